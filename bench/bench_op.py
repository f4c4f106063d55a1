"""Op benchmark on this CPU: ``tinyserve::sparse_decode`` against dense torch SDPA.

Setting (issue 2, section 4): B=1, 9 query heads / 3 KV heads, D=64, page 16,
token budget 2048, fp32 and bf16, contexts 4K/16K/64K (more with ``--full``).

Dense and sparse are timed side by side in one loop (alternating calls, median of
many repetitions, default ``torch`` thread count). The sparse op is called through
``torch.ops.tinyserve.sparse_decode`` exactly as a compiled graph calls it.

Bandwidth bound: the bytes the sparse op must touch (fp32 bounds ``P*D*2*4`` plus
``kabs`` ``P*4`` per KV head, plus the selected keys and values
``budget*D*2*itemsize`` per KV head) divided by the read bandwidth measured once
at start-up (a large ``sum``).

Usage::

    python bench/bench_op.py --quick                # < 1 minute
    python bench/bench_op.py --out-dir results/     # table + results/bench_op.{json,csv,png}
    python bench/bench_op.py --full --json results/bench_op_full.json
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from tinyserve_compile.cost import sparse_site_bytes
from tinyserve_compile.kernels import allocate_bounds, rebuild_bounds_

B, HQ, HKV, D, PAGE, BUDGET = 1, 9, 3, 64, 16, 2048
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def read_bandwidth_gbs(mb: int = 256, reps: int = 7) -> float:
    """Machine read bandwidth in GB/s: median time of ``sum`` over a ``mb`` MB fp32 buffer."""
    x = torch.ones(mb * 2**20 // 4)
    x.sum()  # warm (page faults)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times) / 1e9


def sdpa_materializes_repeat(q, k, v) -> str:
    """Whether SDPA(enable_gqa=True) copies K/V out to all query heads, judged from the profiler's ops."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    names = {e.key for e in prof.key_averages()}
    copies = sorted(n for n in names if "repeat" in n or n in ("aten::index_select", "aten::clone", "aten::contiguous"))
    return "yes (" + ", ".join(copies) + ")" if copies else "no"


def sparse_bytes(L: int, itemsize: int, page: int = PAGE, budget: int = BUDGET, cf: int = 1) -> int:
    """Bytes the sparse op must touch per call (see :func:`tinyserve_compile.cost.sparse_site_bytes`)."""
    return sparse_site_bytes(L, HKV, D, itemsize, page, budget, cf)


