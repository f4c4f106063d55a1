"""Page-selection policies: one small class each, one scoring method.

The base class (kvpress ``ScorerPress`` style) does the rest once: forced pages
(newest, attention sinks), invalid pages, top-k, the optional two-stage
refinement, and the exact attention over the kept pages.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar, Dict, Optional, Tuple

import torch

from ..kernels.reference import PageBounds, Selection, choose_with, mask_page_max
from ..kernels.spec import SelectionSpec
from ..kernels.torch_sparse_decode import attend_selection

__all__ = ["DecodeContext", "PagePolicy", "register_policy", "get_policy", "POLICIES"]


@dataclass
class DecodeContext:
    """Everything a policy may look at for one decode step of one attention site.

    Attributes
    ----------
    q : torch.Tensor
        ``[B, Hq, 1, D]``.
    k_cache, v_cache : torch.Tensor
        ``[B, Hkv, L, D]``.
    bounds : PageBounds
        fp32 page bounds of ``k_cache``.
    valid_len : torch.Tensor
        int64 ``[B]``.
    attn_mask : torch.Tensor or None
        Bool or additive float, broadcastable to ``[B, Hq, 1, L]``.
    scale : float
    spec : SelectionSpec
        The selection knobs (defaults: those of ``TinyServeConfig``); ``ctx.page_size`` and the other
        fields of the spec read through.
    state : dict
        Per cache buffer, kept across steps and cleared whenever the bounds are
        rebuilt (a new sequence); for stateful policies.
    kernel : {"auto", "native", "torch", "triton"}
        Implementation of the fused op, for policies that call it.
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    bounds: PageBounds
    valid_len: torch.Tensor
    attn_mask: Optional[torch.Tensor]
    scale: float
    spec: SelectionSpec = field(default_factory=SelectionSpec.default)
    state: Dict[str, torch.Tensor] = field(default_factory=dict)
    kernel: str = "auto"

    page_size = property(lambda self: self.spec.page_size)
    token_budget = property(lambda self: self.spec.token_budget)
    sink_pages = property(lambda self: self.spec.sink_pages)
    candidate_factor = property(lambda self: self.spec.candidate_factor)
    candidate_extra = property(lambda self: self.spec.candidate_extra)
    keep_tokens = property(lambda self: self.spec.keep_tokens)

    def with_spec(self, **changes) -> "DecodeContext":
        """This context with ``spec.replace(**changes)``."""
        return dataclasses.replace(self, spec=self.spec.replace(**changes))

    @property
    def n_pages(self) -> int:
        return self.bounds.kmax.shape[2]

    def mask_pages(self) -> Optional[torch.Tensor]:
        """``[B, 1 or Hq, P]`` max of the additive mask per page (None without a mask)."""
        B, Hq = self.q.shape[0], self.q.shape[1]
        return mask_page_max(self.attn_mask, B, Hq, self.k_cache.shape[2], self.page_size)


class PagePolicy:
    """Base policy: subclasses implement :meth:`score`; everything else is shared.

    Subclasses may override :meth:`observe` to update ``ctx.state`` after attending.
    """

    name: ClassVar[str] = "base"

    def score(self, ctx: DecodeContext) -> torch.Tensor:
        """Importance of every page: fp32 ``[B, Hkv, P]``, higher is kept first."""
        raise NotImplementedError

    def choose(self, ctx: DecodeContext) -> Tuple[Optional[Selection], int]:
        """What to attend per KV head: ``(selection, unit)``, the selection None for dense attention, else
        pages (``unit = page_size``) or, two-stage with ``ctx.keep_tokens``, single tokens (``unit = 1``)."""
        return choose_with(lambda: self.score(ctx), ctx.q, ctx.k_cache, ctx.valid_len, ctx.attn_mask, ctx.scale,
                           ctx.spec)

    def select(self, ctx: DecodeContext) -> Optional[Selection]:
        """Pages (single tokens with ``ctx.keep_tokens``, two-stage) to attend per KV head, or None for dense."""
        return self.choose(ctx)[0]

    def observe(self, ctx: DecodeContext, sel: Optional[Selection]) -> None:
        """Hook after attention (stateful policies); default does nothing."""

    def __call__(self, ctx: DecodeContext) -> torch.Tensor:
        """Attend: ``[B, Hq, 1, D]`` in the dtype of ``q``."""
        sel, unit = self.choose(ctx)
        out = attend_selection(ctx.q, ctx.k_cache, ctx.v_cache, sel, ctx.valid_len, ctx.attn_mask, ctx.scale, unit)
        self.observe(ctx, sel)
        return out


POLICIES: Dict[str, PagePolicy] = {}


def register_policy(cls):
    """Class decorator: make a policy available by ``cls.name`` (``options={"policy": name}``)."""
    POLICIES[cls.name] = cls()
    return cls


def get_policy(name: str) -> PagePolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; valid: {sorted(POLICIES)}")
    return POLICIES[name]
