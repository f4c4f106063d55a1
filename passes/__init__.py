"""FX passes of the tinyserve backend, one per file, run in the order of :data:`PASSES`.

Each pass is ``(gm, config) -> gm``; they share findings through ``gm.meta``.
"""
from .decode_linear import decode_linear
from .find_decode_attention import AttentionSite, find_decode_attention
from .keep_bounds_on_cache_writes import BOUNDS_PREFIX, keep_bounds_on_cache_writes
from .sparse_decode_attention import sparse_decode_attention

PASSES = [
    find_decode_attention,
    keep_bounds_on_cache_writes,
    sparse_decode_attention,
    decode_linear,
]


def run_passes(gm, config):
    """Run :data:`PASSES` in order."""
    for p in PASSES:
        gm = p(gm, config)
    return gm


__all__ = ["PASSES", "run_passes", "AttentionSite", "BOUNDS_PREFIX"]
