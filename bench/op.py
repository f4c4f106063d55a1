"""Op benchmark on this CPU: the sparse decode op against dense torch SDPA, side by side.

Shape: B=1, 9 query heads / 3 KV heads, D=64, fp32 and bf16,
contexts 4K/16K/64K (1K..256K with ``--full``). Selection settings:

* ``defaults``: the backend's defaults (every selection field of ``TinyServeConfig()``: page size, budget,
  sink pages, candidate factor and extra candidates, kept tokens or pages, bounds dtype);
* ``compare`` (with ``--compare``): ``TinyServeConfig`` with the options given, e.g. ``--compare paper`` (the
  paper's rule: page 16, no sinks, one stage, fp32 bounds) or ``--compare previous`` (the earlier defaults).

Providers, timed in one interleaved loop (rotating order, median of ``--reps``):
``dense`` = ``F.scaled_dot_product_attention(enable_gqa=True)`` over the whole cache,
``sparse`` = the native kernel, ``torch.ops.tinyserve.sparse_decode(..., "native")`` (the CPU
default; the PyTorch path if the native kernel cannot be built, said in the output),
``torch`` = the PyTorch path ``torch.ops.tinyserve.sparse_decode(..., "torch")``
(a variant column; ``--no-torch`` skips it),
``sparse_huge`` (with ``--huge-pages``) = the same native call on a copy of the cache and bounds placed on
transparent huge pages (``madvise`` before the first write, :func:`bench.ceilings.huge_buffer`; what
``THP_MEM_ALLOC_ENABLE=1`` gives every large PyTorch allocation), an A/B of the OS page size in one process.
By default every timed call starts
from a cold cache (a 64 MB buffer is read before it, untimed), as in a real decode
step where the other layers' weights and caches pass through; ``--warm`` skips that.

Bytes: what the sparse kernel reads (:func:`tinyserve_compile.cost.sparse_site_bytes`:
page bounds, candidates' keys, kept keys and values), against the read bandwidth
measured in the same run (``stream_gbps``: one ``sum`` over 256 MB, median of 7).

Usage::

    python -m bench op --quick                  # < 2 minutes
    python -m bench op --out results/           # table + results/bench_op.{json,csv,png}
    python -m bench op --full --compare paper --out results/bench_op_full.json
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

from bench import cli
from bench.timing import machine_fields, read_bandwidth_gbs
from tinyserve_compile.config import TinyServeConfig
from tinyserve_compile.cost import sparse_site_bytes
from tinyserve_compile.kernels import allocate_bounds, rebuild_bounds_
from tinyserve_compile.kernels.native import load_native, native_unavailable_reason
from tinyserve_compile.kernels.spec import SelectionSpec

B, HQ, HKV, D = 1, 9, 3, 64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: the key of each selection field in a setting, and the ``TinyServeConfig`` field it stands for
SETTING_FIELDS = dict(page="page_size", budget="token_budget", sink="sink_pages", cf="candidate_factor",
                      bounds="bounds_dtype", extra="candidate_extra", tokens="keep_tokens")


def config_setting(config: TinyServeConfig) -> dict:
    """The selection setting of a backend configuration."""
    return {key: getattr(config, field) for key, field in SETTING_FIELDS.items()}


#: the settings timed: the defaults, and "compare" when main() is given --compare
SETTINGS = {"defaults": config_setting(TinyServeConfig())}


def sdpa_materializes_repeat(q, k, v) -> str:
    """Whether SDPA(enable_gqa=True) copies K/V out to all query heads, judged from the profiler's ops."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    names = {e.key for e in prof.key_averages()}
    copies = sorted(n for n in names if "repeat" in n or n in ("aten::index_select", "aten::clone", "aten::contiguous"))
    return "yes (" + ", ".join(copies) + ")" if copies else "no"


def sparse_bytes(L: int, itemsize: int, s: dict) -> int:
    """Bytes the sparse kernel reads per call (:func:`tinyserve_compile.cost.sparse_site_bytes`)."""
    bounds_itemsize = getattr(torch, s["bounds"]).itemsize
    return sparse_site_bytes(L, HKV, D, itemsize, s["page"], s["budget"], s["cf"], bounds_itemsize, s["extra"])


