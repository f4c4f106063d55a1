"""Page-bounds maintenance: the ``tinyserve::cache_write`` op (a key write plus the bounds of the pages it
touches), and :func:`rebuild_bounds_` / :func:`update_bounds_` for code outside compiled graphs.

Maintained bounds cover every one of a page's ``S`` slots, written or not, so that
any sequence of writes (appends, overwrites, roll-backs) leaves them equal to a
rebuild from scratch: a touched page is recomputed whole, never merged.

``tinyserve::cache_write`` is registered once, with one kernel per device chosen by the
dispatcher: on CPU the native C++ kernel when it builds (registered from C++, see
``kernels/csrc/dispatch.cpp``), on CUDA the Triton kernel
(:func:`.triton_bounds.cache_write_triton`: one launch, no host sync, the stale flag read on the
device) when Triton is installed, else (and on any other
device) the PyTorch path :func:`cache_write_torch`.

``ctrl``, the op's int32 control block (:data:`CTRL_SIZE` elements; the old form of 2 elements is still taken):

``ctrl[CTRL_STALE]``
    Nonzero: rebuild every page (the host saw a write by someone else through the cache's version counter).
``ctrl[CTRL_DENSE]``
    Nonzero: the layer attends densely (read by the decode ops, not by the write).
``ctrl[CTRL_END]``
    The position after the last one the op wrote (-1: none yet), kept by the op itself, on the ctrl's device. A
    write whose first position is not ``ctrl[CTRL_END]`` rebuilds every page too: positions were skipped (written
    by someone else: an eager prefill, a fill by hand) or rewound (a new sequence, a roll-back). So the bounds
    follow such writes without the host: under an outer CUDA graph capture, whose replays run no host code, and
    for caches without a version counter (inference tensors). What no path sees is a write by someone else that
    ends exactly where the op's last write ended (a new prompt of the same length, written outside the graph,
    into an inference tensor or under an outer capture).
``ctrl[CTRL_ARRIVALS]``
    The Triton kernel's arrival counter (its last program stores ``ctrl[CTRL_END]``); zero between calls.
"""
from __future__ import annotations

import functools
from typing import List

import torch

from .native import when_loaded
from .reference import BOUNDS_DTYPES, PageBounds, num_pages, page_bounds, store_bounds
from .spec import SelectionSpec

__all__ = ["allocate_bounds", "rebuild_bounds_", "update_bounds_", "cache_write_torch", "cache_write_impl",
           "python_cache_write_kernel", "CACHE_WRITE_IMPLS", "new_ctrl", "CTRL_STALE", "CTRL_DENSE", "CTRL_END",
           "CTRL_ARRIVALS", "CTRL_SIZE"]

#: ``ctrl``'s fields (see the module docstring): stale, dense layer, end of the op's last write, arrivals
CTRL_STALE, CTRL_DENSE, CTRL_END, CTRL_ARRIVALS = range(4)
CTRL_SIZE = 4


def new_ctrl(device="cpu", stale: bool = True) -> torch.Tensor:
    """A fresh ``ctrl`` (int32 ``[CTRL_SIZE]``): stale by default, no write recorded (``ctrl[CTRL_END] = -1``)."""
    return torch.tensor([int(stale), 0, -1, 0], dtype=torch.int32, device=device)


def allocate_bounds(k_cache: torch.Tensor, page_size: int, dtype: torch.dtype = torch.float32) -> PageBounds:
    """Empty (zero) bounds for ``k_cache`` ``[B, Hkv, L, D]``; fill with :func:`rebuild_bounds_`.

    ``kmax``/``kmin`` are stored as ``dtype`` (float32, or bfloat16 rounded
    outward); ``kabs`` is always float32.
    """
    if dtype not in BOUNDS_DTYPES:
        raise ValueError(f"allocate_bounds: argument 'dtype' must be one of {BOUNDS_DTYPES}, got {dtype}")
    if not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"allocate_bounds: argument 'page_size' must be a positive int, got {page_size!r}")
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        raise ValueError("allocate_bounds: argument 'k_cache' must be a 4-D tensor [B, Hkv, L, D]")
    B, H, L, D = k_cache.shape
    P = num_pages(L, page_size)
    z = dict(dtype=dtype, device=k_cache.device)
    return PageBounds(torch.zeros(B, H, P, D, **z), torch.zeros(B, H, P, D, **z),
                      torch.zeros(B, H, P, dtype=torch.float32, device=k_cache.device))


