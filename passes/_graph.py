"""FX helpers shared by the passes: node metadata, view chains, cache-write idioms."""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

SDPA_TARGETS = {
    torch._C._nn.scaled_dot_product_attention,
    F.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
}

#: view-like steps allowed between a cache buffer and the K/V argument of SDPA;
#: the chain is then checked semantically (see ``chain_is_repeat_kv``)
VIEW_METHODS = {"expand", "reshape", "view", "contiguous", "repeat_interleave", "unsqueeze", "flatten", "unflatten",
                "transpose", "permute", "clone", "expand_as", "repeat"}
VIEW_FUNCTIONS = {operator.getitem, torch.reshape, torch.unsqueeze, torch.flatten, torch.repeat_interleave,
                  torch.transpose, torch.permute, torch.clone}


def fake(node: Any) -> Optional[torch.Tensor]:
    """The example value (FakeTensor) that dynamo recorded for ``node``, if any."""
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("example_value", node.meta.get("val"))
    return v if isinstance(v, torch.Tensor) else None


def _static_shape(t: torch.Tensor) -> Optional[Tuple[int, ...]]:
    try:
        return tuple(int(s) for s in t.shape)
    except Exception:  # symbolic sizes
        return None


def is_view_step(node: fx.Node) -> bool:
    if node.op == "call_method" and node.target in VIEW_METHODS:
        return True
    return node.op == "call_function" and node.target in VIEW_FUNCTIONS


def _tensor_inputs(node: fx.Node) -> List[fx.Node]:
    flat: List[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: flat.append(n))
    return flat


def trace_view_chain(node: fx.Node) -> Tuple[Optional[fx.Node], List[fx.Node]]:
    """Walk up view-like steps from ``node`` to a graph input.

    Returns
    -------
    (base, chain)
        ``base`` is the placeholder reached (or None), ``chain`` the view steps
        from base (exclusive) to ``node`` (inclusive), in execution order.
    """
    chain: List[fx.Node] = []
    cur = node
    while cur.op != "placeholder":
        if not is_view_step(cur):
            return None, chain
        inputs = _tensor_inputs(cur)
        if len(inputs) != 1:  # a second tensor operand: not a pure view of one buffer
            return None, chain
        chain.append(cur)
        cur = inputs[0]
    chain.reverse()
    return cur, chain


def chain_is_repeat_kv(base: fx.Node, chain: List[fx.Node], n_q_heads: int, enable_gqa: bool) -> Optional[str]:
    """Check that ``chain`` applied to the buffer ``base`` ``[B, Hkv, L, D]`` is HF's ``repeat_kv``.

    The chain is re-executed on an integer tensor that encodes every element's
    coordinates; the result must read element ``(b, h // G, l, d)`` at ``(b, h, l, d)``
    (or be the buffer itself under ``enable_gqa=True``). Returns None when it is,
    else the reason it is not.
    """
    bt = fake(base)
    if bt is None or bt.dim() != 4:
        return "K/V cache buffer is not a 4-D [B, H, L, D] tensor"
    shape = _static_shape(bt)
    if shape is None:
        return "K/V cache buffer has a dynamic shape"
    B, Hkv, L, D = shape
    if n_q_heads % Hkv:
        return f"query heads ({n_q_heads}) are not a multiple of cache heads ({Hkv})"
    G = n_q_heads // Hkv
    code = torch.arange(B * Hkv * L * D, dtype=torch.int64).reshape(B, Hkv, L, D)
    env = {base: code}
    try:
        for n in chain:
            args = fx.node.map_arg(n.args, lambda a: env[a])
            kwargs = fx.node.map_arg(n.kwargs, lambda a: env[a])
            if n.op == "call_method":
                self_obj, *rest = args
                env[n] = getattr(self_obj, n.target)(*rest, **kwargs)
            else:
                env[n] = n.target(*args, **kwargs)
        out = env[chain[-1]] if chain else code
    except Exception as e:  # shapes baked into the chain that we cannot replay
        return f"cannot replay the K/V view chain ({type(e).__name__})"
    want_heads = Hkv if enable_gqa else n_q_heads
    if tuple(out.shape) != (B, want_heads, L, D):
        return f"K/V view chain gives shape {tuple(out.shape)}, expected {(B, want_heads, L, D)}"
    expect = code if enable_gqa else code.repeat_interleave(G, dim=1)
    if not torch.equal(out, expect):
        return "K/V view chain is not repeat_kv of the cache (head order or layout differs)"
    return None


