"""Pure-PyTorch reference for query-aware paged sparse decode.

This package is the single source of truth for the algorithm. Every fast path
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

Modules: :mod:`.bounds` (page bounds and their storage), :mod:`.select` (scores, top-K, two-stage
refinement), :mod:`.attend` (the attention over a selection). Every public name is importable from here.
"""
from .bounds import (
    _INT8_STEP_FLOOR,
    BOUNDS_DTYPES,
    PageBounds,
    _as_valid_len,
    _int8_codes,
    _paged,
    bounds_f32,
    bounds_itemsize,
    int8_bounds_step,
    num_pages,
    page_bounds,
    round_down_bf16,
    round_up_bf16,
    store_bounds,
)
from .select import (
    Selection,
    _candidate_logits,
    _gathered_mask,
    _selected_tokens,
    choose,
    choose_pages,
    choose_with,
    forced_pages,
    mask_page_max,
    page_scores,
    rank_candidate_pages,
    rank_candidate_tokens,
    rank_candidates,
    refine_candidates,
    score_slack_factor,
    score_underflow_slack,
    select_pages,
    selected_token_mask,
    top_pages,
)
from .attend import dropped_mass_bound, softmax_attend, sparse_decode_reference
from ..spec import candidate_pages  # the formula lives with the other selection rules

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
    "top_pages",
    "forced_pages",
    "refine_candidates",
    "selected_token_mask",
    "sparse_decode_reference",
    "softmax_attend",
    "rank_candidates",
    "rank_candidate_pages",
    "choose_pages",
    "choose",
    "choose_with",
    "candidate_pages",
    "rank_candidate_tokens",
    "int8_bounds_step",
    "bounds_f32",
    "bounds_itemsize",
    "dropped_mass_bound",
]
