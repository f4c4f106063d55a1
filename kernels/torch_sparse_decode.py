"""The PyTorch implementation of ``tinyserve::sparse_decode``, the twin of :mod:`.triton_sparse_decode`.

:func:`sparse_decode_torch` is the op's kernel on a device with no kernel of its own, and whenever the ``kernel``
argument asks for ``torch`` (:func:`.sparse_decode.resolve_kernel` chooses, :func:`.sparse_decode.run_kernel`
calls). It makes the selection of :mod:`.reference` (the same scores, the same ``topk`` sets) with fewer and cheaper
ops: one host read picks a fast path (no mask, one valid length, contiguous caches) that gathers whole pages in the
cache dtype; the general path handles masks, ragged lengths and batches that mix dense and sparse rows.
:func:`attend_selection` is the exact attention over a selection that this path and the policies
(:mod:`tinyserve_compile.policies`) share.
"""
from __future__ import annotations

from typing import Optional

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
from .spec import SelectionSpec, reads_every_key

__all__ = ["sparse_decode_torch", "attend_selection"]

#: up to this many (batch, KV head) pairs the CPU path loops over per-head GEMMs instead of bmm
_LOOP_MAX = 16


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


def sparse_decode_torch(q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask, scale,
                        spec: SelectionSpec) -> torch.Tensor:
    """Fast PyTorch path: matmul bound scan, top-k, page gather, exact attention.

    The arguments are those of :func:`.sparse_decode.sparse_decode` with the bounds unpacked; ``spec``'s sizes are
    bounded by the cache here (:meth:`.SelectionSpec.for_cache`, as the native and Triton kernels bound them at
    their entry); returns ``[B, Hq, 1, D]`` in the dtype of ``q``. Host reads: one (``valid_len``'s min and max,
    fused with the mask's triviality) to pick the fast path.
    """
    spec = spec.for_cache(k_cache.shape[2])
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
        out[sp] = sparse_decode_torch(q[sp], k_cache[sp], v_cache[sp], kmax[sp], kmin[sp], kabs[sp], vl[sp],
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
