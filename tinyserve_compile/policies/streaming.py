"""``streaming``: StreamingLLM (Xiao et al., 2023) at page granularity.

Keeps the attention-sink pages and the most recent pages, nothing else.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..kernels.reference import Selection, select_pages
from .base import DecodeContext, PagePolicy, register_policy


@register_policy
class StreamingPolicy(PagePolicy):
    """Attention sinks + a recent window that fills the budget.

    The first ``max(sink_pages, 1)`` pages are sinks (StreamingLLM keeps the first
    4 tokens; one page covers them); the rest of the ``token_budget // page_size``
    pages are the newest ones. The query is never looked at, so the selection is
    the same for every head and step of a given length. Two-stage refinement is
    not applied (the window is the policy).
    """

    name = "streaming"

    def n_sinks(self, ctx: DecodeContext) -> int:
        return max(int(ctx.sink_pages), 1)

    def score(self, ctx: DecodeContext) -> torch.Tensor:
        B, Hkv, P = ctx.q.shape[0], ctx.k_cache.shape[1], ctx.n_pages
        page = torch.arange(P, device=ctx.q.device, dtype=torch.float32)
        s = page.masked_fill(page < self.n_sinks(ctx), float(P) + 1.0)  # sinks above any recency score
        return s.expand(B, Hkv, P).contiguous()

    def choose(self, ctx: DecodeContext) -> Tuple[Optional[Selection], int]:
        B = ctx.q.shape[0]
        vl = ctx.valid_len.reshape(-1).expand(B)
        K = ctx.token_budget // ctx.page_size
        if int(((vl + ctx.page_size - 1) // ctx.page_size).max()) <= K:
            return None, ctx.page_size
        return select_pages(self.score(ctx), vl, ctx.page_size, ctx.token_budget, self.n_sinks(ctx)), ctx.page_size
