"""The byte and latency model of the Triton sparse-decode op on an H100 and an H200, without a GPU:
``python -m bench gpu --model``.

For each launch of :func:`~tinyserve_compile.kernels.triton_sparse_decode.sparse_decode_triton` (1: page scores,
then the head's last program selects the candidates or kept pages; 2, two stages only: the candidates' exact
logits, then the head's last program ranks them and keeps the budget; 3: split-K attention over what was kept,
then the head's last split merges), at each point (32K, 128K and 4K at batch 8; Hq=32, Hkv=8, D=128, bf16 K/V):

* the **grid**, warps and waves on the card, from the kernel's own :class:`_Plan` (its grids are sized by the SM
  count, here the card's), and the launch's two **dependent phases** (the grid, then the one program a head that
  arrives last);
* the **bytes** it must move through HBM at least: the op's cost model :func:`bench.gpu.bytes_touched` (the
  formula ``python -m bench gpu`` quotes its GB/s against, used here as it is, split between the launches by
  differences of it: launch 1 is the select of one stage, launch 2 the candidates' keys a second stage adds,
  launch 3 what the op reads beyond its select), read and written apart; and beside them the **workspace**
  traffic (candidate lists, logits, softmax statistics, kept lists, split partials: the sizes of the kernel's own
  :class:`_Workspace` buffers), which is small and mostly stays in L2, so it is reported, not counted in the floor;
* the time those bytes take at the card's bandwidth (datasheet: 3350 GB/s for an H100 SXM 80 GB, 4800 GB/s for an
  H200; and the 4269 GB/s a device-to-device copy reached on this project's H200, docs/gpu/README.md), with
  ``--phase-us`` a cost for each dependent phase on top;
* the **floor ratio** against SDPA flash, which reads every key and value once (``bytes_touched("sdpa_flash")``):
  dense bytes over the op's bytes, i.e. the speed-up the op would have at the same bandwidth. A ratio under the op's
  target (>= 7x at 32K batch 8, >= 12x at 128K batch 8: :data:`bench.gpu.TARGETS`) cannot meet it by bytes; the
  issue asks a margin of 1.5x over each target (:data:`FLOOR_MARGIN`).

These are modelled bytes, not measurements. The settings: the shipped defaults (``TinyServeConfig()``) and the
``gpu`` preset of :data:`bench.cli.PRESETS` (``--compare`` names another preset or JSON options; ``--options``
changes the base setting).
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence
from unittest import mock

import torch

from bench.timing import DATASHEET_GBS

#: the cards the model is evaluated on: HBM bandwidth (the datasheet's, :data:`bench.timing.DATASHEET_GBS`; ``copy``
#: the device-to-device copy measured on the project's H200, 2026-12-04), memory and SMs (both have 132)
CARDS = {
    "H100": dict(label="H100 SXM 80 GB", gbs=dict(DATASHEET_GBS)["H100"], copy_gbs=None, memory_gb=80, sms=132),
    "H200": dict(label="H200 141 GB", gbs=dict(DATASHEET_GBS)["H200"], copy_gbs=4269.0, memory_gb=141, sms=132),
}
#: the points of the op's targets, and the 4K one (context, batch)
POINTS = ((32768, 8), (131072, 8), (4096, 8))
#: the floor ratio the issue asks of each op target
FLOOR_MARGIN = 1.5
#: dependent phases of SDPA flash's decode (the split-KV kernel, then its combine), for ``--phase-us``
SDPA_PHASES = 2


def card_of(name: str) -> Optional[str]:
    """The key of :data:`CARDS` a device name belongs to ("NVIDIA H100 80GB HBM3" -> "H100"), or None."""
    return next((key for key in CARDS if key in (name or "")), None)


def targets() -> Dict[tuple, float]:
    """The op's speed-up targets over SDPA, ``{(context, batch): minimum}`` (:data:`bench.gpu.TARGETS`)."""
    from bench.gpu import TARGETS

    return {(ctx, batch): want for what, ctx, batch, want in TARGETS if what == "x_sdpa"}


@contextmanager
def _sms(n: int):
    """The kernel's plan sized for a GPU of ``n`` SMs without one: ``_Plan`` asks the CUDA device its SM count."""
    with mock.patch.object(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(
            multi_processor_count=n)):
        yield


