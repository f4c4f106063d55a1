"""What the backend did: counters (asserted by tests) and a readable report.

``tinyserve_compile.counters`` counts, over every graph compiled since the last
:func:`reset`: ``graphs``, ``attention_sites``, ``decode_sites``, ``rewritten``,
``dense``, ``prefill_sites`` and one ``dense:<reason>`` key per reason; ``cudagraphs``
(graphs that run under CUDA graphs) and ``cudagraphs_off`` (graphs that asked for them
and do not get them; each graph's record says why).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import List

__all__ = ["counters", "explain", "reset", "ExplainReport", "record_graph", "record_cudagraphs", "latest_graph"]

counters: Counter = Counter()
_GRAPHS: List[dict] = []


def _reason_key(reason: str) -> str:
    return reason.split(":")[0].split(" (")[0]


def record_graph(gm, config) -> dict:
    """Count and record what the passes did to ``gm``; returns the graph's record (a dict in :func:`explain`)."""
    sites = gm.meta.get("tinyserve_sites", [])
    counters["graphs"] += 1
    slots = gm.meta.get("tinyserve_bounds", [])
    devices = {n.meta["example_value"].device.type for n in gm.graph.nodes
               if n.op == "placeholder" and hasattr(n.meta.get("example_value"), "device")}
    info = {"graph": len(_GRAPHS), "config": config, "sites": [s.describe() for s in sites],
            "device": "cpu" if devices <= {"cpu"} else "/".join(sorted(devices))}
    for s in sites:
        counters["attention_sites"] += 1
        if s.status == "prefill":
            counters["prefill_sites"] += 1
            continue
        if s.query_len == 1:
            counters["decode_sites"] += 1
        if s.status == "sparse":
            counters["rewritten"] += 1
        else:
            counters["dense"] += 1
            counters[f"dense:{_reason_key(s.reason)}"] += 1
    counters["cache_writes_rewritten"] += len(slots)
    lin = gm.meta.get("tinyserve_linears")
    if lin is not None:  # passes/decode_linear.py: linears now the native GEMV, the rest with why
        info["linears"] = {"rewritten": lin["rewritten"], "int4": lin.get("int4", 0),
                           "int4_calls": lin.get("int4_calls", 0), "kept": dict(lin["kept"]),
                           "reason": lin["reason"], "grouped": lin.get("grouped", 0), "groups": lin.get("groups", 0)}
    _GRAPHS.append(info)
    return info


def record_cudagraphs(info: dict, on: bool, reason: str = "") -> None:
    """Record in a graph's record (from :func:`record_graph`) whether it runs under CUDA graphs, and why not.

    Parameters
    ----------
    info : dict
        The graph's record.
    on : bool
    reason : str
        Why they are off: "not requested", "device is cpu", "lower='eager'", a policy that runs Python per
        call, or Inductor's own reason for skipping them. A graph first recorded as on can be turned off later
        (Inductor skips CUDA graphs at compile time or at its first calls); the counters follow.
    """
    old = info.get("cudagraphs")
    new = {"on": bool(on), "reason": "" if on else reason}
    if any(g is info for g in _GRAPHS):  # counted since the last reset(): the counters follow the verdict
        if old is not None and _counter_key(old):
            counters[_counter_key(old)] -= 1
        if _counter_key(new):
            counters[_counter_key(new)] += 1
    info["cudagraphs"] = new


def _counter_key(verdict: dict) -> str:
    """The counter of a CUDA-graphs verdict: "cudagraphs", "cudagraphs_off" (asked for, not had), or none."""
    if verdict["on"]:
        return "cudagraphs"
    return "" if verdict["reason"] == "not requested" else "cudagraphs_off"


def latest_graph() -> dict:
    """The record of the graph recorded last (:func:`record_graph`)."""
    return _GRAPHS[-1]


def _has_linears(lin) -> bool:
    return bool(lin) and bool(lin["rewritten"] or lin["kept"] or lin["reason"] or lin.get("int4_calls"))