def _is_inplace(node: fx.Node) -> bool:
    if node.op == "call_method":
        t = str(node.target)
        return t.endswith("_") and not t.endswith("__")
    if node.op == "call_function":
        if node.target is operator.setitem:
            return True
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.endswith("__") and name != "_"
    return False


def views_of(base: fx.Node) -> List[fx.Node]:
    """``base`` and every node reachable from it through view-like steps."""
    seen, todo = [base], [base]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in seen and is_view_step(u) and _tensor_inputs(u)[:1] == [n]:
                seen.append(u)
                todo.append(u)
    return seen


@dataclass
class CacheWrite:
    """One recognised write into a cache buffer along the sequence dim (dim 2).

    ``kind`` is ``index_copy_``, ``setitem`` or ``slice_copy_``; ``positions`` is a
    node (int64 positions) or a ``(start, stop)`` pair of int/SymInt nodes.
    """

    node: fx.Node
    kind: str
    src: fx.Node
    positions: Any
    extra_nodes: List[fx.Node] = field(default_factory=list)


def _full(s) -> bool:
    return isinstance(s, slice) and s == slice(None, None, None)


def match_cache_write(base: fx.Node, node: fx.Node) -> Optional[CacheWrite]:
    """Recognise ``node`` as a sequence-dim write into ``base`` ``[B, H, L, D]``."""
    if node.op == "call_method" and node.target == "index_copy_" and node.args[0] is base:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        index = node.args[2] if len(node.args) > 2 else node.kwargs.get("index")
        src = node.args[3] if len(node.args) > 3 else node.kwargs.get("source")
        if dim in (2, -2) and isinstance(index, fx.Node) and isinstance(src, fx.Node):
            return CacheWrite(node, "index_copy_", src, index)
        return None
    if node.op == "call_function" and node.target is operator.setitem and node.args[0] is base:
        key, src = node.args[1], node.args[2]
        if isinstance(key, tuple) and len(key) in (3, 4) and _full(key[0]) and _full(key[1]) and \
                all(_full(k) or k is Ellipsis for k in key[3:]) and isinstance(src, fx.Node):
            idx = key[2]
            if isinstance(idx, fx.Node) and fake(idx) is not None and not fake(idx).is_floating_point():
                return CacheWrite(node, "setitem", src, idx)
            if isinstance(idx, slice) and idx.step in (None, 1) and idx.start is not None and idx.stop is not None:
                return CacheWrite(node, "setitem", src, (idx.start, idx.stop))
        return None
    if node.op == "call_method" and node.target == "index_put_" and node.args[0] is base:
        indices, src = node.args[1], node.args[2]
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        if isinstance(indices, (tuple, list)) and len(indices) == 3 and indices[0] is None and indices[1] is None \
                and isinstance(indices[2], fx.Node) and not accumulate and isinstance(src, fx.Node):
            return CacheWrite(node, "index_put_", src, indices[2])
        return None
    if node.op == "call_method" and node.target == "copy_":
        dst = node.args[0]
        if isinstance(dst, fx.Node) and dst.op == "call_function" and dst.target is operator.getitem \
                and dst.args[0] is base:
            key = dst.args[1]
            if isinstance(key, tuple) and len(key) in (3, 4) and _full(key[0]) and _full(key[1]) \
                    and isinstance(key[2], slice) and key[2].step in (None, 1) \
                    and key[2].start is not None and key[2].stop is not None \
                    and all(_full(k) for k in key[3:]):
                return CacheWrite(node, "slice_copy_", node.args[1], (key[2].start, key[2].stop), [dst])
    return None


def cache_writes(base: fx.Node) -> Tuple[List[CacheWrite], List[fx.Node]]:
    """Recognised writes into ``base`` and the in-place ops on it (or its views) that are not."""
    writes, unknown = [], []
    for v in views_of(base):
        for u in v.users:
            if not _is_inplace(u):
                continue
            w = match_cache_write(base, u)
            if w is None:
                unknown.append(u)
            elif w not in writes:
                writes.append(w)
    return writes, unknown


def sdpa_args(node: fx.Node) -> dict:
    """Normalised SDPA arguments of ``node``."""
    names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
    out = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)
    for name, a in zip(names, node.args):
        out[name] = a
    out.update(node.kwargs)
    return out


def node_order(graph: fx.Graph) -> dict:
    return {n: i for i, n in enumerate(graph.nodes)}
