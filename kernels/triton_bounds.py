"""Triton page-bounds maintenance (GPU; CPU under ``TRITON_INTERPRET=1``): the CUDA kernel of
``tinyserve::cache_write`` after its key write (:mod:`.bounds`).

:func:`update_bounds_triton` recomputes the ``kmax``/``kmin``/``kabs`` of every page that
holds a written position, over all of the page's ``S`` slots (inside ``L``), exactly as
:func:`.bounds.update_bounds_` does, so that bounds maintained this way always equal a
rebuild from scratch; :func:`rebuild_bounds_triton` recomputes every page. Both run
:func:`_page_bounds_kernel`, one program per (batch and KV head, position or page).

Bounds are stored in the dtype of ``kmax``/``kmin`` exactly as :func:`.reference.store_bounds`
does: fp32; bf16 rounded outward (bit operations on the fp32 max/min); int8 codes on the page's grid
``step = max(kabs / 126, 2^-126)`` (``tl.div_rn``: IEEE division, as torch), the tightest outward codes
(the max rounded up and the min down, each checked against ``code * step`` and its neighbour), ``kabs``
then being the exact max ``|k|``.
"""
from __future__ import annotations

import torch

try:  # guarded: the package must import without triton
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    _HAS_TRITON = False

__all__ = ["update_bounds_triton", "rebuild_bounds_triton"]


