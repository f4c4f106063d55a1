"""Page selection of the reference: the bound score, the top-K with forced pages, the two-stage refinement.

Part of :mod:`tinyserve_compile.kernels.reference` (the pure-PyTorch source of truth); the conventions are in its docstring.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .bounds import PageBounds, _as_valid_len, _paged, bounds_f32, page_bounds
from ..spec import SelectionSpec

class Selection(NamedTuple):
    """Pages chosen per KV head.

    Attributes
    ----------
    idx : torch.Tensor
        ``[B, Hkv, K]`` int64 page indices, ascending.
    ok : torch.Tensor
        ``[B, Hkv, K]`` bool, False where the slot holds no valid page (a row with
        fewer valid pages than ``K``).
    """

    idx: torch.Tensor
    ok: torch.Tensor


#: up to this many (batch, KV head) pairs, :func:`page_scores` loops over per-head GEMMs on CPU
_MM_LOOP_MAX = 16


def score_slack_factor(head_dim: int) -> float:
    """Relative rounding slack for a length-``head_dim`` fp32 dot product.

    Any fp32 evaluation of ``sum_i a_i*b_i`` is within
    ``gamma_D * sum_i |a_i*b_i|`` of the exact value, with ``gamma_D ~ D*2^-24``.
    The score and the logit it bounds are both such evaluations, so adding twice
    that (with room to spare) to the score keeps it an upper bound on any
    fp32-accumulated logit, whatever the summation order.
    """
    return 4.0 * (head_dim + 2) * 2.0**-24


def score_underflow_slack(head_dim: int) -> float:
    """Absolute slack covering gradual underflow in the fp32 score and logit.

    With subnormal results every product carries an absolute error of up to
    ``2^-150`` on top of the relative one, so tiny keys and queries could make the
    computed score fall below a (tiny) logit. ``(D + 2) * 2^-126`` (the smallest
    normal number times ``D + 2``) dwarfs those errors for any scale in
    ``[2^-20, 2^20]`` and is far below any logit that matters.
    """
    return (head_dim + 2) * 2.0**-126


def page_scores(
    q: torch.Tensor,
    bounds: PageBounds,
    scale: float,
    mask_pages: Optional[torch.Tensor] = None,
    group_reduce: bool = True,
) -> torch.Tensor:
    """Upper bound of the attention logit of every page.

    ``score[b, g, j] = max_{h in group g} (scale * (r_hj + slack_hj) + mask_max_hj)``
    with ``r_hj = sum_i max(q_hi*M_ji, q_hi*m_ji)``, computed as
    ``relu(q)@M + min(q,0)@m`` (the same sum, two small matmuls), and
    ``slack_hj = score_slack_factor(D) * |q_h|_1 * kabs_j + score_underflow_slack(D) / scale``.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, 1, D]`` query, any floating dtype (computed in fp32).
    bounds : PageBounds
        Bounds ``[B, Hkv, P, D]``, float32 or bfloat16 (computed in fp32).
    scale : float
        Softmax scale (> 0).
    mask_pages : torch.Tensor, optional
        ``[B, 1 or Hq, P]`` fp32, the max of the additive mask over each page
        (see :func:`mask_page_max`).
    group_reduce : bool
        Reduce over the GQA group (max). When False, returns ``[B, Hq, P]``.

    Returns
    -------
    torch.Tensor
        fp32 ``[B, Hkv, P]`` (or ``[B, Hq, P]``).
    """
    B, Hq, _, D = q.shape
    Hkv, P = bounds.kmax.shape[1], bounds.kmax.shape[2]
    G = Hq // Hkv
    # ---- stage 1: split the query by sign, one row per (batch, KV head)
    q32 = q.float().reshape(B * Hkv, G, D)
    qp, qn = q32.clamp(min=0), q32.clamp(max=0)  # [B*Hkv,G,D]
    kmax, kmin = bounds_f32(bounds)
    kmax, kmin = kmax.reshape(B * Hkv, P, D), kmin.reshape(B * Hkv, P, D)
    # ---- stage 2: slack, then the two bound matmuls accumulated onto it
    factor = score_slack_factor(D)
    base = score_underflow_slack(D) / (scale * factor)
    slack = torch.addcmul(q32.new_full((), base), q32.abs().sum(-1, keepdim=True), bounds.kabs.reshape(B * Hkv, 1, P))
    if B * Hkv <= _MM_LOOP_MAX and q32.device.type == "cpu":
        # a few heads: one addmm pair per head (CPU bmm nests its batch loop around
        # threaded GEMMs, which stalls badly when the cores are busy)
        r = torch.empty_like(slack)  # [B*Hkv,G,P]
        kmin_t, kmax_t = kmin.transpose(1, 2), kmax.transpose(1, 2)  # [B*Hkv,D,P] views
        for ri, si, qni, qpi, mi, Mi in zip(r.unbind(0), slack.unbind(0), qn.unbind(0), qp.unbind(0),
                                            kmin_t.unbind(0), kmax_t.unbind(0)):
            torch.addmm(si, qni, mi, beta=factor, out=ri)
            ri.addmm_(qpi, Mi)
    else:
        r = torch.baddbmm(slack, qn, kmin.transpose(1, 2), beta=factor)  # [B*Hkv,G,P]
        r = torch.baddbmm(r, qp, kmax.transpose(1, 2))
    s = r.mul_(scale).reshape(B, Hkv, G, P)
    # ---- stage 3: mask and GQA group max
    if mask_pages is not None:
        mp = mask_pages.float()
        if mp.shape[1] == 1:
            s = s + mp[:, :, None, :]
        else:
            s = s + mp.reshape(B, Hkv, G, P)
    if not group_reduce:
        return s.reshape(B, Hq, P)
    return s.amax(2)


def mask_page_max(attn_mask: Optional[torch.Tensor], batch: int, n_heads: int, length: int, page_size: int):
    """Max of the additive mask over each page.

    Parameters
    ----------
    attn_mask : torch.Tensor or None
        Broadcastable to ``[B, Hq, 1, L]``; bool (True = attend) or float.
    batch, n_heads, length, page_size : int
        ``B``, ``Hq``, ``L``, ``S``.

    Returns
    -------
    torch.Tensor or None
        fp32 ``[B, 1 or Hq, P]``: 0 / -inf for a boolean mask.
    """
    if attn_mask is None:
        return None
    m = attn_mask
    if m.dtype == torch.bool:
        m = torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill(~m, float("-inf"))
    m = m.float()
    while m.dim() < 4:
        m = m.unsqueeze(0)
    hm = m.shape[1]
    m = m.expand(batch, hm, 1, length)[:, :, 0, :]  # [B,Hm,L]
    return _paged(m.unsqueeze(-1), page_size, float("-inf")).squeeze(-1).amax(-1)


def select_pages(
    scores: torch.Tensor,
    valid_len: torch.Tensor,
    page_size: int,
    token_budget: int,
    sink_pages: int = 0,
    n_select: Optional[int] = None,
) -> Optional[Selection]:
    """Top-K pages per KV head, with the forced pages.

    Parameters
    ----------
    scores : torch.Tensor
        ``[B, Hkv, P]`` fp32, higher is more important.
    valid_len : torch.Tensor
        int64 ``[B]``.
    page_size, token_budget, sink_pages : int
        ``K = token_budget // page_size`` pages are kept.
    n_select : int, optional
        Override ``K`` (two-stage candidates).

    Returns
    -------
    Selection or None
        None when every valid page of every row fits in the budget (attend densely).
        The page holding the newest token and the first ``sink_pages`` pages score
        +inf; pages past ``valid_len`` score -inf and are never kept.
    """
    B, H, P = scores.shape
    K = token_budget // page_size if n_select is None else n_select
    vl = _as_valid_len(valid_len, B, scores.device)
    if int(((vl + page_size - 1) // page_size).max()) <= K:
        return None
    return top_pages(scores, vl, page_size, K, sink_pages)


def forced_pages(page: torch.Tensor, valid_len: torch.Tensor, page_size: int, sink_pages: int) -> torch.Tensor:
    """Which pages every selection keeps: the page holding each row's newest token and the first ``sink_pages``.

    Parameters
    ----------
    page : torch.Tensor
        int64 page indices ``[B or 1, H or 1, n]``.
    valid_len : torch.Tensor
        int64/int32 ``[B]``; a row of length 0 has no newest page.
    page_size, sink_pages : int

    Returns
    -------
    torch.Tensor
        Bool, ``page`` broadcast against ``[B, 1, 1]``.
    """
    newest = ((valid_len - 1) // page_size).reshape(-1, 1, 1)  # -1 for an empty row: no page
    return (page == newest) | (page < sink_pages)


def top_pages(scores: torch.Tensor, valid_len: torch.Tensor, page_size: int, n_select: int,
              sink_pages: int) -> Selection:
    """The ``n_select`` pages of highest score per KV head with the forced pages, and no host read.

    Parameters
    ----------
    scores : torch.Tensor
        ``[B, Hkv, P]`` fp32, higher is more important.
    valid_len : torch.Tensor
        int64/int32 ``[B]``.
    page_size, n_select, sink_pages : int

    Returns
    -------
    Selection
        ``[B, Hkv, min(n_select, P)]``, ascending. The forced pages (:func:`forced_pages`) score +inf;
        pages past ``valid_len`` score -inf and their slots are not ok.
    """
    B, H, P = scores.shape
    n_valid = ((valid_len + page_size - 1) // page_size).reshape(B, 1, 1)
    page = torch.arange(P, device=scores.device).reshape(1, 1, P)
    s = scores.masked_fill(forced_pages(page, valid_len, page_size, sink_pages), float("inf"))
    s = s.masked_fill(page >= n_valid, float("-inf"))
    top, idx = s.topk(min(n_select, P), dim=-1, sorted=False)
    idx, order = idx.sort(-1)
    ok = (top.gather(-1, order) > float("-inf")) & (idx < n_valid)
    return Selection(idx, ok)


def _selected_tokens(sel: Selection, page_size: int, length: int, valid_len: torch.Tensor):
    """Token positions ``[B,Hkv,K*S]`` (clamped) and their validity."""
    B, H, K = sel.idx.shape
    tok = sel.idx[..., None] * page_size + torch.arange(page_size, device=sel.idx.device)
    tok = tok.reshape(B, H, K * page_size)
    ok = sel.ok.repeat_interleave(page_size, dim=-1) & (tok < valid_len.reshape(B, 1, 1)) & (tok < length)
    return tok.clamp(max=length - 1), ok


def refine_candidates(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    cand: Selection,
    valid_len: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    scale: float,
    page_size: int,
    n_keep: int,
    sink_pages: int,
    keep_tokens: bool = False,
) -> Selection:
    """Second stage: keep the ``n_keep`` candidate pages (or, with ``keep_tokens``, single tokens) of highest
    true attention mass.

    Exact logits are computed over the candidates' keys (no values are read). A page's (token's) mass for
    query head ``h`` is its share of softmax mass among the candidates; the KV-head score is the max over
    the group (:func:`rank_candidates`, :func:`rank_candidate_tokens`). Forced pages (newest, sinks) stay.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, 1, D]``.
    k_cache : torch.Tensor
        ``[B, Hkv, L, D]``.
    cand : Selection
        ``[B, Hkv, Kc]`` candidate pages.
    valid_len : torch.Tensor
        int64 ``[B]``.
    attn_mask : torch.Tensor, optional
        As in :func:`sparse_decode_reference`.
    scale : float
    page_size, n_keep, sink_pages : int
    keep_tokens : bool
        Keep single tokens instead of whole pages.

    Returns
    -------
    Selection
        The kept pages ``[B, Hkv, n_keep]``, or the kept tokens ``[B, Hkv, n']`` as pages of one token.
    """
    vl = _as_valid_len(valid_len, q.shape[0], q.device)
    logits = _candidate_logits(q, k_cache, cand, vl, attn_mask, scale, page_size)  # [B,Hkv,G,Kc*S]
    if not keep_tokens:
        return rank_candidates(logits, cand, vl, page_size, n_keep, sink_pages)[0]
    # a valid length past the cache means every slot of it: no token beyond L is forced or kept
    return rank_candidate_tokens(logits, cand, vl.clamp(max=k_cache.shape[2]), page_size, n_keep, sink_pages)[0]


def _candidate_logits(q, k_cache, cand: Selection, vl, attn_mask, scale: float, page_size: int) -> torch.Tensor:
    """fp32 ``[B, Hkv, G, Kc*S]`` exact logits of the candidate pages' tokens, mask added, -inf where invalid."""
    B, Hq, _, D = q.shape
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    tok, tok_ok = _selected_tokens(cand, page_size, L, vl)  # [B,Hkv,Kc*S]
    kg = k_cache.gather(2, tok[..., None].expand(-1, -1, -1, D)).float()
    logits = (q.float().reshape(B, Hkv, Hq // Hkv, D) @ kg.transpose(-1, -2)) * scale  # [B,Hkv,G,Kc*S]
    logits = logits + _gathered_mask(attn_mask, tok, B, Hq, L)
    return logits.masked_fill(~tok_ok[:, :, None, :], float("-inf"))


def rank_candidates(logits, cand: Selection, valid_len, page_size: int, n_select: int, sink_pages: int):
    """Pick ``n_select`` of the candidate pages by their share of softmax mass.

    Parameters
    ----------
    logits : torch.Tensor
        ``[B, Hkv, G, Kc*S]`` fp32 masked logits of the candidates' tokens.
    cand : Selection
        ``[B, Hkv, Kc]``.
    valid_len : torch.Tensor
        int64 ``[B]``.

    Returns
    -------
    (Selection, torch.Tensor)
        As :func:`rank_candidate_pages`, which ranks the pages' log-sum-exp.
    """
    B, Hkv, G, _ = logits.shape
    page_lse = logits.reshape(B, Hkv, G, cand.idx.shape[-1], page_size).logsumexp(-1)  # [B,Hkv,G,Kc]
    return rank_candidate_pages(page_lse, cand, valid_len, page_size, n_select, sink_pages)


def rank_candidate_pages(page_lse, cand: Selection, valid_len, page_size: int, n_select: int, sink_pages: int):
    """Pick ``n_select`` of the candidate pages by their share of softmax mass, from each page's log-sum-exp.

    A page's share for query head ``h`` is ``exp(lse_hc - lse_h)`` over every candidate page; the KV-head
    score is the max over the group. The newest page and the sink pages are forced.

    Parameters
    ----------
    page_lse : torch.Tensor
        ``[B, Hkv, G, Kc]`` fp32 log-sum-exp of each candidate page's masked logits (-inf for no valid token).
    cand : Selection
        ``[B, Hkv, Kc]`` candidate pages.
    valid_len : torch.Tensor
        int64/int32 ``[B]``.

    Returns
    -------
    (Selection, torch.Tensor)
        The chosen pages ``[B, Hkv, n']`` (in candidate order: ascending when ``cand`` is) and their slots in
        ``cand`` ``[B, Hkv, n']`` int64, ``n' = min(n_select, Kc)``.
    """
    share = (page_lse - page_lse.logsumexp(-1, keepdim=True)).nan_to_num(nan=float("-inf")).amax(2)  # [B,Hkv,Kc]
    forced = forced_pages(cand.idx, valid_len, page_size, sink_pages)
    pos, kept = _top_share(share, forced, cand.ok, n_select)
    return Selection(cand.idx.gather(-1, pos), cand.ok.gather(-1, pos) & kept), pos


def _top_share(share, forced, ok, n_select: int):
    """The ``n_select`` slots of highest ``share`` ``[B, Hkv, T]`` fp32, ``forced`` slots first and never a slot
    that is not ``ok`` (both bool ``[B, Hkv, T]``): ``(slots ascending, kept)``, int64 and bool ``[B, Hkv, n']``;
    ``kept`` is False where a slot's share is -inf."""
    share = share.masked_fill(forced & ok, float("inf")).masked_fill(~ok, float("-inf"))
    top, pos = share.topk(min(n_select, share.shape[-1]), dim=-1, sorted=False)
    pos, order = pos.sort(-1)
    return pos, top.gather(-1, order) > float("-inf")


def _gathered_mask(attn_mask, tok, B, Hq, L):
    """The additive mask at the selected tokens: ``[B, Hkv, 1 or G, T]`` fp32 (0 if None)."""
    if attn_mask is None:
        return torch.zeros((), device=tok.device)
    m = attn_mask
    if m.dtype == torch.bool:
        m = torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill(~m, float("-inf"))
    while m.dim() < 4:
        m = m.unsqueeze(0)
    Hkv, T = tok.shape[1], tok.shape[2]
    hm = m.shape[1]
    m = m.float().expand(B, hm, 1, L)[:, :, 0, :]  # [B,Hm,L]
    if hm == 1:
        return m.gather(2, tok.reshape(B, 1, Hkv * T)).reshape(B, Hkv, 1, T)
    G = Hq // Hkv
    m = m.reshape(B, Hkv, G, L)
    return m.gather(3, tok[:, :, None, :].expand(B, Hkv, G, T))


def selected_token_mask(sel: Optional[Selection], page_size: int, length: int, valid_len) -> torch.Tensor:
    """Boolean ``[B, Hkv, L]``: True at the tokens that sparse attention reads."""
    if sel is None:
        raise ValueError("selected_token_mask: sel is None (dense); every valid token is read")
    B, H, _ = sel.idx.shape
    vl = _as_valid_len(valid_len, B, sel.idx.device)
    tok, ok = _selected_tokens(sel, page_size, length, vl)
    out = torch.zeros(B, H, length, dtype=torch.int32, device=sel.idx.device)
    return out.scatter_add_(2, tok, ok.to(torch.int32)) > 0  # clamped slots add 0


def rank_candidate_tokens(logits, cand: Selection, valid_len, page_size: int, n_select: int, sink_pages: int):
    """Pick ``n_select`` single tokens of the candidate pages by their share of softmax mass.

    A token's share for query head ``h`` is ``exp(l_ht - lse_h)`` over every candidate token; the KV-head
    score is the max over the group. The tokens of the newest page and of the sink pages are forced.

    Parameters
    ----------
    logits : torch.Tensor
        ``[B, Hkv, G, Kc*S]`` fp32 masked logits of the candidates' tokens (-inf past the valid ones).
    cand : Selection
        ``[B, Hkv, Kc]`` candidate pages.
    valid_len : torch.Tensor
        int64 ``[B]``.

    Returns
    -------
    (Selection, torch.Tensor)
        The kept tokens ``[B, Hkv, n']`` (in candidate order: ascending when ``cand`` is; a :class:`Selection`
        with pages of one token) and their slots in the candidates' token list ``[B, Hkv, n']`` int64,
        ``n' = min(n_select, Kc*S)``.
    """
    B, Hkv, G, T = logits.shape
    S = page_size
    tok = (cand.idx[..., None] * S + torch.arange(S, device=cand.idx.device)).reshape(B, Hkv, T)
    ok = cand.ok.repeat_interleave(S, dim=-1) & (tok < valid_len.reshape(B, 1, 1))
    share = (logits - logits.logsumexp(-1, keepdim=True)).nan_to_num(nan=float("-inf")).amax(2)  # [B,Hkv,T]
    pos, kept = _top_share(share, forced_pages(tok // S, valid_len, S, sink_pages), ok, n_select)
    return Selection(tok.gather(-1, pos), ok.gather(-1, pos) & kept), pos


def choose_with(score_fn, q, k_cache, valid_len, attn_mask, scale, spec: SelectionSpec):
    """Page selection around any page scorer: dense when every row's valid pages fit in the budget or are all
    candidates (:attr:`~tinyserve_compile.kernels.spec.SelectionSpec.n_dense_pages`; the scorer is then not called),
    else the top pages by ``score_fn()`` (fp32 ``[B, Hkv, P]``), refined in a second stage
    when ``spec.n_candidates`` exceeds ``K`` (:func:`refine_candidates`): whole pages or, with
    ``spec.keep_tokens``, single tokens.

    Returns ``(selection, unit)``: ``selection`` is None when attention is dense, else the kept pages
    (``unit = page_size``) or the kept tokens (``unit = 1``). Shapes as in :func:`.attend.sparse_decode_reference`;
    ``spec`` is a :class:`~tinyserve_compile.kernels.spec.SelectionSpec`.
    """
    B, S = q.shape[0], spec.page_size
    K = spec.n_pages
    vl = _as_valid_len(valid_len, B, q.device)
    n_valid = ((vl + S - 1) // S).clamp(max=-(-k_cache.shape[2] // S))  # [B]: a length past the cache counts as L
    if int(n_valid.max()) <= spec.n_dense_pages:
        return None, S
    scores = score_fn()
    n1 = spec.n_candidates
    if n1 <= K:
        return select_pages(scores, vl, S, spec.token_budget, spec.sink_pages), S
    cand = select_pages(scores, vl, S, spec.token_budget, spec.sink_pages, n_select=n1)  # some row has more pages
    keep = spec.keep_tokens
    sel = refine_candidates(q, k_cache, cand, vl, attn_mask, scale, S, K * S if keep else K, spec.sink_pages, keep)
    all_cand = n_valid <= n1  # [B]: rows whose valid pages are all candidates attend densely
    if bool(all_cand.any()):
        sel = with_dense_rows(sel, cand, all_cand, vl, S, k_cache.shape[2], keep)
    return sel, 1 if keep else S


def with_dense_rows(sel: Selection, cand: Selection, dense_rows: torch.Tensor, valid_len: torch.Tensor,
                    page_size: int, length: int, tokens: bool) -> Selection:
    """The two-stage selection as a mask over the candidates, with the rows ``dense_rows`` keeping all of them.

    A row whose valid pages number at most ``N1`` has every valid page among its candidates; it attends every
    valid token (:attr:`~tinyserve_compile.kernels.spec.SelectionSpec.n_dense_pages`), in a batch whose other
    rows are two-stage. Every row's list is its candidates (pages, or their tokens), each once and ascending; the
    other rows mark the ones ``sel`` keeps.

    Parameters
    ----------
    sel : Selection
        The refined selection ``[B, Hkv, n]``: ``K`` pages, or (``tokens``) ``K*S`` single tokens.
    cand : Selection
        The candidate pages ``[B, Hkv, Kc]``, ascending.
    dense_rows : torch.Tensor
        bool ``[B]``.
    valid_len : torch.Tensor
        int64 ``[B]``.
    page_size, length : int
        ``S`` and the cache length ``L``.
    tokens : bool
        ``sel`` holds single tokens (then the result is ``[B, Hkv, Kc*S]`` tokens), else pages (``[B, Hkv, Kc]``).

    Returns
    -------
    Selection
        Ascending indices with their ok flags.
    """
    if tokens:
        _, every = _selected_tokens(cand, page_size, length, valid_len)  # [B,Hkv,Kc*S]
        idx = (cand.idx[..., None] * page_size + torch.arange(page_size, device=cand.idx.device)).flatten(2)
        units = length
    else:
        idx, every = cand.idx, cand.ok
        units = -(-length // page_size)
    B, H, _ = idx.shape
    member = torch.zeros(B, H, units, dtype=torch.int32, device=idx.device)
    member = member.scatter_add_(2, sel.idx.clamp(max=units - 1), sel.ok.to(torch.int32)) > 0  # [B,Hkv,units]
    kept = every & member.gather(2, idx.clamp(max=units - 1))
    return Selection(idx, torch.where(dense_rows.reshape(B, 1, 1), every, kept))


def choose(q, k_cache, bounds, valid_len, attn_mask, scale, spec: SelectionSpec):
    """Full query-aware selection: :func:`choose_with` the bound of :func:`page_scores` (mask included)."""
    B, Hq = q.shape[0], q.shape[1]
    L = k_cache.shape[2]
    return choose_with(lambda: page_scores(q, bounds, scale, mask_page_max(attn_mask, B, Hq, L, spec.page_size)), q,
                       k_cache, valid_len, attn_mask, scale, spec)


def choose_pages(q, k_cache, bounds, valid_len, attn_mask, scale, spec: SelectionSpec) -> Optional[Selection]:
    """:func:`choose` keeping whole pages (``spec.keep_tokens`` ignored): the kept pages, or None when dense."""
    return choose(q, k_cache, bounds, valid_len, attn_mask, scale, spec.replace(keep_tokens=False))[0]
