"""GPU benchmark of the Triton sparse-decode kernels: correctness at scale, then timings.

``--dry-run`` (tiny shapes, CPU, Triton interpreter) checks the script's logic; its numbers on CPU are
meaningless.

One call on a lent GPU (H200 by default) does:

1. **Correctness** at every benchmarked shape: the Triton output against the
   pure-PyTorch reference (``reference.sparse_decode_reference`` when it fits in
   memory, else the op's PyTorch path ``kernel="torch"``), within dtype tolerance,
   and the share of KV heads whose attended pages equal ``reference.choose_pages``
   (ties of the fp32 page score may differ). ``--skip-check`` leaves it out of a timing run
   (``bench/gpu_check.sh`` runs it as its own step).
2. **Timings**, each method twice: under CUDA graphs (``triton.testing.do_bench_cudagraph``, median: the calls
   replayed from one graph, so launch cost does not decide the ratio; the ``*_graph_ms`` columns) and launched
   from the host (``triton.testing.do_bench``, median; the ``*_ms`` columns), of

   * ``sparse``: :func:`sparse_decode_triton` (score kernel + top-K + split-K
     gather/attend + combine), and ``select`` (its score + top-K part alone);
   * ``dense``: the same Triton kernel with a budget covering the context;
   * ``sdpa_flash`` / ``sdpa_efficient`` / ``sdpa_math``: ``F.scaled_dot_product_attention``
     pinned to each backend (GQA via ``enable_gqa`` where the backend has it,
     else K/V repeated before timing; "n/a" when the backend refuses the shape).

   at Hq=32 / Hkv=8 / D=128 (Llama-3-8B attention), budget 2048, bf16 (``--dtypes fp16 bf16`` adds fp16), at
   4K, 32K and 128K with a batch of 8 and 32K and 128K with a batch of 1, for each selection setting
   (the defaults first): ``defaults`` (every selection field of ``TinyServeConfig()``: pages of
   8, one sink page, two stages with ``candidate_extra`` extra candidates keeping single tokens, int8 bounds
   rounded outward) and, with ``--compare``, ``compare`` (``--compare paper``: pages of 16, the bound alone, no
   sink page, fp32 bounds; :data:`bench.cli.PRESETS`). Each row records
   the path the Triton kernels took: ``stages`` (1 or 2) and ``kept`` ("pages" or "tokens").
3. **Report**: ms, the speed-up of ``sparse`` over the fastest SDPA backend (``speedup_vs_sdpa``: under CUDA
   graphs where both could be captured, ``speedup_basis`` says which) and over ``dense``, and the GB/s of the
   bytes the sparse path actually touches (the bounds of the valid pages, the candidates' keys, the kept K/V,
   scores) as a share of the HBM peak: the primary ``sparse_pct_peak`` against a device-to-device copy measured
   in the same run (bytes read plus written), ``sparse_pct_datasheet`` against the datasheet (``--peak-gbs``,
   default by name: 3350 GB/s for an H100, 4800 GB/s for an H200). Targets, per setting: >= 7x SDPA at 32K
   batch 8, >= 12x at 128K batch 8, >= 0.9x at 4K batch 8, >= 60% of the measured peak at 128K batch 8. Rows
   are written as they complete (a run cut short keeps them). ``--model`` needs no GPU: the modelled bytes of
   each launch (:mod:`bench.gpu_model`).

Usage::

    python -m bench gpu --check-only --out results/check      # correctness only, every shape
    python -m bench gpu --compare paper --out results/        # full run: table + json/csv/png
    python -m bench gpu --quick --out q.json                  # 4K and 32K, batch 1
    python -m bench gpu --dry-run --out /tmp/dry              # CPU logic check (Triton interpreter)
    python -m bench gpu --model                               # no GPU: modelled bytes per launch (bench/gpu_model.py)
"""
from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import csv  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench import cli  # noqa: E402
from bench.timing import bench_graph_ms, bench_ms, copy_bandwidth_gbs, datasheet_gbs  # noqa: E402
from tinyserve_compile.config import TinyServeConfig  # noqa: E402
from tinyserve_compile.cost import sparse_site_bytes  # noqa: E402
from tinyserve_compile.kernels import reference as ref  # noqa: E402
from tinyserve_compile.kernels.reference import candidate_pages  # noqa: E402
from tinyserve_compile.kernels import sparse_decode  # noqa: E402
from tinyserve_compile.kernels.spec import SelectionSpec  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
TOL = {torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2), torch.float32: (3e-5, 3e-5)}
SDPA = ("sdpa_flash", "sdpa_efficient", "sdpa_math")
METHODS = ("sparse", "select", "dense") + SDPA

