"""The native sparse-decode kernel with and without a busy neighbour process, by how it schedules its work.

A *busy neighbour* is a separate process that spins on one core (:class:`BusyNeighbour`). On a 2-core machine it
takes half of one core from whichever of our threads shares that core. A parallel region that waits for all its
threads at the end (OpenMP's barrier, under ``at::parallel_for``) then waits for the descheduled one, up to a
scheduler time slice, every call; the native kernel's own pool never waits for a helper that has not claimed work.
On an idle machine the opposite holds: the pool's helpers compete for the cores with OpenMP's spinning workers, so
the default (``auto``) runs on ``at::parallel_for`` and switches to the pool while the machine is oversubscribed.

One op call = ``tinyserve_native::sparse_decode`` at SmolLM2-135M's shape (9 query heads, 3 KV heads, head dim 64,
fp32 cache, int8 page bounds) and the backend's default options, at ``--context`` tokens. Variants, timed
interleaved round by round in the same run:

* ``auto``: the default scheduling (``TINYSERVE_NATIVE_SCHED`` unset), ``torch.get_num_threads()`` threads;
* ``pool``: ``TINYSERVE_NATIVE_SCHED=pool``, the same work items on the kernel's own pool;
* ``parallel_for``: ``TINYSERVE_NATIVE_SCHED=omp``, the same work items inside ``at::parallel_for``;
* ``one thread``: ``torch.set_num_threads(1)``.

first without, then with the neighbour. It prints a table (microseconds per call, the slowdown, and the K/V bytes
per call against the copy bandwidth measured in the same run) and with ``--json`` writes the rows, a ``.csv`` and a
``.png`` next to it.

Usage::

    python bench/busy_neighbour.py --json results/busy_neighbour/op.json
    python bench/busy_neighbour.py --quick        # a small dry run (seconds)
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: the neighbour: spins until its deadline (argv[1], seconds) or until it is stopped
_BUSY_LOOP = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


class BusyNeighbour:
    """A separate process that spins one core at nice level ``nice``, for at most ``seconds``.

    Use as a context manager; the process (this one's child) is stopped by its pid on exit.
    """

    def __init__(self, seconds: float = 120.0, nice: int = 0):
        if seconds <= 0:
            raise ValueError(f"seconds: must be positive, got {seconds}")
        if nice < 0:
            raise ValueError(f"nice: must be >= 0 (raising priority needs privileges), got {nice}")
        self.seconds, self.nice, self.proc = seconds, nice, None

    def __enter__(self) -> "BusyNeighbour":
        nice = self.nice
        self.proc = subprocess.Popen([sys.executable, "-c", _BUSY_LOOP, str(self.seconds)],
                                     preexec_fn=(lambda: os.nice(nice)) if nice else None)
        time.sleep(0.2)  # let it start spinning
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def copy_gbps(n_bytes: int = 1 << 28, reps: int = 5) -> float:
    """Best of ``reps`` copies of an ``n_bytes`` fp32 buffer: GB/s read + written."""
    a = torch.ones(n_bytes // 4)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return 2 * n_bytes / best / 1e9


def op_inputs(ctx: int, seed: int = 0):
    """SmolLM2-135M-shaped decode inputs at ``ctx`` tokens: q fp32 ``[1, 9, 1, 64]``, k/v fp32 ``[1, 3, ctx, 64]``,
    int8 page bounds and valid_len int64 ``[1]``; and the backend's default config."""
    from tinyserve_compile.config import TinyServeConfig
    from tinyserve_compile.kernels import reference as ref

    cfg = TinyServeConfig.from_options({})
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 9, 1, 64, generator=g)
    k = torch.randn(1, 3, ctx, 64, generator=g)
    v = torch.randn(1, 3, ctx, 64, generator=g)
    b = ref.page_bounds(k, cfg.page_size, dtype=cfg.bounds_torch_dtype)
    return (q, k, v, b, torch.tensor([ctx])), cfg


def make_call(args, cfg):
    from tinyserve_compile.kernels.native import native_module

    q, k, v, b, vl = args
    lib = native_module()

    def call():
        return lib.sparse_decode(
            q, k, v, b.kmax, b.kmin, b.kabs, vl, None, 0.125, cfg.page_size, cfg.token_budget, cfg.sink_pages,
            cfg.candidate_factor, None, cfg.candidate_extra, cfg.keep_tokens)

    return call


VARIANTS = ("auto", "pool", "parallel_for", "one thread")


def _time_variant(call, variant: str, n_calls: int, threads: int) -> List[float]:
    """Seconds of each of ``n_calls`` calls under ``variant``."""
    old_sched = os.environ.get("TINYSERVE_NATIVE_SCHED")
    if variant == "auto":
        os.environ.pop("TINYSERVE_NATIVE_SCHED", None)
    else:
        os.environ["TINYSERVE_NATIVE_SCHED"] = "omp" if variant == "parallel_for" else "pool"
    torch.set_num_threads(1 if variant == "one thread" else threads)
    try:
        call()  # the first call after a switch starts threads
        out = []
        for _ in range(n_calls):
            t0 = time.perf_counter()
            call()
            out.append(time.perf_counter() - t0)
        return out
    finally:
        torch.set_num_threads(threads)
        if old_sched is None:
            os.environ.pop("TINYSERVE_NATIVE_SCHED", None)
        else:
            os.environ["TINYSERVE_NATIVE_SCHED"] = old_sched


