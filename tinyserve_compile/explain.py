"""What the backend did: counters (asserted by tests) and a readable report.

``tinyserve_compile.counters`` counts, over every graph compiled since the last
:func:`reset`: ``graphs``, ``attention_sites``, ``decode_sites``, ``rewritten``,
``dense``, ``prefill_sites`` and one ``dense:<reason>`` key per reason; ``dense_by_cost`` (rewritten sites whose op
attends every key, the cost model's choice from their shapes: ``passes/dense_by_cost.py``); ``cudagraphs``
(graphs that run under CUDA graphs) and ``cudagraphs_off`` (graphs that asked for them
and do not get them; each graph's record says why); ``failed_graphs`` (graphs whose backend compile raised: Dynamo
runs their code without the backend, so their sites count in none of the site counters; each graph's record holds
the exception, :attr:`ExplainReport.failures`).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import List

from .runtime import native_unavailable_reason, reset_runtime, runtime_stats

__all__ = ["counters", "explain", "reset", "ExplainReport", "record_graph", "record_cudagraphs", "record_failure",
           "latest_graph"]

counters: Counter = Counter()
_GRAPHS: List[dict] = []


def _reason_key(reason: str) -> str:
    return reason.split(":")[0].split(" (")[0]


def record_graph(gm, config, state=None) -> dict:
    """Count and record what the passes did to ``gm``; returns the graph's record (a dict in :func:`explain`).

    Parameters
    ----------
    gm : torch.fx.GraphModule
        The graph; its placeholders give its device.
    config : TinyServeConfig
    state : PassState, optional
        What the passes found and did (:func:`tinyserve_compile.passes.state.pass_state`), handed in by the
        backend (this module sits below the passes); None for a graph the passes have not finished: no sites,
        cache writes or linears.
    """
    sites = state.sites if state is not None else []
    counters["graphs"] += 1
    slots = state.bounds if state is not None else []
    devices = {n.meta["example_value"].device.type for n in gm.graph.nodes
               if n.op == "placeholder" and hasattr(n.meta.get("example_value"), "device")}
    info = {"graph": len(_GRAPHS), "config": config, "sites": [s.describe() for s in sites],
            "device": "cpu" if devices <= {"cpu"} else "/".join(sorted(devices)), "cache_writes": len(slots)}
    _count_sites(info, 1)
    lin = state.linears if state is not None else None
    if lin is not None:  # passes/decode_linear.py: linears now the native GEMV, the rest with why
        info["linears"] = {"rewritten": lin.rewritten, "int4": lin.int4, "int4_calls": lin.int4_calls,
                           "kept": dict(lin.kept), "reason": lin.reason, "grouped": lin.grouped, "groups": lin.groups}
    _GRAPHS.append(info)
    return info


def _count_sites(info: dict, sign: int) -> None:
    """Add (``sign`` 1) or take back (-1) a graph record's sites and cache writes in the counters."""
    for s in info["sites"]:
        counters["attention_sites"] += sign
        if s["status"] == "prefill":
            counters["prefill_sites"] += sign
            continue
        if s["query_len"] == 1:
            counters["decode_sites"] += sign
        if s["status"] == "sparse":
            counters["rewritten"] += sign
            if s.get("dense_by_cost"):  # rewritten, its op attending every key (passes/dense_by_cost.py)
                counters["dense_by_cost"] += sign
        else:
            counters["dense"] += sign
            counters[f"dense:{_reason_key(s['reason'])}"] += sign
    counters["cache_writes_rewritten"] += sign * info.get("cache_writes", 0)