#: the shapes: (context, batch) points; --contexts/--batches replace them by their cross product
FULL = dict(points=[(4096, 8), (32768, 8), (131072, 8), (32768, 1), (131072, 1)], dtypes=["bf16"], hq=32, hkv=8,
            d=128, budget=2048)
QUICK = dict(FULL, points=[(4096, 1), (32768, 1)])
#: the dry run's extra candidates scale with its budget (the defaults' 1024 of 2048 -> 32 of 64), so that its tiny
#: caches stay longer than the candidates (a cache of at most max(K, N1) pages is attended densely) and two stages run
DRY = dict(points=[(128, 1), (384, 1), (128, 2), (384, 2)], dtypes=["fp16", "bf16"], hq=6, hkv=2, d=32, budget=64,
           extra_per_budget=TinyServeConfig().candidate_extra / TinyServeConfig().token_budget)
#: the op's targets: (what, context, batch, minimum); "x_sdpa": speed-up over the fastest SDPA backend, "pct_peak":
#: share of the measured copy bandwidth on the bytes the sparse path touches
TARGETS = (("x_sdpa", 32768, 8, 7.0), ("x_sdpa", 131072, 8, 12.0), ("x_sdpa", 4096, 8, 0.9),
           ("pct_peak", 131072, 8, 60.0))
#: the key of each selection field in a setting, and the ``TinyServeConfig`` field it stands for
SETTING_FIELDS = dict(page="page_size", sink="sink_pages", cf="candidate_factor", extra="candidate_extra",
                      tokens="keep_tokens", bounds="bounds_dtype")


def config_setting(config: TinyServeConfig) -> dict:
    """The selection setting of a backend configuration (the budget comes from the shape grid)."""
    return {key: getattr(config, field) for key, field in SETTING_FIELDS.items()}


#: selection settings: the backend's defaults, and "compare" when main() is given --compare
SETTINGS = {"defaults": config_setting(TinyServeConfig())}


# ---------------------------------------------------------------------------------------------------------------------
# timing and byte counting
# ---------------------------------------------------------------------------------------------------------------------


def time_ms(fn, device, iters: int) -> float:
    """Median milliseconds of ``fn()`` launched from the host (:func:`bench.timing.bench_ms`)."""
    return bench_ms(fn, device, iters)


def bytes_touched(method: str, B, hkv, hq, L, D, S, budget, itemsize, cf: int = 1, bounds_itemsize: int = 4,
                  extra: int = 0) -> int:
    """Bytes a method must read/write at least: the K/V it attends, the bounds it scans (the cost model of
    :func:`tinyserve_compile.cost.sparse_site_bytes`, per batch row), the page scores it writes and reads, q/out."""
    P = math.ceil(L / S)
    qo = 2 * B * hq * D * itemsize
    kv_dense = 2 * B * hkv * L * D * itemsize
    if method in ("dense", "sdpa_flash", "sdpa_efficient"):
        return kv_dense + qo
    scores = 2 * B * hkv * P * 4
    if method == "select":
        bounds = B * hkv * P * (2 * D * bounds_itemsize + 4)
        n1 = candidate_pages(S, budget, cf, extra)
        cand = B * hkv * min(L, n1 * S) * D * itemsize if n1 > budget // S else 0
        return bounds + cand + scores + B * hq * D * itemsize
    return B * sparse_site_bytes(L, hkv, D, itemsize, S, budget, cf, bounds_itemsize, extra) + scores + qo


def peak_gbs_for(device, override):
    """The datasheet's peak bandwidth of ``device`` in GB/s (``override`` when given; NaN when unknown)."""
    return float(override) if override else datasheet_gbs(device)


