"""Pass: turn the key-cache write of every rewritten site into a bounds-keeping write.

``k_cache.index_copy_(2, pos, k)`` (and the ``setitem`` / ``index_put_`` /
slice-``copy_`` idioms) becomes::

    tinyserve::cache_write(k_cache, probe, pos, k, S)

``probe`` is a new graph input per write site (see :mod:`tinyserve_compile.runtime`);
the backend passes it in. Decode sites that will be sparse and prefill sites past
``dense_layers`` are handled, so that a compiled prefill keeps the bounds current.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from tinyserve_compile import runtime  # noqa: F401  (registers the ops)

from ._graph import cache_view

__all__ = ["keep_bounds_on_cache_writes", "PROBE_PREFIX"]

PROBE_PREFIX = "tinyserve_probe_"


def _positions(graph: fx.Graph, site, device) -> fx.Node:
    w = site.k_write
    if isinstance(w.positions, fx.Node):
        return graph.call_function(torch.ops.aten.reshape.default, (w.positions, [-1]))
    start, stop = w.positions
    return graph.call_function(torch.arange, (start, stop), {"device": device, "dtype": torch.int64})


def keep_bounds_on_cache_writes(gm: fx.GraphModule, config) -> fx.GraphModule:
    sites = gm.meta.get("tinyserve_sites", [])
    graph = gm.graph
    probes = gm.meta.setdefault("tinyserve_probes", [])
    n_prefill = 0
    done = {}
    last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
    for site in sites:
        wanted = site.status == "sparse"
        if site.status == "prefill":
            wanted = site.k_write is not None and n_prefill >= config.dense_layers
            n_prefill += 1
        if not wanted:
            continue
        if site.k_base in done:
            site.positions = done[site.k_base]
            continue
        w = site.k_write
        name = f"{PROBE_PREFIX}{len(probes)}"
        with graph.inserting_after(last_placeholder):
            probe = graph.placeholder(name)
        probe.meta["example_value"] = torch.zeros(1)
        last_placeholder = probe
        probes.append(name)
        device = w.src.meta.get("example_value").device if "example_value" in w.src.meta else None
        with graph.inserting_before(w.node):
            pos = _positions(graph, site, device)
            # other layouts ([B, L, H, D] ...): write through the [B, Hkv, L, D] view, the source permuted alike
            cache = cache_view(graph, site.k_base, w.perm, w.batch, site.k_layout.batch_dim)
            src = w.src if w.perm is None else graph.call_function(torch.ops.aten.permute.default,
                                                                   (w.src, list(w.perm)))
            graph.call_function(torch.ops.tinyserve.cache_write.default, (cache, probe, pos, src, config.page_size))
        w.node.replace_all_uses_with(site.k_base)
        graph.erase_node(w.node)
        for extra in w.extra_nodes:
            if not extra.users:
                graph.erase_node(extra)
        site.positions = done[site.k_base] = pos
    graph.lint()
    gm.recompile()
    return gm
