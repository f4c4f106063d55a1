"""Page bounds of the reference: per-page channel-wise key max/min, stored as fp32, bf16 or int8.

Part of :mod:`tinyserve_compile.kernels.reference` (the pure-PyTorch source of truth); the conventions are in its docstring.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..spec import BOUNDS_CODES


class PageBounds(NamedTuple):
    """Per-page key bounds.

    Attributes
    ----------
    kmax : torch.Tensor
        ``[B, Hkv, P, D]`` float32 or bfloat16 (rounded up), channel-wise max of
        each page's keys.
    kmin : torch.Tensor
        ``[B, Hkv, P, D]``, dtype of ``kmax`` (bfloat16: rounded down), channel-wise min.
    kabs : torch.Tensor
        ``[B, Hkv, P]`` float32, ``max(|kmax|, |kmin|)`` over channels of the stored
        values; it sizes the rounding slack that keeps computed scores true upper bounds.
    """

    kmax: torch.Tensor
    kmin: torch.Tensor
    kabs: torch.Tensor


def num_pages(length: int, page_size: int) -> int:
    """Number of pages of ``page_size`` tokens covering ``length`` tokens."""
    return (length + page_size - 1) // page_size


def _as_valid_len(valid_len, batch: int, device) -> torch.Tensor:
    if not isinstance(valid_len, torch.Tensor):
        valid_len = torch.tensor([int(valid_len)], dtype=torch.int64, device=device)
    return valid_len.to(device=device, dtype=torch.int64).reshape(-1).expand(batch)


def _paged(x: torch.Tensor, page_size: int, fill: float) -> torch.Tensor:
    """``[..., L, D] -> [..., P, S, D]``, padding the partial last page with ``fill``."""
    L = x.shape[-2]
    pad = num_pages(L, page_size) * page_size - L
    if pad:
        x = F.pad(x, (0, 0, 0, pad), value=fill)
    return x.unflatten(-2, (-1, page_size))


#: storage dtypes of ``kmax``/``kmin`` (``spec.BOUNDS_CODES``, their one definition)
BOUNDS_DTYPES = BOUNDS_CODES

#: smallest normal fp32 number: the floor of the int8 grid step (no subnormal step, so ``code * step`` is exact
#: to one rounding and ``kmax / step`` cannot overflow)
_INT8_STEP_FLOOR = 2.0**-126


def int8_bounds_step(kabs: torch.Tensor) -> torch.Tensor:
    """Grid step of int8 bounds: ``max(kabs / 126, 2^-126)`` in fp32, elementwise.

    Every reader and writer computes exactly this (one fp32 division, one max): with
    ``|kmax|, |kmin| <= kabs`` the rounded codes stay within ``[-127, 127]``.
    """
    return torch.clamp_min(kabs.float() / 126.0, _INT8_STEP_FLOOR)


def bounds_f32(bounds: PageBounds):
    """``(kmax, kmin)`` decoded to fp32: int8 codes times their page's step, or the stored values upcast."""
    if bounds.kmax.dtype == torch.int8:
        step = int8_bounds_step(bounds.kabs)[..., None]
        return bounds.kmax.float() * step, bounds.kmin.float() * step
    return bounds.kmax.float(), bounds.kmin.float()


def bounds_itemsize(dtype: torch.dtype) -> int:
    """Bytes per stored channel of ``kmax``/``kmin``."""
    return torch.empty((), dtype=dtype).element_size()


def _int8_codes(x: torch.Tensor, step: torch.Tensor, up: bool) -> torch.Tensor:
    """The code ``c`` nearest ``x / step`` on the outward side: the smallest ``c`` with ``c * step >= x`` (``up``)
    or the largest with ``c * step <= x``, all products in fp32, then clamped to ``[-127, 127]``.

    ``ceil``/``floor`` of the fp32 quotient is off by at most one either way (one rounding of the division),
    which one check of each neighbour corrects.
    """
    if up:
        c = torch.ceil(x / step)
        c = torch.where((c - 1) * step >= x, c - 1, c)
        c = torch.where(c * step < x, c + 1, c)
    else:
        c = torch.floor(x / step)
        c = torch.where((c + 1) * step <= x, c + 1, c)
        c = torch.where(c * step > x, c - 1, c)
    return c.clamp(-127, 127).to(torch.int8)