# ---------------------------------------------------------------------------------------------------------------------
# one shape
# ---------------------------------------------------------------------------------------------------------------------


def make_inputs(B, hq, hkv, L, D, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, hq, 1, D, generator=g, device=device, dtype=torch.float32).to(dtype)
    k = torch.randn(B, hkv, L, D, generator=g, device=device, dtype=torch.float32).to(dtype)
    v = torch.randn(B, hkv, L, D, generator=g, device=device, dtype=torch.float32).to(dtype)
    # a few hot tokens per head so that the selection has something to find
    hot = torch.randint(0, L, (16,), generator=g, device=device)
    G = hq // hkv
    k[:, :, hot] = (k[:, :, hot].float() + 3.0 * q.float().reshape(B, hkv, G, D)[:, :, :1]).to(dtype)
    return q, k, v


def check_correctness(tsd, q, k, v, bounds, vl, spec, ref_budget_bytes):
    """Worst normalised error vs the reference, the share of KV heads that keep the reference's pages (or
    tokens), and the path the Triton selection took: ``stages`` (1, 2, or 0 when dense) and ``kept``."""
    B, hq, _, D = q.shape
    hkv, L = k.shape[1], k.shape[2]
    scale = D ** -0.5
    out = tsd.sparse_decode_triton(q, k, v, *bounds, vl, None, scale, spec)
    ref_bytes = 3 * B * hq * L * D * 4
    if ref_bytes <= ref_budget_bytes:
        want = ref.sparse_decode_reference(q, k, v, vl, None, scale, spec, bounds)
        oracle = "reference"
    else:
        want = sparse_decode(q, k, v, bounds, vl, None, scale, spec, kernel="torch")
        oracle = "kernel=torch"
    atol, rtol = TOL[q.dtype]
    err = (out.float() - want.float()).abs()
    excess = float((err / (atol + rtol * want.float().abs())).max())
    sel_ref, unit = ref.choose(q, k, bounds, vl, None, scale, spec)
    sel_tri = tsd.select_pages_triton(q, k, *bounds, vl, None, scale, spec)
    if sel_ref is None or sel_tri is None:
        agree = 1.0 if (sel_ref is None) == (sel_tri is None) else float("nan")
    else:  # the same tokens read per KV head (the lists may differ in width and empty slots)
        same = (ref.selected_token_mask(sel_ref, unit, L, vl) == ref.selected_token_mask(sel_tri, unit, L, vl)).all(-1)
        agree = float(same.float().mean())
    return dict(max_abs_err=float(err.max()), tol_ratio=excess, ok=excess <= 1.0, pages_agree=agree, oracle=oracle,
                ref_kept="all" if sel_ref is None else ("tokens" if unit == 1 else "pages"), **_path_of(sel_tri, spec))


def _path_of(sel, spec) -> dict:
    """The path taken: dense (no selection), one stage, or two stages keeping whole pages or single tokens."""
    stages = 0 if sel is None else (2 if spec.two_stage else 1)
    kept = "all" if sel is None else ("tokens" if spec.two_stage and spec.keep_tokens else "pages")
    return dict(stages=stages, kept=kept)


def selection_path(tsd, q, k, bounds, vl, spec) -> dict:
    """``stages`` and ``kept`` of the Triton selection at one shape, without the check against the reference."""
    return _path_of(tsd.select_pages_triton(q, k, *bounds, vl, None, q.shape[-1] ** -0.5, spec), spec)


