"""The ``tinyserve::sparse_decode`` op: query-aware paged sparse decode attention.

Layout (Liger-Kernel style): :func:`_sparse_decode_torch` is the fast PyTorch
path (CPU, or any device without Triton), :func:`sparse_decode` is the Python
launcher that validates and dispatches, and ``torch.ops.tinyserve.sparse_decode``
is the registered op with a real fake implementation. The reference in
:mod:`.reference` is the source of truth for all of them.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch
import torch.nn.functional as F

from .reference import (
    BOUNDS_DTYPES,
    PageBounds,
    Selection,
    _as_valid_len,
    _gathered_mask,
    _selected_tokens,
    candidate_pages,
    mask_page_max,
    page_scores,
    rank_candidate_tokens,
    rank_candidates,
    select_pages,
    softmax_attend,
)

__all__ = ["sparse_decode", "sparse_decode_impl", "attend_selection", "check_decode_inputs", "KERNELS"]

KERNELS = ("auto", "native", "torch", "triton")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: up to this many (batch, KV head) pairs the CPU path loops over per-head GEMMs instead of bmm
_LOOP_MAX = 16


def check_decode_inputs(
    q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, page_size, token_budget, sink_pages,
    candidate_factor, kernel="auto", candidate_extra=0, keep_tokens=False,
) -> None:
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
    if not isinstance(page_size, int) or page_size <= 0:
        bad("page_size", f"must be a positive int, got {page_size!r}")
    if not isinstance(token_budget, int) or token_budget < page_size:
        bad("token_budget", f"must be an int of at least one page ({page_size} tokens), got {token_budget!r}")
    K = token_budget // page_size
    if not isinstance(sink_pages, int) or not 0 <= sink_pages < K:
        bad("sink_pages", f"must be an int in [0, {K}) (fewer than the pages in the budget), got {sink_pages!r}")
    if not isinstance(candidate_factor, int) or candidate_factor < 1:
        bad("candidate_factor", f"must be an int >= 1, got {candidate_factor!r}")
    if not isinstance(candidate_extra, int) or isinstance(candidate_extra, bool) or candidate_extra < 0:
        bad("candidate_extra", f"must be an int >= 0 (tokens), got {candidate_extra!r}")
    if not isinstance(keep_tokens, bool):
        bad("keep_tokens", f"must be a bool, got {keep_tokens!r}")
    if not isinstance(scale, (int, float)) or not scale > 0 or not math.isfinite(scale):
        bad("scale", f"must be a finite float > 0, got {scale!r}")
    if kernel not in KERNELS:
        bad("kernel", f"must be one of {KERNELS}, got {kernel!r}")
    P = (L + page_size - 1) // page_size
    for name, t, shape in (("kmax", kmax, (B, Hkv, P, D)), ("kmin", kmin, (B, Hkv, P, D)), ("kabs", kabs, (B, Hkv, P))):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            bad(name, f"must be a tensor of shape {shape} (page_size={page_size}), got {got}")
        want = (torch.float32,) if name == "kabs" else BOUNDS_DTYPES
        if t.dtype not in want:
            bad(name, f"must be one of {want} (bf16/int8 bounds are stored rounded outward), got {t.dtype}")
    if kmin.dtype != kmax.dtype:
        bad("kmin", f"must have the dtype of kmax ({kmax.dtype}), got {kmin.dtype}")
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


def _uniform_len(valid_len: torch.Tensor, batch: int):
    """``int(valid_len)`` when every batch row has the same length, else None (one host sync).

    ``valid_len``: int64/int32 ``[B]`` or ``[1]``.
    """
    if valid_len.numel() == 1:
        return int(valid_len.reshape(()))
    lo_hi = torch.aminmax(valid_len.reshape(-1))
    lo, hi = int(lo_hi.min), int(lo_hi.max)
    return lo if lo == hi else None


def _select_uniform(scores: torch.Tensor, n: int, page_size: int, K: int, sink_pages: int) -> torch.Tensor:
    """:func:`.reference.select_pages` for rows that share one valid length, in place on ``scores``.

    Parameters
    ----------
    scores : torch.Tensor
        ``[B, Hkv, P]`` fp32 page scores (overwritten: forced pages +inf, pages past
        the valid length -inf, exactly the values ``select_pages`` builds).
    n : int
        The shared valid length, with ``ceil(n / page_size) > K``.

    Returns
    -------
    torch.Tensor
        int64 ``[B, Hkv, K]`` page indices, in ``topk`` order (the same set as
        ``select_pages``; every slot is a valid page since more than ``K`` exist).
    """
    n_valid = (n + page_size - 1) // page_size
    scores[..., n_valid:] = float("-inf")
    scores[..., (n - 1) // page_size] = float("inf")
    if sink_pages:
        scores[..., :sink_pages] = float("inf")
    return scores.topk(min(K, scores.shape[-1]), dim=-1, sorted=False).indices


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
    idx = _select_uniform(scores, n, page_size, K, sink_pages).sort(-1).values  # [B,Hkv,K] ascending
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
    vg = v_cache.gather(2, final.idx[..., None].expand(-1, -1, -1, D)).float()  # [B,Hkv,T,D]
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
        idx = _select_uniform(scores, n, S, n_cand, sink_pages).sort(-1).values  # [B,Hkv,Kc]
        kg = None if 2 * idx.shape[-1] >= n_valid else _gather_pages_raw(k_cache, idx, S).view(B, Hkv, -1, D).float()
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


def _sparse_decode_torch(
    q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, page_size, token_budget, sink_pages,
    candidate_factor, candidate_extra=0, keep_tokens=False,
) -> torch.Tensor:
    """Fast PyTorch path: matmul bound scan, top-k, page gather, exact attention."""
    B, Hq, _, D = q.shape
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    K = token_budget // page_size
    n_first = candidate_pages(page_size, token_budget, candidate_factor, candidate_extra)
    two = n_first > K
    n = _uniform_len(valid_len, B)  # one host sync; None when rows differ
    if n is not None and attn_mask is None and 0 < n:
        n = min(n, L)
        if (n + page_size - 1) // page_size <= K:  # ---- dense fit: plain SDPA over the n valid tokens
            return _attend_grouped(q, k_cache[:, :, :n], v_cache[:, :, :n], scale)
        full_pages_only = L % page_size == 0 or n <= (L // page_size) * page_size  # newest page inside the cache
        if full_pages_only and k_cache.is_contiguous() and v_cache.is_contiguous():
            if not two:
                return _fast_sparse(q, k_cache, v_cache, kmax, kmin, kabs, n, scale, page_size, K, sink_pages)
            return _fast_two_stage(q, k_cache, v_cache, kmax, kmin, kabs, n, scale, page_size, K, sink_pages,
                                   n_first, keep_tokens)
    vl = _as_valid_len(valid_len, B, q.device)
    qg = q.float().reshape(B, Hkv, G, D)
    n_valid = (vl + page_size - 1) // page_size
    if int(n_valid.max()) <= K:  # ---- dense: every valid page fits in the budget
        return attend_selection(q, k_cache, v_cache, None, vl, attn_mask, scale, page_size)
    # ---- stage 1: bound scan and top-k (or top-cK candidates)
    bounds = PageBounds(kmax, kmin, kabs)
    scores = page_scores(q, bounds, scale, mask_page_max(attn_mask, B, Hq, L, page_size))  # [B,Hkv,P]
    sel = select_pages(scores, vl, page_size, token_budget, sink_pages, n_select=n_first)
    if sel is None:  # candidates cover every valid page
        P = scores.shape[-1]
        idx = torch.arange(P, device=q.device).expand(B, Hkv, P).contiguous()
        sel = Selection(idx, idx < n_valid.reshape(B, 1, 1))
    if two:
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
    return attend_selection(q, k_cache, v_cache, sel, vl, attn_mask, scale, page_size)


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


def _triton_allowed(q: torch.Tensor) -> bool:
    return q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def sparse_decode_impl(q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, page_size, token_budget, sink_pages,
         candidate_factor, kernel, candidate_extra=0, keep_tokens=False):
    args = (q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, page_size, token_budget, sink_pages,
            candidate_factor)
    if kernel == "native" or (kernel == "auto" and q.device.type == "cpu"):
        # ---- the native C++ kernel: the CPU default when it builds (else the PyTorch path below)
        from .native import load_native, native_unavailable_reason

        if kernel == "native" and q.device.type != "cpu":
            raise ValueError(f"sparse_decode: argument 'kernel'='native' runs on CPU tensors only, got {q.device}")
        if load_native():
            return torch.ops.tinyserve_native.sparse_decode(*args, None, candidate_extra, keep_tokens)
        if kernel == "native":
            raise ValueError(f"sparse_decode: argument 'kernel'='native' but the native kernel is unavailable: "
                             f"{native_unavailable_reason()}")
        return _sparse_decode_torch(*args, candidate_extra, keep_tokens)
    use_triton = kernel == "triton" or (kernel == "auto" and q.is_cuda)
    if use_triton:
        if not _triton_allowed(q):
            raise ValueError(
                "sparse_decode: argument 'kernel'='triton' needs CUDA tensors, or TRITON_INTERPRET=1 to run the "
                f"Triton interpreter on {q.device}"
            )
        from .triton_sparse_decode import sparse_decode_triton, triton_available

        if triton_available():
            return sparse_decode_triton(*args, candidate_extra, keep_tokens)
        if kernel == "triton":
            raise ValueError("sparse_decode: argument 'kernel'='triton' but triton is not installed")
    return _sparse_decode_torch(*args, candidate_extra, keep_tokens)


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
    page_size: int,
    token_budget: int,
    sink_pages: int,
    candidate_factor: int,
    kernel: str,
    candidate_extra: int = 0,
    keep_tokens: bool = False,
) -> torch.Tensor:
    return sparse_decode_impl(q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, page_size, token_budget,
                sink_pages, candidate_factor, kernel, candidate_extra, keep_tokens)


@_sparse_decode_op.register_fake
def _(q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, page_size, token_budget, sink_pages,
      candidate_factor, kernel, candidate_extra=0, keep_tokens=False):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def sparse_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    bounds: PageBounds,
    valid_len,
    attn_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    page_size: int = 16,
    token_budget: int = 2048,
    sink_pages: int = 0,
    candidate_factor: int = 1,
    kernel: str = "auto",
    candidate_extra: int = 0,
    keep_tokens: bool = False,
) -> torch.Tensor:
    """Exact attention of one decode token over the query-aware selected pages.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, 1, D]``, float32/float16/bfloat16.
    k_cache, v_cache : torch.Tensor
        ``[B, Hkv, L, D]``, dtype of ``q``; read in place (never repeated for GQA).
    bounds : PageBounds
        Page bounds of ``k_cache`` (``kmax``/``kmin`` ``[B, Hkv, P, D]`` float32, bfloat16 or int8,
        ``kabs`` fp32 ``[B, Hkv, P]``), e.g. from :func:`.bounds.allocate_bounds`.
    valid_len : torch.Tensor or int
        int64 ``[B]`` or ``[1]``: tokens ``>= valid_len`` are absent.
    attn_mask : torch.Tensor, optional
        Bool (True = attend) or additive float, broadcastable to ``[B, Hq, 1, L]``.
    scale : float, optional
        Defaults to ``1/sqrt(D)``.
    page_size, token_budget, sink_pages, candidate_factor : int
        Selection knobs; see :mod:`.reference`.
    kernel : {"auto", "native", "torch", "triton"}
        "auto" picks Triton on CUDA, the native C++ kernel on CPU when it builds
        (:func:`.native.load_native`), and the PyTorch path otherwise.
    candidate_extra : int
        Extra candidate tokens of the two-stage selection (:func:`.reference.candidate_pages`).
    keep_tokens : bool
        Two-stage: keep single tokens instead of whole pages (:func:`.reference.rank_candidate_tokens`).

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
    check_decode_inputs(q, k_cache, v_cache, *bounds, valid_len, attn_mask, scale, page_size, token_budget,
                        sink_pages, candidate_factor, kernel, candidate_extra, keep_tokens)
    return torch.ops.tinyserve.sparse_decode(q, k_cache, v_cache, *bounds, valid_len, attn_mask, float(scale),
                                             page_size, token_budget, sink_pages, candidate_factor, kernel,
                                             candidate_extra, keep_tokens)
