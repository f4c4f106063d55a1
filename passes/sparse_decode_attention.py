"""Pass: replace each rewritable decode SDPA with ``tinyserve::sparse_decode`` or ``tinyserve::policy_attention``.

With the ``query_aware`` policy the site becomes one call of ``tinyserve::sparse_decode``
(the dispatcher runs the native kernel on CPU, Triton on CUDA); the other policies run
through ``tinyserve::policy_attention`` (:mod:`tinyserve_compile.policies.op`).

The op reads the cache buffers directly, so the ``repeat_kv`` copy of the whole
cache that the stock graph makes (expand + reshape) disappears with it.
"""
from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx as fx

from tinyserve_compile import runtime
from tinyserve_compile.config import TinyServeConfig
from tinyserve_compile.explain import counters
from tinyserve_compile.kernels.spec import SelectionSpec
from tinyserve_compile.policies.op import POLICY_ATTENTION

from ._masks import compact_mask, decode_valid_len, pad_mask
from ._node_meta import fake, is_inplace
from ._views import cache_view
from .state import pass_state

__all__ = ["sparse_decode_attention"]


def _erase_dead_chain(graph: fx.Graph, node) -> None:
    todo = [node]
    while todo:
        n = todo.pop()
        if not isinstance(n, fx.Node) or n.users or n.op in ("placeholder", "output") or is_inplace(n):
            continue  # in use, an input, or a write (litgpt reads V from its index_copy_: the write stays)
        inputs = list(n.all_input_nodes)
        graph.erase_node(n)
        todo.extend(inputs)


#: view ops whose result depends only on their arguments: two of them on the same input with the same arguments are
#: the same mask (transformers 4.x slices the decode mask to the key length in every layer)
_MASK_VIEWS = (operator.getitem, torch.ops.aten.slice.Tensor, torch.ops.aten.expand.default,
               torch.ops.aten.view.default)


def _mask_identity(mask: fx.Node):
    """A key equal for mask nodes that are the same view of the same node, else ``mask`` itself."""
    if isinstance(mask, fx.Node) and mask.op == "call_function" and mask.target in _MASK_VIEWS and mask.args:
        return (_mask_identity(mask.args[0]), mask.target, repr(mask.args[1:]), repr(mask.kwargs))
    return mask


def _mask_and_valid_len(graph: fx.Graph, shared: dict, site, attn_mask, k: fx.Node, device, lower: str):
    """The mask and int64 ``[1]`` valid length a rewritten site passes to its op, inserted before ``site.node``.

    A mask over a ``[:n]`` prefix read is padded to the cache length ("not attended" past n). Sites that read
    one mask node with one prefix length and cache length (every layer of an HF model shares its decode mask)
    share one valid length, inserted before the first of them (sites are visited in graph order, so it
    precedes the others), instead of one reduction of the mask per site. Masks that are the same view of one node
    (transformers 4.x slices the decode mask in every layer) count as one mask node. Lowered by Inductor, they
    also share one contiguous copy of the mask (:func:`compact_mask`) instead of one copy per site.
    """
    length = site.k_layout.full(fake(site.k_base))[2]
    if attn_mask is None:  # no mask: the valid length is the keys read (a constant or a size, nothing to share)
        return None, decode_valid_len(graph, k, None, site.kv_len, device)
    key = (_mask_identity(attn_mask), site.kv_len, length, device)
    if key not in shared:
        mask = pad_mask(graph, attn_mask, site.kv_len, length)
        if lower == "inductor":
            mask = compact_mask(graph, mask)  # one buffer for every site, not one copy per site
        shared[key] = mask, decode_valid_len(graph, k, mask, site.kv_len, device)  # [1] int64
    return shared[key]


def sparse_decode_attention(gm: fx.GraphModule, config: TinyServeConfig) -> fx.GraphModule:
    """Replace each site of status ``"sparse"`` whose key-cache write keeps the bounds with the op of
    ``config.policy``; count each rewritten site in its key cache's slot (``decode_sites``)."""
    graph = gm.graph
    shared = {}  # (mask node, prefix length, cache length, device) -> (mask, valid length) of sites sharing them
    state = pass_state(gm)
    slots = state.bounds
    replaced = {}  # an erased site node -> the op call that replaced it (a later site may read it, e.g. as its query)
    for site in state.sites:
        if site.status != "sparse":
            continue
        if site.positions is None:  # the write pass did not run for it: stay dense
            site.status, site.reason = "dense", "key-cache write was not rewritten"
            continue
        a = {name: replaced.get(x, x) if isinstance(x, fx.Node) else x for name, x in site.args.items()}
        q = fake(a["query"])
        scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(int(q.shape[-1]))
        slot_i = site.slot
        slots[slot_i] = dataclasses.replace(slots[slot_i], decode_sites=slots[slot_i].decode_sites + 1)
        kmax, kmin, kabs, ctrl = site.bounds
        query_aware = config.policy == "query_aware"
        native = query_aware and runtime.decode_kernel(q.device, config) == "native"
        spec = SelectionSpec.from_config(config)  # each kernel bounds its sizes by the cache it is called on
        if site.dense_by_cost:  # every key, from the shapes (passes/dense_by_cost.py)
            spec = spec.dense_for(site.k_layout.full(fake(site.k_base))[2])
        spec = spec.to_list()
        with graph.inserting_before(site.node):
            # [B, Hkv, L, D] views of the buffers (themselves unless the cache has another layout)
            k = cache_view(graph, site.k_base, site.k_perm, site.k_layout.batch, site.k_layout.batch_dim)
            v = cache_view(graph, site.v_base, site.v_perm, site.v_layout.batch, site.v_layout.batch_dim)
            mask, valid_len = _mask_and_valid_len(graph, shared, site, a["attn_mask"], k, q.device, config.lower)
            if query_aware:  # one call of the fused op
                new = graph.call_function(
                    torch.ops.tinyserve.sparse_decode.default,
                    (a["query"], k, v, kmax, kmin, kabs, valid_len, mask, float(scale), spec, config.kernel,
                     ctrl),
                )
            else:
                new = graph.call_function(
                    POLICY_ATTENTION,
                    (a["query"], k, v, kmax, kmin, kabs, ctrl, valid_len, mask, float(scale), spec,
                     config.policy, config.kernel),
                )
            counters["native_sites" if native else "python_op_sites"] += 1
        new.meta["example_value"] = site.node.meta.get("example_value")
        old_k, old_v = a["key"], a["value"]
        site.node.replace_all_uses_with(new)
        graph.erase_node(site.node)
        replaced[site.node] = new
        _erase_dead_chain(graph, old_k)
        _erase_dead_chain(graph, old_v)
        site.node = new
    graph.lint()
    gm.recompile()
    return gm