def select_fn(tsd, q, k, bounds, vl, scale, spec):
    """``(fn, how)``: a zero-arg call of the selection launches alone (score + top-K, and the candidate stage of
    two), through whichever entry point this version of the Triton module has, or ``(None, why)``."""
    calls = []
    if hasattr(tsd, "_select"):  # the launches' entry point of earlier versions
        calls.append(("_select", lambda: tsd._select(q, k, *bounds, vl, None, scale, spec)))
    if hasattr(tsd, "_prepare") and hasattr(tsd, "_launch_select"):  # the fused op's launches 1-2

        def launches():
            plan, ws, vl_, vls, mask, mstr, mkind, mper, ctrl, has_ctrl, _ = tsd._prepare(
                q, k, *bounds, vl, None, spec, None, None)
            if plan.mode:
                tsd._launch_select(q, k, *bounds, vl_, vls, mask, mstr, mkind, mper, ctrl, has_ctrl, scale, spec,
                                   plan, ws)
            return ws

        calls.append(("_prepare + _launch_select", launches))
    why = "no selection entry point in this triton_sparse_decode"
    for how, fn in calls:
        try:
            fn()
            return fn, how
        except (TypeError, ValueError, AttributeError, RuntimeError) as e:
            why = f"{how}: {type(e).__name__}: {e}"[:200]
    return None, why