def kernel_plan(B, hkv, G, L, D, spec, sms: int):
    """The Triton op's ``_Plan`` (grids, modes, sizes) of one shape on a CUDA GPU of ``sms`` SMs, and its workspace
    on the meta device (only the buffers' sizes are read)."""
    from tinyserve_compile.kernels import triton_sparse_decode as tsd

    P = -(-L // spec.page_size)
    with _sms(sms):
        plan = tsd._Plan(B, hkv, G, L, D, P, spec, torch.device("cuda"), None)
    return plan, tsd._Workspace(plan, B, hkv, G, P, D, torch.device("meta")), tsd


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def model_point(config, B: int, L: int, hq: int = 32, hkv: int = 8, D: int = 128, itemsize: int = 2,
                sms: int = 132) -> dict:
    """The model of one point under one setting (``config``: a ``TinyServeConfig``): ``launches`` (one dict per
    launch that runs), ``sparse`` (the op's floor bytes: ``bytes_touched("sparse")``), ``workspace``, ``dense``
    (``bytes_touched("sdpa_flash")``), ``floor_ratio`` and ``ws_ratio`` (dense over the op's bytes, without and
    with the workspace), ``phases`` and the selection path."""
    from bench.gpu import bytes_touched
    from tinyserve_compile.kernels.spec import SelectionSpec

    G = hq // hkv
    spec = SelectionSpec.from_config(config).for_cache(L)
    S, budget = spec.page_size, spec.token_budget
    P = -(-L // S)
    plan, ws, tsd = kernel_plan(B, hkv, G, L, D, spec, sms)
    args = (B, hkv, hq, L, D, S, budget, itemsize)
    bits = spec.bounds_dtype.itemsize
    sparse = bytes_touched("sparse", *args, spec.candidate_factor, bits, spec.candidate_extra)
    select = bytes_touched("select", *args, spec.candidate_factor, bits, spec.candidate_extra)
    one_stage = bytes_touched("select", *args, 1, bits, 0)  # bounds, scores, q: launch 1's share
    dense = bytes_touched("sdpa_flash", *args)
    out_bytes = B * hq * D * itemsize
    BH = B * hkv
    launches = []

    def launch(n, what, programs, warps, resident, phases, floor, written, ws_read, ws_written):
        launches.append(dict(launch=n, what=what, grid=f"{BH}x{programs}", programs=BH * programs, warps=warps,
                             waves=BH * programs / (sms * resident), phases=phases, read=floor - written,
                             written=written, ws_read=ws_read, ws_written=ws_written))

    if plan.mode != 0:
        # launch 1: the bounds of every valid page scored by n_prog1 programs a head, scores written; the last
        # program reads the head's scores back (held in registers up to _BLOCK_ALL keys, else 10 chunked passes)
        passes = 1 if P <= tsd._BLOCK_ALL else 10
        launch(1, "page scores -> select", plan.n_prog1, plan.warps1,
               max(1, tsd._LAUNCH1_WARPS_PER_SM // plan.warps1),
               [f"score {P} pages ({plan.n_prog1} programs a head)", f"select {plan.n_cand} of {P}"],
               one_stage, _nbytes(ws.scores), (passes - 1) * _nbytes(ws.scores), _nbytes(ws.cand, ws.ncand))
    if plan.mode in (2, 3):
        # launch 2: the candidates' keys (no values); logits (tokens: every candidate slot of every query head;
        # pages: one log-sum-exp a page) and softmax statistics written, read back by the head's last program
        units = "tokens" if plan.mode == 3 else "pages"
        chunked = plan.n_units2 > tsd._BLOCK_ALL
        share = _nbytes(ws.share) if chunked else 0
        launch(2, "candidate logits -> rank", plan.n_prog2, tsd._select_warps(plan.n_units2), tsd._PROGRAMS_PER_SM,
               [f"logits of {plan.n_cand * S} keys ({plan.n_prog2} programs a head)",
                f"keep {plan.n_keep} of {plan.n_units2} {units}"],
               select - one_stage, 0,
               2 * _nbytes(ws.cand) + _nbytes(ws.ncand, ws.logits, ws.stat_m, ws.stat_l) + 10 * share,
               _nbytes(ws.logits, ws.stat_m, ws.stat_l, ws.kept, ws.count) + share)
    # launch 3: the kept values (and kept keys when pages are kept), split n_splits ways a head; partials written,
    # read back by the head's last split, which writes the output
    if plan.mode == 0:
        l3_floor, kept_lists, kept_logits = sparse, 0, 0
        what = f"attend all {L} tokens"
    else:
        l3_floor = sparse - select
        kept_lists = _nbytes(ws.count) + (_nbytes(ws.kept) if plan.mode in (2, 3) else 0) + _nbytes(ws.cand)
        kept_logits = _nbytes(ws.logits) * plan.n_keep // plan.n_units2 if plan.mode == 3 else 0
        what = f"attend {plan.n_keep if plan.mode == 3 else plan.n_keep * S} kept tokens"
    partials = _nbytes(ws.acc, ws.m, ws.l)
    launch(3, "attend -> merge", plan.n_splits, 4, tsd._PROGRAMS_PER_SM,  # launched with Triton's default 4 warps
           [f"{what} ({plan.n_splits} splits a head)", "merge"],
           l3_floor, out_bytes, kept_lists + kept_logits + partials, partials)
    workspace = sum(x["ws_read"] + x["ws_written"] for x in launches)
    path = {0: "dense (every page fits the budget)", 1: "1 stage, pages", 2: "2 stages, pages",
            3: "2 stages, tokens"}[plan.mode]
    return dict(context=L, batch=B, hq=hq, hkv=hkv, head_dim=D, itemsize=itemsize, page_size=S, pages=P,
                budget=budget, path=path, candidates=plan.n_cand, launches=launches, sparse=sparse,
                workspace=workspace, dense=dense, floor_ratio=dense / sparse, ws_ratio=dense / (sparse + workspace),
                phases=sum(len(x["phases"]) for x in launches))


def setting_label(config) -> str:
    """The selection of a ``TinyServeConfig`` in words."""
    from bench.gpu import config_setting

    s = config_setting(config)
    return (f"pages of {s['page']}, {s['bounds']} bounds, sink {s['sink']}, candidate_factor {s['cf']}, "
            f"candidate_extra {s['extra']}, keep_tokens {s['tokens']}, budget {config.token_budget}")


def evaluate(settings: Dict[str, object], points: Sequence = POINTS, cards: Sequence[str] = tuple(CARDS),
             phase_us: float = 0.0, hq: int = 32, hkv: int = 8, D: int = 128, itemsize: int = 2) -> List[dict]:
    """One row per setting (``{name: TinyServeConfig}``) and point: :func:`model_point` on the first card's SMs
    (every card's grid in ``grids``), the op's target and its margin, and per card the microseconds of each launch
    and of SDPA flash at its bandwidth (``us``: ``{card: {"op": [...], "sdpa": x}}``, the copy peak as
    ``"<card> copy"``), with ``phase_us`` a dependent phase."""
    want = targets()
    rows = []
    for name, config in settings.items():
        for L, B in points:
            row = model_point(config, B, L, hq, hkv, D, itemsize, CARDS[cards[0]]["sms"])
            row["grids"] = {c: [x["grid"] for x in model_point(config, B, L, hq, hkv, D, itemsize, CARDS[c]["sms"])
                                ["launches"]] for c in cards}
            row.update(setting=name, options=setting_label(config), target=want.get((L, B)))
            row["floor_target"] = None if row["target"] is None else FLOOR_MARGIN * row["target"]
            row["meets_target"] = None if row["target"] is None else row["floor_ratio"] >= row["target"]
            row["meets_floor_target"] = None if row["target"] is None else row["floor_ratio"] >= row["floor_target"]
            row["us"] = {}
            for c in cards:
                for label, gbs in ((c, CARDS[c]["gbs"]), (f"{c} copy", CARDS[c]["copy_gbs"])):
                    if gbs:
                        op = [x["read"] + x["written"] for x in row["launches"]]
                        row["us"][label] = dict(gbs=gbs, op=[b / gbs / 1e3 + 2 * phase_us for b in op],
                                                sdpa=row["dense"] / gbs / 1e3 + SDPA_PHASES * phase_us)
                        row["us"][label]["ratio"] = row["us"][label]["sdpa"] / sum(row["us"][label]["op"])
            row["phase_us"] = phase_us
            rows.append(row)
    return rows


def _ctx(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


def table(rows: List[dict]) -> str:
    """Markdown: a summary (one line per setting and point), then each point's launches."""
    cols = [c for c in rows[0]["us"]] if rows else []
    lines = ["| setting | point | path | op floor MB | + workspace MB | SDPA flash MB | floor ratio | with workspace "
             "| op target | 1.5x target | floor >= 1.5x target |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        t = "-" if r["target"] is None else f"{r['target']:g}x"
        ft = "-" if r["target"] is None else f"{r['floor_target']:g}x"
        ok = "-" if r["target"] is None else ("yes" if r["meets_floor_target"] else "NO")
        lines.append(f"| {r['setting']} | {_ctx(r['context'])} B{r['batch']} | {r['path']} | {_mb(r['sparse'])} | "
                     f"{_mb(r['workspace'])} | {_mb(r['dense'])} | {r['floor_ratio']:.2f}x | {r['ws_ratio']:.2f}x | "
                     f"{t} | {ft} | {ok} |")
    lines.append("")
    head = " | ".join(f"us {c}" for c in cols)
    lines += [f"| setting | point | launch | grid | warps | waves | dependent phases | read MB | written MB "
              f"| workspace r/w MB | {head} |", "| --- " * (10 + len(cols)) + "|"]
    for r in rows:
        grids = r["grids"]
        for i, x in enumerate(r["launches"]):
            g = sorted({grids[c][i] for c in grids})
            us = " | ".join(f"{r['us'][c]['op'][i]:.1f}" for c in cols)
            lines.append(f"| {r['setting']} | {_ctx(r['context'])} B{r['batch']} | {x['launch']}: {x['what']} | "
                         f"{' / '.join(g)} | {x['warps']} | {x['waves']:.2f} | {' -> '.join(x['phases'])} | "
                         f"{_mb(x['read'])} | {_mb(x['written'])} | {_mb(x['ws_read'])} / {_mb(x['ws_written'])} | "
                         f"{us} |")
        us = " | ".join(f"{sum(r['us'][c]['op']):.1f}" for c in cols)
        lines.append(f"| {r['setting']} | {_ctx(r['context'])} B{r['batch']} | op total | | | | {r['phases']} phases "
                     f"| {_mb(sum(x['read'] for x in r['launches']))} | "
                     f"{_mb(sum(x['written'] for x in r['launches']))} | {_mb(r['workspace'])} | {us} |")
        us = " | ".join(f"{r['us'][c]['sdpa']:.1f}" for c in cols)
        lines.append(f"| {r['setting']} | {_ctx(r['context'])} B{r['batch']} | SDPA flash (dense) | | | | "
                     f"{SDPA_PHASES} phases | {_mb(r['dense'] - r['hq'] * r['batch'] * r['head_dim'] * r['itemsize'])} "
                     f"| {_mb(r['hq'] * r['batch'] * r['head_dim'] * r['itemsize'])} | | {us} |")
    return "\n".join(lines)


def main(args) -> int:
    """``python -m bench gpu --model`` (``args``: bench/gpu.py's parsed arguments)."""
    from bench import cli

    base = cli.config(dict(args.options))
    variant = args.compare if args.compare is not None else cli.options_arg("gpu")
    name = "defaults" if not args.options else getattr(args.options, "name", "options")
    if name == "compare":
        name = "options"
    settings = {name: base, variant.name: cli.config({**dict(args.options), **dict(variant)})}
    points = POINTS
    if args.contexts or args.batches:
        points = [(L, B) for B in (args.batches or [8]) for L in (args.contexts or [L for L, _ in POINTS])]
    rows = evaluate(settings, points, phase_us=args.phase_us)
    print("# modelled bytes, not measurements: Hq=32 Hkv=8 D=128 bf16 K/V; us = bytes / bandwidth"
          + (f" + {args.phase_us:g} us a dependent phase" if args.phase_us else "") + "; cards: "
          + "; ".join(f"{c['label']} {c['gbs']:.0f} GB/s" + (f" (copy measured {c['copy_gbs']:.0f})"
                                                            if c["copy_gbs"] else "") for c in CARDS.values()))
    for n, config in settings.items():
        print(f"# {n}: {setting_label(config)}")
    print(table(rows))
    for r in rows:
        if r["target"] is not None:
            print(f"# {r['setting']} at {_ctx(r['context'])} B{r['batch']}: floor {r['floor_ratio']:.2f}x SDPA flash; "
                  f"target {r['target']:g}x {'reachable' if r['meets_target'] else 'UNREACHABLE'} by bytes, "
                  f"{r['floor_target']:g}x (1.5x the target) {'met' if r['meets_floor_target'] else 'MISSED'}")
    path = cli.out_path(args.out, "gpu_model")
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(dict(cards=CARDS, floor_margin=FLOOR_MARGIN, rows=rows), f, indent=1)
        print(f"# wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    import sys

    from bench.gpu import main as _gpu_main

    sys.exit(_gpu_main(["--model"] + sys.argv[1:]))
