"""Pass: turn the key-cache write of every rewritten site into a bounds-keeping write.

``k_cache.index_copy_(2, pos, k)`` (and the ``setitem`` / ``index_put_`` /
slice-``copy_`` idioms) becomes::

    cache_write(k_cache, kmax, kmin, kabs, ctrl, pos, k, S)

where ``kmax, kmin, kabs, ctrl`` are four new graph inputs per key-cache buffer
(see :mod:`tinyserve_compile.runtime`; the backend hands them in) and
``cache_write`` is ``tinyserve::cache_write`` (the dispatcher runs the native kernel on CPU).
Decode sites that will be rewritten and prefill sites that write a cache are
handled, so that a compiled prefill keeps the bounds current. Each buffer is
recorded as a :class:`~tinyserve_compile.runtime.BoundsSlot` in the graph's
:attr:`.state.PassState.bounds`; ``site.bounds`` holds its four nodes.

The four placeholders are static inputs: they carry ``meta["tensor_dict"]`` =
:data:`STATIC_INPUT_META`, the record Dynamo leaves on the placeholder of a
tensor marked with ``torch._dynamo.mark_static_address(t, guard=False)``. AOTAutograd
turns that mark into ``fw_metadata.static_input_indices`` (for a graph that keeps
Dynamo's ``_param_name_to_source`` and per-placeholder ``_dynamo_source``, which the
backend carries over to its copy), and Inductor hands those indices to its CUDA
graphs: a replay then neither copies the bounds nor records again, and their
in-place updates by the write op do not make it skip CUDA graphs.
"""
from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx

from tinyserve_compile import runtime
from tinyserve_compile.config import TinyServeConfig
from tinyserve_compile.kernels.spec import SelectionSpec

from ._node_meta import fake
from ._views import cache_view
from .state import pass_state

__all__ = ["keep_bounds_on_cache_writes", "BOUNDS_PREFIX", "STATIC_INPUT_META"]

BOUNDS_PREFIX = "tinyserve_bounds_"
#: ``node.meta["tensor_dict"]`` of the bounds placeholders: Dynamo's record of an unguarded static address
STATIC_INPUT_META = {"_dynamo_static_input_type": "unguarded"}


def _positions(graph: fx.Graph, site, device) -> fx.Node:
    w = site.k_write
    if isinstance(w.positions, fx.Node):
        return graph.call_function(torch.ops.aten.reshape.default, (w.positions, [-1]))  # [n], any integer dtype
    start, stop = w.positions
    return graph.call_function(torch.arange, (start, stop), {"device": device, "dtype": torch.int64})


def keep_bounds_on_cache_writes(gm: fx.GraphModule, config: TinyServeConfig) -> fx.GraphModule:
    """Make the key-cache write of every rewritten site, and of every prefill site that writes a cache, keep the
    page bounds; record each buffer in the graph's :attr:`.state.PassState.bounds`."""
    state = pass_state(gm)
    sites = state.sites
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    slots = state.bounds
    done = {}
    last_placeholder = placeholders[-1] if placeholders else None
    for site in sites:
        wanted = site.status == "sparse" or (site.status == "prefill" and site.k_write is not None)
        if not wanted:
            continue
        if site.k_base in done:
            site.positions, site.bounds, site.slot = done[site.k_base]
            continue
        w = site.k_write
        cache = fake(site.k_base)
        device = cache.device
        # a graph input, or (torch 2.8) the tensor attribute itself, which the graph holds for its life
        index, attr = ((placeholders.index(site.k_base), None) if site.k_base.op == "placeholder"
                       else (None, operator.attrgetter(site.k_base.target)(gm)))
        slot = runtime.BoundsSlot(index, site.k_layout.full(cache), cache.dtype, config.page_size,
                                  config.bounds_torch_dtype, perm=w.perm, rows=w.batch, attr=attr)
        nodes = []
        # example values in the cache's fake mode (Dynamo's), as fake as the rest: no device memory for metadata
        mode = getattr(cache, "fake_mode", None)
        with mode if mode is not None else contextlib.nullcontext():
            examples = slot.example_inputs(device)
        for name, example in zip(("kmax", "kmin", "kabs", "ctrl"), examples):
            with graph.inserting_after(last_placeholder):
                node = graph.placeholder(f"{BOUNDS_PREFIX}{len(slots)}_{name}")
            node.meta["example_value"] = example
            node.meta["tensor_dict"] = dict(STATIC_INPUT_META)  # a static input (same address every call)
            nodes.append(node)
            last_placeholder = node
        slots.append(slot)
        write_op = runtime.write_op()
        with graph.inserting_before(w.node):
            pos = _positions(graph, site, device)
            # other layouts ([B, L, H, D] ...): write through the [B, Hkv, L, D] view, the source permuted alike
            view = cache_view(graph, site.k_base, w.perm, w.batch, site.k_layout.batch_dim)
            src = w.src  # in the written view's dim order
            if w.src_unsqueeze is not None:  # a 0-d position: the source has no sequence dim
                src = graph.call_function(torch.ops.aten.unsqueeze.default, (src, w.src_unsqueeze))
            if w.src_perm is not None:  # [B, Hkv, n, D]
                src = graph.call_function(torch.ops.aten.permute.default, (src, list(w.src_perm)))
            graph.call_function(write_op, (view, *nodes, pos, src, SelectionSpec.from_config(config).to_list()))
        # an in-place method returns the tensor it wrote into (litgpt reads K from it): that view stays
        w.node.replace_all_uses_with(w.node.args[0])
        graph.erase_node(w.node)
        for extra in w.extra_nodes:
            if not extra.users:
                graph.erase_node(extra)
        site.positions, site.bounds, site.slot = done[site.k_base] = pos, nodes, len(slots) - 1
    graph.lint()
    gm.recompile()
    return gm