def round_up_bf16(x: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 value ``>= x`` (fp32 ``x``, finite), as bfloat16.

    bfloat16 is the upper half of an fp32 word: truncating the low 16 bits rounds
    toward zero, so a positive ``x`` with a nonzero low half goes one bf16 step up
    and a negative one is simply truncated.
    """
    x = x.float().contiguous()
    bits = x.view(torch.int32)
    low = (bits & 0xFFFF) != 0
    up = torch.where(low & (x > 0), bits + 0x10000, bits) & -0x10000  # & 0xFFFF0000
    return up.view(torch.float32).to(torch.bfloat16)  # exact: the low half is zero


def round_down_bf16(x: torch.Tensor) -> torch.Tensor:
    """The largest bfloat16 value ``<= x`` (fp32 ``x``, finite), as bfloat16."""
    return -round_up_bf16(-x.float())


def store_bounds(kmax: torch.Tensor, kmin: torch.Tensor, dtype: torch.dtype = torch.float32) -> PageBounds:
    """Exact fp32 page max/min -> stored :class:`PageBounds` of ``dtype`` (outward-rounded) and their ``kabs``.

    Parameters
    ----------
    kmax, kmin : torch.Tensor
        ``[..., P, D]`` float32.
    dtype : torch.dtype
        ``torch.float32``, ``torch.bfloat16`` (rounded outward) or ``torch.int8`` (codes on the page's grid,
        :func:`int8_bounds_step`; ``kabs`` is then the exact max ``|k|`` that sizes the grid).
    """
    if dtype not in BOUNDS_DTYPES:
        raise ValueError(f"argument 'dtype' must be one of {BOUNDS_DTYPES} (page bounds storage), got {dtype}")
    if dtype == torch.int8:
        kmax, kmin = kmax.float(), kmin.float()
        kabs = torch.maximum(kmax.abs(), kmin.abs()).amax(-1)
        step = int8_bounds_step(kabs)[..., None]
        return PageBounds(_int8_codes(kmax, step, True), _int8_codes(kmin, step, False), kabs)
    if dtype == torch.bfloat16:
        kmax, kmin = round_up_bf16(kmax), round_down_bf16(kmin)
    kabs = torch.maximum(kmax.float().abs(), kmin.float().abs()).amax(-1)
    return PageBounds(kmax, kmin, kabs)


def page_bounds(k_cache: torch.Tensor, page_size: int, valid_len=None, dtype: torch.dtype = torch.float32) -> PageBounds:
    """Channel-wise min/max of the keys of every page.

    Parameters
    ----------
    k_cache : torch.Tensor
        ``[B, Hkv, L, D]``, any floating dtype.
    page_size : int
        Tokens per page ``S``. The last page may be partial.
    valid_len : torch.Tensor or int, optional
        int64 ``[B]``. When given, tokens at or past ``valid_len[b]`` are left out,
        and pages with no valid token hold zeros (selection never picks them). When
        omitted, every one of the ``L`` slots counts.

    Returns
    -------
    PageBounds
        fp32 ``kmax``/``kmin`` ``[B, Hkv, P, D]`` and ``kabs`` ``[B, Hkv, P]`` with
        ``P = ceil(L / S)``.
    """
    B, H, L, D = k_cache.shape
    k = k_cache.float()
    if valid_len is None:
        keep = torch.ones(B, 1, L, 1, dtype=torch.bool, device=k.device)
    else:
        vl = _as_valid_len(valid_len, B, k.device)
        keep = (torch.arange(L, device=k.device)[None, :] < vl[:, None])[:, None, :, None]
    hi = torch.where(keep, k, float("-inf"))
    lo = torch.where(keep, k, float("inf"))
    kmax = _paged(hi, page_size, float("-inf")).amax(-2)  # [B,H,P,D]
    kmin = _paged(lo, page_size, float("inf")).amin(-2)
    empty = torch.isinf(kmax)  # only a page with no valid token has -inf max
    kmax = kmax.masked_fill(empty, 0.0)
    kmin = kmin.masked_fill(empty, 0.0)
    return store_bounds(kmax, kmin, dtype)
