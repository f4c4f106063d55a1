"""Timing shared by the benchmarks: kernel timers (plain and under CUDA graphs), bandwidth probes, and the
profile of one decode step (kernels, launches, host syncs, CUDA graph replays).

Every function takes the device it measures on; on a CPU the kernel timers fall back to the wall clock and
the CUDA-only fields of a profile are None.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch

from bench.omp_env import WAIT_VARIABLES

#: runtime API calls that launch one kernel each (the CUDA runtime's and the driver's names)
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaLaunchCooperativeKernel")
#: runtime API calls that block the host until the device catches up (a synchronous ``cudaMemcpy`` too)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cuStreamSynchronize", "cuCtxSynchronize")
#: ATen ops that read a device scalar on the host (each one a device-to-host copy and a sync)
ITEM_OPS = ("aten::_local_scalar_dense", "aten::item")
#: a replay of a captured CUDA graph
GRAPH_LAUNCH = ("cudaGraphLaunch", "cuGraphLaunch")
#: the vendor's peak memory bandwidth in GB/s by device name (the datasheets'), matched in this order
DATASHEET_GBS = (("H200", 4800.0), ("H100", 3350.0), ("A100", 2039.0), ("L40", 864.0), ("4090", 1008.0))


#: a neighbour: spins one core until its deadline (argv[1], seconds) or until it is stopped
_SPIN = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


@contextlib.contextmanager
def busy_neighbours(n: int, seconds: float = 900.0) -> Iterator[None]:
    """``n`` other processes that each spin one core, at nice 0 (as equals), for the block (at most ``seconds``).

    What a shared machine does to a benchmark: another user's job, a build beside it. ``n = 0``: nothing.
    """
    if n < 0:
        raise ValueError(f"busy_neighbours: argument 'n' must be >= 0, got {n}")
    procs = [subprocess.Popen([sys.executable, "-c", _SPIN, str(seconds)]) for _ in range(n)]
    try:
        if procs:
            time.sleep(0.2)  # let them start spinning
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def wait_env() -> Dict[str, Optional[str]]:
    """``{name.lower(): value}`` of OpenMP's wait variables (:data:`bench.omp_env.WAIT_VARIABLES`) in this process
    (None when unset): what records keep of how the run's threads waited."""
    return {k.lower(): os.environ.get(k) for k in WAIT_VARIABLES}


def sync_fn(device: torch.device) -> Callable[[], None]:
    """``torch.cuda.synchronize`` on a CUDA device, a no-op elsewhere."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def wall_ms(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Median wall-clock milliseconds of ``fn()`` over ``iters`` calls after one untimed call."""
    sync = sync_fn(device)
    fn()
    sync()
    ts = []
    for _ in range(max(1, iters)):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def bench_ms(fn: Callable[[], object], device: torch.device, iters: int = 100) -> float:
    """Median milliseconds of ``fn()``: ``triton.testing.do_bench`` on CUDA (each call launched from the host,
    so launch cost counts), the wall clock elsewhere.

    Parameters
    ----------
    fn : callable
        What to time, without arguments.
    device : torch.device
        Where it runs.
    iters : int
        On CUDA, do_bench's ``rep`` in milliseconds (at least 50); elsewhere the number of timed calls.
    """
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=max(50, iters), return_mode="median"))
    return wall_ms(fn, iters, device)