def measure(ctx: int, n_calls: int, rounds: int, nice: int, seconds: float, log=print) -> List[Dict]:
    """Rows per (neighbour, variant): mean and median microseconds per call, slowdown against no neighbour."""
    from tinyserve_compile.cost import sparse_site_bytes
    from tinyserve_compile.kernels.native import load_native, native_module, native_unavailable_reason

    if not load_native():
        raise RuntimeError(f"native kernel unavailable: {native_unavailable_reason()}")
    if n_calls < 1 or rounds < 1:
        raise ValueError(f"calls/rounds: need >= 1, got {n_calls}/{rounds}")
    args, cfg = op_inputs(ctx)
    call = make_call(args, cfg)
    threads = torch.get_num_threads()
    kv_bytes = sparse_site_bytes(ctx, 3, 64, 4, cfg.page_size, cfg.token_budget, cfg.candidate_factor,
                                 cfg.bounds_torch_dtype.itemsize, cfg.candidate_extra)
    gbps = copy_gbps()
    log(f"sparse_decode at {ctx} tokens, {threads} threads, {kv_bytes / 1e6:.2f} MB of K/V state per call; "
        f"copy bandwidth {gbps:.1f} GB/s; {rounds} rounds x {n_calls} calls per variant")
    rows = []
    for neighbour in ("none", f"busy (nice {nice})"):
        times: Dict[str, List[float]] = {v: [] for v in VARIANTS}
        with BusyNeighbour(seconds, nice) if neighbour != "none" else contextlib.nullcontext():
            for _ in range(rounds):  # interleaved, so that drift hits every variant alike
                for var in VARIANTS:
                    times[var] += _time_variant(call, var, n_calls, threads)
        for var in VARIANTS:
            ts = times[var]
            mean_us = 1e6 * sum(ts) / len(ts)
            rows.append(dict(neighbour=neighbour, variant=var, threads=1 if var == "one thread" else threads,
                             context=ctx, calls=len(ts), mean_us=mean_us, median_us=1e6 * statistics.median(ts),
                             p99_us=1e6 * sorted(ts)[min(len(ts) - 1, int(0.99 * len(ts)))],
                             kv_bytes=kv_bytes, gbps=kv_bytes / (mean_us * 1e-6) / 1e9, copy_gbps=gbps))
    base = {r["variant"]: r["mean_us"] for r in rows if r["neighbour"] == "none"}
    for r in rows:
        r["slowdown"] = r["mean_us"] / base[r["variant"]]
    return rows


def print_table(rows: List[Dict], log=print) -> None:
    log(f"{'neighbour':<16} {'variant':<13} {'threads':>7} {'mean us':>9} {'median us':>9} {'p99 us':>9} "
        f"{'slowdown':>8} {'GB/s K/V':>8}")
    for r in rows:
        log(f"{r['neighbour']:<16} {r['variant']:<13} {r['threads']:>7} {r['mean_us']:>9.1f} {r['median_us']:>9.1f} "
            f"{r['p99_us']:>9.1f} {r['slowdown']:>7.2f}x {r['gbps']:>8.2f}")


def write_outputs(rows: List[Dict], path: str) -> List[str]:
    """``path`` (JSON list of rows), and a .csv and (with matplotlib) a .png next to it."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    stem = os.path.splitext(path)[0]
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    out = [path, stem + ".csv"]
    try:
        import matplotlib
    except ImportError:
        return out
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    neighbours = list(dict.fromkeys(r["neighbour"] for r in rows))
    for i, nb in enumerate(neighbours):
        rs = [r for r in rows if r["neighbour"] == nb]
        ax.bar([j + 0.4 * i for j in range(len(rs))], [r["mean_us"] for r in rs], width=0.4, label=nb)
    ax.set_xticks([j + 0.2 for j in range(len(VARIANTS))], VARIANTS)
    ax.set_ylabel("us per sparse_decode call")
    ax.set_title(f"native kernel at {rows[0]['context']} tokens, busy neighbour or not")
    ax.legend()
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=120)
    plt.close(fig)
    return out + [stem + ".png"]


def main(argv=None) -> List[Dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=200, help="timed calls per variant and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--nice", type=int, default=0, help="nice level of the neighbour (default 0: an equal)")
    ap.add_argument("--seconds", type=float, default=300.0, help="the neighbour stops by itself after this")
    ap.add_argument("--quick", action="store_true", help="a small dry run: 1K tokens, 1 round of at most 10 calls")
    ap.add_argument("--json", default=None, help="write the rows here (a .csv and .png go next to it)")
    a = ap.parse_args(argv)
    if a.quick:
        a.context, a.calls, a.rounds = 1024, min(a.calls, 10), 1
    rows = measure(a.context, a.calls, a.rounds, a.nice, a.seconds)
    print_table(rows)
    if a.json:
        print("# wrote " + ", ".join(write_outputs(rows, a.json)))
    return rows


if __name__ == "__main__":
    main()
