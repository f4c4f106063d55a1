"""``tinyserve::linear``: a linear layer for decode shapes (at most 8 activation rows, 4 with bf16 weights), a GEMV on CPU.

``linear(x, weight, bias)`` is ``F.linear``: ``x`` ``[..., K]``, ``weight`` ``[N, K]``, ``bias`` ``[N]`` or
None, result ``[..., N]``. Its CPU kernel is the native GEMV of ``csrc/gemv.cpp`` once
:func:`load_native_linear` has built, checked and registered it: fp32 or bf16 weights (``x`` of the
weight's dtype), fp32 accumulation, each weight row streamed once. Every other case (more rows, other dtypes,
other devices, the native module unavailable) runs ``F.linear``.

``linear_int4(x, qdata, scale_and_zero, group_size, out_features, bias)`` is the linear of torchao's
``Int4OpaqueTensor`` (``_weight_int4pack_mm_for_cpu``); its CPU kernel is the int4 GEMV of ``csrc/gemv_int4.cpp``
(bf16 activations, at most 8 rows, output features a multiple of 64), registered with ``tinyserve::linear``'s, or
ATen's own kernel where that is faster on the machine (:func:`int4_kernel`, :data:`INT4_KERNEL_ENV`). The
GEMV reads the layout ATen packs on the machine: blocks of 64 rows on AVX-512 ATen builds, 32 on AVX2 ones
(:func:`int4_block_n`).
"""
from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = ["linear", "linear_int4", "linear_group", "linear_int4_group", "dequantize_int4pack", "load_native_linear",
           "native_linear_reason", "int4_layout_problem", "int4_block_n", "int4_kernel", "GEMV_MAX_ROWS",
           "GEMV_MAX_ROWS_BF16", "INT4_BLOCK_N", "INT4_KERNELS", "INT4_KERNEL_ENV"]

#: the most activation rows (product of ``x``'s leading dimensions) the GEMV takes (``GEMV_MAX_ROWS`` of gemv.h)
GEMV_MAX_ROWS = 8
#: the most rows for bf16 weights (``GEMV_MAX_ROWS_BF16`` of gemv.h): at more rows the widening GEMV is bound by
#: FMAs, and ATen's linear (oneDNN, AVX512-BF16 dot products) does half the instructions
GEMV_MAX_ROWS_BF16 = 4

_lock = threading.Lock()
_state: dict = {"loaded": None, "reason": None, "int4_block_n": None, "int4_kernel": None}
#: the kernels of the int4 linears once the native module loads: ``native`` (the GEMV of ``csrc/gemv_int4.cpp``),
#: ``aten`` (ATen's ``_weight_int4pack_mm_for_cpu``, what torchao calls), or ``auto``: the faster of the two on
#: this machine, timed at load (:func:`_time_int4`). Neither is faster everywhere: at Llama-3-8B's shapes the GEMV
#: took 0.88-2.58x ATen's time on a Zen 4 EPYC and 0.65-0.93x on an Emerald Rapids Xeon (docs/bench/linear).
INT4_KERNELS = ("auto", "native", "aten")
#: the environment variable that forces one of :data:`INT4_KERNELS` (read once, at load)
INT4_KERNEL_ENV = "TINYSERVE_INT4_GEMV"
#: ``auto`` takes ATen's kernel only when it takes at most this share of the GEMV's time (a tie, within the noise of
#: a shared machine's bandwidth, keeps the GEMV)
INT4_ATEN_MARGIN = 0.95
#: the multiple of output features the int4 GEMV takes: the rows per block of ATen's CPU int4pack layout on
#: AVX-512 builds (64); AVX2 builds pack blocks of 32 rows, whose multiples include these
INT4_BLOCK_N = 64
#: rows per block of the int4pack layouts the GEMV reads (``aten_int4_block_n`` of gemv_int4.cpp)
INT4_LAYOUTS = (64, 32)