def bench_one(L: int, dtype: torch.dtype, reps: int, warmup: int = 3, seed: int = 0, page: int = PAGE,
              budget: int = BUDGET, sink: int = 0, cf: int = 1) -> dict:
    """Time dense SDPA and the sparse op, alternating, on one (context, dtype) point."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, 1, D, generator=gen).to(dtype)  # [1,9,1,64]
    k = torch.randn(B, HKV, L, D, generator=gen).to(dtype)  # [1,3,L,64]
    v = torch.randn(B, HKV, L, D, generator=gen).to(dtype)
    bounds = rebuild_bounds_(k, allocate_bounds(k, page), page)  # fp32 [1,3,P,64] x2, [1,3,P]
    vl = torch.tensor([L], dtype=torch.int64)
    scale = 1.0 / D**0.5
    op = torch.ops.tinyserve.sparse_decode

    def dense():
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    def sparse():
        return op(q, k, v, *bounds, vl, None, scale, page, budget, sink, cf, "torch")

    for _ in range(warmup):
        dense()
        sparse()
    td, ts = [], []
    for i in range(reps):
        for name in (("dense", "sparse") if i % 2 == 0 else ("sparse", "dense")):
            t0 = time.perf_counter()
            (dense if name == "dense" else sparse)()
            dt = time.perf_counter() - t0
            (td if name == "dense" else ts).append(dt)
    dense_ms = statistics.median(td) * 1e3
    sparse_ms = statistics.median(ts) * 1e3
    nbytes = sparse_bytes(L, k.element_size(), page, budget, cf)
    return dict(
        context=L,
        dtype=str(dtype).replace("torch.", ""),
        heads=f"{HQ}/{HKV}",
        page=page,
        budget=budget,
        sink_pages=sink,
        candidate_factor=cf,
        dense_ms=round(dense_ms, 4),
        sparse_ms=round(sparse_ms, 4),
        ratio=round(dense_ms / sparse_ms, 2),
        sparse_bytes=nbytes,
        effective_gbs=round(nbytes / (sparse_ms * 1e-3) / 1e9, 2),
        reps=reps,
    )


def fmt_ctx(L: int) -> str:
    return f"{L // 1024}K" if L % 1024 == 0 else str(L)


def print_table(rows, bw_gbs: float) -> str:
    head = ("context", "dtype", "heads", "dense ms", "sparse ms", "ratio", "eff GB/s", "bw bound ms")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(
            f"| {fmt_ctx(r['context'])} | {r['dtype']} | {r['heads']} | {r['dense_ms']:.3f} | {r['sparse_ms']:.3f} | "
            f"{r['ratio']:.1f}x | {r['effective_gbs']:.1f} | {r['bound_ms']:.3f} |"
        )
    text = "\n".join(lines)
    print(text)
    return text


def write_outputs(rows, json_path: str) -> None:
    """``json_path`` (one record per row), plus a CSV and a PNG plot with the same stem."""
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(rows, f, indent=1)
    stem = os.path.splitext(json_path)[0]
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for dt in sorted({r["dtype"] for r in rows}):
        rr = [r for r in rows if r["dtype"] == dt]
        ctx = [r["context"] for r in rr]
        ax.plot(ctx, [r["dense_ms"] for r in rr], "o--", label=f"SDPA {dt}")
        ax.plot(ctx, [r["sparse_ms"] for r in rr], "s-", label=f"sparse_decode {dt}")
        ax.plot(ctx, [r["bound_ms"] for r in rr], ":", color="gray")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms per decode step (median)")
    r0 = rows[0]
    ax.set_title(f"B={B}, {HQ}q/{HKV}kv heads, D={D}, page {r0['page']}, budget {r0['budget']}, "
                 f"c={r0['candidate_factor']} (dotted: bw bound)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=120)
    print(f"wrote {json_path}, {stem}.csv, {stem}.png")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few repetitions; finishes in under a minute")
    ap.add_argument("--full", action="store_true", help="add 1K, 128K and 256K contexts")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per point (default 15 quick, 60)")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    ap.add_argument("--json", default=None, help="write records here (+ .csv and .png with the same stem)")
    ap.add_argument("--out-dir", default=None, help="write bench_op.json/.csv/.png into this folder")
    ap.add_argument("--page-size", type=int, default=PAGE)
    ap.add_argument("--budget", type=int, default=BUDGET)
    ap.add_argument("--sink-pages", type=int, default=0)
    ap.add_argument("--candidate-factor", type=int, default=1)
    ap.add_argument("--defaults", action="store_true",
                    help="use the backend's default selection (tinyserve_compile.config) instead of the paper's")
    args = ap.parse_args(argv)
    if args.defaults:
        from tinyserve_compile import config as C

        args.page_size, args.budget = C.DEFAULT_PAGE_SIZE, C.DEFAULT_TOKEN_BUDGET
        args.sink_pages, args.candidate_factor = C.DEFAULT_SINK_PAGES, C.DEFAULT_CANDIDATE_FACTOR

    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = [4096, 16384, 65536]
    if args.full:
        contexts = [1024] + contexts + [131072, 262144]
    reps = args.reps or (15 if args.quick else 60)
    t_start = time.perf_counter()
    bw = read_bandwidth_gbs(128 if args.quick else 512)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()} "
          f"({os.cpu_count()} cpus); measured read bandwidth {bw:.1f} GB/s")
    q = torch.randn(1, HQ, 1, D)
    kv = torch.randn(1, HKV, 4096, D)
    print(f"SDPA enable_gqa materializes repeated K/V: {sdpa_materializes_repeat(q, kv, kv)}")
    print(f"selection: page {args.page_size}, budget {args.budget}, sink pages {args.sink_pages}, "
          f"candidate factor {args.candidate_factor}")
    rows = []
    for L in contexts:
        for name in args.dtypes.split(","):
            r = bench_one(L, DTYPES[name], reps, page=args.page_size, budget=args.budget, sink=args.sink_pages,
                          cf=args.candidate_factor)
            r["bound_ms"] = round(r["sparse_bytes"] / (bw * 1e9) * 1e3, 4)
            r["read_gbs"] = round(bw, 2)
            rows.append(r)
    print()
    print_table(rows, bw)
    json_path = args.json or (os.path.join(args.out_dir, "bench_op.json") if args.out_dir else None)
    if json_path:
        write_outputs(rows, json_path)
    print(f"total {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
