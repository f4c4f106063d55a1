"""Attend a decode site densely where its page selection cannot pay on the device: the cost model
(:func:`tinyserve_compile.cost.selection_pays`) on the site's static cache shape, at compile time.

Such a site is still rewritten (the op, its bounds-keeping cache write, CUDA graphs as before), but
:mod:`.sparse_decode_attention` hands its op the spec that attends every key
(:meth:`~tinyserve_compile.kernels.spec.SelectionSpec.dense_for`): one launch on a GPU, exact dense attention in
every implementation. A site whose cache has a symbolic dimension (a dynamic shape) keeps its selection, as does
every site of a baseline policy (the cost model is the query-aware op's): the op's own rule still attends rows
densely whose valid pages all fit (``SelectionSpec.n_dense_pages``).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from tinyserve_compile import cost
from tinyserve_compile.config import TinyServeConfig

from ._node_meta import fake
from .state import pass_state


def dense_by_cost(gm: fx.GraphModule, config: TinyServeConfig) -> fx.GraphModule:
    """Mark each ``"sparse"`` site whose selection cannot pay (``site.dense_by_cost``: the reason);
    :func:`tinyserve_compile.explain` counts them (``dense_by_cost``)."""
    if not config.dense_by_cost or config.policy != "query_aware":  # the cost model is the query-aware op's
        return gm
    for site in pass_state(gm).sites:
        if site.status != "sparse" or site.k_base is None:
            continue
        kt = fake(site.k_base)
        # a symbolic dimension (automatic dynamic shapes) is not decided from its hint: the op's length may differ
        if kt is None or any(isinstance(n, torch.SymInt) for n in kt.shape):
            continue
        shape = site.k_layout.full(kt)  # [B, Hkv, L, D]
        if len(shape) != 4:
            continue
        B, hkv, L, D = (int(n) for n in shape)
        pays, why = cost.selection_pays(L, B, hkv, D, kt.element_size(), config, kt.device.type)
        if not pays:
            site.dense_by_cost = why
    return gm