# A plain schema, not torch.library.custom_op: custom_op adds a Python autograd kernel to every call (~10-20 us,
# a few ms per decode step over 200 linears); this op is for inference graphs (passes/decode_linear.py rewrites
# only linears whose result needs no grad), so the dispatcher goes straight to the CPU kernel.
_lib = torch.library.Library("tinyserve", "FRAGMENT")
_lib.define("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")


def _linear_fallback(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    # every device, and CPU until the native GEMV registers itself as the CPU kernel
    return F.linear(x, weight, bias)


_lib.impl("linear", _linear_fallback, "CompositeExplicitAutograd")


@torch.library.register_fake("tinyserve::linear", lib=_lib)
def _(x, weight, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


_lib.define("linear_int4(Tensor x, Tensor qdata, Tensor scale_and_zero, int group_size, int out_features, "
            "Tensor? bias=None) -> Tensor")


def _linear_int4_fallback(x, qdata, scale_and_zero, group_size: int, out_features: int, bias=None):
    # ATen's kernel, the call torchao's Int4OpaqueTensor makes, until the native GEMV registers itself
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]).contiguous(), qdata, group_size,
                                                   scale_and_zero)[:, :out_features]  # [M, N]
    if bias is not None:
        y = y + bias
    return y.to(x.dtype).reshape(*x.shape[:-1], out_features)


_lib.impl("linear_int4", _linear_int4_fallback, "CompositeExplicitAutograd")


@torch.library.register_fake("tinyserve::linear_int4", lib=_lib)
def _(x, qdata, scale_and_zero, group_size, out_features, bias=None):
    return x.new_empty((*x.shape[:-1], out_features))


# Grouped forms: the linears of one layer that read the same activation (q, k and v; gate and up), without bias,
# in one call and one parallel region; the result holds their outputs side by side (``F.linear(x, cat(weights))``).
# One Tensor, not Tensor[]: Inductor's cpp_wrapper calls an op that returns tensors through the dispatcher, but
# calls back into Python for a list return (~15 us a call).
_lib.define("linear_group(Tensor x, Tensor[] weights) -> Tensor")


def _linear_group_fallback(x: torch.Tensor, weights: List[torch.Tensor]) -> torch.Tensor:
    return torch.cat([F.linear(x, w) for w in weights], -1)


_lib.impl("linear_group", _linear_group_fallback, "CompositeExplicitAutograd")


@torch.library.register_fake("tinyserve::linear_group", lib=_lib)
def _(x, weights):
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


_lib.define("linear_int4_group(Tensor x, Tensor[] qdata, Tensor[] scale_and_zero, int group_size, "
            "int[] out_features) -> Tensor")


def _linear_int4_group_fallback(x, qdata, scale_and_zero, group_size: int, out_features: List[int]):
    if not len(qdata) == len(scale_and_zero) == len(out_features):
        raise ValueError(f"linear_int4_group: qdata, scale_and_zero and out_features need one entry per weight, got "
                         f"{len(qdata)}, {len(scale_and_zero)} and {len(out_features)}")
    return torch.cat([_linear_int4_fallback(x, q, sz, group_size, n)
                      for q, sz, n in zip(qdata, scale_and_zero, out_features)], -1)


_lib.impl("linear_int4_group", _linear_int4_group_fallback, "CompositeExplicitAutograd")


@torch.library.register_fake("tinyserve::linear_int4_group", lib=_lib)
def _(x, qdata, scale_and_zero, group_size, out_features):
    return x.new_empty((*x.shape[:-1], sum(out_features)))


def linear_group(x: torch.Tensor, weights: List[torch.Tensor]) -> torch.Tensor:
    """``torch.cat([F.linear(x, w) for w in weights], -1)`` through ``tinyserve::linear_group``: one call, one
    parallel region.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., K]`` activations, fp32 or bf16 for the GEMV.
    weights : list of torch.Tensor
        ``[N_i, K]`` each, of ``x``'s dtype.

    Returns
    -------
    torch.Tensor
        ``[..., sum N_i]`` in ``x``'s dtype: weight ``i``'s output in columns ``[N_0 + .. + N_{i-1}, .. + N_i)``.
    """
    return torch.ops.tinyserve.linear_group(x, weights)


