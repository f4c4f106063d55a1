"""What an FX node is and what dynamo recorded for it: example values, size hints, SDPA calls, in-place ops."""
from __future__ import annotations

import operator
from typing import Any, List, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

SDPA_TARGETS = {
    torch._C._nn.scaled_dot_product_attention,
    F.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
}


def fake(node: Any) -> Optional[torch.Tensor]:
    """The example value (FakeTensor) that dynamo recorded for ``node``, if any."""
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("example_value", node.meta.get("val"))
    return v if isinstance(v, torch.Tensor) else None


def example_value(node: fx.Node) -> Any:
    """The value dynamo recorded for ``node``, of any type (a tensor, a SymInt, a tuple of tensors), or None."""
    return node.meta.get("example_value", node.meta.get("val"))


def is_dtensor(t: Any) -> bool:
    """True for a DTensor (a tensor-parallel plan that keeps DTensor activations)."""
    if not isinstance(t, torch.Tensor) or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def hint(x: Any) -> Any:
    """A concrete int for an int or SymInt (its size hint); anything else unchanged."""
    if isinstance(x, torch.SymInt):
        try:
            from torch.fx.experimental.symbolic_shapes import optimization_hint
        except ImportError:  # torch 2.8 names it hint_int
            from torch.fx.experimental.symbolic_shapes import hint_int as optimization_hint

        return int(optimization_hint(x))
    return x


def same_int(a: Any, b: Any) -> bool:
    """True when ints/SymInts ``a`` and ``b`` are provably equal (no guard added)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001 - mixed symbolic kinds: not provable
        return False


def is_inplace(node: fx.Node) -> bool:
    """True for an in-place op (a method or function whose name ends in one ``_``, or ``setitem``)."""
    if node.op == "call_method":
        t = str(node.target)
        return t.endswith("_") and not t.endswith("__")
    if node.op == "call_function":
        if node.target is operator.setitem:
            return True
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.endswith("__") and name != "_"
    return False


def returns_self(node: fx.Node) -> bool:
    """True for an in-place method call (``x.index_copy_(...)``), and for a conversion that converts nothing
    (``x.to(y)``, ``x.type_as(y)``, ``x.to(dtype)`` at ``x``'s own dtype and device, as Meta's reference Llama
    does with its caches each call): its value is ``x`` itself."""
    if node.op != "call_method" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if is_inplace(node):
        return True
    return node.target in ("to", "type_as") and len(node.args) == 2 and not node.kwargs.get("copy", False) \
        and _same_tensor_type(fake(node.args[0]), fake(node))


def _same_tensor_type(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    """``a.to(...)`` returned ``a`` itself: the same dtype, device, shape and strides (the graph is guarded on them)."""
    return a is not None and b is not None and a.dtype == b.dtype and a.device == b.device \
        and tuple(a.shape) == tuple(b.shape) and a.stride() == b.stride()


def ancestors(node: fx.Node, limit: int = 400) -> List[fx.Node]:
    """Nodes ``node`` depends on, nearest first (at most ``limit``)."""
    seen, todo, out = {node}, [node], []
    while todo and len(out) < limit:
        n = todo.pop(0)
        for i in n.all_input_nodes:
            if i not in seen:
                seen.add(i)
                out.append(i)
                todo.append(i)
    return out


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


def size_node(graph: fx.Graph, size: Any) -> Any:
    """An int as itself, or the graph node whose SymInt value provably equals ``size`` (None when there is none)."""
    if isinstance(size, int):
        return size
    for n in graph.nodes:
        if n.op != "output" and isinstance(example_value(n), torch.SymInt) and same_int(example_value(n), size):
            return n
    return None
