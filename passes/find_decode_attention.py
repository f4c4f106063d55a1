"""Pass: find every SDPA call, classify it, and record why a site stays dense.

A site is rewritten (status ``"sparse"``) only when all of these hold:

* the query has length 1 (decode), read from the node's example value;
* K and V are views of graph inputs (cache buffers) through a chain that is
  exactly ``repeat_kv`` (or the buffer itself under ``enable_gqa=True``);
* the graph writes the key cache in place, with a recognised idiom, before the
  attention, and does nothing else in place to it;
* no ``is_causal``, no dropout, and a mask (if any) over the whole cache length.

The first ``dense_layers`` layers are rewritten too, and attend densely at run
time (:mod:`tinyserve_compile.runtime` ranks layers across graphs).

Everything else stays dense, with the reason in ``gm.meta["tinyserve_sites"]``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch.fx as fx

from ._graph import SDPA_TARGETS, CacheWrite, cache_writes, chain_is_repeat_kv, fake, node_order, sdpa_args, \
    trace_view_chain

__all__ = ["AttentionSite", "find_decode_attention"]


@dataclass
class AttentionSite:
    """One SDPA call in a graph and what the backend does with it."""

    index: int
    node: fx.Node
    query_len: Optional[int]
    status: str = "dense"  #: "sparse" | "dense" | "prefill"
    reason: str = ""
    k_base: Optional[fx.Node] = None
    v_base: Optional[fx.Node] = None
    k_write: Optional[CacheWrite] = None
    positions: Any = None  #: node holding the written positions (set by the write pass)
    bounds: Any = None  #: the kmax, kmin, kabs, ctrl placeholders of the key cache (set by the write pass)
    args: dict = field(default_factory=dict)

    def describe(self) -> dict:
        return {"index": self.index, "node": self.node.name, "query_len": self.query_len, "status": self.status,
                "reason": self.reason}


def _cache_of(node, n_q_heads: int, enable_gqa: bool):
    base, chain = trace_view_chain(node) if isinstance(node, fx.Node) else (None, [])
    if base is None:
        return None, "K/V are not views of a graph input (no persistent cache buffer, e.g. DynamicCache torch.cat)"
    why = chain_is_repeat_kv(base, chain, n_q_heads, enable_gqa)
    return (None, why) if why else (base, "")


def _classify(site: AttentionSite, order: dict) -> None:
    a = site.args
    q = fake(a["query"])
    if q is None or q.dim() != 4:
        site.reason = "query shape unknown or not 4-D [B, H, Lq, D]"
        return
    try:
        site.query_len = int(q.shape[2])
    except Exception:
        site.reason = "query length is symbolic"
        return
    decode = site.query_len == 1
    if decode:
        k_base, why = _cache_of(a["key"], int(q.shape[1]), bool(a["enable_gqa"]))
        v_base, why_v = _cache_of(a["value"], int(q.shape[1]), bool(a["enable_gqa"]))
    else:  # prefill: only the key cache's writes matter (its SDPA stays dense), any view chain will do
        k_base, why = (trace_view_chain(a["key"])[0] if isinstance(a["key"], fx.Node) else None), ""
        v_base, why_v = None, ""
    site.k_base, site.v_base = k_base, v_base
    if k_base is not None:
        writes, unknown = cache_writes(k_base)
        before = [w for w in writes if order[w.node] < order[site.node]]
        if unknown:
            site.reason = f"unrecognised in-place write to the key cache: {unknown[0].target}"
            k_base = site.k_base = None
        elif len(writes) != 1 or len(before) != 1:
            site.reason = (f"key cache must be written exactly once, before the attention, in this graph "
                           f"(found {len(writes)} write(s), {len(before)} before)")
            k_base = site.k_base = None
        else:
            site.k_write = before[0]
    if site.query_len != 1:
        site.status, site.reason = "prefill", f"prefill (query length {site.query_len}) stays dense"
        return
    if k_base is None or v_base is None:
        site.reason = site.reason or why or why_v
        return
    if k_base is v_base:
        site.reason = "K and V read the same buffer"
        return
    if a["is_causal"]:
        site.reason = "is_causal=True with one query token attends only the first key; left to SDPA"
        return
    if a["dropout_p"] not in (0, 0.0):
        site.reason = "dropout_p != 0"
        return
    kt, vt = fake(k_base), fake(v_base)
    if kt.shape != vt.shape or kt.dtype != vt.dtype:
        site.reason = "K and V caches differ in shape or dtype"
        return
    if kt.dtype != q.dtype:
        site.reason = f"query dtype {q.dtype} differs from cache dtype {kt.dtype}"
        return
    mask = a["attn_mask"]
    if mask is not None:
        mt = fake(mask)
        if mt is None:
            site.reason = "attention mask is not a tensor"
            return
        L = int(kt.shape[2])
        if mt.shape[-1] != L or (mt.dim() == 4 and int(mt.shape[1]) not in (1, int(q.shape[1]))) or mt.dim() > 4:
            site.reason = f"attention mask shape {tuple(mt.shape)} does not cover the cache length {L}"
            return
    site.status, site.reason = "sparse", ""


def find_decode_attention(gm: fx.GraphModule, config) -> fx.GraphModule:
    """Record an :class:`AttentionSite` per SDPA call in ``gm.meta["tinyserve_sites"]``."""
    order = node_order(gm.graph)
    sites: List[AttentionSite] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in SDPA_TARGETS:
            continue
        site = AttentionSite(len(sites), node, None, args=sdpa_args(node))
        _classify(site, order)
        sites.append(site)
    gm.meta["tinyserve_sites"] = sites
    return gm
