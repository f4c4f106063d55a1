"""Pure-PyTorch reference for query-aware paged sparse decode.

This module is the single source of truth for the algorithm. Every fast path
(the CPU op in :mod:`sparse_decode`, the Triton kernel) is tested against it.

The algorithm (TinyServe, arXiv 2509.12211; Quest, ICML 2024):

1. Split the key cache into pages of ``page_size`` tokens and keep, per page and
   channel, the max ``M`` and min ``m`` of the keys.
2. Score page ``j`` for query ``q`` with ``r_j = sum_i max(q_i*M_ji, q_i*m_ji)``,
   an upper bound on ``max_{k in page j} q.k``. Under GQA the score of a KV-head
   page is the max over the group's query heads (the max of bounds is a bound).
3. Keep the top ``token_budget // page_size`` pages (always the newest page and
   the ``sink_pages`` first pages), and attend exactly over their tokens.
4. Optionally two-stage: keep ``N1 = candidate_factor * K + candidate_extra // page_size``
   candidate pages by the bound, compute their exact logits (no values read), and keep
   by true softmax share (max over the GQA group) either ``K`` whole pages or, with
   ``keep_tokens``, the ``K * page_size`` single tokens of highest share.

Conventions used throughout
---------------------------
* ``q``: ``[B, Hq, 1, D]``; ``k_cache``, ``v_cache``: ``[B, Hkv, L, D]`` with
  ``Hq % Hkv == 0``; query head ``h`` reads KV head ``h // (Hq // Hkv)``.
* ``valid_len``: int64 ``[B]`` (or one element, broadcast): tokens at positions
  ``>= valid_len[b]`` do not exist for batch row ``b``.
* ``attn_mask``: optional, broadcastable to ``[B, Hq, 1, L]``; boolean
  (True = attend) or additive float, as in ``F.scaled_dot_product_attention``.
* Page bounds are computed in fp32 (exact for fp16/bf16/fp32 keys) and stored
  either as fp32 or, compactly, as bf16 rounded *outward* (max rounded up, min
  rounded down): the stored box contains the true one, so a score computed from
  it is still an upper bound on every logit of the page. ``kabs`` stays fp32 and
  is taken from the stored values.
* int8 bounds (:func:`int8_bounds_step`): one signed byte per channel on a per-page grid
  of ``step = max(kabs / 126, 2^-126)`` with ``kabs`` the page's exact max ``|k|``;
  the max is rounded up and the min down to the grid (codes in ``[-127, 127]``), and
  every reader decodes ``code * step`` in fp32, the writer having checked that product.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

__all__ = [
    "PageBounds",
    "Selection",
    "BOUNDS_DTYPES",
    "round_up_bf16",
    "round_down_bf16",
    "store_bounds",
    "num_pages",
    "page_bounds",
    "score_slack_factor",
    "score_underflow_slack",
    "page_scores",
    "mask_page_max",
    "select_pages",
    "refine_by_page_mass",
    "selected_token_mask",
    "sparse_decode_reference",
    "softmax_attend",
    "rank_candidates",
    "choose_pages",
    "choose",
    "choose_with",
    "candidate_pages",
    "rank_candidate_tokens",
    "refine_by_token_mass",
    "int8_bounds_step",
    "bounds_f32",
    "bounds_itemsize",
]


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


#: storage dtypes of ``kmax``/``kmin``
BOUNDS_DTYPES = (torch.float32, torch.bfloat16, torch.int8)

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
    n_valid = (vl + page_size - 1) // page_size  # [B]
    if int(n_valid.max()) <= K:
        return None
    page = torch.arange(P, device=scores.device)
    valid = page[None, :] < n_valid[:, None]  # [B,P]
    forced = (page[None, :] == (vl[:, None] - 1) // page_size) | (page[None, :] < sink_pages)
    s = scores.masked_fill(forced[:, None, :], float("inf"))
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    top, idx = s.topk(min(K, P), dim=-1, sorted=False)
    idx, order = idx.sort(-1)
    ok = top.gather(-1, order) > float("-inf")
    ok = ok & (idx < n_valid[:, None, None])
    return Selection(idx, ok)


def _selected_tokens(sel: Selection, page_size: int, length: int, valid_len: torch.Tensor):
    """Token positions ``[B,Hkv,K*S]`` (clamped) and their validity."""
    B, H, K = sel.idx.shape
    tok = sel.idx[..., None] * page_size + torch.arange(page_size, device=sel.idx.device)
    tok = tok.reshape(B, H, K * page_size)
    ok = sel.ok.repeat_interleave(page_size, dim=-1) & (tok < valid_len.reshape(B, 1, 1)) & (tok < length)
    return tok.clamp(max=length - 1), ok


def refine_by_page_mass(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    cand: Selection,
    valid_len: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    scale: float,
    page_size: int,
    n_select: int,
    sink_pages: int,
) -> Selection:
    """Second stage: keep the ``n_select`` candidate pages of highest true attention mass.

    Exact logits are computed over the candidates' keys (no values are read). A
    page's mass for query head ``h`` is its share of softmax mass among the
    candidates; the KV-head score is the max over the group. Forced pages
    (newest, sinks) stay.

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
    page_size, n_select, sink_pages : int

    Returns
    -------
    Selection
        ``[B, Hkv, n_select]``.
    """
    vl = _as_valid_len(valid_len, q.shape[0], q.device)
    logits = _candidate_logits(q, k_cache, cand, vl, attn_mask, scale, page_size)  # [B,Hkv,G,Kc*S]
    return rank_candidates(logits, cand, vl, page_size, n_select, sink_pages)[0]


def _candidate_logits(q, k_cache, cand: Selection, vl, attn_mask, scale: float, page_size: int) -> torch.Tensor:
    """fp32 ``[B, Hkv, G, Kc*S]`` exact logits of the candidate pages' tokens, mask added, -inf where invalid."""
    B, Hq, _, D = q.shape
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    tok, tok_ok = _selected_tokens(cand, page_size, L, vl)  # [B,Hkv,Kc*S]
    kg = k_cache.gather(2, tok[..., None].expand(-1, -1, -1, D)).float()
    logits = (q.float().reshape(B, Hkv, Hq // Hkv, D) @ kg.transpose(-1, -2)) * scale  # [B,Hkv,G,Kc*S]
    logits = logits + _gathered_mask(attn_mask, tok, B, Hq, L)
    return logits.masked_fill(~tok_ok[:, :, None, :], float("-inf"))


def refine_by_token_mass(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    cand: Selection,
    valid_len: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    scale: float,
    page_size: int,
    n_tokens: int,
    sink_pages: int,
) -> Selection:
    """Second stage keeping single tokens: the ``n_tokens`` candidate tokens of highest softmax share.

    As :func:`refine_by_page_mass` (exact logits over the candidates' keys, no values read), ranked by
    :func:`rank_candidate_tokens`. Returns the kept tokens ``[B, Hkv, n']`` as a :class:`Selection` of
    pages of one token.
    """
    vl = _as_valid_len(valid_len, q.shape[0], q.device)
    logits = _candidate_logits(q, k_cache, cand, vl, attn_mask, scale, page_size)  # [B,Hkv,G,Kc*S]
    # a valid length past the cache means every slot of it: no token beyond L is forced or kept
    return rank_candidate_tokens(logits, cand, vl.clamp(max=k_cache.shape[2]), page_size, n_tokens, sink_pages)[0]


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
        The chosen pages ``[B, Hkv, n_select]`` (ascending) and their slots in
        ``cand`` ``[B, Hkv, n_select]`` int64.
    """
    B, Hkv, G, _ = logits.shape
    Kc = cand.idx.shape[-1]
    page_lse = logits.reshape(B, Hkv, G, Kc, page_size).logsumexp(-1)  # [B,Hkv,G,Kc]
    total = page_lse.logsumexp(-1, keepdim=True)
    share = (page_lse - total).nan_to_num(nan=float("-inf")).amax(2)  # [B,Hkv,Kc]
    forced = (cand.idx == ((valid_len - 1) // page_size).reshape(B, 1, 1)) | (cand.idx < sink_pages)
    share = share.masked_fill(forced & cand.ok, float("inf")).masked_fill(~cand.ok, float("-inf"))
    top, pos = share.topk(min(n_select, Kc), dim=-1, sorted=False)
    pos, order = pos.sort(-1)  # candidate slots ascending = pages ascending
    top = top.gather(-1, order)
    idx = cand.idx.gather(-1, pos)
    ok = cand.ok.gather(-1, pos) & (top > float("-inf"))
    return Selection(idx, ok), pos


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


def candidate_pages(page_size: int, token_budget: int, candidate_factor: int = 1, candidate_extra: int = 0) -> int:
    """Number of candidate pages of the first stage: ``candidate_factor * K + candidate_extra // page_size``
    with ``K = token_budget // page_size``; two-stage when it exceeds ``K``."""
    K = token_budget // page_size
    return max(1, int(candidate_factor)) * K + max(0, int(candidate_extra)) // page_size


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
        The kept tokens ``[B, Hkv, n']`` (ascending; a :class:`Selection` with pages of one token) and their
        slots in the candidates' token list ``[B, Hkv, n']`` int64, ``n' = min(n_select, Kc*S)``.
    """
    B, Hkv, G, T = logits.shape
    S = page_size
    tok = (cand.idx[..., None] * S + torch.arange(S, device=cand.idx.device)).reshape(B, Hkv, T)
    ok = cand.ok.repeat_interleave(S, dim=-1) & (tok < valid_len.reshape(B, 1, 1))
    share = (logits - logits.logsumexp(-1, keepdim=True)).nan_to_num(nan=float("-inf")).amax(2)  # [B,Hkv,T]
    forced = (tok // S == ((valid_len - 1) // S).reshape(B, 1, 1)) | (tok < sink_pages * S)
    share = share.masked_fill(forced & ok, float("inf")).masked_fill(~ok, float("-inf"))
    top, pos = share.topk(min(n_select, T), dim=-1, sorted=False)
    pos, order = pos.sort(-1)  # slots ascending = tokens ascending (candidate pages are ascending)
    top = top.gather(-1, order)
    return Selection(tok.gather(-1, pos), ok.gather(-1, pos) & (top > float("-inf"))), pos


def choose_with(
    score_fn, q, k_cache, valid_len, attn_mask, scale, page_size, token_budget, sink_pages=0, candidate_factor=1,
    candidate_extra=0, keep_tokens=False,
):
    """Page selection around any page scorer: dense when every valid page fits in the budget (the scorer is
    then not called), else the top pages by ``score_fn()`` (fp32 ``[B, Hkv, P]``), refined in a second stage
    when :func:`candidate_pages` exceeds ``K``: whole pages (:func:`refine_by_page_mass`) or, with
    ``keep_tokens``, single tokens (:func:`refine_by_token_mass`).

    Returns ``(selection, unit)``: ``selection`` is None when attention is dense, else the kept pages
    (``unit = page_size``) or the kept tokens (``unit = 1``). Shapes as in :func:`sparse_decode_reference`.
    """
    B, S = q.shape[0], page_size
    K = token_budget // S
    vl = _as_valid_len(valid_len, B, q.device)
    n_valid = (vl + S - 1) // S
    if int(n_valid.max()) <= K:
        return None, S
    scores = score_fn()
    n1 = candidate_pages(S, token_budget, candidate_factor, candidate_extra)
    if n1 <= K:
        return select_pages(scores, vl, S, token_budget, sink_pages), S
    cand = select_pages(scores, vl, S, token_budget, sink_pages, n_select=n1)
    if cand is None:  # the candidates cover every valid page: rank them all
        P = scores.shape[-1]
        idx = torch.arange(P, device=q.device).expand(B, scores.shape[1], P)
        cand = Selection(idx.contiguous(), (idx < n_valid.reshape(B, 1, 1)))
    if not keep_tokens:
        return refine_by_page_mass(q, k_cache, cand, vl, attn_mask, scale, S, K, sink_pages), S
    return refine_by_token_mass(q, k_cache, cand, vl, attn_mask, scale, S, K * S, sink_pages), 1


def choose(
    q, k_cache, bounds, valid_len, attn_mask, scale, page_size, token_budget, sink_pages=0, candidate_factor=1,
    candidate_extra=0, keep_tokens=False,
):
    """Full query-aware selection: :func:`choose_with` the bound of :func:`page_scores` (mask included)."""
    B, Hq = q.shape[0], q.shape[1]
    L = k_cache.shape[2]
    return choose_with(lambda: page_scores(q, bounds, scale, mask_page_max(attn_mask, B, Hq, L, page_size)), q,
                       k_cache, valid_len, attn_mask, scale, page_size, token_budget, sink_pages, candidate_factor,
                       candidate_extra, keep_tokens)


def choose_pages(
    q, k_cache, bounds, valid_len, attn_mask, scale, page_size, token_budget, sink_pages=0, candidate_factor=1,
    candidate_extra=0,
) -> Optional[Selection]:
    """:func:`choose` keeping whole pages: the kept pages, or None when attention is dense."""
    return choose(q, k_cache, bounds, valid_len, attn_mask, scale, page_size, token_budget, sink_pages,
                  candidate_factor, candidate_extra, False)[0]


def sparse_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    valid_len,
    attn_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    page_size: int = 16,
    token_budget: int = 2048,
    sink_pages: int = 0,
    candidate_factor: int = 1,
    bounds: Optional[PageBounds] = None,
    candidate_extra: int = 0,
    keep_tokens: bool = False,
) -> torch.Tensor:
    """Sparse decode attention, written for clarity: dense SDPA with a token mask.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, 1, D]``.
    k_cache, v_cache : torch.Tensor
        ``[B, Hkv, L, D]``, same dtype as ``q``.
    valid_len : torch.Tensor or int
        int64 ``[B]``.
    attn_mask : torch.Tensor, optional
        Broadcastable to ``[B, Hq, 1, L]``, bool or additive float.
    scale : float, optional
        Defaults to ``1/sqrt(D)`` as in SDPA.
    page_size, token_budget, sink_pages, candidate_factor : int
        Selection knobs (see :func:`select_pages`, :func:`refine_by_page_mass`).
    bounds : PageBounds, optional
        Defaults to :func:`page_bounds` over all ``L`` slots.
    candidate_extra : int
        Extra candidate tokens of the two-stage selection (see :func:`candidate_pages`).
    keep_tokens : bool
        Two-stage: keep single tokens (:func:`rank_candidate_tokens`) instead of whole pages.

    Returns
    -------
    torch.Tensor
        ``[B, Hq, 1, D]``, dtype of ``q``.
    """
    B, Hq, _, D = q.shape
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    vl = _as_valid_len(valid_len, B, q.device)
    if bounds is None:
        bounds = page_bounds(k_cache, page_size)
    sel, unit = choose(q, k_cache, bounds, vl, attn_mask, scale, page_size, token_budget, sink_pages,
                       candidate_factor, candidate_extra, keep_tokens)
    keep = torch.arange(L, device=q.device)[None, None, :] < vl[:, None, None]  # [B,1,L]
    if sel is not None:
        keep = keep & selected_token_mask(sel, unit, L, vl)  # [B,Hkv,L]
    keep = keep.expand(B, Hkv, L).repeat_interleave(G, dim=1)[:, :, None, :]  # [B,Hq,1,L]
    add = torch.zeros(B, Hq, 1, L, dtype=torch.float32, device=q.device).masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        m = attn_mask
        if m.dtype == torch.bool:
            m = torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill(~m, float("-inf"))
        add = add + m.float()
    k = k_cache.float().repeat_interleave(G, dim=1)
    v = v_cache.float().repeat_interleave(G, dim=1)
    logits = (q.float() @ k.transpose(-1, -2)) * scale + add  # [B,Hq,1,L]
    return softmax_attend(logits, v).to(q.dtype)


def softmax_attend(logits: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``softmax(logits) @ v`` in fp32; a row with no finite logit gives zeros, as SDPA does.

    Parameters
    ----------
    logits : torch.Tensor
        ``[..., T]`` fp32.
    v : torch.Tensor
        ``[..., T, D]`` fp32.
    """
    m = logits.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(logits - m)
    den = p.sum(-1, keepdim=True)
    return (p @ v) / torch.where(den > 0, den, torch.ones_like(den))


def dropped_mass_bound(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    bounds: PageBounds,
    sel: Optional[Selection],
    valid_len,
    attn_mask: Optional[torch.Tensor],
    scale: float,
    page_size: int,
):
    """Certified upper bound on the softmax mass a selection leaves out, next to the true value.

    For query head ``h`` let ``Z_in = sum_{t selected} exp(l_t)`` (exact logits) and,
    for every valid page ``j`` not selected for ``h``'s KV head,
    ``n_j * exp(u_hj)`` with ``u_hj`` the page's logit upper bound
    (:func:`page_scores` per query head, rounding slack and mask included) and
    ``n_j`` its number of valid tokens. With ``Z_out_ub = sum_j n_j exp(u_hj) >= Z_out``
    and ``x -> x / (Z_in + x)`` increasing,

    ``dropped_h = Z_out / (Z_in + Z_out) <= Z_out_ub / (Z_in + Z_out_ub)``.

    Computed in log space (shifted by the row max) so nothing overflows. This
    reads every key only to return the *measured* dropped mass next to the bound;
    the bound itself needs only ``Z_in`` (from the attended tokens) and the bounds.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, 1, D]``.
    k_cache : torch.Tensor
        ``[B, Hkv, L, D]``.
    bounds : PageBounds
        Bounds covering ``k_cache`` (``P = ceil(L / S)`` pages).
    sel : Selection or None
        Kept pages ``[B, Hkv, K]``; None means dense (nothing dropped).
    valid_len : torch.Tensor or int
    attn_mask : torch.Tensor, optional
        As in :func:`sparse_decode_reference`.
    scale : float
    page_size : int

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``(bound, measured)``, both fp32 ``[B, Hq]`` in ``[0, 1]``; ``bound >= measured``
        up to fp32 rounding of the final division.
    """
    B, Hq, _, D = q.shape
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    G, S = Hq // Hkv, page_size
    P = bounds.kmax.shape[2]
    vl = _as_valid_len(valid_len, B, q.device)
    if sel is None:
        z = torch.zeros(B, Hq, device=q.device)
        return z, z
    valid_tok = torch.arange(L, device=q.device)[None, :] < vl[:, None]  # [B,L]
    kept_tok = selected_token_mask(sel, S, L, vl) & valid_tok[:, None, :]  # [B,Hkv,L]
    logits = (q.float().reshape(B, Hkv, G, D) @ k_cache.float().transpose(-1, -2)) * scale  # [B,Hkv,G,L]
    logits = logits + _gathered_mask(attn_mask, torch.arange(L, device=q.device).expand(B, Hkv, L), B, Hq, L)
    logits = logits.masked_fill(~valid_tok[:, None, None, :], float("-inf"))
    lse_in = logits.masked_fill(~kept_tok[:, :, None, :], float("-inf")).logsumexp(-1)  # [B,Hkv,G]
    lse_out = logits.masked_fill(kept_tok[:, :, None, :], float("-inf")).logsumexp(-1)
    measured = torch.sigmoid(lse_out - lse_in).nan_to_num(nan=0.0)
    # ---- the bound: unselected valid pages, n_j * exp(u_hj)
    ub = page_scores(q, bounds, scale, mask_page_max(attn_mask, B, Hq, L, S), group_reduce=False)  # [B,Hq,P]
    ub = ub.reshape(B, Hkv, G, P)
    page = torch.arange(P, device=q.device)
    n_tok = (vl[:, None] - page[None, :] * S).clamp(min=0, max=S)  # [B,P]
    kept_page = torch.zeros(B, Hkv, P, dtype=torch.bool, device=q.device)
    kept_page.scatter_(2, sel.idx.clamp(max=P - 1), sel.ok)
    out_page = (~kept_page) & (n_tok > 0)[:, None, :]  # [B,Hkv,P]
    log_terms = ub + torch.log(n_tok.float().clamp(min=1))[:, None, None, :]
    lse_out_ub = log_terms.masked_fill(~out_page[:, :, None, :], float("-inf")).logsumexp(-1)  # [B,Hkv,G]
    bound = torch.sigmoid(lse_out_ub - lse_in).nan_to_num(nan=0.0)
    return bound.reshape(B, Hq), measured.reshape(B, Hq)