if _HAS_TRITON:

    @triton.jit
    def _key_f32(x):
        """Keys upcast to fp32, exactly: bf16 through its bits (the interpreter's bf16 -> fp32 conversion
        mishandles subnormals), other dtypes by conversion."""
        if x.dtype.is_bf16():
            return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        return x.to(tl.float32)

    @triton.jit
    def _round_up_bf16_bits(x):
        """fp32 bits (int32) of the smallest bfloat16 value ``>= x`` (fp32 ``x``, finite); low half zero.

        As :func:`.reference.round_up_bf16`: truncating the low 16 bits rounds toward zero, so a
        positive ``x`` with a nonzero low half goes one bf16 step up.
        """
        bits = x.to(tl.int32, bitcast=True)
        return tl.where(((bits & 0xFFFF) != 0) & (x > 0), bits + 0x10000, bits) & -0x10000  # & 0xFFFF0000

    @triton.jit
    def _bf16_of_bits(bits):
        """The bfloat16 value of fp32 bits with a zero low half: the high half, bitcast (exact, subnormals too;
        the interpreter's fp32 -> bf16 conversion mishandles subnormals)."""
        return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _int8_codes(x, step, UP: tl.constexpr):
        """The code nearest ``x / step`` on the outward side, clamped to ``[-127, 127]``: the smallest ``c`` with
        ``c * step >= x`` (``UP``) or the largest with ``c * step <= x``, as :func:`.reference._int8_codes`.

        ``ceil``/``floor`` of the fp32 quotient (``tl.div_rn``: IEEE, as torch) is off by at most one either way,
        which one check of each neighbour corrects. On the GPU ``tl.ceil``/``tl.floor`` lower to
        ``cvt.rpi/rmi.ftz``: a subnormal quotient flushes to 0, one off at most, corrected the same way.
        """
        if UP:
            c = tl.ceil(tl.div_rn(x, step))
            c = tl.where((c - 1.0) * step >= x, c - 1.0, c)
            c = tl.where(c * step < x, c + 1.0, c)
        else:
            c = tl.floor(tl.div_rn(x, step))
            c = tl.where((c + 1.0) * step <= x, c + 1.0, c)
            c = tl.where(c * step > x, c - 1.0, c)
        return tl.minimum(tl.maximum(c, -127.0), 127.0).to(tl.int8)

    @triton.jit
    def _store_page_bounds(tile, inside, kmax_ptr, kmin_ptr, kabs_ptr, x_off, a_off, offs_d, d_ok,
                           BOUNDS_KIND: tl.constexpr):
        """Store the bounds of a page tile ``[S_PAD, D_PAD]`` fp32 over its ``inside`` slots, as
        :func:`.reference.store_bounds` does for the dtype ``BOUNDS_KIND`` (0 fp32, 1 bf16, 2 int8)."""
        # -- exact fp32 channel max/min over the page's slots (padding channels hold 0)
        hi = tl.max(tl.where(inside, tile, float("-inf")), axis=0)
        lo = tl.min(tl.where(inside, tile, float("inf")), axis=0)
        if BOUNDS_KIND == 2:
            # -- int8: kabs is the exact max |k|; codes on the grid step = max(kabs / 126, 2^-126), checked
            kabs = tl.max(tl.where(d_ok, tl.maximum(tl.abs(hi), tl.abs(lo)), 0.0), axis=0)
            step = tl.maximum(tl.div_rn(kabs, 126.0), 1.1754943508222875e-38)  # 2^-126
            tl.store(kmax_ptr + x_off + offs_d, _int8_codes(hi, step, True), mask=d_ok)
            tl.store(kmin_ptr + x_off + offs_d, _int8_codes(lo, step, False), mask=d_ok)
        elif BOUNDS_KIND == 1:
            # -- bf16: rounded outward; kabs of the stored values
            hi_bits = _round_up_bf16_bits(hi)
            lo_bits = (-_round_up_bf16_bits(-lo).to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)  # -up(-x)
            tl.store(kmax_ptr + x_off + offs_d, _bf16_of_bits(hi_bits), mask=d_ok)
            tl.store(kmin_ptr + x_off + offs_d, _bf16_of_bits(lo_bits), mask=d_ok)
            hi = hi_bits.to(tl.float32, bitcast=True)
            lo = lo_bits.to(tl.float32, bitcast=True)
            kabs = tl.max(tl.where(d_ok, tl.maximum(tl.abs(hi), tl.abs(lo)), 0.0), axis=0)
        else:
            tl.store(kmax_ptr + x_off + offs_d, hi, mask=d_ok)
            tl.store(kmin_ptr + x_off + offs_d, lo, mask=d_ok)
            kabs = tl.max(tl.where(d_ok, tl.maximum(tl.abs(hi), tl.abs(lo)), 0.0), axis=0)
        tl.store(kabs_ptr + a_off, kabs)

    @triton.jit
    def _page_bounds_kernel(
        k_ptr, pos_ptr, kmax_ptr, kmin_ptr, kabs_ptr,
        stride_kb, stride_kh, stride_kl, stride_kd,
        stride_pos,
        H, L, P,
        D: tl.constexpr, D_PAD: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr, BOUNDS_KIND: tl.constexpr,
    ):
        """Recompute the bounds of the page of ``positions[n]``, once per run of positions in a page."""
        pid_bh = tl.program_id(0)
        n = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        pos = tl.load(pos_ptr + n * stride_pos).to(tl.int64)
        prev = tl.load(pos_ptr + (n - 1) * stride_pos, mask=n > 0, other=-1).to(tl.int64)
        live = (pos >= 0) & (pos < L)
        page = tl.where(live, pos // S, 0)
        prev_page = tl.where((prev >= 0) & (prev < L), prev // S, -1)
        if live & ((n == 0) | (prev_page != page)):
            offs_s = tl.arange(0, S_PAD)
            offs_d = tl.arange(0, D_PAD)
            d_ok = offs_d < D
            slot_pos = page * S + offs_s
            inside = (offs_s < S) & (slot_pos < L)
            tile = tl.load(k_ptr + b * stride_kb + h * stride_kh + slot_pos[:, None] * stride_kl
                           + offs_d[None, :] * stride_kd, mask=inside[:, None] & d_ok[None, :], other=0.0)
            tile = _key_f32(tile)
            _store_page_bounds(tile, inside[:, None], kmax_ptr, kmin_ptr, kabs_ptr, (pid_bh * P + page) * D,
                               pid_bh * P + page, offs_d, d_ok, BOUNDS_KIND)


def _pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


#: ``BOUNDS_KIND`` of the kernels for each storage dtype of ``kmax``/``kmin``
_BOUNDS_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


def _bounds_kind(fn: str, kmax: torch.Tensor, kmin: torch.Tensor, kabs: torch.Tensor, shape) -> int:
    """Check the bounds buffers (``shape`` = ``(B, H, P, D)``) and return their ``BOUNDS_KIND``."""
    if kmax.dtype not in _BOUNDS_KINDS or kmin.dtype != kmax.dtype:
        raise ValueError(f"{fn}: arguments 'kmax'/'kmin' must both be float32, bfloat16 or int8, "
                         f"got {kmax.dtype}/{kmin.dtype}")
    for name, t, shp in (("kmax", kmax, shape), ("kmin", kmin, shape), ("kabs", kabs, shape[:3])):
        if tuple(t.shape) != tuple(shp) or not t.is_contiguous():
            raise ValueError(f"{fn}: argument '{name}' must be contiguous {tuple(shp)}, got {tuple(t.shape)}")
    if kabs.dtype != torch.float32:
        raise ValueError(f"{fn}: argument 'kabs' must be float32, got {kabs.dtype}")
    return _BOUNDS_KINDS[kmax.dtype]


def update_bounds_triton(k_cache: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, kabs: torch.Tensor,
                         positions: torch.Tensor, page_size: int) -> None:
    """Recompute the bounds of the pages holding ``positions`` in place, bit-identical to
    :func:`.bounds.update_bounds_` and without a host sync (no ``torch.unique``: the program of a position
    whose predecessor lies in the same page skips it, and the stores of a page repeated elsewhere in
    ``positions`` are identical).

    Parameters
    ----------
    k_cache : torch.Tensor
        ``[B, Hkv, L, D]``, float32/float16/bfloat16 (any strides), already written.
    kmax, kmin : torch.Tensor
        ``[B, Hkv, P, D]`` contiguous float32, bfloat16 or int8, ``P = ceil(L / page_size)``; written in place.
    kabs : torch.Tensor
        ``[B, Hkv, P]`` float32 contiguous; written in place.
    positions : torch.Tensor
        Integer ``[N]`` positions written (outside ``[0, L)``: skipped).
    page_size : int
    """
    fn = "update_bounds_triton"
    if not _HAS_TRITON:
        raise RuntimeError(f"{fn}: triton is not installed")
    B, H, L, D = k_cache.shape
    P = (L + page_size - 1) // page_size
    kind = _bounds_kind(fn, kmax, kmin, kabs, (B, H, P, D))
    positions = positions.reshape(-1)
    N = positions.numel()
    if P == 0 or N == 0:
        return
    _page_bounds_kernel[(B * H, N)](
        k_cache, positions, kmax, kmin, kabs, *k_cache.stride(), positions.stride(0), H, L, P,
        D=D, D_PAD=_pow2(D), S=page_size, S_PAD=_pow2(page_size), BOUNDS_KIND=kind,
    )


def rebuild_bounds_triton(k_cache: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, kabs: torch.Tensor,
                          page_size: int) -> None:
    """Recompute every page's bounds from ``k_cache`` in place, as :func:`.bounds.rebuild_bounds_` (bit-identical).

    Parameters
    ----------
    k_cache : torch.Tensor
        ``[B, Hkv, L, D]``, float32/float16/bfloat16 (any strides).
    kmax, kmin : torch.Tensor
        ``[B, Hkv, P, D]`` contiguous float32, bfloat16 or int8, ``P = ceil(L / page_size)``; written in place.
    kabs : torch.Tensor
        ``[B, Hkv, P]`` float32 contiguous; written in place.
    page_size : int
    """
    fn = "rebuild_bounds_triton"
    if not _HAS_TRITON:
        raise RuntimeError(f"{fn}: triton is not installed")
    B, H, L, D = k_cache.shape
    P = (L + page_size - 1) // page_size
    kind = _bounds_kind(fn, kmax, kmin, kabs, (B, H, P, D))
    if P == 0:
        return
    starts = torch.arange(P, dtype=torch.int64, device=k_cache.device) * page_size  # [P]: one program per page
    _page_bounds_kernel[(B * H, P)](
        k_cache, starts, kmax, kmin, kabs, *k_cache.stride(), starts.stride(0), H, L, P,
        D=D, D_PAD=_pow2(D), S=page_size, S_PAD=_pow2(page_size), BOUNDS_KIND=kind,
    )
