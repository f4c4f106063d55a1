"""``h2o``: heavy hitters by accumulated observed attention (H2O, Zhang et al., 2023), paged.

How this differs from the paper's H2O:

* **Page granularity.** Mass is accumulated per KV page (``page_size`` tokens),
  not per token, and pages are kept or dropped whole.
* **Decode-time only.** The paper accumulates the prefill attention matrix;
  here the prefill runs dense and is not observed. Instead the first decode
  step (empty state) is seeded with that step's true page mass over every valid
  key (one query's worth of "prefill statistics"; it still attends only the
  budget), and from then on only observed mass accumulates.
* **Only observed pages accumulate.** A page gains mass only on steps where it
  was attended (selected); a page outside the kept set never gains, so an
  early miss is permanent, as in the paper's eviction, but nothing is evicted
  from the cache: a page can come back if its accumulated mass overtakes.
* **Per KV head.** The mass of a page is summed over the query heads of its
  GQA group (the paper is per attention head, MHA).
* **Recent window.** Half of the budget (``recent_fraction``) is a forced
  recent window, the paper's "recent tokens" half; sinks follow ``sink_pages``.
* No decay, no normalisation by age.

State: ``ctx.state["h2o_mass"]``, fp32 ``[B, Hkv, P]``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..kernels.reference import Selection, selected_token_mask
from .base import DecodeContext, PagePolicy, register_policy

KEY = "h2o_mass"


def observed_page_mass(ctx: DecodeContext, sel: Optional[Selection]) -> torch.Tensor:
    """Softmax mass each page received this step over the attended tokens, summed over the GQA group.

    Returns fp32 ``[B, Hkv, P]`` (zero for pages not attended).
    """
    B, Hq, _, D = ctx.q.shape
    Hkv, L = ctx.k_cache.shape[1], ctx.k_cache.shape[2]
    G, S, P = Hq // Hkv, ctx.page_size, ctx.n_pages
    vl = ctx.valid_len.reshape(-1).expand(B)
    keep = torch.arange(L, device=ctx.q.device)[None, None, :] < vl[:, None, None]  # [B,1,L]
    if sel is not None:
        keep = keep & selected_token_mask(sel, S, L, vl)
    keep = keep.expand(B, Hkv, L)
    logits = (ctx.q.float().reshape(B, Hkv, G, D) @ ctx.k_cache.float().transpose(-1, -2)) * ctx.scale
    logits = logits.masked_fill(~keep[:, :, None, :], float("-inf"))
    p = torch.softmax(logits, dim=-1).sum(2)  # [B,Hkv,L]
    pad = P * S - L
    if pad:
        p = torch.nn.functional.pad(p, (0, pad))
    return p.reshape(B, Hkv, P, S).sum(-1)


@register_policy
class H2OPolicy(PagePolicy):
    """Score = attention mass accumulated over the decode steps so far; a recent window is forced."""

    name = "h2o"
    recent_fraction = 0.5

    def score(self, ctx: DecodeContext) -> torch.Tensor:
        B, Hkv, P = ctx.q.shape[0], ctx.k_cache.shape[1], ctx.n_pages
        mass = ctx.state.get(KEY)
        if mass is None or tuple(mass.shape) != (B, Hkv, P):
            mass = observed_page_mass(ctx, None)  # the seed: this step's true mass over all valid keys
        page = torch.arange(P, device=ctx.q.device)
        vl = ctx.valid_len.reshape(-1).expand(B)
        last = (vl - 1) // ctx.page_size  # [B]
        n_recent = int(self.recent_fraction * (ctx.token_budget // ctx.page_size))
        recent = (page[None, :] > (last[:, None] - n_recent)) & (page[None, :] <= last[:, None])  # [B,P]
        tie = page.float() / (P * 1e6)  # break ties toward recent pages
        return (mass + tie).masked_fill(recent[:, None, :], float("inf"))

    def choose(self, ctx: DecodeContext) -> Tuple[Optional[Selection], int]:
        # whole pages: the observed mass is kept per page
        return super().choose(ctx.with_spec(keep_tokens=False))

    def observe(self, ctx: DecodeContext, sel: Optional[Selection]) -> None:
        prev = ctx.state.get(KEY)
        if prev is None or prev.shape[-1] != ctx.n_pages:
            ctx.state[KEY] = observed_page_mass(ctx, None)  # seed (see the module docstring)
        else:
            ctx.state[KEY] = prev + observed_page_mass(ctx, sel)