def sdpa_fn(backend_name, q, k, v, device):
    """A zero-arg SDPA call pinned to one backend, or None when the backend refuses the shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
               "sdpa_math": SDPBackend.MATH}
    be = backend[backend_name]
    G = q.shape[1] // k.shape[1]
    for gqa in (True, False):
        kk, vv = (k, v) if gqa else (k.repeat_interleave(G, 1), v.repeat_interleave(G, 1))

        def fn(kk=kk, vv=vv, gqa=gqa):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=gqa)

        try:
            with warnings.catch_warnings():  # a backend that refuses a shape says why in a warning: expected here
                warnings.simplefilter("ignore")
                fn()
            return fn, ("enable_gqa" if gqa else "repeat_kv")
        except (RuntimeError, ValueError, NotImplementedError):
            continue
    return None, "n/a"


def bench_shape(tsd, cfg, B, L, dname, device, iters, ref_budget_bytes, peak, log, setting="defaults",
                check_only=False, copy_gbs=float("nan"), check=True, graph_rep=50, graphs=True):
    """One row: the check against the reference (unless ``check`` is False: then only the selection path), and
    unless ``check_only`` the timings of :data:`METHODS`, plain (``*_ms``) and under CUDA graphs
    (``*_graph_ms``; ``*_graph_error`` says why one is missing), ratios and shares of the peaks. ``peak``: the
    datasheet's GB/s; ``copy_gbs``: the copy bandwidth measured in this run (the primary peak)."""
    dtype = DTYPES[dname]
    hq, hkv, D, budget = cfg["hq"], cfg["hkv"], cfg["d"], cfg["budget"]
    S, sink, cf, extra, tokens, bdt = (SETTINGS[setting][k_] for k_ in ("page", "sink", "cf", "extra", "tokens",
                                                                         "bounds"))
    if extra and "extra_per_budget" in cfg:
        extra = int(cfg["extra_per_budget"] * budget)
    q, k, v = make_inputs(B, hq, hkv, L, D, dtype, device)
    bounds = ref.page_bounds(k, S, dtype=getattr(torch, bdt))  # stored as the backend stores them
    vl = torch.full((B,), L, dtype=torch.int64, device=device)
    scale = D ** -0.5
    row = dict(context=L, batch=B, dtype=dname, setting=setting, hq=hq, hkv=hkv, head_dim=D, page=S, budget=budget,
               sink_pages=sink, candidate_factor=cf, candidate_extra=extra, keep_tokens=tokens, bounds_dtype=bdt)
    spec = SelectionSpec(S, budget, sink, cf, extra, tokens, getattr(torch, bdt))
    if check:
        row.update(check_correctness(tsd, q, k, v, bounds, vl, spec, ref_budget_bytes))
    else:
        row.update(max_abs_err=None, tol_ratio=None, ok=None, pages_agree=None, oracle="not checked", ref_kept=None,
                   **selection_path(tsd, q, k, bounds, vl, spec))
    if check_only:
        log(fmt_check(row))
        del q, k, v, bounds
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return row
    fns = {
        "sparse": lambda: tsd.sparse_decode_triton(q, k, v, *bounds, vl, None, scale, spec),
        "dense": lambda: tsd.sparse_decode_triton(q, k, v, *bounds, vl, None, scale,
                                                  SelectionSpec(S, L + S, 0, 1, 0, False, getattr(torch, bdt))),
    }
    select, row["select_how"] = select_fn(tsd, q, k, bounds, vl, scale, spec)
    if select is not None:
        fns["select"] = select
    for name in SDPA:
        fn, how = sdpa_fn(name, q, k, v, device)
        row[f"{name}_gqa"] = how
        if fn is not None:
            fns[name] = fn
    if device.type == "cuda" and row["sdpa_flash_gqa"] != "enable_gqa":  # the anchor: GQA-native flash, K/V once
        log(f"# SDPA flash did not take enable_gqa at ctx={L} B={B} ({row['sdpa_flash_gqa']}): its anchor reads "
            f"K/V repeated to every query head")
    itemsize = torch.empty((), dtype=dtype).element_size()
    for name in METHODS:
        row[f"{name}_ms"] = row[f"{name}_graph_ms"] = row[f"{name}_gbs"] = None
        row[f"{name}_graph_error"] = ""
        if name not in fns:
            row[f"{name}_graph_error"] = "backend refused the shape"
            continue
        row[f"{name}_ms"] = time_ms(fns[name], device, iters)
        if graphs:
            row[f"{name}_graph_ms"], row[f"{name}_graph_error"] = bench_graph_ms(fns[name], device, graph_rep)
        else:
            row[f"{name}_graph_error"] = "--no-graphs"
        ms = row[f"{name}_graph_ms"] or row[f"{name}_ms"]
        nbytes = bytes_touched(name, B, hkv, hq, L, D, S, budget, itemsize, cf, bounds[0].element_size(), extra)
        row[f"{name}_gbs"] = nbytes / (ms * 1e-3) / 1e9
    _ratios(row, peak, copy_gbs)
    log(fmt_row(row))
    del q, k, v, bounds, fns
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _ratios(row, peak, copy_gbs):
    """The speed-ups (under CUDA graphs where sparse and an SDPA backend were both captured, else plain) and the
    shares of the peaks, into ``row``."""
    def best_sdpa(key):
        got = [(row[f"{n}_{key}"], n) for n in SDPA if row.get(f"{n}_{key}") is not None]
        return min(got) if got else (None, None)

    plain, plain_by = best_sdpa("ms")
    graph, graph_by = best_sdpa("graph_ms")
    row["speedup_vs_sdpa_plain"] = plain / row["sparse_ms"] if plain else None
    row["speedup_vs_sdpa_graph"] = graph / row["sparse_graph_ms"] if graph and row["sparse_graph_ms"] else None
    if row["speedup_vs_sdpa_graph"] is not None:
        row.update(speedup_vs_sdpa=row["speedup_vs_sdpa_graph"], speedup_basis="cudagraph", best_sdpa=graph_by)
    else:
        why = row["sparse_graph_error"] or "no SDPA backend captured"
        row.update(speedup_vs_sdpa=row["speedup_vs_sdpa_plain"], speedup_basis=f"do_bench ({why})",
                   best_sdpa=plain_by)
    sparse = row["sparse_graph_ms"] or row["sparse_ms"]
    dense = row["dense_graph_ms"] if row["sparse_graph_ms"] and row["dense_graph_ms"] else row["dense_ms"]
    row["speedup_vs_dense"] = dense / sparse if dense and sparse else None
    row["sparse_pct_peak"] = None if math.isnan(copy_gbs) else row["sparse_gbs"] / copy_gbs * 100
    row["sparse_pct_datasheet"] = None if math.isnan(peak) else row["sparse_gbs"] / peak * 100
    row["copy_gbs"] = None if math.isnan(copy_gbs) else copy_gbs
    row["datasheet_gbs"] = None if math.isnan(peak) else peak


# ---------------------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------------------

HEADER = (f"{'setting':>8} {'path':>8} {'ctx':>7} {'B':>2} {'dt':>4} | "
          f"{'sparse':>8} {'(plain)':>8} {'select':>8} {'dense':>8} {'sdpa':>8} {'(plain)':>8} {'backend':>9} (ms) | "
          f"{'x sdpa':>6} {'(plain)':>7} {'x dense':>7} | {'GB/s':>7} {'%copy':>6} {'%sheet':>6}")
