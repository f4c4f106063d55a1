"""The ``tinyserve::sparse_decode`` op: query-aware paged sparse decode attention.

One op, registered once, with one kernel per device chosen through the dispatcher:

* ``cpu``: the native C++ kernel (:mod:`.native`) when it builds, else the PyTorch path;
* ``cuda``: the Triton kernels (:mod:`.triton_sparse_decode`) when Triton is installed, else the PyTorch path;
* any other device: the PyTorch path (:mod:`.torch_sparse_decode`).

This module validates the arguments (:func:`check_decode_inputs`), chooses the implementation
(:func:`resolve_kernel`, the one place where the ``kernel`` argument, ``auto``, ``native``, ``torch`` or
``triton``, is resolved) and runs it (:func:`run_kernel`), registers the op, and holds its Python launcher
(:func:`sparse_decode`). The implementations live in their own modules; the selection knobs come as one packed
``int[] spec`` (:class:`.spec.SelectionSpec`); the reference in :mod:`.reference` is the source of truth for every
implementation. :func:`attend_selection` (exact attention over a selection, of :mod:`.torch_sparse_decode`) is
part of this module's public names too, imported from there.
"""
from __future__ import annotations

import functools
import math
import os
from typing import List, Optional

import torch

from .native import when_loaded
from .reference import PageBounds
from .spec import KERNELS, SelectionSpec
# attend_selection (run_kernel's dense path) stays one of this module's public names (__all__), as it was before the
# PyTorch path had a module of its own
from .torch_sparse_decode import attend_selection, sparse_decode_torch

