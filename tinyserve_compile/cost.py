"""Bytes of K/V state a decode step reads: the cost model quoted by the demo and the benchmarks, and the
shape-static dense rule the compiler takes from it (:func:`selection_pays`)."""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

from .config import TinyServeConfig

__all__ = ["sparse_site_bytes", "kv_bytes_per_token", "selection_pays", "DeviceCost", "DEVICE_COSTS", "PHASES"]


class DeviceCost(NamedTuple):
    """What the dense rule weighs on one kind of device: the read bandwidth (GB/s) the op's bytes take, and what
    one dependent phase of the op costs beyond its bytes (seconds)."""

    gbs: float
    phase_s: float


#: the dense rule's devices (``torch.device.type``); a device not here keeps the selection (no model of it)
DEVICE_COSTS = {
    # an H100 SXM's datasheet HBM3 (the slower of the cards lent, 3350 GB/s); a phase is a launch replayed under
    # CUDA graphs plus the one program per head that arrives last, 4-8 us by issue 51's reading of the kernels:
    # a model, not a measurement, until a GPU times the op at 4K and 8K
    "cuda": DeviceCost(gbs=3350.0, phase_s=6e-6),
    # the native kernel is one call per site in every mode: the rule is the bytes alone
    "cpu": DeviceCost(gbs=20.0, phase_s=0.0),
}
#: dependent phases of the op (each launch, then the program per head that arrives last): dense from the shapes
#: (split-K attention, its merge), one stage (the page scores and their select first), two stages (the
#: candidates' exact logits and their rank too)
PHASES = {"dense": 2, "one stage": 4, "two stages": 6}


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


def selection_pays(length: int, batch: int, n_kv_heads: int, head_dim: int, itemsize: int,
                   config: TinyServeConfig, device_type: str) -> Tuple[bool, str]:
    """Whether a decode site's page selection can beat attending its whole cache on ``device_type``, from the
    static shapes alone (the compiler's dense rule), and why not.

    The op's time is modelled as its bytes (:func:`sparse_site_bytes`, ``batch`` rows) at the device's
    bandwidth plus its dependent phases (:data:`PHASES`) at :data:`DEVICE_COSTS`; attending densely reads every
    key and value in :data:`PHASES` ``["dense"]``. A cache the spec attends densely anyway
    (``SelectionSpec.dense_cache``) pays nothing either way.

    Parameters
    ----------
    length : int
        Tokens of the static cache (``L`` of its ``[B, Hkv, L, D]`` view).
    batch, n_kv_heads, head_dim : int
        The cache's other dimensions.
    itemsize : int
        Bytes of one key element (2 for bf16).
    config : TinyServeConfig
    device_type : str
        ``torch.device.type`` of the cache.

    Returns
    -------
    (bool, str)
        True and "" where the selection can pay, or there is no model of the device; False and the reason.
    """
    from .kernels.spec import SelectionSpec

    cost = DEVICE_COSTS.get(device_type)
    spec = SelectionSpec.from_config(config)
    if cost is None or spec.dense_cache(-(-length // spec.page_size)):
        return True, ""
    per_row = dict(n_kv_heads=n_kv_heads, head_dim=head_dim, itemsize=itemsize, page_size=spec.page_size)
    sparse = batch * sparse_site_bytes(length, token_budget=spec.token_budget,
                                       candidate_factor=spec.candidate_factor,
                                       bounds_itemsize=spec.bounds_dtype.itemsize,
                                       candidate_extra=spec.candidate_extra, **per_row)
    dense = batch * 2 * length * n_kv_heads * head_dim * itemsize
    phases = PHASES["two stages" if spec.two_stage else "one stage"]
    t_sparse = sparse / (cost.gbs * 1e9) + phases * cost.phase_s
    t_dense = dense / (cost.gbs * 1e9) + PHASES["dense"] * cost.phase_s
    if t_sparse < t_dense:
        return True, ""
    return False, (f"a cache of {length} tokens x batch {batch} on {device_type}: the selection reads "
                   f"{sparse / 1e6:.1f} of {dense / 1e6:.1f} MB in {phases} dependent phases, modelled "
                   f"{t_sparse * 1e6:.0f} us against {t_dense * 1e6:.0f} us dense (cost.DEVICE_COSTS)")