def linear_int4_group(x: torch.Tensor, qdata: List[torch.Tensor], scale_and_zero: List[torch.Tensor], group_size: int,
                      out_features: List[int]) -> torch.Tensor:
    """:func:`linear_int4` (no bias) of several int4 weights that read one ``x``, in one call, side by side.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., K]`` bf16 activations for the GEMV.
    qdata : list of torch.Tensor
        ``[N_i, K / 2]`` uint8 each (see :func:`linear_int4`).
    scale_and_zero : list of torch.Tensor
        ``[K / group_size, N_i, 2]`` bf16 each.
    group_size : int
        Input channels per scale/zero pair, shared by the weights.
    out_features : list of int
        ``N_i``.

    Returns
    -------
    torch.Tensor
        ``[..., sum N_i]`` in ``x``'s dtype: weight ``i``'s output in columns ``[N_0 + .. + N_{i-1}, .. + N_i)``.
    """
    return torch.ops.tinyserve.linear_int4_group(x, qdata, scale_and_zero, group_size, out_features)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` through ``tinyserve::linear``.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., K]`` activations, fp32 or bf16 for the GEMV.
    weight : torch.Tensor
        ``[N, K]``, of ``x``'s dtype.
    bias : torch.Tensor, optional
        ``[N]``, of ``x``'s dtype.

    Returns
    -------
    torch.Tensor
        ``[..., N]`` in ``x``'s dtype.
    """
    return torch.ops.tinyserve.linear(x, weight, bias)


def linear_int4(x: torch.Tensor, qdata: torch.Tensor, scale_and_zero: torch.Tensor, group_size: int,
                out_features: int, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The linear of torchao's ``Int4OpaqueTensor`` (weight-only int4) through ``tinyserve::linear_int4``.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., K]`` activations of ``scale_and_zero``'s dtype (bf16 for the GEMV).
    qdata : torch.Tensor
        ``[N, K / 2]`` uint8, the weight as ``aten._convert_weight_to_int4pack_for_cpu`` packs it.
    scale_and_zero : torch.Tensor
        ``[K / group_size, N, 2]`` bf16 for the GEMV: scale and zero point of each group of ``group_size`` input
        channels; the weight is ``(q - 8) * scale + zero``.
    group_size : int
        Input channels per scale/zero pair.
    out_features : int
        ``N``.
    bias : torch.Tensor, optional
        ``[N]``.

    Returns
    -------
    torch.Tensor
        ``[..., N]`` in ``x``'s dtype.
    """
    return torch.ops.tinyserve.linear_int4(x, qdata, scale_and_zero, group_size, out_features, bias)


def dequantize_int4pack(qdata: torch.Tensor, scale_and_zero: torch.Tensor, group_size: int,
                        block_n: Optional[int] = None) -> torch.Tensor:
    """The weight ``[N, K]`` (dtype of ``scale_and_zero``) of an int4pack weight in the layout the GEMV reads.

    The PyTorch reference of ``tinyserve::linear_int4``: ``qdata`` ``[N, K / 2]`` uint8 is ``[N / B, K, B / 2]``
    with ``B = block_n`` (by default :func:`int4_block_n`, the layout ATen packs here), byte ``j`` of (block ``b``,
    column ``k``) holding row ``B b + j`` in its low nibble and row ``B b + B / 2 + j`` in its high nibble;
    ``scale_and_zero`` ``[K / group_size, N, 2]``; ``W = (q - 8) * scale + zero`` rounded to the dtype of
    ``scale_and_zero`` (ATen's kernel dequantizes to the activations' dtype the same way).
    """
    if block_n is None:
        block_n = int4_block_n()
        if block_n is None:
            raise ValueError(f"dequantize_int4pack: argument 'block_n' is needed here: {int4_layout_problem()}")
    N, K = qdata.shape[0], qdata.shape[1] * 2
    if block_n not in INT4_LAYOUTS or N % block_n:
        raise ValueError(f"dequantize_int4pack: argument 'block_n' must be one of {INT4_LAYOUTS} and divide the "
                         f"{N} rows of 'qdata', got {block_n}")
    blocks = qdata.view(N // block_n, K, block_n // 2)
    q = torch.cat([blocks & 15, blocks >> 4], dim=2).permute(0, 2, 1).reshape(N, K).float()  # [N, K] codes
    scale = scale_and_zero[..., 0].float().t().repeat_interleave(group_size, 1)  # [N, K]
    zero = scale_and_zero[..., 1].float().t().repeat_interleave(group_size, 1)  # [N, K]
    return ((q - 8) * scale + zero).to(scale_and_zero.dtype)


def _probe_int4_layout():
    """(rows per block, "") of the layout ATen packs int4 weights in here, or (0, why the GEMV cannot read it)."""
    gen = torch.Generator().manual_seed(77)
    N, K = 2 * INT4_BLOCK_N, 64
    q = torch.randint(0, 16, (N, K), dtype=torch.int32, generator=gen)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    except (RuntimeError, AttributeError) as e:
        return 0, f"ATen cannot pack int4 weights on CPU ({type(e).__name__})"
    if packed.shape != (N, K // 2) or packed.dtype != torch.uint8:
        return 0, f"ATen's int4pack weight is {tuple(packed.shape)} {packed.dtype}, not [N, K / 2] uint8"
    ones = torch.stack([torch.ones(1, N), torch.full((1, N), 8.0)], -1).to(torch.bfloat16)  # scale 1, zero 8
    sz = ones.expand(K // 32, N, 2).contiguous()
    for block_n in INT4_LAYOUTS:
        if torch.equal(dequantize_int4pack(packed, sz, 32, block_n).float(), q.float()):
            return block_n, ""
    return 0, (f"ATen's int4pack layout on this CPU (ATen capability {torch.backends.cpu.get_cpu_capability()}) "
               f"is none of the blocks of {' or '.join(map(str, INT4_LAYOUTS))} rows the GEMV reads")


def int4_block_n() -> Optional[int]:
    """Rows per block of the int4pack layout ATen packs in this process (64 on AVX-512 builds, 32 on AVX2), or None.

    The layout of ``_convert_weight_to_int4pack_for_cpu`` depends on the vector ISA ATen runs with (its CPU
    capability, which ``ATEN_CPU_CAPABILITY`` can lower), so a probe of random codes is packed and read back in
    each layout the GEMV reads. Cached per process.
    """
    if _state["int4_block_n"] is None:
        _state["int4_block_n"] = _probe_int4_layout()
    return _state["int4_block_n"][0] or None


def int4_layout_problem() -> Optional[str]:
    """None when this ATen packs int4 weights in a layout :func:`dequantize_int4pack` and the GEMV read, else why."""
    int4_block_n()
    return _state["int4_block_n"][1] or None


def _self_check(lib) -> Optional[str]:
    """The GEMV against ``F.linear`` on small cases (fp32 and bf16, 1..8 rows, bias or not, K with a tail)."""
    gen = torch.Generator().manual_seed(4321)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        for rows, K, N, with_bias in ((1, 64, 37, False), (3, 100, 20, True), (4, 35, 9, True), (8, 35, 9, True)):
            x = torch.randn(rows, K, generator=gen).to(dtype)
            w = torch.randn(N, K, generator=gen).to(dtype)
            b = torch.randn(N, generator=gen).to(dtype) if with_bias else None
            want = F.linear(x.float(), w.float(), None if b is None else b.float())
            err = float((lib.linear_rows(x, w, b).float() - want).abs().max())
            if not err <= tol * max(1.0, float(want.abs().max())):
                return f"linear_rows differs from F.linear by {err:.3g} ({dtype}, {rows}x{K} @ {N}x{K})"
    if int4_layout_problem() is None:  # the int4 GEMV against the dequantized weight
        if lib.aten_int4_block_n() != int4_block_n():
            return (f"the int4 GEMV reads blocks of {lib.aten_int4_block_n()} rows, ATen packs blocks of "
                    f"{int4_block_n()}")
        for rows, K, N in ((1, 64, 64), (5, 96, 128), (4, 64, 192)):
            q = torch.randint(0, 16, (N, K), dtype=torch.int32, generator=gen)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            sz = torch.stack([torch.rand(K // 32, N, generator=gen) * 0.1,
                              torch.randn(K // 32, N, generator=gen) * 0.1], -1).to(torch.bfloat16)
            x = torch.randn(rows, K, generator=gen).to(torch.bfloat16)
            want = F.linear(x.float(), dequantize_int4pack(packed, sz, 32).float())
            err = float((lib.linear_int4_rows(x, packed, sz, 32, N, None).float() - want).abs().max())
            if not err <= 2e-2 * max(1.0, float(want.abs().max())):
                return f"linear_int4_rows differs from the dequantized weight by {err:.3g} ({rows}x{K} @ {N}x{K})"
    # the grouped forms against the single ones (the same row and block kernels, one parallel region)
    x = torch.randn(3, 64, generator=gen)
    ws = [torch.randn(n, 64, generator=gen) for n in (40, 9)]
    if not torch.equal(lib.linear_group_rows(x, ws), torch.cat([lib.linear_rows(x, w, None) for w in ws], -1)):
        return "linear_group_rows differs from linear_rows"
    if int4_layout_problem() is None:
        x = torch.randn(2, 64, generator=gen).to(torch.bfloat16)
        qs = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.randint(0, 16, (n, 64), dtype=torch.int32, generator=gen), 1) for n in (64, 128)]
        szs = [torch.stack([torch.rand(2, n, generator=gen) * 0.1, torch.randn(2, n, generator=gen) * 0.1],
                           -1).to(torch.bfloat16) for n in (64, 128)]
        got = lib.linear_int4_group_rows(x, qs, szs, 32, [64, 128])
        if not torch.equal(got, torch.cat([lib.linear_int4_rows(x, q, sz, 32, q.shape[0], None)
                                           for q, sz in zip(qs, szs)], -1)):
            return "linear_int4_group_rows differs from linear_int4_rows"
    return None


#: the int4 calls :func:`_time_int4` makes, as ``(output features of each weight, K)``: one decoder layer of
#: Llama-3.2-1B's shape as a compiled decode step calls it (q, k and v grouped; o; gate and up grouped; down) and a
#: slice of its head, 60 MB in int4. Each kernel wins some of them (the GEMV the small grouped q/k/v, ATen the
#: 8192-row gate/up and the head on the Xeon of 2026-12-07), so the mix decides.
INT4_TIMING_CALLS = (((2048, 512, 512), 2048), ((2048,), 2048), ((8192, 8192), 2048), ((2048,), 8192),
                     ((32768,), 2048))


def _time_int4(lib, reps: int = 5) -> Dict[str, float]:
    """Milliseconds of one bf16 row through the int4 calls of :data:`INT4_TIMING_CALLS`, for each kernel: each
    call's least time over ``reps`` rounds, summed. One row, weights streamed once: a decode step's linears."""
    gen = torch.Generator().manual_seed(11)
    gs = 32
    calls = []
    for ns, K in INT4_TIMING_CALLS:
        qs, szs = [], []
        for N in ns:
            q = torch.randint(0, 16, (N, K), dtype=torch.int32, generator=gen)
            qs.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
            szs.append(torch.stack([torch.rand(K // gs, N, generator=gen) * 0.1,
                                    torch.randn(K // gs, N, generator=gen) * 0.1], -1).to(torch.bfloat16))
        x = torch.randn(1, K, generator=gen).to(torch.bfloat16)
        if len(ns) > 1:
            calls.append(lambda x=x, qs=qs, szs=szs, ns=list(ns): lib.linear_int4_group_rows(x, qs, szs, gs, ns))
        else:
            calls.append(lambda x=x, q=qs[0], sz=szs[0], n=ns[0]: lib.linear_int4_rows(x, q, sz, gs, n, None))
    # paired: each call through both kernels back to back, so that both see the same moment of a machine whose
    # bandwidth wanders
    best = {name: [float("inf")] * len(calls) for name in ("native", "aten")}
    try:
        for r in range(reps):
            for i, call in enumerate(calls):
                for name in (("native", "aten") if (r + i) % 2 == 0 else ("aten", "native")):
                    lib.set_int4_aten(name == "aten")
                    t0 = time.perf_counter()
                    call()
                    best[name][i] = min(best[name][i], (time.perf_counter() - t0) * 1e3)
    finally:
        lib.set_int4_aten(False)
    return {name: sum(ts) for name, ts in best.items()}


def _choose_int4_kernel(lib) -> Tuple[str, str]:
    """``(kernel, why)`` for the int4 linears: :data:`INT4_KERNEL_ENV` when it names one, else timed
    (:func:`_time_int4`); an unknown value of the variable warns, naming it, and is taken as ``auto``."""
    want = os.environ.get(INT4_KERNEL_ENV, "auto").strip().lower() or "auto"
    if want not in INT4_KERNELS:
        warnings.warn(f"tinyserve: environment variable {INT4_KERNEL_ENV}={want!r} is not one of {INT4_KERNELS}; "
                      f"using 'auto'", RuntimeWarning, stacklevel=3)
        want = "auto"
    if want != "auto":
        return want, f"{INT4_KERNEL_ENV}={want}"
    t = _time_int4(lib)
    pick = "aten" if t["aten"] < INT4_ATEN_MARGIN * t["native"] else "native"
    return pick, (f"timed at load: the GEMV {t['native']:.3f} ms, ATen {t['aten']:.3f} ms for one row through "
                  f"a Llama-3.2-1B layer's int4 calls and a slice of its head")


def int4_kernel() -> Tuple[Optional[str], str]:
    """``(kernel, why)`` of the int4 linears in this process: ``native`` or ``aten`` and how it was chosen, or
    ``(None, why)`` when the native module did not load (ATen's kernel then, through the op's fallback)."""
    if _state["int4_kernel"] is None:
        if _state["loaded"]:
            return None, f"ATen's kernel: {int4_layout_problem()}"
        return None, native_linear_reason() or "the native GEMV was not loaded"
    return _state["int4_kernel"]


def load_native_linear() -> bool:
    """Build the native module if needed, check the GEMV, make it the CPU kernel of ``tinyserve::linear``.

    True when it is registered; :func:`native_linear_reason` says why not otherwise. Once per process.
    """
    if _state["loaded"] is not None:
        return _state["loaded"]
    with _lock:
        if _state["loaded"] is not None:
            return _state["loaded"]
        from .native import load_native, native_module, native_unavailable_reason

        lib = native_module() if load_native() else None
        if lib is None:
            _state["loaded"], _state["reason"] = False, native_unavailable_reason() or "native module not loaded"
            return False
        problem = _self_check(lib)
        if problem:
            _state["loaded"], _state["reason"] = False, f"native GEMV self-check failed: {problem}"
            return False
        if int4_layout_problem() is None:
            kernel, why = _choose_int4_kernel(lib)
            lib.set_int4_aten(kernel == "aten")
            _state["int4_kernel"] = (kernel, why)
        lib.register_linear_kernel()
        _state["loaded"] = True
        return True


def native_linear_reason() -> Optional[str]:
    """Why the native GEMV is not the CPU kernel of ``tinyserve::linear`` (None when it is, or was never tried)."""
    return _state["reason"]