CHECK_HEADER = (f"{'setting':>8} {'path':>8} {'ctx':>7} {'B':>2} {'dt':>4} | {'ok':>3} {'pages=':>6} "
                f"{'max abs err':>11} {'x tol':>6} oracle")


def _f(x, w=8, p=3):
    return f"{'n/a':>{w}}" if x is None else f"{x:>{w}.{p}f}"


def _path(r):
    """The selection path of a row: stages and what is kept, e.g. ``2/tokens``."""
    return f"{r['stages']}/{r['kept']}"


def fmt_check(r):
    return (f"{r['setting']:>8} {_path(r):>8} {r['context']:>7} {r['batch']:>2} {r['dtype']:>4} | "
            f"{('yes' if r['ok'] else 'NO'):>3} "
            f"{r['pages_agree']:>6.2f} {r['max_abs_err']:>11.2e} {r['tol_ratio']:>6.2f} {r['oracle']}")


def fmt_row(r):
    """One timing row: the graph-timed ms first, the plain ones in brackets' columns."""
    by = r.get("best_sdpa") or ""
    g = r.get(f"{by}_graph_ms") if by else None
    p = r.get(f"{by}_ms") if by else None
    return (f"{r['setting']:>8} {_path(r):>8} {r['context']:>7} {r['batch']:>2} {r['dtype']:>4} | "
            f"{_f(r['sparse_graph_ms'])} {_f(r['sparse_ms'])} {_f(r['select_graph_ms'] or r['select_ms'])} "
            f"{_f(r['dense_graph_ms'] or r['dense_ms'])} {_f(g)} {_f(p)} {by.replace('sdpa_', ''):>9}      | "
            f"{_f(r['speedup_vs_sdpa'], 6, 2)} {_f(r['speedup_vs_sdpa_plain'], 7, 2)} "
            f"{_f(r['speedup_vs_dense'], 7, 2)} | {_f(r['sparse_gbs'], 7, 0)} {_f(r.get('sparse_pct_peak'), 6, 1)} "
            f"{_f(r.get('sparse_pct_datasheet'), 6, 1)}")


def check_targets(rows, peak=None):
    """The op's targets (:data:`TARGETS`) per setting, the defaults first: ``value`` (the worst row at that point,
    None when the point was not run) and ``met`` (None then)."""
    out = []
    for setting in dict.fromkeys(r["setting"] for r in rows):
        rs = [r for r in rows if r["setting"] == setting and r.get("sparse_ms") is not None]
        for what, ctx, batch, want in TARGETS:
            key = "speedup_vs_sdpa" if what == "x_sdpa" else "sparse_pct_peak"
            vals = [r[key] for r in rs if (r["context"], r["batch"]) == (ctx, batch) and r.get(key) is not None]
            value = min(vals) if vals else None
            label = (f">= {want:g}x the fastest SDPA" if what == "x_sdpa" else
                     f">= {want:g}% of the measured HBM peak on bytes touched")
            ctx_s = f"{ctx // 1024}K" if ctx % 1024 == 0 else str(ctx)
            out.append(dict(target=f"{setting}: {label} at {ctx_s} batch {batch}", setting=setting, context=ctx,
                            batch=batch, want=want, worst=value, met=None if value is None else value >= want))
    return out


