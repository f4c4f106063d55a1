"""Triton page-bounds maintenance (GPU; CPU under ``TRITON_INTERPRET=1``): the CUDA kernel of
``tinyserve::cache_write`` (:mod:`.bounds`).

:func:`cache_write_triton` is the whole op in ONE launch of :func:`_cache_write_kernel` with no host read:
it stores the new key rows, reads the stale flag ``ctrl[0]`` (and the end of the last write) on the device, and
recomputes the ``kmax``/``kmin``/``kabs`` of every page that holds a written position (or, when stale, of every
page), over all of the page's ``S`` slots (inside ``L``), exactly as :func:`.bounds.update_bounds_` /
:func:`.bounds.rebuild_bounds_` do after the write, so that bounds maintained this way always equal a
rebuild from scratch. CUDA graphs capture it. :func:`update_bounds_triton` and :func:`rebuild_bounds_triton`
launch the same kernel without the write (the stale flag a compile-time constant).

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

__all__ = ["cache_write_triton", "update_bounds_triton", "rebuild_bounds_triton"]


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
    def _store_page_after_write(
        k_ptr, src_ptr, pos_ptr, kmax_ptr, kmin_ptr, kabs_ptr,
        k_base, s_base, bh, page, lo_page, hi_page, N, L, P,
        stride_kl, stride_kd, stride_sn, stride_sd, stride_pos,
        WRITE: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr,
        N_BLOCK: tl.constexpr, BOUNDS_KIND: tl.constexpr,
    ):
        """Recompute the bounds of page ``page`` of one (batch, KV head) as they are after this launch's write.

        The tile is built from the cache rows with the new rows laid over it (``WRITE``): slot ``s`` takes
        ``src[last]``, ``last`` the largest ``n`` with ``positions[n] == page * S + s``, which is the row that
        program ``last`` stores. So the bounds never depend on another program's store (race-free in one launch).
        """
        offs_s = tl.arange(0, S_PAD)
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < D
        slot_pos = (page * S + offs_s).to(tl.int64)  # [S_PAD] sequence position of each slot
        inside = (offs_s < S) & (slot_pos < L)
        # -- stage a: the page's rows as the cache holds them (some may be overwritten by this launch)
        tile = tl.load(k_ptr + k_base + slot_pos[:, None] * stride_kl + offs_d[None, :] * stride_kd,
                       mask=inside[:, None] & d_ok[None, :], other=0.0)  # [S_PAD, D_PAD], dtype of the cache
        if WRITE:
            if (page >= lo_page) & (page <= hi_page):
                # -- stage b: per slot, the last n writing it (-1: none), by blocks of positions
                last = tl.full([S_PAD], -1, tl.int32)
                for n0 in range(0, N, N_BLOCK):
                    offs_n = n0 + tl.arange(0, N_BLOCK)
                    pm = tl.load(pos_ptr + offs_n * stride_pos, mask=offs_n < N, other=-1).to(tl.int64)
                    hit = slot_pos[:, None] == pm[None, :]  # [S_PAD, N_BLOCK]; padding (-1) never hits
                    last = tl.maximum(last, tl.max(tl.where(hit, offs_n[None, :], -1), axis=1))
                # -- stage c: overlay those src rows on the tile
                has = inside & (last >= 0)
                rows = tl.load(src_ptr + s_base + last[:, None] * stride_sn + offs_d[None, :] * stride_sd,
                               mask=has[:, None] & d_ok[None, :], other=0.0)
                tile = tl.where(has[:, None], rows, tile)
        # -- stage d: the page's bounds over its inside slots
        row = bh * P + page
        _store_page_bounds(_key_f32(tile), inside[:, None], kmax_ptr, kmin_ptr, kabs_ptr, row * D, row,
                           offs_d, d_ok, BOUNDS_KIND)

    @triton.jit
    def _cache_write_kernel(
        k_ptr, src_ptr, pos_ptr, ctrl_ptr, kmax_ptr, kmin_ptr, kabs_ptr,
        stride_kb, stride_kh, stride_kl, stride_kd,
        stride_sb, stride_sh, stride_sn, stride_sd,
        stride_pos,
        H, L, P, N, G,
        WRITE: tl.constexpr, STALE: tl.constexpr, TRACK_END: tl.constexpr,
        D: tl.constexpr, D_PAD: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr, N_BLOCK: tl.constexpr,
        BOUNDS_KIND: tl.constexpr,
    ):
        """Key write and bounds of ``tinyserve::cache_write`` in one launch, grid ``(G, B * H)``.

        Program ``(j, bh)`` owns position ``n = j`` (when ``j < N``) and, when the bounds are stale, the pages
        ``p = j, j + G, ...``. ``STALE``: 0 reads ``ctrl[0]`` (nonzero: stale), 1 always stale, 2 never.
        ``TRACK_END`` (with ``STALE`` 0): positions whose least is not ``ctrl[2]`` are stale too, and the last
        program to arrive (counted in ``ctrl[3]``, which it sets back to 0) stores the greatest position + 1 in
        ``ctrl[2]``. Every program reads ``ctrl[2]`` before it arrives, so none sees the new end.
        ``WRITE``: store ``src`` rows (else the cache is only read, and ``src_ptr`` is not).
        """
        j = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        b = bh // H
        h = bh % H
        k_base = b * stride_kb + h * stride_kh
        s_base = b * stride_sb + h * stride_sh
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < D
        # -- stage 1: the stale flag, read on the device
        if STALE == 0:
            stale = tl.load(ctrl_ptr) != 0
        else:
            stale = STALE == 1
        # -- stage 2: this program's position, and one O(N) pass over all of them: a later n of the same
        #    position (then this row is not stored), an earlier n of the same page (then that one recomputes
        #    it), and the range of positions inside [0, L) (the only pages that need an overlay)
        pos = tl.load(pos_ptr + j * stride_pos, mask=j < N, other=-1).to(tl.int64)
        live = (pos >= 0) & (pos < L)
        page = tl.where(live, pos // S, 0)
        later = tl.full([], 0, tl.int32)
        earlier = tl.full([], 0, tl.int32)
        lo = tl.full([], 0, tl.int64) + L
        hi = tl.full([], -1, tl.int64)
        for n0 in range(0, N, N_BLOCK):
            offs_n = n0 + tl.arange(0, N_BLOCK)
            pm = tl.load(pos_ptr + offs_n * stride_pos, mask=offs_n < N, other=-1).to(tl.int64)
            live_m = (pm >= 0) & (pm < L)  # padding (-1) is not live
            page_m = tl.where(live_m, pm // S, -1)
            later = tl.maximum(later, tl.max(tl.where(live_m & (offs_n > j) & (pm == pos), 1, 0), axis=0))
            earlier = tl.maximum(earlier, tl.max(tl.where((offs_n < j) & (page_m == page), 1, 0), axis=0))
            lo = tl.minimum(lo, tl.min(tl.where(live_m, pm, L), axis=0))
            hi = tl.maximum(hi, tl.max(tl.where(live_m, pm, -1), axis=0))
        lo_page = lo // S
        hi_page = tl.where(hi >= 0, hi // S, -1)
        if TRACK_END:  # positions that do not go on from the last write: written by someone else, or rewound
            end = tl.load(ctrl_ptr + 2).to(tl.int64)
            stale = stale | ((hi >= 0) & (lo != end))
        # -- stage 3: store the new row of position n (unless a later n writes the same position)
        if WRITE:
            if live & (later == 0):
                new_row = tl.load(src_ptr + s_base + j * stride_sn + offs_d * stride_sd, mask=d_ok)
                tl.store(k_ptr + k_base + pos * stride_kl + offs_d * stride_kd, new_row, mask=d_ok)
        # -- stage 4: bounds. Stale: pages j, j + G, ... of this head; else the page of position n, by the
        #    first n in that page. Either way every tile overlays the new rows instead of reading the stores.
        if stale:
            for p in range(j, P, G):
                _store_page_after_write(k_ptr, src_ptr, pos_ptr, kmax_ptr, kmin_ptr, kabs_ptr,
                                        k_base, s_base, bh, p, lo_page, hi_page, N, L, P,
                                        stride_kl, stride_kd, stride_sn, stride_sd, stride_pos,
                                        WRITE, D, D_PAD, S, S_PAD, N_BLOCK, BOUNDS_KIND)
        else:
            if live & (earlier == 0):
                _store_page_after_write(k_ptr, src_ptr, pos_ptr, kmax_ptr, kmin_ptr, kabs_ptr,
                                        k_base, s_base, bh, page, lo_page, hi_page, N, L, P,
                                        stride_kl, stride_kd, stride_sn, stride_sd, stride_pos,
                                        WRITE, D, D_PAD, S, S_PAD, N_BLOCK, BOUNDS_KIND)
        # -- stage 5: the new end, stored by the last program to arrive (after every program read the old one)
        if TRACK_END:
            arrived = tl.atomic_add(ctrl_ptr + 3, 1, sem="acq_rel")
            if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
                if hi >= 0:
                    tl.store(ctrl_ptr + 2, (hi + 1).to(tl.int32))
                tl.store(ctrl_ptr + 3, 0)


def _pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


#: key-cache dtypes the kernel reads
_KEY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: programs per (batch, KV head) of :func:`cache_write_triton` that share a rebuild of stale bounds (a rebuild
#: follows an outside write such as a prefill: rare, so a few programs per head; the others exit at once)
_REBUILD_PROGRAMS = 32

#: elements of a ``ctrl`` that records the end of the last write: ``CTRL_SIZE`` of :mod:`.bounds`, which imports this
#: module lazily (an import of it here would close a circle, which tests/kernels/test_imports.py refuses)
_CTRL_SIZE = 4

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


def _launch(fn: str, k_cache: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, kabs: torch.Tensor,
            ctrl, positions, src, page_size: int, write: bool, stale: int, programs: int) -> None:
    """Launch :func:`_cache_write_kernel` once (or not at all when there is nothing to do).

    ``stale``: the kernel's ``STALE`` (0 reads ``ctrl[0]``, 1 always, 2 never); ``programs``: the number of
    programs per (batch, KV head) that share a rebuild. Shapes only size the grid: ``(max(N, programs), B * H)``.
    """
    if not _HAS_TRITON:
        raise RuntimeError(f"{fn}: triton is not installed")
    if not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"{fn}: argument 'page_size' must be a positive int, got {page_size!r}")
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4 or k_cache.dtype not in _KEY_DTYPES:
        got = f"{k_cache.dtype} {tuple(k_cache.shape)}" if isinstance(k_cache, torch.Tensor) else type(k_cache).__name__
        raise ValueError(f"{fn}: argument 'k_cache' must be a float32/float16/bfloat16 tensor [B, Hkv, L, D], "
                         f"got {got}")
    B, H, L, D = k_cache.shape
    P = (L + page_size - 1) // page_size
    kind = _bounds_kind(fn, kmax, kmin, kabs, (B, H, P, D))
    N = 0
    if positions is not None:
        if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool \
                or positions.dim() > 1 or positions.device != k_cache.device:
            raise ValueError(f"{fn}: argument 'positions' must be an integer 0-d or [N] tensor on {k_cache.device}, "
                             f"got {positions.dtype} {tuple(positions.shape)} on {positions.device}")
        positions = positions.reshape(-1)  # a view: 0-d -> [1]
        N = positions.shape[0]
    if write and (src.dim() != 4 or tuple(src.shape) != (B, H, N, D) or src.dtype != k_cache.dtype
                  or src.device != k_cache.device):
        raise ValueError(f"{fn}: argument 'src' must be {k_cache.dtype} {(B, H, N, D)} on {k_cache.device}, "
                         f"got {src.dtype} {tuple(src.shape)} on {src.device}")
    if stale == 0 and (ctrl.dtype != torch.int32 or ctrl.numel() not in (2, _CTRL_SIZE)
                       or ctrl.device != k_cache.device or not ctrl.is_contiguous()):
        raise ValueError(f"{fn}: argument 'ctrl' must be a contiguous int32 tensor of 2 or {_CTRL_SIZE} elements "
                         f"on {k_cache.device}, got {ctrl.dtype} {tuple(ctrl.shape)} on {ctrl.device}")
    grid0 = max(N, min(P, programs)) if stale != 2 else N
    if P == 0 or B * H == 0 or grid0 == 0:  # no page: every position lies outside [0, L)
        return
    # pointers never read stand in for empty or absent tensors (an empty tensor's pointer may be null)
    pos_arg, stride_pos = (positions, positions.stride(0)) if N else (kabs, 0)
    src_arg, src_strides = (src, src.stride()) if write and N else (k_cache, (0, 0, 0, 0))
    ctrl_arg = ctrl if stale == 0 else kabs
    _cache_write_kernel[(grid0, B * H)](
        k_cache, src_arg, pos_arg, ctrl_arg, kmax, kmin, kabs, *k_cache.stride(), *src_strides, stride_pos,
        H, L, P, N, grid0,
        WRITE=bool(write and N), STALE=stale, TRACK_END=stale == 0 and ctrl.numel() == _CTRL_SIZE,
        D=D, D_PAD=_pow2(D), S=page_size, S_PAD=_pow2(page_size),
        N_BLOCK=min(max(_pow2(N), 16), 64), BOUNDS_KIND=kind,
    )


def cache_write_triton(k_cache: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, kabs: torch.Tensor,
                       ctrl: torch.Tensor, positions: torch.Tensor, src: torch.Tensor, page_size: int) -> None:
    """The CUDA kernel of ``tinyserve::cache_write``: the key write and the bounds in ONE Triton launch, with no
    host read and no host-synchronising op, so that CUDA graphs capture it.

    Grid ``(G, B * Hkv)``, ``G = max(N, min(P, 32))`` (shapes only). Program ``(j, bh)`` reads the stale flag
    ``ctrl[0]`` on the device, then, for position ``n = j < N``:

    * stores ``src[b, h, n]`` at ``k_cache[b, h, positions[n]]``, unless a later ``m`` writes the same position
      (the last ``n`` of a position wins) or the position lies outside ``[0, L)``;
    * when not stale, recomputes the page of ``positions[n]`` if no earlier ``m`` writes into that page (each
      touched page by exactly one program).

    When stale, program ``j`` instead recomputes the pages ``j, j + G, ...`` of its head (every page once).
    A page is recomputed from its cache rows with the new rows laid over the written slots (the ``src`` row of
    the last ``n`` of each slot), never from another program's store: race-free within the launch, and the
    bounds agree with the stored rows. Bounds equal :func:`.bounds.cache_write_torch`'s bit for bit (fp32;
    bf16 rounded outward; int8 codes, see the module docstring). A ``ctrl`` of 4 elements also records where the
    write ended (:mod:`.bounds`: positions that do not start there are stale too) and counts the programs'
    arrivals; its flags are never written: the host sets ``ctrl[0]`` before each call.

    Parameters
    ----------
    k_cache : torch.Tensor
        ``[B, Hkv, L, D]`` float32/float16/bfloat16 key cache (any strides), written in place.
    kmax, kmin : torch.Tensor
        ``[B, Hkv, P, D]`` contiguous float32, bfloat16 or int8, ``P = ceil(L / page_size)``; written in place.
    kabs : torch.Tensor
        ``[B, Hkv, P]`` float32 contiguous; written in place.
    ctrl : torch.Tensor
        int32, contiguous, 2 or 4 elements (:data:`.bounds.CTRL_SIZE`), on ``k_cache``'s device (a CPU tensor under
        the interpreter); ``ctrl[0] != 0`` (or, of 4 elements, positions not starting at ``ctrl[2]``) recomputes
        every page, else only the pages holding a written position. Only ``ctrl[2:4]`` is written.
    positions : torch.Tensor
        Any integer dtype, 0-d, ``[1]`` or ``[N]``, on ``k_cache``'s device (any stride): the sequence positions
        written; those outside ``[0, L)`` are skipped. Cast inside the kernel.
    src : torch.Tensor
        ``[B, Hkv, N, D]`` new keys, dtype of ``k_cache`` (any strides).
    page_size : int
    """
    _launch("cache_write_triton", k_cache, kmax, kmin, kabs, ctrl, positions, src, page_size,
            write=True, stale=0, programs=_REBUILD_PROGRAMS)


def update_bounds_triton(k_cache: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, kabs: torch.Tensor,
                         positions: torch.Tensor, page_size: int) -> None:
    """Recompute the bounds of the pages holding ``positions`` in place, bit-identical to
    :func:`.bounds.update_bounds_` and without a host sync: :func:`_cache_write_kernel` with no write and the
    stale flag off (one launch, grid ``(N, B * Hkv)``; the first ``n`` of each touched page recomputes it).

    Parameters
    ----------
    k_cache : torch.Tensor
        ``[B, Hkv, L, D]``, float32/float16/bfloat16 (any strides), already written.
    kmax, kmin : torch.Tensor
        ``[B, Hkv, P, D]`` contiguous float32, bfloat16 or int8, ``P = ceil(L / page_size)``; written in place.
    kabs : torch.Tensor
        ``[B, Hkv, P]`` float32 contiguous; written in place.
    positions : torch.Tensor
        Integer 0-d or ``[N]`` positions written, on ``k_cache``'s device (outside ``[0, L)``: skipped).
    page_size : int
    """
    _launch("update_bounds_triton", k_cache, kmax, kmin, kabs, None, positions, None, page_size,
            write=False, stale=2, programs=0)


def rebuild_bounds_triton(k_cache: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, kabs: torch.Tensor,
                          page_size: int) -> None:
    """Recompute every page's bounds from ``k_cache`` in place, as :func:`.bounds.rebuild_bounds_` (bit-identical):
    :func:`_cache_write_kernel` with no write and the stale flag on (one launch, grid ``(P, B * Hkv)``: one
    program per page).

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
    B, H, L, D = k_cache.shape if isinstance(k_cache, torch.Tensor) and k_cache.dim() == 4 else (0, 0, 0, 0)
    P = (L + page_size - 1) // page_size if isinstance(page_size, int) and page_size > 0 else 0
    _launch("rebuild_bounds_triton", k_cache, kmax, kmin, kabs, None, None, None, page_size,
            write=False, stale=1, programs=P)
