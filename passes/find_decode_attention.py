"""Pass: find every SDPA call, classify it, and record why a site stays dense.

A site is rewritten (status ``"sparse"``) only when all of these hold:

* the query has length 1 (decode), read from the node's example value;
* K and V are views of graph inputs (cache buffers) through a chain that is
  ``repeat_kv`` (or nothing, under ``enable_gqa=True``) of a ``[B, Hkv, L, D]``
  view of the buffer: the buffer itself, or a permutation of it (``[B, L, H, D]``
  caches transposed for SDPA), possibly a ``[:b]`` batch slice and a ``[:n]``
  sequence prefix (:class:`~._views.CacheLayout`, recorded per site);
* the graph writes the key cache in place along its sequence dim, with a
  recognised idiom, before the attention, and does nothing else in place to it.
  The write may go through a view of the buffer (``self.k[:bs, ...]``, a
  ``[..., :n, :]`` prefix, a transpose, a negative dim), take positions of any
  integer dtype (0-d or ``[n]``), and its return value may be what SDPA reads
  (litgpt's ``k = self.k[:bs, ...].index_copy_(-2, pos, k)``);
* no ``is_causal``, no dropout, and a mask (if any) exactly as long as the keys
  read: the whole cache, or the ``[:n]`` prefix read (litgpt's
  ``input_pos_maxp1``; keys past ``n`` are never attended, so this is exact).

The first ``dense_layers`` layers are rewritten too, and attend densely at run
time (:mod:`tinyserve_compile.runtime` ranks layers across graphs).

Everything else stays dense, with the reason in the graph's :attr:`.state.PassState.sites`.
"""
from __future__ import annotations

from typing import List

import torch.fx as fx

from tinyserve_compile.config import TinyServeConfig

from ._cache_writes import cache_writes, describe_write, is_sliding_window_write
from ._node_meta import SDPA_TARGETS, ancestors, fake, is_dtensor, node_order, same_int, sdpa_args, size_node
from ._views import (CacheLayout, cache_layout, first_non_view, is_buffer_node, is_written_in_place, layout_name,
                     trace_view_chain)
from .state import AttentionSite, pass_state

__all__ = ["find_decode_attention"]


def _cache_of(node, n_q_heads: int, enable_gqa: bool):
    """``(buffer, CacheLayout)`` of a K/V operand, or ``(None, reason)``."""
    base, chain = trace_view_chain(node) if isinstance(node, fx.Node) else (None, [])
    if base is None:
        return None, _not_a_view_reason(node)
    lay = cache_layout(base, chain, n_q_heads, enable_gqa, fake(node))
    return (None, lay) if isinstance(lay, str) else (base, lay)