class _Flush:
    """Evicts the caches: reads (and writes one element per line of) a buffer larger than the last-level cache."""

    def __init__(self, mb: int = 64):
        self.buf = torch.ones(mb * 2**20 // 4)

    def __call__(self):
        self.buf[::16].add_(1.0)


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` in a buffer advised for transparent huge pages before its first write."""
    from bench.ceilings import huge_buffer

    nbytes = -(-t.numel() * t.element_size() // 4) * 4  # whole fp32 words
    raw = huge_buffer(max(nbytes, 4), huge=True).view(torch.uint8)[:t.numel() * t.element_size()]
    return raw.view(t.dtype).view(t.shape).copy_(t)


def bench_one(L: int, dtype: torch.dtype, setting: str, reps: int, native: bool, with_torch: bool = True,
              cold: bool = True, warmup: int = 3, seed: int = 0, huge: bool = False) -> dict:
    """Time dense SDPA, the sparse kernel and (optionally) the PyTorch path, interleaved, on one point."""
    s = SETTINGS[setting]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, 1, D, generator=gen).to(dtype)  # [1,9,1,64]
    k = torch.randn(B, HKV, L, D, generator=gen).to(dtype)  # [1,3,L,64]
    v = torch.randn(B, HKV, L, D, generator=gen).to(dtype)
    bdt = getattr(torch, s["bounds"])
    bounds = rebuild_bounds_(k, allocate_bounds(k, s["page"], bdt), s["page"])  # [1,3,P,64] x2, [1,3,P]
    vl = torch.tensor([L], dtype=torch.int64)
    scale = 1.0 / D**0.5
    spec = SelectionSpec(s["page"], s["budget"], s["sink"], s["cf"], s["extra"], s["tokens"], bdt).to_list()
    flush = _Flush() if cold else (lambda: None)

    def dense():
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    kernel = "native" if native else "torch"

    def sparse():
        return torch.ops.tinyserve.sparse_decode(q, k, v, *bounds, vl, None, scale, spec, kernel, None)

    def torch_path():
        return torch.ops.tinyserve.sparse_decode(q, k, v, *bounds, vl, None, scale, spec, "torch", None)

    fns = {"dense": dense, "sparse": sparse}
    if with_torch:
        fns["torch"] = torch_path
    if huge:
        kh, vh = on_huge_pages(k), on_huge_pages(v)
        bh = type(bounds)(*(on_huge_pages(b) for b in bounds))

        def sparse_huge():
            return torch.ops.tinyserve.sparse_decode(q, kh, vh, *bh, vl, None, scale, spec, kernel, None)

        fns["sparse_huge"] = sparse_huge
    for _ in range(warmup):
        for f in fns.values():
            f()
    times = {name: [] for name in fns}
    names = list(fns)
    for i in range(reps):
        for j in range(len(names)):
            name = names[(i + j) % len(names)]  # rotate the order
            flush()
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    nbytes = sparse_bytes(L, k.element_size(), s)
    return dict(
        context=L,
        dtype=str(dtype).replace("torch.", ""),
        setting=setting,
        kernel="native" if native else "torch",
        heads=f"{HQ}/{HKV}",
        page=s["page"],
        budget=s["budget"],
        sink_pages=s["sink"],
        candidate_factor=s["cf"],
        candidate_extra=s["extra"],
        keep_tokens=s["tokens"],
        bounds_dtype=s["bounds"],
        dense_ms=round(ms["dense"], 4),
        sparse_ms=round(ms["sparse"], 4),
        torch_ms=round(ms["torch"], 4) if with_torch else None,
        ratio=round(ms["dense"] / ms["sparse"], 2),
        torch_ratio=round(ms["dense"] / ms["torch"], 2) if with_torch else None,
        sparse_huge_ms=round(ms["sparse_huge"], 4) if huge else None,
        huge_speedup=round(ms["sparse"] / ms["sparse_huge"], 3) if huge else None,
        bytes=nbytes,
        gbps=round(nbytes / (ms["sparse"] * 1e-3) / 1e9, 2),
        cold=cold,
        reps=reps,
        threads=torch.get_num_threads(),
    )


def fmt_ctx(L: int) -> str:
    return f"{L // 1024}K" if L % 1024 == 0 else str(L)


def print_table(rows) -> str:
    huge = any(r.get("sparse_huge_ms") is not None for r in rows)
    head = ("context", "dtype", "setting", "SDPA ms", "sparse ms", "ratio", "torch-path ms", "MB read", "GB/s",
            "% of stream") + (("on huge pages ms",) if huge else ())
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        tp = f"{r['torch_ms']:.3f} ({r['torch_ratio']:.1f}x)" if r["torch_ms"] is not None else "-"
        hp = f" {r['sparse_huge_ms']:.3f} ({r['huge_speedup']:.2f}x) |" if huge else ""
        lines.append(
            f"| {fmt_ctx(r['context'])} | {r['dtype']} | {r['setting']} | {r['dense_ms']:.3f} | {r['sparse_ms']:.3f} | "
            f"{r['ratio']:.1f}x | {tp} | {r['bytes'] / 1e6:.1f} | {r['gbps']:.1f} | "
            f"{100 * r['gbps'] / r['stream_gbps']:.0f}% |{hp}"
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
        from bench.output import pyplot

        plt = pyplot()
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    settings = sorted({r["setting"] for r in rows})
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4), squeeze=False)
    for ax, st_name in zip(axes[0], settings):
        for dt in sorted({r["dtype"] for r in rows}):
            rr = [r for r in rows if r["dtype"] == dt and r["setting"] == st_name]
            ctx = [r["context"] for r in rr]
            ax.plot(ctx, [r["dense_ms"] for r in rr], "o--", label=f"SDPA {dt}")
            ax.plot(ctx, [r["sparse_ms"] for r in rr], "s-", label=f"{rr[0]['kernel']} {dt}")
            if rr[0]["torch_ms"] is not None:
                ax.plot(ctx, [r["torch_ms"] for r in rr], "^:", label=f"torch path {dt}")
            ax.plot(ctx, [r["bound_ms"] for r in rr], ":", color="gray")
        s = SETTINGS[st_name]
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms per call (median)")
        ax.set_title(f"{st_name}: page {s['page']}, budget {s['budget']}, sinks {s['sink']}, c={s['cf']}, "
                     f"{s['bounds']} bounds (dotted: bandwidth bound)", fontsize=8)
        ax.legend(fontsize=7)
    fig.suptitle(f"B={B}, {HQ}q/{HKV}kv heads, D={D}, {rows[0]['threads']} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=120)
    print(f"wrote {json_path}, {stem}.csv, {stem}.png")


def main(argv=None) -> int:
    ap = cli.parser("op", __doc__, quick="few repetitions; finishes in about 2 minutes",
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="add 1K, 2K, 128K and 256K contexts")
    ap.add_argument("--contexts", default=None, help="comma-separated contexts (overrides --full)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per point (default 11 quick, 41)")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch-path column")
    ap.add_argument("--warm", action="store_true", help="do not evict the caches before each timed call")
    ap.add_argument("--huge-pages", action="store_true",
                    help="also time the native op on a copy of the cache on transparent huge pages (sparse_huge)")
    args = cli.parse(ap, argv)
    settings = ["defaults"]
    if args.compare is not None:
        SETTINGS[args.compare.name] = config_setting(cli.config(args.compare))
        settings.append(args.compare.name)
    if args.contexts:
        contexts = [int(x) for x in args.contexts.split(",")]
    else:
        contexts = [4096, 16384, 65536]
        if args.full:
            contexts = [1024, 2048] + contexts + [131072, 262144]
    reps = args.reps or (11 if args.quick else 41)
    t_start = time.perf_counter()
    native = load_native()
    bw = read_bandwidth_gbs(mb=256)
    machine = machine_fields()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()} "
          f"({os.cpu_count()} cpus, {machine['cpu']}, {machine['isa']}, ATen {machine['aten_isa']}, "
          f"native {machine['native_isa']}); read bandwidth (sum over 256 MB) {bw:.1f} GB/s")
    print("sparse kernel: " + ("native (tinyserve::sparse_decode, kernel=native)" if native else
                               f"PyTorch path (native unavailable: {native_unavailable_reason()})"))
    q = torch.randn(1, HQ, 1, D)
    kv = torch.randn(1, HKV, 4096, D)
    print(f"SDPA enable_gqa materializes repeated K/V: {sdpa_materializes_repeat(q, kv, kv)}")
    for s in settings:
        print(f"setting {s}: {SETTINGS[s]}")
    print(f"caches: {'warm' if args.warm else 'evicted before every timed call'}; {reps} reps per point")
    rows = []
    for L in contexts:
        for name in args.dtypes.split(","):
            for s in settings:
                r = bench_one(L, DTYPES[name], s, reps, native, with_torch=not args.no_torch, cold=not args.warm,
                              huge=args.huge_pages)
                r["stream_gbps"] = round(bw, 2)
                r.update(machine)  # the ISA with every figure
                r["bound_ms"] = round(r["bytes"] / (bw * 1e9) * 1e3, 4)
                rows.append(r)
                print(f"  {fmt_ctx(L)} {name} {s}: SDPA {r['dense_ms']:.3f} ms, sparse {r['sparse_ms']:.3f} ms "
                      f"({r['ratio']:.1f}x), {r['gbps']:.1f} GB/s" + (
                          f"; on huge pages {r['sparse_huge_ms']:.3f} ms ({r['huge_speedup']:.2f}x)"
                          if args.huge_pages else ""), flush=True)
    print()
    print_table(rows)
    json_path = cli.out_path(args.out, "bench_op")
    if json_path:
        write_outputs(rows, json_path)
    print(f"total {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