def _linears_text(lin: dict) -> str:
    """One graph's (or the sum's) decode_linear record as a line of :class:`ExplainReport`."""
    kept = ", ".join(f"{k}: {v}" for k, v in sorted(lin["kept"].items()))
    return (f"{lin['rewritten']} to the native GEMV"
            + (f" ({lin['int4']} int4)" if lin.get("int4") else "")
            + (f", {lin['int4_calls']} Int4Linear calls" if lin.get("int4_calls") else "")
            + (f", {lin['grouped']} of them in {lin['groups']} shared-input calls" if lin.get("groups") else "")
            + (f", kept in ATen ({kept})" if kept else "")
            + (f"; {lin['reason']}" if lin["reason"] else ""))


@dataclass
class ExplainReport:
    """Sites found, rewritten and left dense (with reasons), plus run-time statistics."""

    graphs: List[dict] = field(default_factory=list)
    counters: dict = field(default_factory=dict)
    runtime: dict = field(default_factory=dict)
    #: "in use", or why the PyTorch path runs instead (no compiler, build error); "" before any CPU graph
    native_kernel: str = ""

    @property
    def dense_reasons(self) -> List[str]:
        return [s["reason"] for g in self.graphs for s in g["sites"] if s["status"] == "dense"]

    @property
    def cudagraphs(self) -> List[dict]:
        """Per graph, ``{"on": bool, "reason": str}``: whether it runs under CUDA graphs, and why not."""
        return [dict(g["cudagraphs"]) for g in self.graphs if "cudagraphs" in g]

    def __str__(self) -> str:
        c = self.counters
        lines = [f"tinyserve: {c.get('graphs', 0)} graph(s), {c.get('attention_sites', 0)} attention site(s): "
                 f"{c.get('rewritten', 0)} rewritten, {c.get('dense', 0)} dense decode, "
                 f"{c.get('prefill_sites', 0)} prefill"]
        for g in self.graphs:
            for s in g["sites"]:
                why = f"  ({s['reason']})" if s["reason"] else ""
                lines.append(f"  graph {g['graph']} site {s['index']} [{s['node']}]: {s['status']}{why}")
            lin = g.get("linears")
            if _has_linears(lin):
                lines.append(f"  graph {g['graph']} linears: {_linears_text(lin)}")
            cg = g.get("cudagraphs")
            if cg is not None:
                lines.append(f"  graph {g['graph']} CUDA graphs: " + ("on" if cg["on"] else f"off ({cg['reason']})"))
        per_graph = [g["linears"] for g in self.graphs if _has_linears(g.get("linears"))]
        if len(per_graph) > 1:  # a graph break splits a step: the sum over its graphs
            total = {k: sum(lin.get(k, 0) for lin in per_graph) for k in ("rewritten", "int4", "int4_calls", "grouped",
                                                                            "groups")}
            total["kept"] = {}
            for lin in per_graph:
                for k, v in lin["kept"].items():
                    total["kept"][k] = total["kept"].get(k, 0) + v
            total["reason"] = ""
            lines.append(f"  linears of all {len(per_graph)} graphs: {_linears_text(total)}")
        cb = {k: v for k, v in c.items() if k.startswith("cb_")}
        if cb:  # continuous batching (tinyserve_compile.continuous_batching): rows per kind, dense reasons
            lines.append("  continuous batching: " + ", ".join(f"{k[3:]}={v}" for k, v in sorted(cb.items())))
        if self.native_kernel:
            lines.append(f"  native CPU kernel: {self.native_kernel}")
        if self.runtime:
            lines.append("  runtime: " + ", ".join(f"{k}={v}" for k, v in sorted(self.runtime.items())))
        return "\n".join(lines)


def explain() -> ExplainReport:
    """Report on every graph the backend compiled since the last :func:`reset`."""
    from .runtime import native_unavailable_reason, runtime_stats

    native = ""
    if any(g["device"] == "cpu" for g in _GRAPHS):
        why = native_unavailable_reason()
        native = "in use" if why is None else f"unavailable, PyTorch path used: {why}"
    return ExplainReport([dict(g) for g in _GRAPHS], dict(counters), dict(runtime_stats), native)


def reset() -> None:
    """Clear the counters, the graph reports and every cache's bounds."""
    from .runtime import reset_runtime

    counters.clear()
    _GRAPHS.clear()
    reset_runtime()