def _producer(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def _not_a_view_reason(node) -> str:
    """Why a K/V operand that is not a view of a graph input is not a cache read, naming its producer."""
    if not isinstance(node, fx.Node):
        return f"K/V are not views of a graph input: {type(node).__name__}"
    stop = first_non_view(node)
    what = _producer(stop)
    if what == "cat":
        return ("K/V are not views of a graph input: built by torch.cat each step "
                "(a DynamicCache-style cache, no persistent buffer)")
    caches = [a for a in ancestors(stop) if is_buffer_node(a) and is_written_in_place(a)]
    if caches and what in _CONVERSIONS and isinstance(stop.args[0], fx.Node) and \
            trace_view_chain(stop.args[0])[0] in caches:
        return (f"K/V are not views of a graph input: the cache buffer is converted by {what} each step "
                f"(a cache stored in another dtype than the attention's), so no buffer holds the keys attended")
    if caches:
        return (f"K/V are not views of a graph input: computed each step by {what} from a cache buffer "
                f"(e.g. a compressed MLA latent cache), not read from it")
    return f"K/V are not views of a graph input: they come from {what} (no persistent cache buffer)"


#: ops that convert a tensor's dtype (a copy of the whole cache when applied to it)
_CONVERSIONS = {"to", "float", "half", "bfloat16", "double", "type", "type_as", "_to_copy", "_to_copy.default"}


def _writes_reason(base: fx.Node, lay: CacheLayout, order: dict, site_node: fx.Node):
    """``(the one write before the site, "")`` or ``(None, reason)``."""
    writes, unknown = cache_writes(base, lay)
    before = [w for w in writes if order[w.node] < order[site_node]]
    if unknown and is_sliding_window_write(base, unknown[0][0]):
        return None, ("sliding-window cache: the buffer is rolled and copied back whole each step "
                      "(cache.copy_(cache.roll(...))), so positions move; left to SDPA")
    if unknown:
        node, why = unknown[0]
        name = layout_name(lay.perm)
        rows = f", rows [:{lay.batch}]" if lay.batch is not None else ""
        why = why or f"not a write of new positions along the sequence dim {lay.seq_dim}"
        return None, (f"unrecognised in-place write to the key cache: {describe_write(node)}: {why} "
                      f"(cache layout {name}{rows})")
    if not writes:
        return None, ("key cache is not written in this graph: the step's write must be in the same graph as the "
                      "attention (a graph break between them, or a cache filled elsewhere, leaves no write to keep "
                      "the page bounds with)")
    if len(writes) > 1:
        return None, (f"key cache is written {len(writes)} times in this graph "
                      f"({', '.join(describe_write(w.node) for w in writes)}): one write per step is kept bounds-aware")
    if not before:
        return None, ("key cache is written after the attention in this graph: the attention reads the cache as it "
                      "was before this step's write")
    return before[0], ""


def _classify(site: AttentionSite, order: dict, graph: fx.Graph) -> None:
    """Set ``site``'s status and reason, and what the later passes read of a site they rewrite (its caches, their
    layouts, the key cache's write, the length of a ``[:n]`` prefix read)."""
    a = site.args
    q = fake(a["query"])
    if q is None or q.dim() != 4:
        site.reason = "query shape unknown or not 4-D [B, H, Lq, D]"
        return
    # a symbolic query length is a prompt of dynamic length (Dynamo specialises a length of 1): a prefill. It is
    # not read with int(), which would specialise the graph on it (a recompile per prompt length)
    site.query_len = q.shape[2] if isinstance(q.shape[2], int) else None
    if any(is_dtensor(fake(a[name])) for name in ("query", "key", "value")):
        site.reason = ("DTensor activations (a tensor-parallel plan that keeps DTensor outputs): the sparse ops have "
                       "no sharding rule; use local outputs (use_local_output=True) to rewrite")
        if site.query_len != 1:
            site.status = "prefill"
        return
    gqa = bool(a["enable_gqa"])
    k_base, k_lay = _cache_of(a["key"], int(q.shape[1]), gqa)
    v_base, v_lay = _cache_of(a["value"], int(q.shape[1]), gqa)
    if site.query_len != 1:
        _classify_prefill(site, q, k_base, k_lay, order)
        return
    why = k_lay if k_base is None else (v_lay if v_base is None else "")
    if why:
        site.reason = why
        return
    site.k_base, site.v_base, site.k_layout, site.v_layout = k_base, v_base, k_lay, v_lay
    site.k_write, why = _writes_reason(k_base, k_lay, order, site.node)
    if site.k_write is None:
        site.reason, site.k_base = why, None
        return
    # in this order: the prefix length is looked up (a node of the graph) only for operands that fit
    why = _operands_reason(site, q) or _prefix_reason(site, graph) or _mask_reason(site, q)
    if why:
        site.reason = why
        return
    site.status, site.reason = "sparse", ""


def _classify_prefill(site: AttentionSite, q, k_base, k_lay, order: dict) -> None:
    """A prefill stays dense; its key-cache write is kept bounds-aware when the layout is known (``k_base`` a
    cache buffer, read through ``k_lay``)."""
    n = site.query_len if site.query_len is not None else f"{q.shape[2]}, dynamic"
    site.status, site.reason = "prefill", f"prefill (query length {n}) stays dense"
    if k_base is not None:
        site.k_base, site.k_layout = k_base, k_lay
        site.k_write, _ = _writes_reason(k_base, k_lay, order, site.node)
        if site.k_write is None:
            site.k_base = None


def _operands_reason(site: AttentionSite, q) -> str:
    """Why a decode site whose K and V read cache buffers (and whose key cache is written once before it) stays
    dense for its arguments: the buffers, their shapes and dtypes, ``is_causal``, dropout ("" when they fit)."""
    a = site.args
    if site.k_base is site.v_base:
        return "K and V read the same buffer"
    if a["is_causal"]:
        return "is_causal=True with one query token attends only the first key; left to SDPA"
    if a["dropout_p"] not in (0, 0.0):
        return "dropout_p != 0"
    k_lay, v_lay = site.k_layout, site.v_layout
    kt, vt = fake(site.k_base), fake(site.v_base)
    k_shape, v_shape = k_lay.full(kt), v_lay.full(vt)
    if k_shape != v_shape or kt.dtype != vt.dtype:
        return f"K and V caches differ in shape or dtype ({k_shape} {kt.dtype} vs {v_shape} {vt.dtype})"
    if k_lay.batch != v_lay.batch or not (k_lay.length is v_lay.length is None or same_int(k_lay.length, v_lay.length)):
        return "K and V read different parts of their caches"
    if kt.dtype != q.dtype:
        return f"query dtype {q.dtype} differs from cache dtype {kt.dtype}"
    return ""


def _prefix_reason(site: AttentionSite, graph: fx.Graph) -> str:
    """Set ``site.kv_len`` to the graph's value of ``n`` when K/V read a ``[:n]`` prefix of the cache; the reason
    why the site stays dense when no value of the graph holds ``n`` ("" otherwise)."""
    length = site.k_layout.length
    if length is None:
        return ""
    site.kv_len = size_node(graph, length)
    if site.kv_len is None:
        return f"K/V read a [:n] prefix of the cache, n={length} is not a value of the graph"
    return ""


def _mask_reason(site: AttentionSite, q) -> str:
    """Why the site's attention mask keeps it dense ("" without a mask, or with one that covers exactly the keys
    read, with 1 or the query's head count of heads)."""
    mask = site.args["attn_mask"]
    if mask is None:
        return ""
    mt = fake(mask)
    if mt is None:
        return "attention mask is not a tensor"
    k_lay = site.k_layout
    kt = fake(site.k_base)
    L = k_lay.full(kt)[2]
    # the mask covers exactly the keys read: the whole cache, or the [:n] prefix read (keys past n are never
    # attended, so the op's mask is padded with "not attended" up to the cache length)
    keys = kt.shape[k_lay.seq_dim] if k_lay.length is None else k_lay.length
    what = f"the cache length {L}" if k_lay.length is None else f"the {k_lay.length} keys read (a [:n] prefix)"
    if mt.dim() > 4 or not same_int(mt.shape[-1], keys):
        if mt.dim() <= 4 and same_int(mt.shape[-1], 1):
            return (f"attention mask shape {tuple(mt.shape)} broadcasts one value over all keys "
                    f"(last dim 1), not one per key of {what}")
        return f"attention mask shape {tuple(mt.shape)} does not cover {what}"
    if mt.dim() == 4 and int(mt.shape[1]) not in (1, int(q.shape[1])):
        return (f"attention mask shape {tuple(mt.shape)} has {int(mt.shape[1])} heads, "
                f"neither 1 nor the {int(q.shape[1])} query heads")
    return ""


def find_decode_attention(gm: fx.GraphModule, config: TinyServeConfig) -> fx.GraphModule:
    """Record an :class:`~.state.AttentionSite` per SDPA call in the graph's :attr:`.state.PassState.sites`."""
    order = node_order(gm.graph)
    sites: List[AttentionSite] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in SDPA_TARGETS:
            continue
        site = AttentionSite(len(sites), node, None, args=sdpa_args(node))
        _classify(site, order, gm.graph)
        sites.append(site)
    pass_state(gm).sites = sites
    return gm
