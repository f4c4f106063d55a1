"""Read-bandwidth ceilings of this machine for the sparse op's access patterns, side by side in one run.

At its defaults (fp32, D=64, pages of 8 tokens, two stages keeping tokens) the op reads three things
(:func:`tinyserve_compile.cost.sparse_site_bytes`): the page bounds in one sequential scan, the candidate pages'
keys as whole pages (``page_size * D * 4`` = 2 KB each) and the kept tokens' values as single rows
(``D * 4`` = 256 bytes), pages and rows in ascending order, scattered over the cache. ``bench op`` states the
op's bytes against a sequential read (``% of stream``); this says how fast this machine reads the scattered
parts at all, with a plain C++ loop (``bench/csrc/gather_probe.cpp``, built at first use) that only sums
what it reads:

* ``seq``: one sequential read of as many bytes as the page gather (from the start of the buffer);
* ``page``: ``--pages`` random whole pages of the buffer, ascending (the candidates' keys: 384 pages per KV
  head at the defaults, 3 KV heads);
* ``row``: random rows, ascending, as many bytes as the pages (the kept values are 2048 rows per KV head);

each cold (a 64 MB buffer is read before every timed call), with one thread and with all threads, without
and with software prefetch into L2 a few chunks ahead (as the op does), over 4 KB pages and over transparent
huge pages (``madvise(MADV_HUGEPAGE)`` on the buffer before it is first written; the granted huge-page MB are
recorded). ``stream_gbps`` is ``bench op``'s read bandwidth (one ``sum`` over 256 MB).

Usage::

    python -m bench ceilings                        # table + results/ceilings.{json,csv,png}
    python -m bench ceilings --quick                # fewer repetitions
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import statistics
import time
from typing import Dict, List, Optional

import torch

from bench import cli
from bench.output import bar_png, write_rows
from bench.timing import cpu_isa, read_bandwidth_gbs

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "csrc", "gather_probe.cpp")
MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15
HUGE = 2 << 20


def probe_flags(isa: str) -> List[str]:
    """Compiler flags of the probe for a CPU of vector ISA ``isa`` (:func:`bench.timing.cpu_isa`): this CPU's
    instructions and ATen's matching ``CPU_CAPABILITY`` for ``at::vec``, as the native kernels are built."""
    flags = ["-O3", "-fopenmp", "-DNDEBUG", "-fno-math-errno"]
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return flags + ["-mcpu=native", "-DCPU_CAPABILITY=DEFAULT"]
    if isa.startswith("AVX-512"):
        return flags + ["-march=native", "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if isa == "AVX2":
        return flags + ["-march=native", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return flags + ["-march=x86-64-v2", "-DCPU_CAPABILITY=DEFAULT"]


def load_probe():
    """The probe's extension module, built once per source and flags (:func:`probe_flags`)."""
    from torch.utils import cpp_extension

    from tinyserve_compile.kernels.native import cache_root

    cflags, ldflags = probe_flags(cpu_isa()), ["-fopenmp"]
    src = open(SOURCE, "rb").read()
    key = hashlib.sha256(src + " ".join(cflags).encode() + torch.__version__.encode()).hexdigest()[:12]
    build = os.path.join(cache_root(), f"gather-probe-{key}")
    os.makedirs(build, exist_ok=True)
    return cpp_extension.load(name=f"tinyserve_gather_probe_{key}", sources=[SOURCE], extra_cflags=cflags,
                              extra_ldflags=ldflags, build_directory=build, verbose=False)


def anon_huge_kb() -> int:
    """This process's anonymous transparent huge pages, kB (0 where /proc does not say)."""
    try:
        text = open("/proc/self/smaps_rollup").read()
    except OSError:
        return 0
    m = re.search(r"AnonHugePages:\s+(\d+) kB", text)
    return int(m.group(1)) if m else 0


def huge_buffer(nbytes: int, huge: bool) -> torch.Tensor:
    """A float32 buffer of ``nbytes`` bytes, 2 MB aligned, advised for huge pages (or against them) before its
    first write, then filled with ones. Where ``madvise`` is missing the advice is skipped."""
    raw = torch.empty(nbytes + HUGE, dtype=torch.uint8)  # not written yet: no page is backed
    off = (-raw.data_ptr()) % HUGE
    buf = raw[off:off + nbytes]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(nbytes // HUGE * HUGE),
                     MADV_HUGEPAGE if huge else MADV_NOHUGEPAGE)
    except (OSError, AttributeError):
        pass
    f = buf.view(torch.float32)
    f.fill_(1.0)
    return f


def offsets(kind: str, n_bytes: int, buf_bytes: int, page_bytes: int, row_bytes: int,
            gen: torch.Generator) -> (torch.Tensor, int):
    """Byte offsets (ascending, int64) and chunk size of one pattern reading ``n_bytes``."""
    if kind == "seq":
        return torch.arange(0, n_bytes, page_bytes, dtype=torch.int64), page_bytes
    chunk = page_bytes if kind == "page" else row_bytes
    n = n_bytes // chunk
    slots = torch.randperm(buf_bytes // chunk, generator=gen)[:n]
    return torch.sort(slots).values * chunk, chunk


def measure(probe, buf: torch.Tensor, off: torch.Tensor, chunk: int, ahead: int, threads: int, reps: int,
            flush: torch.Tensor) -> float:
    """Median GB/s of reading the chunks, cold, with ``threads`` threads."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        probe.read_chunks(buf, off, chunk, ahead)  # warm the code path
        ts = []
        for _ in range(reps):
            flush.sum()
            t0 = time.perf_counter()
            probe.read_chunks(buf, off, chunk, ahead)
            ts.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(prev)
    return off.numel() * chunk / statistics.median(ts) / 1e9


def run(pages: int = 1152, page_bytes: int = 2048, row_bytes: int = 256, buf_mb: int = 128, reps: int = 21,
        threads: Optional[List[int]] = None, seed: int = 0, log=print) -> List[Dict]:
    """Rows of every (page size, pattern, threads, prefetch), one run."""
    probe = load_probe()
    all_threads = torch.get_num_threads()
    threads = threads or sorted({1, all_threads})
    stream = read_bandwidth_gbs()  # the read bandwidth bench op states
    n_bytes = pages * page_bytes
    flush = torch.ones(64 * 2**20 // 4)
    rows = []
    for huge in (False, True):
        before = anon_huge_kb()
        buf = huge_buffer(buf_mb * 2**20, huge)
        granted = (anon_huge_kb() - before) / 1024
        gen = torch.Generator().manual_seed(seed)
        for kind in ("seq", "page", "row"):
            off, chunk = offsets(kind, n_bytes, buf.numel() * 4, page_bytes, row_bytes, gen)
            for t in threads:
                for ahead in (0, 4 if kind != "row" else 32):
                    gbps = measure(probe, buf, off, chunk, ahead, t, reps, flush)
                    rows.append(dict(pattern=kind, chunk_bytes=chunk, chunks=int(off.numel()), bytes=int(off.numel()) * chunk,
                                     os_pages="2M" if huge else "4K", huge_granted_mb=round(granted, 1),
                                     threads=t, prefetch_ahead=ahead, gbps=round(gbps, 2),
                                     stream_gbps=round(stream, 2), pct_of_stream=round(100 * gbps / stream, 1),
                                     machine=platform.machine()))
                    log(f"  {kind:4s} {'2M' if huge else '4K'} pages, {t} thread(s), prefetch {ahead:2d}: "
                        f"{gbps:6.2f} GB/s ({100 * gbps / stream:.0f}% of stream)")
        del buf
    return rows


def print_table(rows: List[Dict]) -> str:
    head = ("pattern", "chunk", "OS pages", "threads", "prefetch", "GB/s", "% of stream", "% of seq")
    seq = {(r["os_pages"], r["threads"], r["prefetch_ahead"] > 0): r["gbps"] for r in rows if r["pattern"] == "seq"}
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        s = seq.get((r["os_pages"], r["threads"], r["prefetch_ahead"] > 0))
        of_seq = f"{100 * r['gbps'] / s:.0f}%" if s else "-"
        lines.append(f"| {r['pattern']} | {r['chunk_bytes']} B | {r['os_pages']} | {r['threads']} | "
                     f"{r['prefetch_ahead']} | {r['gbps']:.2f} | {r['pct_of_stream']:.0f}% | {of_seq} |")
    text = "\n".join(lines)
    print(text)
    return text


def main(argv=None):
    ap = cli.parser("ceilings", __doc__.split("\n\n")[0], out="results", quick="7 repetitions", threads=False)
    ap.add_argument("--pages", type=int, default=1152, help="whole pages per gather (default: 384 x 3 KV heads)")
    ap.add_argument("--page-bytes", type=int, default=2048, help="bytes of one page of keys (8 x 64 x fp32)")
    ap.add_argument("--row-bytes", type=int, default=256, help="bytes of one token row (64 x fp32)")
    ap.add_argument("--buffer-mb", type=int, default=128, help="the buffer the chunks are drawn from (a long cache)")
    ap.add_argument("--reps", type=int, default=21)
    args = cli.parse(ap, argv, compare="ceilings measures the machine's read bandwidth, not the backend: it has no "
                     "TinyServeConfig options to vary")
    for name in ("pages", "page_bytes", "row_bytes", "buffer_mb", "reps"):
        if getattr(args, name) <= 0:
            ap.error(f"argument --{name.replace('_', '-')} must be > 0")
    if args.page_bytes % 64 or args.row_bytes % 64:
        ap.error("arguments --page-bytes and --row-bytes must be multiples of 64")
    if args.pages * args.page_bytes * 2 > args.buffer_mb * 2**20:
        ap.error("argument --buffer-mb must hold at least twice the pages' bytes")
    t0 = time.perf_counter()
    print(f"threads: {torch.get_num_threads()}; {args.pages} pages of {args.page_bytes} B from {args.buffer_mb} MB")
    rows = run(args.pages, args.page_bytes, args.row_bytes, args.buffer_mb, 7 if args.quick else args.reps)
    print(f"stream (sum over 256 MB): {rows[0]['stream_gbps']:.1f} GB/s; huge pages granted: "
          f"{max(r['huge_granted_mb'] for r in rows):.0f} MB")
    print_table(rows)
    path = cli.out_path(args.out, "ceilings")
    write_rows(rows, path)
    best = [r for r in rows if r["prefetch_ahead"] > 0 and r["threads"] == max(x["threads"] for x in rows)]
    bar_png([f"{r['pattern']} {r['os_pages']}" for r in best], [r["gbps"] for r in best], "GB/s",
            f"read bandwidth by access pattern ({best[0]['threads']} threads, prefetch)",
            os.path.splitext(path)[0] + ".png")
    print(f"total {time.perf_counter() - t0:.1f} s")
    return rows


if __name__ == "__main__":
    main()
