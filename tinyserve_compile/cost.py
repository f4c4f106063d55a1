"""Bytes of K/V state a decode step reads: the cost model quoted by the demo and the benchmarks."""
from __future__ import annotations

from typing import Optional

from .config import TinyServeConfig

__all__ = ["sparse_site_bytes", "kv_bytes_per_token"]


def sparse_site_bytes(ctx: int, n_kv_heads: int, head_dim: int, itemsize: int, page_size: int, token_budget: int,
                      candidate_factor: int = 1, bounds_itemsize: int = 4, candidate_extra: int = 0) -> int:
    """Bytes one rewritten attention site reads per decode step, all KV heads.

    Dense (every page fits in ``token_budget // page_size``, or every page is a candidate:
    ``SelectionSpec.dense_cache``, ``ctx`` taken as the cache's length): every key and value.
    Otherwise the page bounds (``kmax``/``kmin`` of ``bounds_itemsize`` bytes each,
    fp32 ``kabs``), the candidates'
    keys (two-stage: ``candidate_pages`` pages), the kept keys (one stage only;
    two-stage reuses the candidates' logits) and the kept values (``K * page_size``
    tokens, whole pages or single tokens alike).
    """
    from .kernels.reference import candidate_pages

    h, d, S = n_kv_heads, head_dim, page_size
    pages = -(-ctx // S)
    K = token_budget // S
    n1 = candidate_pages(S, token_budget, candidate_factor, candidate_extra)
    if pages <= max(K, n1):
        return h * ctx * d * 2 * itemsize
    two = n1 > K
    bounds = h * (pages * d * 2 * bounds_itemsize + pages * 4)
    cand_keys = h * n1 * S * d * itemsize if two else 0
    kept_keys = 0 if two else h * K * S * d * itemsize
    return bounds + cand_keys + kept_keys + h * K * S * d * itemsize


def kv_bytes_per_token(hf_config, ctx: int, config: Optional[TinyServeConfig] = None, itemsize: int = 4) -> int:
    """K/V bytes a decoder reads per token at context ``ctx``: dense (``config=None``) or under tinyserve."""
    c = hf_config
    h = c.num_key_value_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    dense = 2 * ctx * h * d * itemsize
    if config is None:
        return c.num_hidden_layers * dense
    n_dense = min(config.dense_layers, c.num_hidden_layers)
    sparse = sparse_site_bytes(ctx, h, d, itemsize, config.page_size, config.token_budget, config.candidate_factor,
                               config.bounds_torch_dtype.itemsize, config.candidate_extra)
    return n_dense * dense + (c.num_hidden_layers - n_dense) * sparse
