"""The ``tinyserve::sparse_decode`` op: query-aware paged sparse decode attention.

One op, registered once, with one kernel per device chosen through the dispatcher:

* ``cpu``: the native C++ kernel (:mod:`.native`) when it builds, else the PyTorch path;
* ``cuda``: the Triton kernels (:mod:`.triton_sparse_decode`) when Triton is installed, else the PyTorch path;
* any other device: the PyTorch path (:func:`_sparse_decode_torch`).

The ``kernel`` argument (``auto``, ``native``, ``torch``, ``triton``) overrides that choice;
:func:`resolve_kernel` is the one place where it is resolved. The selection knobs come
as one packed ``int[] spec`` (:class:`.spec.SelectionSpec`). :func:`sparse_decode` is the
Python launcher that validates its arguments; the reference in :mod:`.reference` is the
source of truth for every implementation.
"""
from __future__ import annotations

import functools
import math
import os
from typing import List, Optional

import torch
import torch.nn.functional as F

from .reference import (
    PageBounds,
    Selection,
    _as_valid_len,
    _gathered_mask,
    _selected_tokens,
    mask_page_max,
    page_scores,
    rank_candidate_tokens,
    rank_candidates,
    select_pages,
    softmax_attend,
    top_pages,
)
from .native import when_loaded
from .spec import KERNELS, SelectionSpec, reads_every_key