def _check(fn, k_cache, kmax, kmin, kabs, page_size):
    if not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"{fn}: argument 'page_size' must be a positive int, got {page_size!r}")
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        got = tuple(k_cache.shape) if isinstance(k_cache, torch.Tensor) else type(k_cache).__name__
        raise ValueError(f"{fn}: argument 'k_cache' must be a 4-D tensor [B, Hkv, L, D], got {got}")
    if k_cache.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{fn}: argument 'k_cache' must be float32, float16 or bfloat16, got {k_cache.dtype}")
    if k_cache.device.type == "meta":
        raise ValueError(f"{fn}: argument 'k_cache' is on the 'meta' device (no data to bound)")
    B, H, L, D = k_cache.shape
    P = num_pages(L, page_size)
    bdt = kmax.dtype if isinstance(kmax, torch.Tensor) and kmax.dtype in BOUNDS_DTYPES else torch.float32
    for name, t, shape, dt in (("kmax", kmax, (B, H, P, D), bdt), ("kmin", kmin, (B, H, P, D), bdt),
                               ("kabs", kabs, (B, H, P), torch.float32)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{fn}: argument '{name}' must be a {dt} tensor {shape}, got {type(t).__name__}")
        if tuple(t.shape) != shape or t.dtype != dt or t.device != k_cache.device:
            raise ValueError(
                f"{fn}: argument '{name}' must be {dt} {shape} on {k_cache.device} (kmax/kmin float32, bfloat16 or int8, "
                f"kabs float32), got {t.dtype} {tuple(t.shape)} on {t.device}"
            )


def rebuild_bounds_impl(k_cache: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, kabs: torch.Tensor,
                        page_size: int) -> None:
    b = page_bounds(k_cache, page_size, dtype=kmax.dtype)
    kmax.copy_(b.kmax)
    kmin.copy_(b.kmin)
    kabs.copy_(b.kabs)


def update_bounds_impl(k_cache: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, kabs: torch.Tensor,
                       positions: torch.Tensor, page_size: int) -> None:
    B, H, L, D = k_cache.shape
    if positions.numel() == 1 and positions.device.type == "cpu":
        # ---- decode: one position, one page, recomputed from a slice (no unique / gather)
        p = int(positions.reshape(())) // page_size
        if 0 <= p < kmax.shape[2]:
            keys = k_cache[:, :, p * page_size:(p + 1) * page_size]  # [B,H,<=S,D]
            b = store_bounds(keys.amax(2).float(), keys.amin(2).float(), kmax.dtype)  # [B,H,D]
            kmax[:, :, p] = b.kmax
            kmin[:, :, p] = b.kmin
            kabs[:, :, p] = b.kabs
        return
    pages = torch.unique(positions.reshape(-1).to(torch.int64) // page_size)  # pages touched, ascending
    pages = pages[(pages >= 0) & (pages < kmax.shape[2])]
    if pages.numel() == 0:
        return
    tok = (pages[:, None] * page_size + torch.arange(page_size, device=pages.device)).reshape(-1)
    inside = tok < L
    keys = k_cache.index_select(2, tok.clamp(max=L - 1)).float()  # [B,H,n*S,D]
    keys = keys.unflatten(2, (pages.numel(), page_size))  # [B,H,n,S,D]
    inside = inside.reshape(1, 1, pages.numel(), page_size, 1)
    hi = keys.masked_fill(~inside, float("-inf")).amax(3)  # [B,H,n,D]
    lo = keys.masked_fill(~inside, float("inf")).amin(3)
    b = store_bounds(hi, lo, kmax.dtype)
    kmax.index_copy_(2, pages, b.kmax)
    kmin.index_copy_(2, pages, b.kmin)
    kabs.index_copy_(2, pages, b.kabs)


def rebuild_bounds_(k_cache: torch.Tensor, bounds: PageBounds, page_size: int) -> PageBounds:
    """Recompute every page of ``bounds`` from ``k_cache`` in place (O(L*D)).

    Parameters
    ----------
    k_cache : torch.Tensor
        ``[B, Hkv, L, D]``.
    bounds : PageBounds
        fp32 ``[B, Hkv, P, D]`` / ``[B, Hkv, P]``, written in place.
    page_size : int
    """
    _check("rebuild_bounds_", k_cache, *bounds, page_size)
    rebuild_bounds_impl(k_cache, *bounds, page_size)
    return bounds


def update_bounds_(k_cache: torch.Tensor, bounds: PageBounds, positions: torch.Tensor, page_size: int) -> PageBounds:
    """Recompute only the pages holding ``positions`` (O(pages touched * S * D)).

    Parameters
    ----------
    k_cache : torch.Tensor
        ``[B, Hkv, L, D]`` after the write.
    bounds : PageBounds
        Written in place.
    positions : torch.Tensor
        int64 ``[N]``: the sequence positions just written.
    page_size : int
    """
    _check("update_bounds_", k_cache, *bounds, page_size)
    if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int64, torch.int32):
        raise ValueError("update_bounds_: argument 'positions' must be an integer tensor of written positions")
    update_bounds_impl(k_cache, *bounds, positions, page_size)
    return bounds


# ---- tinyserve::cache_write -------------------------------------------------------------------------------------
def _positions(positions: torch.Tensor) -> torch.Tensor:
    """Written positions as int64 ``[n]``: any integer dtype, 0-d, ``[1]`` or ``[n]``."""
    if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise ValueError(f"cache_write: argument 'positions' must be an integer tensor, got {positions.dtype}")
    return positions.reshape(-1).to(torch.int64)


def _stale_on_host(ctrl: torch.Tensor, pos: torch.Tensor) -> bool:
    """Whether a write of ``pos`` rebuilds every page: ``ctrl[CTRL_STALE]`` set, or (a ``ctrl`` that records the
    end) ``pos`` not starting where the last write ended. Read on the host (a sync for a device ``ctrl``/``pos``)."""
    if int(ctrl[CTRL_STALE]):
        return True
    return ctrl.numel() >= CTRL_SIZE and pos.numel() > 0 and int(pos.min()) != int(ctrl[CTRL_END])


def _record_end(ctrl: torch.Tensor, pos: torch.Tensor) -> None:
    """``ctrl[CTRL_END] = max(pos) + 1`` and ``ctrl[CTRL_STALE] = 0``, on the host."""
    ctrl[CTRL_STALE] = 0
    if ctrl.numel() >= CTRL_SIZE and pos.numel() > 0:
        ctrl[CTRL_END] = int(pos.max()) + 1


def cache_write_torch(k_cache, kmax, kmin, kabs, ctrl, positions, src, page_size: int) -> None:
    """The PyTorch path of ``tinyserve::cache_write`` (any device; ``ctrl`` on the CPU or the cache's device, read
    and written on the host: a fallback, so a device ``ctrl`` costs a sync here)."""
    pos = _positions(positions)
    stale = _stale_on_host(ctrl, pos)
    k_cache.index_copy_(2, pos, src.to(k_cache.dtype))
    if stale:
        rebuild_bounds_impl(k_cache, kmax, kmin, kabs, page_size)
    else:
        update_bounds_impl(k_cache, kmax, kmin, kabs, pos, page_size)
    _record_end(ctrl, pos)


def _cache_write_native(k_cache, kmax, kmin, kabs, ctrl, positions, src, page_size: int) -> None:
    from .native import native_module

    native_module().cache_write(k_cache, kmax, kmin, kabs, ctrl, _positions(positions), src.to(k_cache.dtype),
                                page_size)


def _cache_write_triton(k_cache, kmax, kmin, kabs, ctrl, positions, src, page_size: int) -> None:
    """The Triton path: :func:`.triton_bounds.cache_write_triton`, one launch that reads ``ctrl`` on the device.

    ``ctrl`` on ``k_cache``'s device is handed to the kernel as is: it reads the stale flag and the recorded end
    there and stores the new end (never the flags). A ``ctrl`` in host memory (a CPU tensor: the cache's own device
    under the interpreter, or beside a CUDA cache) has its stale flag cleared after the launch, as the other paths
    clear it; beside a CUDA cache it is read and written on the host (:func:`_stale_on_host`, a sync for the
    positions) and the kernel gets a device copy of the decision from :func:`_device_flags`.
    """
    from .triton_bounds import cache_write_triton

    src = src.to(k_cache.dtype)  # the same tensor when the dtypes agree (an index_copy_ source always does)
    if ctrl.device == k_cache.device:
        cache_write_triton(k_cache, kmax, kmin, kabs, ctrl, positions, src, page_size)
        if ctrl.device.type == "cpu":
            ctrl[CTRL_STALE] = 0
    else:  # a host ctrl beside a device cache
        pos = _positions(positions)
        stale = _stale_on_host(ctrl, pos)
        cache_write_triton(k_cache, kmax, kmin, kabs, _device_flags(k_cache.device)[1 if stale else 0],
                           positions, src, page_size)
        _record_end(ctrl, pos)


@functools.lru_cache(maxsize=8)
def _device_flags(device: torch.device) -> torch.Tensor:
    """int32 ``[2, 2]`` on ``device``: row 0 the flags ``(0, 0)``, row 1 ``(1, 0)`` (a stale flag for the kernel;
    of 2 elements, so the kernel neither compares nor records an end)."""
    return torch.tensor([[0, 0], [1, 0]], dtype=torch.int32, device=device)


#: the implementations of ``tinyserve::cache_write`` by name (the conformance tests run each)
CACHE_WRITE_IMPLS = {"torch": cache_write_torch, "native": _cache_write_native, "triton": _cache_write_triton}


def cache_write_impl(device: torch.device) -> str:
    """The implementation of ``tinyserve::cache_write`` that runs on ``device``: native on CPU when it builds,
    Triton on CUDA when it is installed, else the PyTorch path."""
    device = torch.device(device)
    if device.type == "cpu":
        from .native import load_native

        return "native" if load_native() else "torch"
    if device.type == "cuda":
        from .triton_sparse_decode import triton_available

        return "triton" if triton_available() else "torch"
    return "torch"


def python_cache_write_kernel(k_cache, kmax, kmin, kabs, ctrl, positions, src, spec) -> None:
    """The op's kernel in Python: what :func:`cache_write_impl` picks for ``k_cache``'s device.

    It serves every device until the native module loads; then :func:`_register_native` makes the native kernel
    the op's CPU kernel (no Python per call), which hands a malformed ``spec`` back to this for its error."""
    _check_ctrl(ctrl, k_cache.device)
    impl = CACHE_WRITE_IMPLS[cache_write_impl(k_cache.device)]
    impl(k_cache, kmax, kmin, kabs, ctrl, positions, src, _page_size_of(tuple(spec)))


@functools.lru_cache(maxsize=64)
def _page_size_of(spec: tuple) -> int:
    return SelectionSpec.from_list(list(spec)).page_size


def _check_ctrl(ctrl: torch.Tensor, device: torch.device) -> None:
    """``ctrl``: contiguous int32 of 2 or :data:`CTRL_SIZE` elements, on the CPU (every path) or on the cache's
    ``device``."""
    if (ctrl.device.type != "cpu" and ctrl.device != device) or ctrl.dtype != torch.int32 \
            or ctrl.numel() not in (2, CTRL_SIZE) or not ctrl.is_contiguous():
        raise ValueError(f"cache_write: argument 'ctrl' must be a contiguous int32 tensor of 2 or {CTRL_SIZE} "
                         f"elements on the CPU or on {device}, got {ctrl.dtype} {tuple(ctrl.shape)} on {ctrl.device}")


@torch.library.custom_op("tinyserve::cache_write", mutates_args=("k_cache", "kmax", "kmin", "kabs", "ctrl"))
def _cache_write_op(k_cache: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, kabs: torch.Tensor,
                    ctrl: torch.Tensor, positions: torch.Tensor, src: torch.Tensor, spec: List[int]) -> None:
    """``k_cache.index_copy_(2, positions, src)``, then keep the page bounds exact.

    Parameters
    ----------
    k_cache : torch.Tensor
        ``[B, Hkv, L, D]`` key cache (any strides with a unit stride on ``D``), written in place.
    kmax, kmin : torch.Tensor
        ``[B, Hkv, P, D]`` contiguous float32, bfloat16 or int8 bounds, written in place.
    kabs : torch.Tensor
        ``[B, Hkv, P]`` contiguous float32.
    ctrl : torch.Tensor
        int32 ``[CTRL_SIZE]`` (or ``[2]``: no end recorded), on the CPU or on ``k_cache``'s device (see the module
        docstring): ``ctrl[CTRL_STALE] != 0``, or positions that do not start at ``ctrl[CTRL_END]``, rebuild every
        page; otherwise only the pages holding ``positions`` are recomputed. The op stores the new
        ``ctrl[CTRL_END]``. A CPU ``ctrl[CTRL_STALE]`` is cleared after the call; one on the device is read there by
        the Triton kernel and never written (the host sets it before each call).
    positions : torch.Tensor
        Integer (any dtype) 0-d, ``[1]`` or ``[n]``: the sequence positions written.
    src : torch.Tensor
        ``[B, Hkv, n, D]`` new keys.
    spec : list of int
        :meth:`.spec.SelectionSpec.to_list` (the page size is what the write reads).
    """
    # any device without a kernel of its own (CPU too, until the native module registers its kernel)
    python_cache_write_kernel(k_cache, kmax, kmin, kabs, ctrl, positions, src, spec)


@_cache_write_op.register_kernel("cuda")
def _(k_cache, kmax, kmin, kabs, ctrl, positions, src, spec):
    # the key write plus the Triton bounds kernel when Triton is installed, else the PyTorch path
    python_cache_write_kernel(k_cache, kmax, kmin, kabs, ctrl, positions, src, spec)


@_cache_write_op.register_fake
def _(k_cache, kmax, kmin, kabs, ctrl, positions, src, spec):
    return None


def _register_native(module) -> None:
    """Make the native kernel the CPU kernel of ``tinyserve::cache_write`` (once the native module has loaded)."""
    module.register_cache_write_cpu_kernel(python_cache_write_kernel)
    # custom_op's Python autograd and ADInplaceOrView kernels cost ~30 us per call on CPU: a C++ pass-through
    module.register_autograd_passthrough(["cache_write"])


when_loaded(_register_native)
