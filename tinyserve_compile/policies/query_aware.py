"""``query_aware``: the paper's page bound (the default)."""
from __future__ import annotations

import torch

from ..kernels.reference import page_scores
from ..kernels.sparse_decode import resolve_kernel, run_kernel
from .base import DecodeContext, PagePolicy, register_policy


@register_policy
class QueryAwarePolicy(PagePolicy):
    """Score = upper bound of the page's logit, ``sum_i max(q_i*M_i, q_i*m_i)``, max over the GQA group.

    Attention runs through the fused ``tinyserve::sparse_decode`` op (Triton on
    GPU, the fast PyTorch path on CPU), which computes the same selection.
    """

    name = "query_aware"

    def score(self, ctx: DecodeContext) -> torch.Tensor:
        return page_scores(ctx.q, ctx.bounds, ctx.scale, ctx.mask_pages())

    def __call__(self, ctx: DecodeContext) -> torch.Tensor:
        # the op's implementation, called directly: this runs inside tinyserve::policy_attention already
        return run_kernel(resolve_kernel(ctx.kernel, ctx.q.device), ctx.q, ctx.k_cache, ctx.v_cache, *ctx.bounds,
                          ctx.valid_len, ctx.attn_mask, float(ctx.scale), ctx.spec)