__all__ = ["sparse_decode", "attend_selection", "check_decode_inputs", "resolve_kernel", "run_kernel", "KERNELS"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: up to this many (batch, KV head) pairs the CPU path loops over per-head GEMMs instead of bmm
_LOOP_MAX = 16


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


def _gather_pages(cache: torch.Tensor, idx: torch.Tensor, page_size: int) -> torch.Tensor:
    """Keys or values of the selected pages.

    Parameters
    ----------
    cache : torch.Tensor
        ``[B, Hkv, L, D]``.
    idx : torch.Tensor
        int64 ``[B, Hkv, K]`` page indices.

    Returns
    -------
    torch.Tensor
        ``[B, Hkv, K*S, D]`` in fp32 (slots past ``L`` clamp to ``L-1``; callers mask them).
    """
    B, H, L, D = cache.shape
    K = idx.shape[-1]
    if L % page_size == 0 and cache.is_contiguous():
        P = L // page_size
        rows = (torch.arange(B * H, device=idx.device).reshape(B, H, 1) * P + idx).reshape(-1)
        out = cache.reshape(B * H * P, page_size * D).index_select(0, rows)  # [B*H*K, S*D]: page memcpy
        return out.reshape(B, H, K * page_size, D).float()
    tok = (idx[..., None] * page_size + torch.arange(page_size, device=idx.device)).reshape(B, H, K * page_size)
    tok = tok.clamp(max=L - 1)
    return cache.gather(2, tok[..., None].expand(-1, -1, -1, D)).float()


def _attend(qg, kg, vg, tok_ok, mask_add, scale) -> torch.Tensor:
    """Masked softmax attention of grouped queries over gathered tokens.

    qg ``[B,Hkv,G,D]`` fp32, kg/vg ``[B,Hkv,T,D]`` fp32, tok_ok ``[B,Hkv,T]`` bool,
    mask_add broadcastable to ``[B,Hkv,G,T]``; returns ``[B,Hkv,G,D]`` fp32.
    """
    logits = (qg @ kg.transpose(-1, -2)) * scale  # [B,Hkv,G,T]
    logits = (logits + mask_add).masked_fill(~tok_ok[:, :, None, :], float("-inf"))
    return softmax_attend(logits, vg)


def _uniform_len(valid_len: torch.Tensor, attn_mask: Optional[torch.Tensor], batch: int):
    """``(n, attn_mask)``: ``n = int(valid_len)`` when every batch row has the same length (else None), and the
    mask, or None when it attends every token below ``n`` with weight 0 (HF's causal decode mask), which then
    changes nothing: tokens at or past ``valid_len`` are never attended. One host read for both.

    ``valid_len``: int64/int32 ``[B]`` or ``[1]``; ``attn_mask``: bool or additive float, broadcastable to
    ``[B, Hq, 1, L]``, or None.
    """
    vl = valid_len.reshape(-1)
    lo_hi = torch.aminmax(vl)
    parts = [lo_hi.min.reshape(1).long(), lo_hi.max.reshape(1).long()]
    if attn_mask is not None:
        # whether the mask is trivial below the longest row: a device-side flag read with the lengths
        L = attn_mask.shape[-1]
        below = torch.arange(L, device=attn_mask.device) < lo_hi.max
        ok = attn_mask if attn_mask.dtype == torch.bool else attn_mask == 0
        parts.append((ok | ~below).all().reshape(1).long())
    got = torch.cat(parts).tolist()
    lo, hi = got[0], got[1]
    if attn_mask is not None and lo == hi and got[2]:
        attn_mask = None
    return (lo if lo == hi else None), attn_mask


def _gather_pages_raw(cache: torch.Tensor, idx: torch.Tensor, page_size: int) -> torch.Tensor:
    """Whole pages of a contiguous cache, in the cache dtype.

    ``cache`` ``[B, H, L, D]``, ``idx`` int64 ``[B, H, K]`` -> ``[B*H, K*S, D]``. Every
    index must name a full page (``idx < L // page_size``). With ``L % S == 0`` this
    is one ``index_select`` of whole pages (``S*D`` contiguous elements each);
    otherwise the full pages are indexed through a strided view.
    """
    B, H, L, D = cache.shape
    P, K = L // page_size, idx.shape[-1]
    rows = idx.reshape(B * H, K)
    if L % page_size:
        pages = cache.as_strided((B * H, P, page_size * D), (L * D, page_size * D, 1))  # full pages only
        bh = torch.arange(B * H, device=idx.device)[:, None]
        return pages[bh, rows].view(B * H, K * page_size, D)
    if B * H > 1:
        rows = rows + torch.arange(0, B * H * P, P, device=idx.device)[:, None]
    out = cache.view(B * H * P, page_size * D).index_select(0, rows.reshape(-1))  # [B*H*K, S*D]
    return out.view(B * H, K * page_size, D)


def _small_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)``; on CPU with few batches, a loop of ``mm`` instead.

    CPU ``bmm`` (and the fp32 SDPA kernel) run threaded GEMMs inside a threaded
    batch loop, which stalls for milliseconds when the cores are shared.
    """
    if a.shape[0] > _LOOP_MAX or a.device.type != "cpu":
        return torch.bmm(a, b)
    out = a.new_empty(a.shape[0], a.shape[1], b.shape[2])
    for oi, ai, bi in zip(out.unbind(0), a.unbind(0), b.unbind(0)):
        torch.mm(ai, bi, out=oi)
    return out


def _attend_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Unmasked decode attention of query groups over their KV head's tokens.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, 1, D]``.
    k, v : torch.Tensor
        ``[B, Hkv, T, D]`` (any strides with a unit last stride), dtype of ``q``.

    Returns
    -------
    torch.Tensor
        ``[B, Hq, 1, D]``, dtype of ``q``. fp32: grouped GEMMs and a fused softmax
        (every group row reads its KV head once); fp16/bf16: SDPA's fused kernel,
        which accumulates in fp32 without an fp32 copy of the pages.
    """
    B, Hq, _, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    if q.dtype != torch.float32:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=Hq != Hkv)
    BH = B * Hkv
    logits = _small_bmm(q.reshape(BH, Hq // Hkv, D), k.reshape(BH, T, D).transpose(1, 2))  # [BH,G,T]
    p = torch.softmax(logits.mul_(scale), dim=-1)
    return _small_bmm(p, v.reshape(BH, T, D)).view(B, Hq, 1, D)


def _fast_sparse(q, k_cache, v_cache, kmax, kmin, kabs, n, scale, page_size, K, sink_pages):
    """Sparse decode for the common case: no mask, one valid length ``n``, contiguous caches, the newest page a full page of the cache.

    Same pages as the reference (same scores, same ``topk`` set), fewer and cheaper
    ops: whole pages gathered in the cache dtype, then :func:`_attend_grouped`.
    Only the newest page can be partial; with the pages ascending it comes last, so
    its missing slots are cut off the end instead of masked.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, 1, D]``.
    k_cache, v_cache : torch.Tensor
        ``[B, Hkv, L, D]`` contiguous, dtype of ``q``, ``n <= (L // page_size) * page_size``.
    kmax, kmin : torch.Tensor
        fp32 ``[B, Hkv, P, D]`` page bounds.
    kabs : torch.Tensor
        fp32 ``[B, Hkv, P]``.
    n : int
        Valid length shared by every batch row, with ``ceil(n / page_size) > K``.
    scale : float
    page_size, K, sink_pages : int
        Tokens per page, pages kept, forced leading pages.

    Returns
    -------
    torch.Tensor
        ``[B, Hq, 1, D]``, dtype of ``q``.
    """
    B, Hq, _, D = q.shape
    Hkv = k_cache.shape[1]
    # ---- stage 1: bound scan (the reference scorer, bit for bit) and top-K pages
    scores = page_scores(q, PageBounds(kmax, kmin, kabs), scale)  # [B,Hkv,P] fp32
    vl = torch.full((B,), n, dtype=torch.int64, device=q.device)
    idx = top_pages(scores, vl, page_size, K, sink_pages).idx  # [B,Hkv,K] ascending, every one a valid page
    # ---- stage 2: gather whole pages in the cache dtype
    T = idx.shape[-1] * page_size
    kg = _gather_pages_raw(k_cache, idx, page_size).view(B, Hkv, T, D)  # [B,Hkv,K*S,D]
    vg = _gather_pages_raw(v_cache, idx, page_size).view(B, Hkv, T, D)
    # ---- stage 3: exact attention over the selected tokens (the newest page's slots >= n dropped)
    T -= -n % page_size
    return _attend_grouped(q, kg[:, :, :T], vg[:, :, :T], scale)


def _attend_kept_tokens(q, v_cache, logits, cand: Selection, vl, page_size: int, K: int, sink_pages: int):
    """Keep the ``K * page_size`` candidate tokens of highest share (:func:`.reference.rank_candidate_tokens`)
    and attend them, reusing their logits: ``logits`` fp32 ``[B, Hkv, G, Kc*S]`` of the candidate pages
    ``cand`` ``[B, Hkv, Kc]``; returns ``[B, Hq, 1, D]`` in the dtype of ``q``."""
    B, Hkv, G, _ = logits.shape
    D = v_cache.shape[-1]
    final, slots = rank_candidate_tokens(logits, cand, vl, page_size, K * page_size, sink_pages)  # [B,Hkv,T]
    kept = logits.gather(3, slots[:, :, None, :].expand(B, Hkv, G, slots.shape[-1]))  # [B,Hkv,G,T]
    kept = kept.masked_fill(~final.ok[:, :, None, :], float("-inf"))
    L = v_cache.shape[2]
    # slots of the partial last page past L are never kept (masked above); clamp them for the gather
    vg = v_cache.gather(2, final.idx.clamp(max=L - 1)[..., None].expand(-1, -1, -1, D)).float()  # [B,Hkv,T,D]
    return softmax_attend(kept, vg).reshape(B, Hkv * G, 1, D).to(q.dtype)


def _fast_two_stage(q, k_cache, v_cache, kmax, kmin, kabs, n, scale, page_size, K, sink_pages, n_cand,
                    keep_tokens=False):
    """Two-stage sparse decode for the common case (no mask, one valid length ``n``, contiguous caches).

    The same selection as :func:`.reference.choose`: the bound keeps ``n_cand``
    candidate pages (all valid pages when they number fewer, with no bound scan),
    exact logits over the candidates' keys rank them by softmax mass
    (:func:`.reference.rank_candidates`, or per token with ``keep_tokens``:
    :func:`.reference.rank_candidate_tokens`), and the kept logits are reused
    for the final softmax: only the kept values are read.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, 1, D]``.
    k_cache, v_cache : torch.Tensor
        ``[B, Hkv, L, D]`` contiguous, dtype of ``q``, ``n <= (L // page_size) * page_size``.
    kmax, kmin : torch.Tensor
        fp32 ``[B, Hkv, P, D]`` page bounds.
    kabs : torch.Tensor
        fp32 ``[B, Hkv, P]``.
    n : int
        Valid length shared by every batch row, with ``ceil(n / page_size) > K``.
    scale : float
    page_size, K, sink_pages, n_cand : int
        Tokens per page, pages kept, forced leading pages, candidate pages (``> K``).
    keep_tokens : bool
        Keep the ``K * page_size`` best single tokens instead of ``K`` pages.

    Returns
    -------
    torch.Tensor
        ``[B, Hq, 1, D]``, dtype of ``q``.
    """
    B, Hq, _, D = q.shape
    Hkv = k_cache.shape[1]
    G, S = Hq // Hkv, page_size
    n_valid = (n + S - 1) // S
    vl = torch.full((B,), n, dtype=torch.int64, device=q.device)
    # ---- stage 1: candidate pages (every valid page when c*K covers them)
    if n_cand >= n_valid:
        idx = torch.arange(n_valid, device=q.device).expand(B, Hkv, n_valid)
        kg = k_cache[:, :, :n_valid * S].float()  # [B,Hkv,Kc*S,D]
    else:
        scores = page_scores(q, PageBounds(kmax, kmin, kabs), scale)  # [B,Hkv,P] fp32
        idx = top_pages(scores, vl, S, n_cand, sink_pages).idx  # [B,Hkv,Kc] ascending, every one a valid page
        kg = None if reads_every_key(idx.shape[-1], n_valid) else \
            _gather_pages_raw(k_cache, idx, S).view(B, Hkv, -1, D).float()
    Kc = idx.shape[-1]
    # ---- stage 2: exact logits over the candidates' keys; rank pages by softmax mass
    qg = q.float().reshape(B, Hkv, G, D)
    if kg is None:  # most pages are candidates: one pass over every valid key beats copying most of them
        full = (qg @ k_cache[:, :, :n_valid * S].float().transpose(-1, -2)) * scale  # [B,Hkv,G,n_valid*S]
        sel = idx[:, :, None, :, None].expand(B, Hkv, G, Kc, S)
        logits = full.view(B, Hkv, G, n_valid, S).gather(3, sel).view(B, Hkv, G, Kc * S)
    else:
        logits = (qg @ kg.transpose(-1, -2)) * scale  # [B,Hkv,G,Kc*S]
    cut = -n % S  # the newest page (last, pages ascending) has slots past n
    if cut:
        logits[..., Kc * S - cut:] = float("-inf")
    if keep_tokens:
        # ---- stage 3 (tokens): the K*S best single tokens, their logits and values
        return _attend_kept_tokens(q, v_cache, logits, Selection(idx, torch.ones_like(idx, dtype=torch.bool)), vl,
                                   S, K, sink_pages)
    final, slots = rank_candidates(logits, Selection(idx, torch.ones_like(idx, dtype=torch.bool)), vl, S, K,
                                   sink_pages)
    # ---- stage 3: softmax over the kept pages' logits, values of those pages only
    kept = logits.view(B, Hkv, G, Kc, S).gather(3, slots[:, :, None, :, None].expand(B, Hkv, G, slots.shape[-1], S))
    vg = _gather_pages_raw(v_cache, final.idx, S).view(B, Hkv, -1, D).float()  # [B,Hkv,K*S,D]
    out = softmax_attend(kept.reshape(B, Hkv, G, -1), vg)  # [B,Hkv,G,D]
    return out.reshape(B, Hq, 1, D).to(q.dtype)


def _sparse_decode_torch(q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask, scale,
                         spec: SelectionSpec) -> torch.Tensor:
    """Fast PyTorch path: matmul bound scan, top-k, page gather, exact attention.

    Host reads: one (``valid_len``'s min and max, fused with the mask's triviality) to pick the fast path.
    """
    page_size, token_budget, sink_pages = spec.page_size, spec.token_budget, spec.sink_pages
    keep_tokens = spec.keep_tokens
    B, Hq, _, D = q.shape
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    K = spec.n_pages
    n_first = spec.n_candidates
    two = n_first > K
    n_dense = spec.n_dense_pages  # a row of at most this many valid pages attends densely
    n, attn_mask = _uniform_len(valid_len, attn_mask, B)  # one host sync; n None when rows differ
    if n is not None and attn_mask is None and 0 < n:
        n = min(n, L)
        if (n + page_size - 1) // page_size <= n_dense:  # ---- dense: plain SDPA over the n valid tokens
            return _attend_grouped(q, k_cache[:, :, :n], v_cache[:, :, :n], scale)
        full_pages_only = L % page_size == 0 or n <= (L // page_size) * page_size  # newest page inside the cache
        if full_pages_only and k_cache.is_contiguous() and v_cache.is_contiguous():
            if not two:
                return _fast_sparse(q, k_cache, v_cache, kmax, kmin, kabs, n, scale, page_size, K, sink_pages)
            return _fast_two_stage(q, k_cache, v_cache, kmax, kmin, kabs, n, scale, page_size, K, sink_pages,
                                   n_first, keep_tokens)
    vl = _as_valid_len(valid_len, B, q.device)
    qg = q.float().reshape(B, Hkv, G, D)
    n_valid = ((vl + page_size - 1) // page_size).clamp(max=-(-L // page_size))  # [B]
    dense_row = n_valid <= n_dense  # [B]: every valid page fits in the budget or is a candidate
    if bool(dense_row.all()):  # ---- dense
        return attend_selection(q, k_cache, v_cache, None, vl, attn_mask, scale, page_size)
    if bool(dense_row.any()):  # ---- a mixed batch: the dense rows densely, the others through the sparse path
        d, sp = dense_row.nonzero().flatten(), (~dense_row).nonzero().flatten()
        m = attn_mask
        if m is not None:  # broadcastable to [B, Hq, 1, L]: one entry per row
            m = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape)).expand(B, -1, -1, -1)
        out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=q.device)
        out[d] = attend_selection(q[d], k_cache[d], v_cache[d], None, vl[d], None if m is None else m[d], scale,
                                  page_size)
        out[sp] = _sparse_decode_torch(q[sp], k_cache[sp], v_cache[sp], kmax[sp], kmin[sp], kabs[sp], vl[sp],
                                       None if m is None else m[sp], scale, spec)
        return out
    # ---- stage 1: bound scan and top-k (or top-cK candidates)
    bounds = PageBounds(kmax, kmin, kabs)
    scores = page_scores(q, bounds, scale, mask_page_max(attn_mask, B, Hq, L, page_size))  # [B,Hkv,P]
    sel = select_pages(scores, vl, page_size, token_budget, sink_pages, n_select=n_first)  # every row has more pages
    if not two:
        return attend_selection(q, k_cache, v_cache, sel, vl, attn_mask, scale, page_size)
    # ---- stage 2: exact logits over the candidates' keys pick K pages (or K*S tokens) by mass
    tok, tok_ok = _selected_tokens(sel, page_size, L, vl)  # [B,Hkv,T]
    kg = _gather_pages(k_cache, sel.idx, page_size)  # [B,Hkv,T,D]
    logits = (qg @ kg.transpose(-1, -2)) * scale
    logits = (logits + _gathered_mask(attn_mask, tok, B, Hq, L)).masked_fill(~tok_ok[:, :, None, :], float("-inf"))
    if keep_tokens:
        return _attend_kept_tokens(q, v_cache, logits, sel, vl.clamp(max=L), page_size, K, sink_pages)
    final, slots = rank_candidates(logits, sel, vl, page_size, K, sink_pages)
    Kc = sel.idx.shape[-1]
    lp = logits.reshape(B, Hkv, G, Kc, page_size)
    lp = lp.gather(3, slots[:, :, None, :, None].expand(B, Hkv, G, slots.shape[-1], page_size))
    keep = final.ok.repeat_interleave(page_size, -1)[:, :, None]
    logits = lp.reshape(B, Hkv, G, -1).masked_fill(~keep, float("-inf"))
    vg = _gather_pages(v_cache, final.idx, page_size)
    out = softmax_attend(logits, vg)
    return out.reshape(B, Hq, 1, D).to(q.dtype)


def attend_selection(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    sel: Optional[Selection],
    valid_len: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    scale: float,
    page_size: int,
) -> torch.Tensor:
    """Exact attention over the tokens of the selected pages (dense when ``sel`` is None).

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, 1, D]``.
    k_cache, v_cache : torch.Tensor
        ``[B, Hkv, L, D]``, read in place (GQA-native, no repeat).
    sel : Selection or None
        ``[B, Hkv, K]`` pages; None attends every valid token.
    valid_len : torch.Tensor
        int64 ``[B]`` (or one element).
    attn_mask : torch.Tensor, optional
        Bool or additive float, broadcastable to ``[B, Hq, 1, L]``.
    scale : float
    page_size : int

    Returns
    -------
    torch.Tensor
        ``[B, Hq, 1, D]``, dtype of ``q``.
    """
    B, Hq, _, D = q.shape
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    qg = q.float().reshape(B, Hkv, Hq // Hkv, D)
    vl = _as_valid_len(valid_len, B, q.device)
    if sel is None:
        T = min(int(vl.max()), L)
        tok = torch.arange(T, device=q.device).expand(B, Hkv, T)
        tok_ok = tok < vl.reshape(B, 1, 1)
        kg, vg = k_cache[:, :, :T].float(), v_cache[:, :, :T].float()
    else:
        tok, tok_ok = _selected_tokens(sel, page_size, L, vl)  # [B,Hkv,T]
        kg = _gather_pages(k_cache, sel.idx, page_size)  # [B,Hkv,T,D]
        vg = _gather_pages(v_cache, sel.idx, page_size)
    out = _attend(qg, kg, vg, tok_ok, _gathered_mask(attn_mask, tok, B, Hq, L), scale)  # [B,Hkv,G,D]
    return out.reshape(B, Hq, 1, D).to(q.dtype)


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
    """Run one implementation (``"native"``, ``"triton"`` or ``"torch"``; see :func:`resolve_kernel`), with
    ``spec``'s sizes bounded by the cache (:meth:`.SelectionSpec.for_cache`; the native kernel bounds them too)."""
    spec = spec.for_cache(k_cache.shape[2])
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
    return _sparse_decode_torch(q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, spec)


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