def write_outputs(rows, meta, targets, args, png=True):
    """JSON (meta, targets, rows), CSV and, with ``png`` and matplotlib, a plot, where ``--out`` says
    (:func:`bench.cli.out_path`). Called after every row with ``png=False`` (a run cut short keeps its rows)."""
    paths = {}
    path = cli.out_path(args.out, "bench_kernel_gpu")
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        stem = os.path.splitext(path)[0]
        paths = {"json": path, "csv": stem + ".csv", "png": stem + ".png"}
    if "json" in paths:
        with open(paths["json"] + ".tmp", "w") as f:
            json.dump({"meta": meta, "targets": targets, "rows": rows}, f, indent=2)
        os.replace(paths["json"] + ".tmp", paths["json"])
    if "csv" in paths and rows:
        keys = list(dict.fromkeys(k_ for r in rows for k_ in r))
        with open(paths["csv"], "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
    if "png" in paths:
        if not png or not rows or rows[0].get("sparse_ms") is None:  # --check-only: nothing to plot
            del paths["png"]
        else:
            try:
                plot(rows, meta, paths["png"])
            except ImportError as e:
                print(f"# no plot: {e}")
                del paths["png"]
    return paths


def plot(rows, meta, path):
    from bench.output import pyplot

    plt = pyplot()

    groups = sorted({(r["setting"], r["batch"], r["dtype"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (st, B, dt) in zip(axes[0], groups):
        rs = sorted((r for r in rows if (r["setting"], r["batch"], r["dtype"]) == (st, B, dt)),
                    key=lambda r: r["context"])
        ctx = [r["context"] for r in rs]
        for name, style in (("sparse", "o-"), ("dense", "s--"), ("sdpa_flash", "^:"), ("sdpa_efficient", "v:"),
                            ("sdpa_math", "x:")):
            ys = [r.get(f"{name}_graph_ms") or r.get(f"{name}_ms") for r in rs]
            if any(y is not None for y in ys):
                ax.plot([c for c, y in zip(ctx, ys) if y is not None], [y for y in ys if y is not None], style,
                        label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms per call (CUDA graphs where captured)")
        ax.set_title(f"{st}, B={B} {dt}")
        ax.legend()
    fig.suptitle(f"tinyserve Triton sparse decode, budget {rows[0]['budget']} on {meta['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------------


def compiled_resources(tsd) -> list:
    """Registers, spills and shared memory of every compiled specialisation of the op's kernels (what the driver
    reports once they ran), a dict per kernel; empty under the interpreter. Triton internals: an error is
    recorded in place of the list's entries, never raised."""
    out = []
    for name in tsd.LAUNCHES:
        fn = getattr(tsd, name)
        try:
            for caches in getattr(fn, "device_caches", {}).values():
                for kernel in caches[0].values():
                    kernel._init_handles()
                    md = kernel.metadata
                    out.append(dict(kernel=name, num_warps=md.num_warps, num_stages=md.num_stages,
                                    registers=kernel.n_regs, spills=kernel.n_spills, shared=md.shared))
        except Exception as e:  # noqa: BLE001 - a record, not a check
            out.append(dict(kernel=name, error=f"{type(e).__name__}: {e}"))
    return out


def main(argv=None):
    p = cli.parser("gpu", __doc__.split("\n\n")[0], quick="4K and 32K, batch 1", threads=False, options=True)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--model", action="store_true",
                   help="no GPU: the byte and latency model of each launch on an H100 and an H200 (bench/gpu_model.py) "
                        "for the defaults (or --options) and the 'gpu' preset (or --compare); --contexts/--batches "
                        "change the points")
    p.add_argument("--phase-us", type=float, default=0.0,
                   help="--model: microseconds added for each dependent phase (default 0: bytes only)")
    p.add_argument("--check-only", action="store_true",
                   help="correctness against the reference at every shape, no timing (exit 1 on a mismatch)")
    p.add_argument("--skip-check", action="store_true",
                   help="time without the check against the reference (run it apart with --check-only)")
    p.add_argument("--contexts", type=int, nargs="*",
                   help="override the context lengths (with the batches: every pair)")
    p.add_argument("--batches", type=int, nargs="*", help="override the batch sizes")
    p.add_argument("--dtypes", nargs="*", choices=sorted(DTYPES), help="override the dtypes (default bf16)")
    p.add_argument("--iters", type=int, default=100, help="timing repetitions (do_bench rep ms on CUDA)")
    p.add_argument("--graph-rep", type=int, default=50,
                   help="do_bench_cudagraph's rep: ms of calls captured in one graph (replayed 10 times)")
    p.add_argument("--no-graphs", action="store_true", help="plain do_bench only (no CUDA graph timings)")
    p.add_argument("--peak-gbs", type=float, default=None,
                   help="the datasheet's peak bandwidth in GB/s (default by device name; the primary peak is a "
                        "device-to-device copy measured in the run)")
    p.add_argument("--ref-budget-gb", type=float, default=24.0,
                   help="largest fp32 working set for the dense reference; above it the op's torch path is the oracle")
    args = cli.parse(p, argv)
    if args.model:
        from bench import gpu_model

        return gpu_model.main(args)
    if args.options:
        p.error("argument --options: only with --model (the timed settings are the defaults and --compare)")
    args.settings = ["defaults"]
    if args.compare is not None:
        SETTINGS[args.compare.name] = config_setting(cli.config(args.compare))
        args.settings.append(args.compare.name)

    if args.dry_run:
        device = torch.device("cpu")
        cfg = dict(DRY)
        args.iters = min(args.iters, 2)
    else:
        if not torch.cuda.is_available():
            p.error("needs a CUDA GPU (or --dry-run for the CPU logic check)")
        device = torch.device("cuda")
        cfg = dict(QUICK if args.quick else FULL)
    if args.contexts or args.batches:
        contexts = args.contexts or list(dict.fromkeys(L for L, _ in cfg["points"]))
        batches = args.batches or list(dict.fromkeys(B for _, B in cfg["points"]))
        cfg["points"] = [(L, B) for B in batches for L in contexts]
    if args.dtypes:
        cfg["dtypes"] = args.dtypes

    from tinyserve_compile.kernels import triton_sparse_decode as tsd

    if not tsd.triton_available():
        p.error("triton is not installed")
    peak = peak_gbs_for(device, args.peak_gbs)
    copy_gbs = float("nan") if args.check_only else copy_bandwidth_gbs(device)
    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor()}), "
        "Triton interpreter: timings meaningless",
        torch=torch.__version__, triton=__import__("triton").__version__, peak_gbs=peak,
        datasheet_gbs=None if math.isnan(peak) else peak, copy_gbs=None if math.isnan(copy_gbs) else copy_gbs,
        dry_run=args.dry_run, check_only=args.check_only, checked=not args.skip_check,
        timers="do_bench_cudagraph (median) and do_bench (median)" if device.type == "cuda" else "wall clock",
        config=cfg, settings={s_: SETTINGS[s_] for s_ in args.settings},
    )
    print(f"# {meta['device']}  torch {meta['torch']}  triton {meta['triton']}  {meta['date']}")
    print(f"# HBM peak: device-to-device copy measured now {copy_gbs:.0f} GB/s (read + written; the primary peak), "
          f"datasheet {peak} GB/s")
    print(f"# Hq={cfg['hq']} Hkv={cfg['hkv']} D={cfg['d']} budget={cfg['budget']} settings: "
          + ", ".join(f"{s_}={SETTINGS[s_]}" for s_ in args.settings))
    if not args.check_only:
        print("# times in ms under CUDA graphs (do_bench_cudagraph), the plain do_bench ones as '(plain)'")
    print(CHECK_HEADER if args.check_only else HEADER)
    rows = []
    for setting in args.settings:
        for dname in cfg["dtypes"]:
            for L, B in cfg["points"]:
                rows.append(bench_shape(tsd, cfg, B, L, dname, device, args.iters, args.ref_budget_gb * 1e9, peak,
                                        print, setting, args.check_only, copy_gbs, not args.skip_check,
                                        args.graph_rep, not args.no_graphs))
                write_outputs(rows, meta, check_targets(rows), args, png=False)
    targets = check_targets(rows)
    for t in targets:
        if args.check_only:
            break
        state = "not run" if t["met"] is None else f"{t['worst']:.2f} -> {'met' if t['met'] else 'MISSED'}"
        print(f"# target {t['target']}: {state}")
    meta["kernels"] = compiled_resources(tsd)
    for k_ in meta["kernels"]:
        print("# compiled " + ", ".join(f"{key} {val}" for key, val in k_.items()))
    bad = [r for r in rows if r["ok"] is False]
    for r in bad:
        print(f"# CORRECTNESS FAILURE at ctx={r['context']} B={r['batch']} {r['dtype']}: "
              f"max abs err {r['max_abs_err']:.3e} ({r['tol_ratio']:.2f}x tolerance, oracle {r['oracle']})")
    paths = write_outputs(rows, meta, targets, args)
    for k_, v_ in paths.items():
        print(f"# wrote {k_}: {v_}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
