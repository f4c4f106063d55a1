"""``oracle``: true attention mass per page (reads every key; an accuracy ceiling, not a fast path)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..kernels.reference import Selection
from .base import DecodeContext, PagePolicy, register_policy


def page_log_mass(ctx: DecodeContext) -> torch.Tensor:
    """Log of each page's share of the softmax mass, per query head: fp32 ``[B, Hq, P]``.

    Exact logits over all valid keys (with the additive mask); pages with no valid
    token get -inf.
    """
    B, Hq, _, D = ctx.q.shape
    Hkv, L = ctx.k_cache.shape[1], ctx.k_cache.shape[2]
    G, S, P = Hq // Hkv, ctx.page_size, ctx.n_pages
    vl = ctx.valid_len.reshape(-1).expand(B)
    logits = (ctx.q.float().reshape(B, Hkv, G, D) @ ctx.k_cache.float().transpose(-1, -2)) * ctx.scale
    logits = logits.reshape(B, Hq, L)
    if ctx.attn_mask is not None:
        m = ctx.attn_mask
        if m.dtype == torch.bool:
            m = torch.zeros(m.shape, device=m.device).masked_fill(~m, float("-inf"))
        while m.dim() < 4:
            m = m.unsqueeze(0)
        logits = logits + m.float().expand(B, Hq, 1, L)[:, :, 0, :]
    valid = torch.arange(L, device=ctx.q.device)[None, :] < vl[:, None]
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    pad = P * S - L
    if pad:
        logits = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
    lse = logits.reshape(B, Hq, P, S).logsumexp(-1)
    return lse - lse.logsumexp(-1, keepdim=True)


@register_policy
class OraclePolicy(PagePolicy):
    """Score = the page's true share of softmax mass, max over the query heads of the GQA group.

    Selection stays per KV head (the max keeps, for each KV head, the pages that
    matter most to any of its query heads). Ignores ``candidate_factor``: the
    ranking is already exact (and with it ``candidate_extra`` and ``keep_tokens``: it keeps pages).
    """

    name = "oracle"

    def score(self, ctx: DecodeContext) -> torch.Tensor:
        B, Hq = ctx.q.shape[0], ctx.q.shape[1]
        Hkv = ctx.k_cache.shape[1]
        return page_log_mass(ctx).reshape(B, Hkv, Hq // Hkv, -1).amax(2).nan_to_num(nan=float("-inf"))

    def choose(self, ctx: DecodeContext) -> Tuple[Optional[Selection], int]:
        return super().choose(ctx.with_spec(candidate_factor=1, candidate_extra=0))
