"""Triton KV append fused with page-bounds maintenance (GPU; CPU under ``TRITON_INTERPRET=1``).

:func:`append_kv_and_update_bounds_triton` does, in one launch for a decode step,
what ``k_cache.index_copy_(2, positions, k_new)``, the same for ``v_cache``, and
``tinyserve::update_bounds`` do in three: write the new tokens' K and V rows, then
recompute the ``kmax``/``kmin``/``kabs`` of every page touched, over all of the
page's ``S`` slots (inside ``L``), exactly as :mod:`.bounds` does, so that bounds
maintained this way always equal a rebuild from scratch.

:func:`_append_kv_bounds_kernel` (grid ``B*Hkv x N``) runs one program per new
token. Programs of new tokens that share a page race on the cache, so each
program builds its page in registers: the cache rows, overlaid with *every* new
token that lands in the page (the last one in ``positions`` order wins, as a
sequential ``index_copy_`` would). Every program of a page thus computes the same
bounds (identical stores are benign), and each program writes only its own row,
and only when it is the last writer of that position.

The overlay scan costs ``O(N)`` per program, fine for decode (``N = 1``) and small
chunks. For a long prefill chunk (``N > 64``) the launcher uses two kernels
instead: :func:`_scatter_kv_kernel` writes the rows, then
:func:`_page_bounds_kernel` recomputes each page once per run of positions in it
(the stream orders the two launches, so the second sees every write).
:func:`rebuild_bounds_triton` runs :func:`_page_bounds_kernel` once per page.

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

__all__ = ["append_kv_and_update_bounds_triton", "rebuild_bounds_triton"]

_FUSED_MAX_N = 64


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
    def _append_kv_bounds_kernel(
        k_ptr, v_ptr, kn_ptr, vn_ptr, pos_ptr, kmax_ptr, kmin_ptr, kabs_ptr,
        stride_kb, stride_kh, stride_kl, stride_kd,
        stride_vb, stride_vh, stride_vl, stride_vd,
        stride_knb, stride_knh, stride_knn, stride_knd,
        stride_vnb, stride_vnh, stride_vnn, stride_vnd,
        stride_pos,
        H, L, N, P,
        D: tl.constexpr, D_PAD: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
        BOUNDS_KIND: tl.constexpr,
    ):
        """Write new token ``n`` of head ``(b, h)`` and recompute the bounds of its page."""
        pid_bh = tl.program_id(0)
        n = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        pos = tl.load(pos_ptr + n * stride_pos).to(tl.int64)
        live = (pos >= 0) & (pos < L)
        page = tl.where(live, pos // S, 0)
        offs_s = tl.arange(0, S_PAD)
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < D
        slot_pos = page * S + offs_s
        # (scalar conditions are broadcast to vectors before `&`: the interpreter's bool `&` with a scalar is int)
        pos_s = pos + tl.zeros([S_PAD], tl.int64)
        inside = (offs_s < S) & (slot_pos < L) & (pos_s >= 0) & (pos_s < L)

        # -- stage 1: for each slot of the page, the last new token written there (-1: none)
        src = tl.full([S_PAD], -1, tl.int32)
        for n0 in range(0, N, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            pn = tl.load(pos_ptr + offs_n * stride_pos, mask=offs_n < N, other=-1).to(tl.int64)
            hit = (pn[None, :] == slot_pos[:, None]) & (offs_n < N)[None, :]
            src = tl.maximum(src, tl.max(tl.where(hit, offs_n[None, :], -1), axis=1))

        # -- stage 2: the page in registers: cache rows overlaid with the new rows
        from_new = inside & (src >= 0)
        from_cache = inside & (src < 0)
        k_base = k_ptr + b * stride_kb + h * stride_kh
        kn_base = kn_ptr + b * stride_knb + h * stride_knh
        old = tl.load(k_base + slot_pos[:, None] * stride_kl + offs_d[None, :] * stride_kd,
                      mask=from_cache[:, None] & d_ok[None, :], other=0.0)
        old = _key_f32(old)
        new = tl.load(kn_base + tl.maximum(src, 0)[:, None] * stride_knn + offs_d[None, :] * stride_knd,
                      mask=from_new[:, None] & d_ok[None, :], other=0.0)
        new = _key_f32(new)
        tile = tl.where(from_new[:, None], new, old)

        # -- stage 3: write this token's K and V rows (only the last writer of the position)
        writer = tl.sum(tl.where(slot_pos == pos, src, 0), axis=0)
        pos_d = pos + tl.zeros([D_PAD], tl.int64)
        w_ok = d_ok & (pos_d >= 0) & (pos_d < L) & ((writer + tl.zeros([D_PAD], tl.int32)) == n)
        krow = tl.load(kn_base + n * stride_knn + offs_d * stride_knd, mask=w_ok)
        tl.store(k_base + pos * stride_kl + offs_d * stride_kd, krow, mask=w_ok)
        vrow = tl.load(vn_ptr + b * stride_vnb + h * stride_vnh + n * stride_vnn + offs_d * stride_vnd, mask=w_ok)
        tl.store(v_ptr + b * stride_vb + h * stride_vh + pos * stride_vl + offs_d * stride_vd, vrow, mask=w_ok)

        # -- stage 4: bounds of the whole page (all programs of a page store the same values)
        if live:
            x_off = (pid_bh * P + page) * D
            _store_page_bounds(tile, inside[:, None], kmax_ptr, kmin_ptr, kabs_ptr, x_off, pid_bh * P + page,
                               offs_d, d_ok, BOUNDS_KIND)

    @triton.jit
    def _scatter_kv_kernel(
        k_ptr, v_ptr, kn_ptr, vn_ptr, pos_ptr,
        stride_kb, stride_kh, stride_kl, stride_kd,
        stride_vb, stride_vh, stride_vl, stride_vd,
        stride_knb, stride_knh, stride_knn, stride_knd,
        stride_vnb, stride_vnh, stride_vnn, stride_vnd,
        stride_pos,
        H, L,
        D: tl.constexpr, D_PAD: tl.constexpr,
    ):
        """``k_cache[b, h, positions[n]] = k_new[b, h, n]`` (and V), one row per program."""
        pid_bh = tl.program_id(0)
        n = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        pos = tl.load(pos_ptr + n * stride_pos).to(tl.int64)
        offs_d = tl.arange(0, D_PAD)
        pos_d = pos + tl.zeros([D_PAD], tl.int64)
        ok = (offs_d < D) & (pos_d >= 0) & (pos_d < L)
        krow = tl.load(kn_ptr + b * stride_knb + h * stride_knh + n * stride_knn + offs_d * stride_knd, mask=ok)
        tl.store(k_ptr + b * stride_kb + h * stride_kh + pos * stride_kl + offs_d * stride_kd, krow, mask=ok)
        vrow = tl.load(vn_ptr + b * stride_vnb + h * stride_vnh + n * stride_vnn + offs_d * stride_vnd, mask=ok)
        tl.store(v_ptr + b * stride_vb + h * stride_vh + pos * stride_vl + offs_d * stride_vd, vrow, mask=ok)

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


def append_kv_and_update_bounds_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    positions: torch.Tensor,
    kmax: torch.Tensor,
    kmin: torch.Tensor,
    kabs: torch.Tensor,
    page_size: int,
    fused: bool | None = None,
) -> None:
    """Write new K/V rows into the cache and refresh the bounds of the pages touched, in place.

    Equivalent to ``k_cache.index_copy_(2, positions, k_new)``,
    ``v_cache.index_copy_(2, positions, v_new)`` and then
    ``torch.ops.tinyserve.update_bounds(k_cache, kmax, kmin, kabs, positions, page_size)``
    (bit-identical, for every storage dtype of the bounds).

    Parameters
    ----------
    k_cache, v_cache : torch.Tensor
        ``[B, Hkv, L, D]``, float32/float16/bfloat16 (any strides); written in place.
    k_new, v_new : torch.Tensor
        ``[B, Hkv, N, D]``, dtype of the caches.
    positions : torch.Tensor
        int64/int32 ``[N]``: the sequence position of each new token, shared by the
        batch, in ``[0, L)`` (positions outside are skipped).
    kmax, kmin : torch.Tensor
        ``[B, Hkv, P, D]`` contiguous, ``P = ceil(L / page_size)``; float32, bfloat16 (rounded
        outward) or int8 (codes on the page's grid, :func:`.reference.int8_bounds_step`); written in place.
    kabs : torch.Tensor
        ``[B, Hkv, P]`` float32 contiguous; written in place.
    page_size : int
    fused : bool, optional
        Force the single fused kernel (True) or the scatter + page-bounds pair
        (False). Default: fused for ``N <= 64``.
    """
    fn = "append_kv_and_update_bounds_triton"
    if not _HAS_TRITON:
        raise RuntimeError(f"{fn}: triton is not installed")
    B, H, L, D = k_cache.shape
    N = k_new.shape[2]
    P = kmax.shape[2]
    if k_new.shape != (B, H, N, D) or v_new.shape != k_new.shape or v_cache.shape != k_cache.shape:
        raise ValueError(f"{fn}: k_new/v_new must be [B, Hkv, N, D] matching the caches")
    if k_new.dtype != k_cache.dtype or v_new.dtype != v_cache.dtype:
        raise ValueError(f"{fn}: new rows must have the dtype of the caches")
    kind = _bounds_kind(fn, kmax, kmin, kabs, (B, H, (L + page_size - 1) // page_size, D))
    positions = positions.reshape(-1)
    if positions.numel() != N:
        raise ValueError(f"{fn}: positions must hold N entries")
    if N == 0:
        return
    strides = (*k_cache.stride(), *v_cache.stride(), *k_new.stride(), *v_new.stride(), positions.stride(0))
    D_PAD, S_PAD = _pow2(D), _pow2(page_size)
    if fused is None:
        fused = N <= _FUSED_MAX_N
    if fused:
        _append_kv_bounds_kernel[(B * H, N)](
            k_cache, v_cache, k_new, v_new, positions, kmax, kmin, kabs, *strides, H, L, N, P,
            D=D, D_PAD=D_PAD, S=page_size, S_PAD=S_PAD, BLOCK_N=min(64, _pow2(N)), BOUNDS_KIND=kind,
        )
        return
    _scatter_kv_kernel[(B * H, N)](k_cache, v_cache, k_new, v_new, positions, *strides, H, L, D=D, D_PAD=D_PAD)
    _page_bounds_kernel[(B * H, N)](
        k_cache, positions, kmax, kmin, kabs, *k_cache.stride(), positions.stride(0), H, L, P,
        D=D, D_PAD=D_PAD, S=page_size, S_PAD=S_PAD, BOUNDS_KIND=kind,
    )


def rebuild_bounds_triton(k_cache: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, kabs: torch.Tensor,
                          page_size: int) -> None:
    """Recompute every page's bounds from ``k_cache`` in place, as ``tinyserve::rebuild_bounds`` (bit-identical).

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
