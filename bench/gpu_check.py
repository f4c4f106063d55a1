"""The two ends of ``bench/gpu_check.sh``: what the machine is (``env``) and what the steps measured
(``summary``).

``python -m bench.gpu_check env --out DIR [--dry-run [--device-name NAME]] [--layers-8b N|all]``
    Prints and writes ``DIR/env.json``: Python, torch (and its CUDA), Triton and transformers versions, the
    device's name and memory, the card it is (``card``: "H100", "H200" or "unknown", by
    ``torch.cuda.get_device_name``) and its datasheet bandwidth, the driver, and the git commit; and
    ``DIR/plan.env``, the shell variables ``bench/gpu_check.sh`` runs with (:func:`plan`): ``CARD``, ``DEVICE``,
    ``PEAK_GBS``, ``MEMORY_GB`` and each decode step's points, those that do not fit in the device's memory run at
    a smaller batch (:func:`plan_points`). ``--device-name`` (dry run only) pretends to be that device: its card's
    memory and peak (:data:`bench.gpu_model.CARDS`). Exit status 3 when no CUDA device is usable (unless
    ``--dry-run``), or when torch, triton, transformers or tinyserve_compile does not import.

``python -m bench.gpu_check summary --out DIR --seconds N --limit S``
    Reads ``DIR/steps.tsv`` (one line per step: name, exit status, seconds, limit), ``env.json`` and every
    step's JSON, writes ``DIR/summary.json`` and ``DIR/summary.csv`` and prints a short table, the targets
    met or MISSED, and the steps' states: the last thing the check prints. Exit status 0 when every step
    passed, 1 otherwise.

``summary.json`` holds: ``env``; ``steps`` (name, rc, seconds, limit, state); ``kernel_check`` (shapes, failures,
the worst error as a share of the tolerance, the selection paths per setting); ``kernel_bench`` (one dict per
timed shape: ms under CUDA graphs and plain, the speed-ups, GB/s and shares of the measured copy peak and of
the datasheet) and ``kernel_targets``; ``decode`` (one dict per provider and point: ms per token,
``vs_best_stock``, compile s, layers, the profiled step's kernels, launches, host syncs, CUDA graphs on/off and
why, or why it was skipped) and ``decode_targets``; ``ok``.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
from typing import List, Optional, Tuple

#: the decode targets of the check: step -> one (label, minimum speed-up of the best tinyserve row over the best
#: stock provider) per point, in the order the step runs its points. The dry run runs the same steps at tiny
#: points (its ratios mean nothing).
DECODE_TARGETS = {
    "decode_smollm": (("SmolLM2 shape 8K B1", 0.95), ("SmolLM2 shape 32K B1", 1.3)),
    "decode_8b": (("Llama-3-8B shape 32K B8", 2.2), ("Llama-3-8B shape 128K B4", 3.0)),
}
#: each decode step's model shape (:data:`bench.models.SHAPES`) and points (context, batch), in the order of its
#: targets (:data:`DECODE_TARGETS`); a point whose rows do not fit in the device's memory runs at a smaller batch
DECODE_POINTS = {"decode_smollm": ("smollm2", ((8192, 1), (32768, 1))),
                 "decode_8b": ("llama3-8b", ((32768, 8), (131072, 4)))}
#: the dry run's points of each decode step (a tiny Llama on the CPU)
DRY_POINTS = {"decode_smollm": ((384, 1), (512, 1)), "decode_8b": ((256, 2), (512, 2))}
#: the share of the device's memory a decode point may plan to hold (the rest: the CUDA context, Inductor's and
#: the CUDA graphs' pools, fragmentation)
FIT_SHARE = 0.8
#: positions a decode point's static cache holds past its context (bench/decode.py: max(warmup, steps + 1))
DECODE_HEADROOM = 16
#: the decode record fields summary.json keeps
DECODE_KEYS = ("step", "provider", "context", "batch", "ms_per_token", "vs_best_stock", "best_stock", "compile_s",
               "cold_compile", "floor_ms", "model", "shape", "layers", "full_model_layers", "dtype", "device",
               "compile_mode", "cudagraphs_asked", "skipped", "failed", "complete", "cudagraphs", "cudagraphs_why", "gpu_kernels_per_step",
               "launch_calls_per_step", "graph_launches_per_step", "sync_calls_per_step", "dtoh_copies_per_step",
               "item_calls_per_step", "host_syncs_per_step", "sparse_sites", "tinyserve_cudagraphs")
#: the kernel bench fields summary.json keeps
KERNEL_KEYS = ("setting", "stages", "kept", "bounds_dtype", "context", "batch", "dtype", "ok", "tol_ratio",
               "pages_agree", "oracle", "sparse_graph_ms",
               "sparse_ms", "best_sdpa", "speedup_vs_sdpa", "speedup_basis", "speedup_vs_sdpa_plain",
               "speedup_vs_sdpa_graph", "speedup_vs_dense", "sparse_gbs", "sparse_pct_peak", "sparse_pct_datasheet",
               "sparse_graph_error", "sdpa_flash_gqa")


def _commit(root: str) -> str:
    try:
        out = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def decode_bytes(shape: dict, layers: Optional[int], ctx: int, batch: int, itemsize: int = 2) -> int:
    """Bytes a decode point of ``shape`` (a :data:`bench.models.SHAPES` entry, its first ``layers`` layers; None:
    all) holds on the GPU, roughly: the bf16 weights, the static cache of every layer at ``ctx`` +
    :data:`DECODE_HEADROOM` positions, the largest transient (one layer's K/V repeated to every query head: HF's
    ``repeat_kv`` in the stock providers) and the fp32 logits."""
    h, heads, kv = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    d = shape.get("head_dim") or h // heads
    n = shape["num_hidden_layers"] if layers is None else min(int(layers), shape["num_hidden_layers"])
    layer = 2 * h * heads * d + 2 * h * kv * d + 3 * h * shape["intermediate_size"]
    embed = shape["vocab_size"] * h * (1 if shape.get("tie_word_embeddings") else 2)
    L = ctx + DECODE_HEADROOM
    cache = n * 2 * batch * kv * L * d * itemsize
    repeated = 2 * batch * heads * L * d * itemsize
    return (n * layer + embed) * itemsize + cache + repeated + batch * shape["vocab_size"] * 4


def plan_points(step: str, memory_bytes: Optional[float], layers: Optional[int] = None
                ) -> Tuple[List[Tuple[int, int]], List[str]]:
    """``(points, notes)`` of a decode step (:data:`DECODE_POINTS`) on a device of ``memory_bytes`` (None:
    unknown, every point): a point whose :func:`decode_bytes` exceed :data:`FIT_SHARE` of the memory runs at the
    largest batch that fits, halving it (a note says so), or is left out when batch 1 does not fit."""
    from bench.models import SHAPES

    shape_name, points = DECODE_POINTS[step]
    if not memory_bytes:
        return list(points), []
    room = FIT_SHARE * memory_bytes
    out, notes = [], []
    for ctx, batch in points:
        b = batch
        while b >= 1 and decode_bytes(SHAPES[shape_name], layers, ctx, b) > room:
            b //= 2
        if b != batch:
            need = decode_bytes(SHAPES[shape_name], layers, ctx, batch) / 1e9
            why = (f"{step}: {ctx}x{batch} would hold {need:.0f} GB, over {room / 1e9:.0f} GB ({FIT_SHARE:.0%} of "
                   f"{memory_bytes / 1e9:.0f} GB)")
            notes.append(f"{why}: run at {ctx}x{b}" if b else f"{why} even at batch 1: left out")
        if b:
            out.append((ctx, b))
    return out, notes


def plan(info: dict, layers_8b: Optional[int] = 8) -> dict:
    """What the check runs on the device ``info`` (env.json) describes: ``card``, ``peak_gbs`` (its datasheet's),
    ``memory_gb``, and per decode step the ``points`` (:func:`plan_points`; the dry run's
    :data:`DRY_POINTS`, with the points it would run on that card in ``gpu_points``) and ``notes``."""
    memory = info.get("device_memory_gib")
    memory_bytes = None if memory is None else memory * 2**30
    layers = {"decode_smollm": None, "decode_8b": layers_8b}
    gpu = {step: plan_points(step, memory_bytes, layers[step]) for step in DECODE_POINTS}
    out = dict(card=info.get("card", "unknown"), device=info.get("device", "?"), peak_gbs=info.get("datasheet_gbs"),
               memory_gb=None if memory_bytes is None else round(memory_bytes / 1e9),
               gpu_points={step: pts for step, (pts, _) in gpu.items()},
               notes=[n for _, notes in gpu.values() for n in notes])
    out["points"] = dict(DRY_POINTS) if info.get("dry_run") else out["gpu_points"]
    return out


def write_plan(out: str, p: dict) -> str:
    """``out/plan.env``: the plan as shell assignments (``bench/gpu_check.sh`` sources it)."""
    import shlex

    def _q(value) -> str:
        return shlex.quote("" if value is None else str(value))

    pts = {step: " ".join(f"{c}x{b}" for c, b in p["points"][step]) for step in DECODE_POINTS}
    peak = "" if p["peak_gbs"] is None else f"{p['peak_gbs']:.0f}"
    lines = [f"CARD={_q(p['card'])}", f"DEVICE={_q(p['device'])}", f"PEAK_GBS={_q(peak)}",
             f"MEMORY_GB={_q(p['memory_gb'])}", f"SMOL_POINTS={_q(pts['decode_smollm'])}",
             f"BIG_POINTS={_q(pts['decode_8b'])}", f"PLAN_NOTES={_q('; '.join(p['notes']))}"]
    path = os.path.join(out, "plan.env")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _card(info: dict, name: str, memory_bytes: Optional[float]) -> None:
    """``card`` (:data:`bench.gpu_model.CARDS`), ``datasheet_gbs`` (:data:`bench.timing.DATASHEET_GBS`) and
    ``device_memory_gib`` (``memory_bytes``, else the card's) of a device name, into ``info``."""
    from bench.gpu_model import CARDS, card_of
    from bench.timing import DATASHEET_GBS

    card = card_of(name)
    info["card"] = card or "unknown"
    info["datasheet_gbs"] = next((gbs for key, gbs in DATASHEET_GBS if key in name), None)
    if memory_bytes is None and card:
        memory_bytes = CARDS[card]["memory_gb"] * 1e9
    if memory_bytes is not None:
        info["device_memory_gib"] = round(memory_bytes / 2**30, 1)


def env(out: str, dry_run: bool = False, device_name: Optional[str] = None, layers_8b: Optional[int] = 8) -> int:
    """Write ``out/env.json`` and ``out/plan.env`` and print them; 3 when the check cannot run here (see the
    module doc). ``device_name``: with ``dry_run``, the device to pretend to be."""
    if device_name and not dry_run:
        raise ValueError("gpu_check env: --device-name pretends a device in a dry run only")
    info = dict(python=sys.version.split()[0], platform=platform.platform(), dry_run=dry_run,
                commit=_commit(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    rc = 0
    try:
        import torch

        info.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
        if device_name:
            info.update(device=device_name, pretend=True, driver="none (dry run)")
            _card(info, device_name, None)
        elif torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info.update(device=torch.cuda.get_device_name(0), multiprocessors=props.multi_processor_count,
                        driver=_driver())
            _card(info, info["device"], props.total_memory)
        else:
            info.update(device=f"CPU ({platform.machine()})", driver="none", card="none")
            rc = 0 if dry_run else 3
    except ImportError as e:
        info["error"] = f"torch: {e}"
        rc = 3
    for mod in ("triton", "transformers", "tinyserve_compile"):
        try:
            info[mod] = getattr(__import__(mod), "__version__", "installed")
        except ImportError as e:
            info[mod] = f"missing ({e})"
            rc = 3
    os.makedirs(out, exist_ok=True)
    p = plan(info, layers_8b) if "torch" in info else None
    if p is not None:
        info["plan"] = p
        write_plan(out, p)
    with open(os.path.join(out, "env.json"), "w") as f:
        json.dump(info, f, indent=1)
    for k, v in info.items():
        if k != "plan":
            print(f"{k}: {v}")
    if p is not None:
        peak = "unknown" if p["peak_gbs"] is None else f"{p['peak_gbs']:.0f} GB/s"
        mem = "unknown" if p["memory_gb"] is None else f"{p['memory_gb']} GB"
        print(f"card: {p['card']} ({p['device']}{', pretended' if info.get('pretend') else ''}): datasheet {peak}, "
              f"memory {mem}; decode points on it: "
              + "; ".join(f"{step} {' '.join(f'{c}x{b}' for c, b in pts)}" for step, pts in p["gpu_points"].items()))
        for note in p["notes"]:
            print(f"plan: {note}")
    return rc


def _load(out: str, path: str):
    path = os.path.join(out, path)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _state(rc: int) -> str:
    return "ok" if rc == 0 else ("TIMED OUT" if rc in (124, 137) else f"FAILED (rc {rc})")


def _x(v, fmt="{:.2f}x") -> str:
    return "-" if v is None else fmt.format(v)


def decode_targets(step: str, rows: List[dict], dry_run: bool) -> List[dict]:
    """The targets of one decode step (:data:`DECODE_TARGETS`): the best tinyserve row against the best stock
    provider of the target's point (``met`` None when nothing was measured). A target's point is the step's
    point of its context (:data:`DECODE_POINTS`), which may have run at a smaller batch on a device of less memory
    (the target says so); in a dry run, the rows' points in their order."""
    points = list(dict.fromkeys((r["context"], r["batch"]) for r in rows))
    intended = DECODE_POINTS.get(step, ("", ()))[1]
    out = []
    for i, (label, want) in enumerate(DECODE_TARGETS.get(step, ())):
        if dry_run or i >= len(intended):
            point = points[i] if i < len(points) else None
        else:
            point = next((p for p in points if p[0] == intended[i][0]), None)
        rs = [r for r in rows if point is not None and (r["context"], r["batch"]) == point]
        ts = [r for r in rs if r["provider"].startswith("tinyserve") and r.get("vs_best_stock") is not None]
        best = max(ts, key=lambda r: r["vs_best_stock"], default=None)
        where = ""
        if point is not None and dry_run:
            where = f" (dry run at {point[0]} x B{point[1]})"
        elif point is not None and i < len(intended) and point != tuple(intended[i]):
            where = f" (run at {point[0]} x B{point[1]}: the device's memory)"
        t = dict(step=step, target=f"{label}: tinyserve >= {want:g}x the best stock provider{where}", want=want,
                 context=None if point is None else point[0], batch=None if point is None else point[1],
                 value=None if best is None else best["vs_best_stock"], by=None if best is None else best["provider"],
                 vs=None if best is None else best.get("best_stock"), dry_run=dry_run)
        t["met"] = None if best is None else best["vs_best_stock"] >= want
        out.append(t)
    return out


def summary(out: str, seconds: float, limit: int = 0) -> int:
    """Write ``summary.json`` and ``summary.csv`` under ``out`` and print the summary (see the module doc).
    ``seconds``: the check's wall time before the summary; ``limit``: the summary's own time limit (counted in
    ``limits_total`` beside the steps' limits)."""
    steps = _read_steps(out)
    info = _load(out, "env.json") or {}
    dry = bool(info.get("dry_run"))
    s: dict = dict(env=info, steps=steps, total_seconds=seconds, summary_limit=limit,
                   limits_total=sum(x["limit"] for x in steps) + limit,
                   ok=bool(steps) and all(x["rc"] == 0 for x in steps))
    table: List[dict] = []  # summary.csv
    lines: List[str] = []
    bench = _load(out, "kernel/bench_kernel_gpu.json")
    _kernel_check(bench, s, lines)
    _kernel_bench(bench, s, lines, table)
    _decode(out, steps, dry, s, lines, table)
    lines += _target_lines(s, dry)
    _write_summary(out, s, table)
    _print_summary(out, s, lines, seconds, dry)
    return 0 if s["ok"] else 1


def _read_steps(out: str) -> List[dict]:
    """The steps of ``out/steps.tsv`` (name, rc, seconds, limit) with their state; [] without the file."""
    steps = []
    tsv = os.path.join(out, "steps.tsv")
    if os.path.exists(tsv):
        with open(tsv) as f:
            for r in csv.reader(f, delimiter="\t"):
                steps.append(dict(step=r[0], rc=int(r[1]), seconds=int(r[2]), limit=int(r[3]), state=_state(int(r[1]))))
    return steps


def _kernel_check(bench: Optional[dict], s: dict, lines: List[str]) -> None:
    """``s["kernel_check"]`` and its line: the kernel bench's correctness rows (shapes, failures, worst error)."""
    if not (bench and any(r.get("ok") is not None for r in bench.get("rows", []))):
        return
    rows = [r for r in bench["rows"] if r.get("ok") is not None]
    s["kernel_check"] = c = dict(shapes=len(rows), failures=sum(r["ok"] is False for r in rows),
                                 worst_tol_ratio=max(r["tol_ratio"] for r in rows),
                                 min_pages_agree=min(r["pages_agree"] for r in rows),
                                 paths={st: sorted({f"{r['stages']}/{r['kept']}" for r in rows
                                                    if r["setting"] == st})
                                        for st in dict.fromkeys(r["setting"] for r in rows)})
    lines.append(f"kernel check: {c['shapes']} shapes, {c['failures']} failures, worst error "
                 f"{c['worst_tol_ratio']:.2f}x tolerance, same selection as the reference in >= "
                 f"{c['min_pages_agree']:.0%} of KV heads; paths "
                 + ", ".join(f"{k} {' '.join(v)}" for k, v in c["paths"].items()))


def _kernel_bench(bench: Optional[dict], s: dict, lines: List[str], table: List[dict]) -> None:
    """``s["kernel_peak"]``, ``s["kernel_bench"]`` (:data:`KERNEL_KEYS` of each timed shape), ``s["kernel_targets"]``;
    their lines and summary.csv rows."""
    if not (bench and any(r.get("sparse_ms") is not None for r in bench.get("rows", []))):
        return
    meta = bench.get("meta", {})
    s["kernel_peak"] = dict(copy_gbs=meta.get("copy_gbs"), datasheet_gbs=meta.get("datasheet_gbs"))
    s["kernel_bench"] = [{k: r.get(k) for k in KERNEL_KEYS} for r in bench["rows"] if r.get("sparse_ms")]
    s["kernel_targets"] = bench.get("targets", [])
    lines.append(f"op alone (Hq=32 Hkv=8 D=128 budget 2048; HBM peak: copy {_x(meta.get('copy_gbs'), '{:.0f}')}"
                 f" GB/s measured, {_x(meta.get('datasheet_gbs'), '{:.0f}')} datasheet):")
    lines.append(f"  {'setting':>8} {'ctx':>6} {'B':>2} {'sparse ms':>9} {'x sdpa':>7} {'(plain)':>7} "
                 f"{'%peak':>6}  basis")
    for r in s["kernel_bench"]:
        ms = r["sparse_graph_ms"] or r["sparse_ms"]
        basis = "graphs" if r["speedup_basis"] == "cudagraph" else "plain"
        lines.append(f"  {r['setting']:>8} {r['context']:>6} {r['batch']:>2} {_x(ms, '{:.4f}'):>9} "
                     f"{_x(r['speedup_vs_sdpa']):>7} {_x(r['speedup_vs_sdpa_plain']):>7} "
                     f"{_x(r['sparse_pct_peak'], '{:.0f}%'):>6}  {basis} vs {r['best_sdpa'] or '-'}")
        table.append(dict(section="op", step="kernel", point=f"{r['context']}x{r['batch']}",
                          name=f"sparse {r['setting']}", ms=ms, ratio=r["speedup_vs_sdpa"],
                          ratio_plain=r["speedup_vs_sdpa_plain"], pct_peak=r["sparse_pct_peak"],
                          basis=r["speedup_basis"]))


def _decode(out: str, steps: List[dict], dry: bool, s: dict, lines: List[str], table: List[dict]) -> None:
    """``s["decode"]`` (:data:`DECODE_KEYS` of every decode step's records) and ``s["decode_targets"]``
    (:func:`decode_targets`); their lines (:func:`_decode_line`) and summary.csv rows."""
    s["decode"], s["decode_targets"] = [], []
    for st in steps:
        rows = _load(out, f"{st['step']}/decode.json")
        if not rows:
            continue
        for r in rows:
            s["decode"].append(dict({k: r.get(k) for k in DECODE_KEYS}, step=st["step"]))
        s["decode_targets"] += decode_targets(st["step"], rows, dry)
    if not s["decode"]:
        return
    lines.append("decode: ms per step, x the best stock provider, and in the profiled step: CUDA graphs, kernels, "
                 "launches, host syncs")
    last = None
    for r in s["decode"]:
        if (r["step"], r["context"], r["batch"]) != last:
            last = (r["step"], r["context"], r["batch"])
            lines.append(f"  {r['step']}: {r['model']} {r['layers']} of {r['full_model_layers']} layers, "
                         f"{r['context']} x B{r['batch']} {r['dtype']}")
        lines.append(_decode_line(r))
        table.append(dict(section="decode", step=r["step"], point=f"{r['context']}x{r['batch']}",
                          name=r["provider"], ms=r["ms_per_token"], ratio=r["vs_best_stock"],
                          cudagraphs=r["cudagraphs"], kernels=r["gpu_kernels_per_step"],
                          launches=r["launch_calls_per_step"], host_syncs=r["host_syncs_per_step"],
                          skipped=r["skipped"]))


def _decode_line(r: dict) -> str:
    """One decode record's line: why it was not measured, or its ms, ratio and profiled step."""
    if r["ms_per_token"] is None:
        why = r["skipped"] or "not measured (cut short)"
        return f"    {r['provider']:<21} {why[:80]}"
    return (f"    {r['provider']:<21} {r['ms_per_token']:8.3f} {_x(r['vs_best_stock']):>6} "
            f"{r['cudagraphs'] or '-':>4} {_x(r['gpu_kernels_per_step'], '{:.0f}'):>5} "
            f"{_x(r['launch_calls_per_step'], '{:.0f}'):>5} "
            f"{_x(r['host_syncs_per_step'], '{:.0f}'):>3}"
            + (f"  off: {r['cudagraphs_why'][:60]}" if r["cudagraphs"] == "off"
               and r["cudagraphs_why"] != "not asked for" else ""))


def _target_lines(s: dict, dry: bool) -> List[str]:
    """The targets' lines: the kernel's and the decode steps', met, MISSED or not run."""
    lines = ["targets" + (" (dry run: CPU numbers, met/MISSED meaningless)" if dry else "") + ":"]
    for t in s.get("kernel_targets", []):
        state = "not run" if t.get("met") is None else f"{t['worst']:.2f} -> {'met' if t['met'] else 'MISSED'}"
        lines.append(f"  op {t['target']}: {state}")
    for t in s["decode_targets"]:
        state = "not run" if t["met"] is None else \
            f"{t['value']:.2f}x ({t['by']} vs {t['vs']}) -> {'met' if t['met'] else 'MISSED'}"
        lines.append(f"  {t['target']}: {state}")
    return lines


def _write_summary(out: str, s: dict, table: List[dict]) -> None:
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(s, f, indent=1)
    keys = list(dict.fromkeys(k for r in table for k in r)) or ["section"]
    with open(os.path.join(out, "summary.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(table)


def _print_summary(out: str, s: dict, lines: List[str], seconds: float, dry: bool) -> None:
    info, steps = s["env"], s["steps"]
    print(f"\n==== gpu_check summary: {info.get('device', '?')}, driver {info.get('driver', '?')}, torch "
          f"{info.get('torch', '?')} (CUDA {info.get('cuda', '-')}), triton {info.get('triton', '?')}, transformers "
          f"{info.get('transformers', '?')}, commit {info.get('commit', 'unknown')}"
          + (" [DRY RUN]" if dry else ""))
    for line in lines:
        print(line)
    print(f"steps ({seconds:.0f} s before the summary; limits {s['limits_total']} s with the summary's): "
          + ", ".join(f"{x['step']} {x['state']} {x['seconds']}/{x['limit']} s" for x in steps))
    print(f"output in {out}: summary.json, summary.csv, env.json, steps.tsv, <step>.log, <step>/*.json")
    print("all steps passed" if s["ok"] else "SOME STEPS FAILED: see the logs in " + out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("env", "summary"))
    ap.add_argument("--out", required=True, help="the check's output folder")
    ap.add_argument("--dry-run", action="store_true", help="env: no CUDA device needed")
    ap.add_argument("--device-name", default=None,
                    help="env, with --dry-run: pretend to be this device, e.g. 'NVIDIA H100 80GB HBM3' (its card's "
                         "memory and datasheet peak)")
    ap.add_argument("--layers-8b", default="8", help="env: the layers decode_8b runs of Llama-3-8B's shape (a number, "
                                                     "or 'all'), which size its points' memory")
    ap.add_argument("--seconds", type=float, default=0.0, help="summary: the check's wall time so far")
    ap.add_argument("--limit", type=int, default=0, help="summary: its own time limit in seconds")
    a = ap.parse_args(argv)
    if a.device_name and not a.dry_run:
        ap.error("argument --device-name: only with --dry-run (a GPU run detects its device)")
    if a.what == "env":
        return env(a.out, a.dry_run, a.device_name, None if a.layers_8b == "all" else int(a.layers_8b))
    return summary(a.out, a.seconds, a.limit)


if __name__ == "__main__":
    sys.exit(main())