__all__ = ["sparse_decode", "attend_selection", "check_decode_inputs", "resolve_kernel", "run_kernel", "KERNELS"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_decode_inputs(q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, spec: SelectionSpec,
                        kernel="auto") -> None:
    """Raise ``ValueError`` naming the first bad argument of :func:`sparse_decode`."""

    def bad(name, msg):
        raise ValueError(f"sparse_decode: argument '{name}' {msg}")

    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            bad(name, f"must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            bad(name, f"must be 4-D [B, H, L, D], got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            bad(name, f"must be float32, float16 or bfloat16, got {t.dtype}")
        if t.device.type == "meta":
            bad(name, "is on the 'meta' device: the op reads real data (use FakeTensors for tracing)")
    B, Hq, Lq, D = q.shape
    if Lq != 1:
        bad("q", f"must hold one decode token ([B, Hq, 1, D]), got query length {Lq}")
    if k_cache.shape != v_cache.shape:
        bad("v_cache", f"must have the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if k_cache.shape[0] != B or k_cache.shape[3] != D:
        bad("k_cache", f"must be [B={B}, Hkv, L, D={D}], got {tuple(k_cache.shape)}")
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    if Hq % Hkv:
        bad("k_cache", f"KV heads ({Hkv}) must divide query heads ({Hq})")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            bad(name, f"must have the dtype of q ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            bad(name, f"must be on the device of q ({q.device}), got {t.device}")
    if not isinstance(spec, SelectionSpec):
        bad("spec", f"must be a SelectionSpec, got {type(spec).__name__}")
    if not isinstance(scale, (int, float)) or not scale > 0 or not math.isfinite(scale):
        bad("scale", f"must be a finite float > 0, got {scale!r}")
    if kernel not in KERNELS:
        bad("kernel", f"must be one of {KERNELS}, got {kernel!r}")
    S = spec.page_size
    P = (L + S - 1) // S
    for name, t, shape in (("kmax", kmax, (B, Hkv, P, D)), ("kmin", kmin, (B, Hkv, P, D)), ("kabs", kabs, (B, Hkv, P))):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            bad(name, f"must be a tensor of shape {shape} (page_size={S}), got {got}")
    if kabs.dtype != torch.float32:
        bad("kabs", f"must be float32, got {kabs.dtype}")
    for name, t in (("kmax", kmax), ("kmin", kmin)):
        if t.dtype != spec.bounds_dtype:
            bad(name, f"must have the spec's bounds dtype {spec.bounds_dtype} (bf16/int8 bounds are stored rounded "
                      f"outward), got {t.dtype}")
    for name, t in (("kmax", kmax), ("kmin", kmin), ("kabs", kabs)):
        if t.device != q.device:
            bad(name, f"must be on the device of q ({q.device}), got {t.device}")
    if not isinstance(valid_len, torch.Tensor) or valid_len.dtype not in (torch.int64, torch.int32):
        bad("valid_len", "must be an int64 tensor of shape [B] or [1]")
    if valid_len.numel() not in (1, B):
        bad("valid_len", f"must have 1 or B={B} elements, got {valid_len.numel()}")
    if valid_len.device != q.device:
        bad("valid_len", f"must be on the device of q ({q.device}), got {valid_len.device}")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            bad("attn_mask", f"must be a tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in _FLOAT_DTYPES:
            bad("attn_mask", f"must be bool or floating, got {attn_mask.dtype}")
        if attn_mask.device != q.device:
            bad("attn_mask", f"must be on the device of q ({q.device}), got {attn_mask.device}")
        try:
            torch.broadcast_shapes(attn_mask.shape, (B, Hq, 1, L))
        except RuntimeError:
            bad("attn_mask", f"must broadcast to [B, Hq, 1, L] = {(B, Hq, 1, L)}, got {tuple(attn_mask.shape)}")
        if attn_mask.dim() == 4 and attn_mask.shape[1] not in (1, Hq):
            bad("attn_mask", f"head dim must be 1 or Hq={Hq}, got {attn_mask.shape[1]}")


def _ctrl_dense(ctrl: Optional[torch.Tensor]) -> bool:
    """``ctrl[1] != 0`` (a dense layer) or ``ctrl[0] != 0`` (stale bounds, never read): attend densely.

    ``ctrl``: int32 ``[2]`` or None, on the CPU (a read of host memory, not a device sync) or, for the PyTorch
    path on a GPU (a fallback), on the device (then this read waits for it). The Triton path reads it in-kernel.
    """
    if ctrl is None:
        return False
    if ctrl.dtype != torch.int32 or ctrl.numel() < 2:
        raise ValueError(f"sparse_decode: argument 'ctrl' must be an int32 tensor of 2 elements, got "
                         f"{ctrl.dtype} {tuple(ctrl.shape)} on {ctrl.device}")
    return bool(ctrl[:2].any())


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """The implementation that runs: ``"native"``, ``"triton"`` or ``"torch"``; the one place it is chosen.

    ``auto`` takes the native kernel on CPU when it builds, Triton on CUDA when it is installed, and the
    PyTorch path otherwise. ``native`` needs CPU tensors and a built kernel; ``triton`` CUDA tensors (or
    ``TRITON_INTERPRET=1``, the interpreter, on any device) and an installed Triton. Raises ``ValueError``
    naming ``kernel`` when the choice cannot run.
    """
    if kernel not in KERNELS:
        raise ValueError(f"sparse_decode: argument 'kernel' must be one of {KERNELS}, got {kernel!r}")
    device = torch.device(device)
    if kernel == "torch":
        return "torch"
    if kernel == "native" or (kernel == "auto" and device.type == "cpu"):
        from .native import load_native, native_unavailable_reason

        if kernel == "native" and device.type != "cpu":
            raise ValueError(f"sparse_decode: argument 'kernel'='native' runs on CPU tensors only, got {device}")
        if load_native():
            return "native"
        if kernel == "native":
            raise ValueError(f"sparse_decode: argument 'kernel'='native' but the native kernel is unavailable: "
                             f"{native_unavailable_reason()}")
        return "torch"
    if kernel == "triton" or (kernel == "auto" and device.type == "cuda"):
        if kernel == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("sparse_decode: argument 'kernel'='triton' needs CUDA tensors, or TRITON_INTERPRET=1 "
                             f"to run the Triton interpreter on {device}")
        from .triton_sparse_decode import triton_available

        if triton_available():
            return "triton"
        if kernel == "triton":
            raise ValueError("sparse_decode: argument 'kernel'='triton' but triton is not installed")
    return "torch"


@functools.lru_cache(maxsize=64)
def _spec_of(spec: tuple) -> SelectionSpec:
    return SelectionSpec.from_list(list(spec))


def run_kernel(impl: str, q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, spec: SelectionSpec,
               ctrl=None) -> torch.Tensor:
    """Run one implementation (``"native"``, ``"triton"`` or ``"torch"``; see :func:`resolve_kernel`); each bounds
    ``spec``'s sizes by the cache at its own entry (:meth:`.SelectionSpec.for_cache`)."""
    if impl == "native":
        from .native import native_module

        return native_module().sparse_decode(q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask, float(scale),
                                             spec.to_list(), ctrl)
    if impl == "triton":  # reads ctrl on the device: no host read, the same launches whatever the flags say
        from .triton_sparse_decode import sparse_decode_triton

        return sparse_decode_triton(q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, spec,
                                    ctrl=ctrl)
    if _ctrl_dense(ctrl):  # ---- a dense layer (or stale bounds): exact attention over every valid token
        return attend_selection(q, k_cache, v_cache, None, valid_len, attn_mask, scale, spec.page_size)
    return sparse_decode_torch(q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, spec)


@torch.library.custom_op("tinyserve::sparse_decode", mutates_args=())
def _sparse_decode_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kmax: torch.Tensor,
    kmin: torch.Tensor,
    kabs: torch.Tensor,
    valid_len: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    scale: float,
    spec: List[int],
    kernel: str,
    ctrl: Optional[torch.Tensor],
) -> torch.Tensor:
    # any device without a kernel of its own (CPU too, until the native module registers its kernel)
    return python_kernel(q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, spec, kernel, ctrl)


def python_kernel(q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, spec, kernel, ctrl):
    """The op's kernel in Python: what ``kernel`` resolves to on ``q``'s device (:func:`resolve_kernel`).

    It serves every device until the native module loads; then :func:`_register_native` makes the native kernel
    the op's CPU kernel (no Python per call), which hands the other ``kernel`` choices back to this.
    """
    return run_kernel(resolve_kernel(kernel, q.device), q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask,
                      scale, _spec_of(tuple(spec)), ctrl)


@_sparse_decode_op.register_kernel("cuda")
def _(q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, spec, kernel, ctrl):
    # Triton when it is installed, else the PyTorch path
    return python_kernel(q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, spec, kernel, ctrl)


@_sparse_decode_op.register_fake
def _(q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, spec, kernel, ctrl):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _register_native(module) -> None:
    """Make the native kernel the CPU kernel of ``tinyserve::sparse_decode`` (once the native module has loaded)."""
    module.register_sparse_decode_cpu_kernel(python_kernel)
    # custom_op's Python autograd and ADInplaceOrView kernels cost ~30 us per call on CPU: a C++ pass-through
    module.register_autograd_passthrough(["sparse_decode"])


when_loaded(_register_native)


def sparse_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    bounds: PageBounds,
    valid_len,
    attn_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    spec: Optional[SelectionSpec] = None,
    kernel: str = "auto",
    ctrl: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Exact attention of one decode token over the query-aware selected pages.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, 1, D]``, float32/float16/bfloat16.
    k_cache, v_cache : torch.Tensor
        ``[B, Hkv, L, D]``, dtype of ``q``; read in place (never repeated for GQA).
    bounds : PageBounds
        Page bounds of ``k_cache`` (``kmax``/``kmin`` ``[B, Hkv, P, D]`` of ``spec.bounds_dtype``,
        ``kabs`` fp32 ``[B, Hkv, P]``), e.g. from :func:`.bounds.allocate_bounds`.
    valid_len : torch.Tensor or int
        int64 ``[B]`` or ``[1]``: tokens ``>= valid_len`` are absent.
    attn_mask : torch.Tensor, optional
        Bool (True = attend) or additive float, broadcastable to ``[B, Hq, 1, L]``.
    scale : float, optional
        Defaults to ``1/sqrt(D)``.
    spec : SelectionSpec, optional
        The selection; defaults to the ``TinyServeConfig`` defaults with the bounds dtype of ``bounds``.
    kernel : {"auto", "native", "torch", "triton"}
        See :func:`resolve_kernel`.
    ctrl : torch.Tensor, optional
        int32 ``[2]`` (on the CPU, or on the device of ``q``); ``ctrl[0]`` or ``ctrl[1]`` nonzero attends densely.

    Returns
    -------
    torch.Tensor
        ``[B, Hq, 1, D]``, dtype of ``q``.
    """
    if not isinstance(valid_len, torch.Tensor):
        valid_len = torch.tensor([int(valid_len)], dtype=torch.int64, device=q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None and isinstance(q, torch.Tensor) else scale
    if not isinstance(bounds, tuple) or len(bounds) != 3:
        raise ValueError("sparse_decode: argument 'bounds' must be a PageBounds(kmax, kmin, kabs)")
    if spec is None:
        spec = SelectionSpec.default(bounds_dtype=bounds[0].dtype)
    check_decode_inputs(q, k_cache, v_cache, *bounds, valid_len, attn_mask, scale, spec, kernel)
    return torch.ops.tinyserve.sparse_decode(q, k_cache, v_cache, *bounds, valid_len, attn_mask, float(scale),
                                             spec.to_list(), kernel, ctrl)
