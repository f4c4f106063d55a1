"""``tinyserve::linear``: a linear layer for decode shapes (at most 8 activation rows, 4 with bf16 weights), a GEMV on CPU.

``linear(x, weight, bias)`` is ``F.linear``: ``x`` ``[..., K]``, ``weight`` ``[N, K]``, ``bias`` ``[N]`` or
None, result ``[..., N]``. Its CPU kernel is the native GEMV of ``csrc/gemv.cpp`` once
:func:`load_native_linear` has built, checked and registered it: fp32 or bf16 weights (``x`` of the
weight's dtype), fp32 accumulation, each weight row streamed once. Every other case (more rows, other dtypes,
other devices, the native module unavailable) runs ``F.linear``.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["linear", "load_native_linear", "native_linear_reason", "GEMV_MAX_ROWS", "GEMV_MAX_ROWS_BF16"]

#: the most activation rows (product of ``x``'s leading dimensions) the GEMV takes (``GEMV_MAX_ROWS`` of gemv.h)
GEMV_MAX_ROWS = 8
#: the most rows for bf16 weights (``GEMV_MAX_ROWS_BF16`` of gemv.h): at more rows the widening GEMV is bound by
#: FMAs, and ATen's linear (oneDNN, AVX512-BF16 dot products) does half the instructions
GEMV_MAX_ROWS_BF16 = 4

_lock = threading.Lock()
_state: dict = {"loaded": None, "reason": None}


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
    return None


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
        lib.register_linear_kernel()
        _state["loaded"] = True
        return True


def native_linear_reason() -> Optional[str]:
    """Why the native GEMV is not the CPU kernel of ``tinyserve::linear`` (None when it is, or was never tried)."""
    return _state["reason"]