def bench_graph_ms(fn: Callable[[], object], device: torch.device, rep: int = 50) -> Tuple[Optional[float], str]:
    """Median milliseconds of ``fn()`` replayed from one CUDA graph (``triton.testing.do_bench_cudagraph``):
    launch cost does not count. ``(None, why)`` when it cannot be timed so (no CUDA device, or ``fn`` cannot be
    captured: a host sync, a CPU tensor, ...); ``(ms, "")`` otherwise."""
    if device.type != "cuda":
        return None, "CUDA graphs need a CUDA device"
    from triton.testing import do_bench_cudagraph

    try:
        try:
            ms = do_bench_cudagraph(fn, rep=rep, return_mode="median")
        except TypeError:  # a Triton without return_mode
            ms = do_bench_cudagraph(fn, rep=rep, quantiles=[0.5])
        return float(ms[0] if isinstance(ms, (list, tuple)) else ms), ""
    except Exception as e:  # noqa: BLE001  (capture errors come as RuntimeError, AssertionError, ...)
        torch.cuda.synchronize()
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def copy_bandwidth_gbs(device: torch.device, mb: int = 2048) -> float:
    """Measured device memory bandwidth in GB/s: one device-to-device copy of ``mb`` MB, bytes read plus bytes
    written over its median time (do_bench). NaN on a CPU."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(mb * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device, 100)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * mb * 2**20 / (ms * 1e-3) / 1e9


def read_bandwidth_gbs(device: torch.device = torch.device("cpu"), mb: int = 256, reps: int = 7) -> float:
    """Read bandwidth in GB/s: median time of one ``sum`` over an ``mb`` MB fp32 buffer on ``device`` (the
    machine's on the CPU, the figure every CPU benchmark quotes its bytes against)."""
    x = torch.ones(mb * 2**20 // 4, device=device)
    sync = sync_fn(device)
    x.sum()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        sync()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times) / 1e9


def datasheet_gbs(device: torch.device) -> float:
    """The vendor's peak memory bandwidth of ``device`` in GB/s (:data:`DATASHEET_GBS`), NaN when unknown."""
    if device.type != "cuda":
        return float("nan")
    name = torch.cuda.get_device_name(device)
    return next((gbs for key, gbs in DATASHEET_GBS if key in name), float("nan"))


#: the categories of a step's host time (:func:`step_breakdown`): op names by prefix, matched in this order
BREAKDOWN = (
    ("linear", ("tinyserve::linear", "aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm",
                "aten::_weight_int4pack_mm", "mkldnn::", "mkl::", "aten::mkldnn_", "aten::_mkl", "onednn::")),
    ("attention", ("tinyserve::", "aten::scaled_dot_product_attention", "aten::_scaled_dot_product")),
    ("wrappers", ("Torch-Compiled", "CompiledFunction", "## ")),  # Torch-Compiled Region, ## Call CompiledFxGraph
)


def _category(name: str) -> str:
    for cat, prefixes in BREAKDOWN:
        if name.startswith(prefixes):
            return cat
    return "other_ops"


def step_breakdown(events, mark: str = "bench_step") -> Dict[str, float]:
    """Where one profiled step's host time went, in ms: each event's self time (its time less its children's) by
    category, and the rest of the step's mark.

    Parameters
    ----------
    events : list of torch.autograd.profiler_util.FunctionEvent
        A profile's events holding one ``record_function(mark)`` around the step.

    Returns
    -------
    dict
        ``step_ms`` (the mark's span), ``linear_ms`` (GEMM/GEMV ops, ATen's and tinyserve's), ``attention_ms``
        (the rewritten attention's ops, or SDPA), ``other_ops_ms`` (every other named op: ATen's, and Inductor's
        kernels where ``torch._inductor.config.cpp.enable_kernel_profile`` named them at compile time),
        ``wrappers_ms`` (the compiled regions' own time: their Python wrappers, and Inductor's kernels when
        unnamed) and ``python_guards_ms`` (time in no event: Dynamo's guards, the model's code outside the
        compiled regions, the caller). Empty without the mark.
    """
    marks = [e for e in events if e.name == mark]
    if not marks:
        return {}
    m = marks[0]
    t0, t1 = m.time_range.start, m.time_range.end
    out = {"linear_ms": 0.0, "attention_ms": 0.0, "other_ops_ms": 0.0, "wrappers_ms": 0.0}
    thread = m.thread
    for e in events:
        if e is m or e.thread != thread or not (t0 <= e.time_range.start and e.time_range.end <= t1):
            continue
        out[_category(e.name) + "_ms"] += e.self_cpu_time_total / 1e3
    out["python_guards_ms"] = m.self_cpu_time_total / 1e3
    out["step_ms"] = (t1 - t0) / 1e3
    return out


def step_profile(step: Callable[[], object], device: torch.device) -> Dict[str, object]:
    """Counts of one call of ``step`` (one decode step, already warmed up) under ``torch.profiler``.

    Returns
    -------
    dict
        ``gpu_kernels`` (kernels the device ran, memcpy/memset not counted), ``launch_calls`` (runtime calls
        that launch one kernel, :data:`LAUNCH_CALLS`), ``graph_launches`` (CUDA graph replays), ``sync_calls``
        (:data:`SYNC_CALLS`), ``dtoh_copies`` (device-to-host copies the device ran), ``item_calls``
        (:data:`ITEM_OPS`; each is one device-to-host copy and one stream sync), ``host_syncs`` (the largest of
        the three: a lower bound on the times the host waited for the device) and ``cudagraph_replayed`` (a
        graph replay was seen). The CUDA-only counts are None on a CPU, where ``host_syncs`` is the item
        calls and ``profile_<category>_ms`` the step's host time by category (:func:`step_breakdown`);
        ``profile_error`` says why a profile is missing.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device.type == "cuda"
    sync = sync_fn(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    try:
        with profile(activities=activities) as prof:
            with record_function("bench_step"):
                step()
            sync()
        events = list(prof.events())
    except Exception as e:  # noqa: BLE001  (a profiler that fails must not cost the step's timings)
        return dict(profile_error=f"{type(e).__name__}: {e}"[:300])
    marks = [e for e in events if e.name == "bench_step"]
    t0 = min((m.time_range.start for m in marks), default=float("-inf"))
    t1 = max((m.time_range.end for m in marks), default=float("inf"))
    host = [e for e in events if getattr(e.device_type, "name", "CPU") == "CPU" and t0 <= e.time_range.start <= t1]
    names = [e.name for e in host]

    def count(which):
        return sum(n in which for n in names)

    items = count(ITEM_OPS) - names.count("aten::item")  # aten::item calls _local_scalar_dense: count it once
    out: Dict[str, object] = dict(item_calls=items, gpu_kernels=None, launch_calls=None, graph_launches=None,
                                  sync_calls=None, dtoh_copies=None, host_syncs=items, cudagraph_replayed=None)
    if not cuda:  # the host's time is the step's: where it went (a CUDA step's host time is launches and waits)
        out.update({f"profile_{k}": v for k, v in step_breakdown(events).items()})
    if cuda:
        dev = [e for e in events if getattr(e.device_type, "name", "") == "CUDA"]
        kernels = [e for e in dev if not e.name.startswith(("Memcpy", "Memset"))]
        dtoh = sum(e.name.startswith("Memcpy DtoH") or "Device -> Pageable" in e.name or "Device -> Pinned" in e.name
                   for e in dev)
        syncs = count(SYNC_CALLS)
        graphs = count(GRAPH_LAUNCH)
        out.update(gpu_kernels=len(kernels), launch_calls=count(LAUNCH_CALLS), graph_launches=graphs,
                   sync_calls=syncs, dtoh_copies=dtoh, host_syncs=max(syncs, dtoh, items),
                   cudagraph_replayed=graphs > 0)
    return out


def cpu_isa(flags: Optional[set] = None) -> str:
    """The vector ISA of this CPU as every CPU figure records it: ``"AVX-512 (VNNI, BF16)"``, ``"AVX-512 (VNNI)"``,
    ``"AVX-512"``, ``"AVX2"`` or ``"baseline"`` (from ``/proc/cpuinfo``'s flags, or ``flags`` when given)."""
    if flags is None:
        flags = set()
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("flags"):
                        flags = set(line.split(":", 1)[1].split())
                        break
        except OSError:
            pass
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        extra = [name for flag, name in (("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16")) if flag in flags]
        return "AVX-512" + (f" ({', '.join(extra)})" if extra else "")
    if {"avx2", "fma"} <= flags:
        return "AVX2"
    return "baseline"


def cpu_model() -> str:
    """``/proc/cpuinfo``'s model name ("unknown" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def machine_fields() -> Dict[str, str]:
    """What every benchmark row records about the CPU it ran on: ``cpu`` (model), ``isa`` (the CPU's,
    :func:`cpu_isa`), and the vector ISA the code ran with, which can be forced lower than the CPU's:
    ``aten_isa`` (ATen's CPU capability, ``ATEN_CPU_CAPABILITY``) and ``native_isa`` (the native kernels' build,
    ``TINYSERVE_NATIVE_ISA``)."""
    import torch

    from tinyserve_compile.kernels.native import native_isa

    return {"cpu": cpu_model(), "isa": cpu_isa(), "aten_isa": torch.backends.cpu.get_cpu_capability(),
            "native_isa": native_isa()}
