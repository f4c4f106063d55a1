"""FX passes of the tinyserve backend, one per file, run in the order of :data:`PASSES`.

Each pass is ``(gm: fx.GraphModule, config: TinyServeConfig) -> fx.GraphModule``; they share their findings
through the graph's :class:`~.state.PassState` (:func:`~.state.pass_state`).
"""
from __future__ import annotations

import torch.fx as fx

from tinyserve_compile.config import TinyServeConfig

from .decode_linear import decode_linear
from .dense_by_cost import dense_by_cost
from .find_decode_attention import find_decode_attention
from .keep_bounds_on_cache_writes import BOUNDS_PREFIX, keep_bounds_on_cache_writes
from .sparse_decode_attention import sparse_decode_attention
from .state import AttentionSite, LinearReport, PassState, pass_state

PASSES = [
    find_decode_attention,
    dense_by_cost,
    keep_bounds_on_cache_writes,
    sparse_decode_attention,
    decode_linear,
]


def run_passes(gm: fx.GraphModule, config: TinyServeConfig) -> fx.GraphModule:
    """Run :data:`PASSES` in order."""
    for p in PASSES:
        gm = p(gm, config)
    return gm


__all__ = ["PASSES", "run_passes", "AttentionSite", "LinearReport", "PassState", "pass_state", "BOUNDS_PREFIX"]
