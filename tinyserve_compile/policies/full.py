"""``full``: dense attention over every valid token (the accuracy baseline)."""
from __future__ import annotations

from typing import Optional, Tuple

from ..kernels.reference import Selection
from .base import DecodeContext, PagePolicy, register_policy


@register_policy
class FullPolicy(PagePolicy):
    """Keeps every page: exact full attention through the same code path."""

    name = "full"

    def choose(self, ctx: DecodeContext) -> Tuple[Optional[Selection], int]:
        return None, ctx.page_size