def record_failure(info: dict, stage: str, error: str) -> None:
    """Record in a graph's record (from :func:`record_graph`) that its backend compile failed.

    Dynamo then runs the graph's code without the backend (a graph break, the frame run eagerly), or raises: the
    graph's sites do not run as the passes left them, so they leave the site counters (``failed_graphs`` counts
    the graph), each site's ``status`` becomes ``"not compiled"`` (the passes' verdict and reason kept as
    ``planned`` and ``planned_reason``), its linears leave the report's sum, and a graph recorded as running under
    CUDA graphs is recorded as not.

    Parameters
    ----------
    info : dict
        The graph's record.
    stage : str
        What failed: "the passes", "the backend", "lowering (inductor)", ...
    error : str
        The exception, ``"Type: first line of its message"``.
    """
    if info.get("failed"):
        return
    if any(g is info for g in _GRAPHS):  # counted since the last reset(): the counters follow
        _count_sites(info, -1)
        counters["failed_graphs"] += 1
    cg = info.get("cudagraphs")
    if cg is not None and cg["on"]:
        record_cudagraphs(info, False, "the backend compile failed")
    for s in info["sites"]:
        s["planned"], s["planned_reason"] = s["status"], s["reason"]
        s["status"], s["reason"] = "not compiled", f"the graph's compile failed in {stage}"
    info["failed"] = {"stage": stage, "error": error}


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
    def failures(self) -> List[dict]:
        """Per graph whose backend compile failed, ``{"graph": int, "stage": str, "error": str}`` (the error is
        ``"Type: first line of the exception's message"``)."""
        return [{"graph": g["graph"], **g["failed"]} for g in self.graphs if g.get("failed")]

    @property
    def not_run(self) -> List[int]:
        """The graphs that compiled and were never called (Dynamo compiled them, then ran something else): their
        rewritten sites have not run. Only graphs the backend wraps count their calls: those with rewritten sites or
        CUDA graphs."""
        return [g["graph"] for g in self.graphs if g.get("calls") == 0 and not g.get("failed")]

    @property
    def cudagraphs(self) -> List[dict]:
        """Per graph, ``{"on": bool, "reason": str}``: whether it runs under CUDA graphs, and why not."""
        return [dict(g["cudagraphs"]) for g in self.graphs if "cudagraphs" in g]

    def __str__(self) -> str:
        c = self.counters
        failed = f" ({c['failed_graphs']} failed to compile)" if c.get("failed_graphs") else ""
        lines = [f"tinyserve: {c.get('graphs', 0)} graph(s){failed}, {c.get('attention_sites', 0)} attention site(s): "
                 f"{c.get('rewritten', 0)} rewritten, {c.get('dense', 0)} dense decode, "
                 f"{c.get('prefill_sites', 0)} prefill"]
        for g in self.graphs:
            if g.get("failed"):
                f = g["failed"]
                lines.append(f"  graph {g['graph']}: compile FAILED in {f['stage']} ({f['error']}): its code runs "
                             f"without tinyserve (Dynamo's fallback), or the call raised")
            elif g.get("calls") == 0:
                sparse = sum(s["status"] == "sparse" for s in g["sites"])
                lines.append(f"  graph {g['graph']}: compiled, never called"
                             + (f": its {sparse} rewritten site(s) have not run" if sparse else ""))
            for s in g["sites"]:
                why = f"  ({s['reason']})" if s["reason"] else ""
                if s.get("dense_by_cost") and s["status"] == "sparse":
                    why = f"  (every key, by the cost model: {s['dense_by_cost']})"
                planned = f" (the passes made it {s['planned']})" if s.get("planned") else ""
                lines.append(f"  graph {g['graph']} site {s['index']} [{s['node']}]: {s['status']}{planned}{why}")
            lin = g.get("linears")
            if _has_linears(lin) and not g.get("failed"):
                lines.append(f"  graph {g['graph']} linears: {_linears_text(lin)}")
            cg = g.get("cudagraphs")
            if cg is not None:
                lines.append(f"  graph {g['graph']} CUDA graphs: " + ("on" if cg["on"] else f"off ({cg['reason']})"))
        per_graph = [g["linears"] for g in self.graphs if _has_linears(g.get("linears")) and not g.get("failed")]
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
    native = ""
    if any(g["device"] == "cpu" for g in _GRAPHS):
        why = native_unavailable_reason()
        native = "in use" if why is None else f"unavailable, PyTorch path used: {why}"
    return ExplainReport([dict(g) for g in _GRAPHS], dict(counters), dict(runtime_stats), native)


def reset() -> None:
    """Clear the counters, the graph reports and every cache's bounds."""
    counters.clear()
    _GRAPHS.clear()
    reset_runtime()
