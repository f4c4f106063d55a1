"""Page-bounds maintenance ops: ``tinyserve::rebuild_bounds`` and ``tinyserve::update_bounds``.

Maintained bounds cover every one of a page's ``S`` slots, written or not, so that
any sequence of writes (appends, overwrites, roll-backs) leaves them equal to a
rebuild from scratch: a touched page is recomputed whole, never merged.
"""
from __future__ import annotations

import torch

from .reference import BOUNDS_DTYPES, PageBounds, num_pages, page_bounds, store_bounds

__all__ = ["allocate_bounds", "rebuild_bounds_", "update_bounds_"]


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


_rebuild_bounds_op = torch.library.custom_op("tinyserve::rebuild_bounds", rebuild_bounds_impl,
                                             mutates_args=("kmax", "kmin", "kabs"))


@_rebuild_bounds_op.register_fake
def _(k_cache, kmax, kmin, kabs, page_size):
    return None


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


_update_bounds_op = torch.library.custom_op("tinyserve::update_bounds", update_bounds_impl,
                                            mutates_args=("kmax", "kmin", "kabs"))


@_update_bounds_op.register_fake
def _(k_cache, kmax, kmin, kabs, positions, page_size):
    return None


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
    torch.ops.tinyserve.rebuild_bounds(k_cache, *bounds, page_size)
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
    torch.ops.tinyserve.update_bounds(k_cache, *bounds, positions, page_size)
    return bounds
