"""FX helpers shared by the passes: node metadata, view chains, cache layouts, cache-write idioms."""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

SDPA_TARGETS = {
    torch._C._nn.scaled_dot_product_attention,
    F.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
}

#: view-like steps allowed between a cache buffer and the K/V argument of SDPA;
#: the chain is then checked semantically (see :func:`cache_layout`)
VIEW_METHODS = {"expand", "reshape", "view", "contiguous", "repeat_interleave", "unsqueeze", "flatten", "unflatten",
                "transpose", "permute", "clone", "expand_as", "repeat", "narrow", "squeeze", "movedim", "swapaxes",
                "chunk", "split", "unbind", "tensor_split", "split_with_sizes"}
VIEW_FUNCTIONS = {operator.getitem, torch.reshape, torch.unsqueeze, torch.flatten, torch.repeat_interleave,
                  torch.transpose, torch.permute, torch.clone, torch.narrow, torch.squeeze, torch.movedim,
                  torch.swapaxes, torch.chunk, torch.split, torch.unbind, torch.tensor_split}


def fake(node: Any) -> Optional[torch.Tensor]:
    """The example value (FakeTensor) that dynamo recorded for ``node``, if any."""
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("example_value", node.meta.get("val"))
    return v if isinstance(v, torch.Tensor) else None


def _example(node: fx.Node) -> Any:
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
        from torch.fx.experimental.symbolic_shapes import optimization_hint

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


def _static_shape(t: torch.Tensor) -> Optional[Tuple[int, ...]]:
    try:
        return tuple(int(s) for s in t.shape)
    except Exception:  # symbolic sizes
        return None


def is_view_step(node: fx.Node) -> bool:
    if node.op == "call_method" and node.target in VIEW_METHODS:
        return True
    return node.op == "call_function" and node.target in VIEW_FUNCTIONS


def _is_tensor_node(n: fx.Node) -> bool:
    """True unless ``n``'s example value is known to be a non-tensor (a SymInt size, a python scalar).

    A tuple of tensors (the result of ``chunk``/``split``, indexed by ``getitem``) counts as a tensor.
    """
    if "example_value" not in n.meta and "val" not in n.meta:
        return True
    ex = _example(n)
    if isinstance(ex, (tuple, list)):
        return bool(ex) and all(isinstance(t, torch.Tensor) for t in ex)
    return isinstance(ex, torch.Tensor)


def _tensor_inputs(node: fx.Node) -> List[fx.Node]:
    flat: List[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: flat.append(n) if _is_tensor_node(n) else None)
    return flat


def trace_view_chain(node: fx.Node) -> Tuple[Optional[fx.Node], List[fx.Node]]:
    """Walk up view-like steps from ``node`` to a graph input.

    Size arguments (SymInt nodes) may appear in the steps; a step with a second
    tensor operand ends the walk.

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
        if len(inputs) != 1 or not cur.args or cur.args[0] is not inputs[0]:
            return None, chain  # a second tensor operand: not a pure view of one buffer
        chain.append(cur)
        cur = inputs[0]
    chain.reverse()
    return cur, chain


def layout_name(perm: Optional[Tuple[int, ...]]) -> str:
    """``"[B, Hkv, L, D]"``-style name of the buffer layout whose ``permute(perm)`` is ``[B, Hkv, L, D]``."""
    dims = ["B", "Hkv", "L", "D"]
    if perm is None:
        return "[B, Hkv, L, D]"
    names = [""] * 4
    for view_dim, buf_dim in enumerate(perm):
        names[buf_dim] = dims[view_dim]
    return "[" + ", ".join(names) + "]"


@dataclass
class CacheLayout:
    """How SDPA's K (or V) operand reads a cache buffer.

    The operand equals ``repeat_kv(view)`` (or ``view`` under ``enable_gqa``) with
    ``view = buffer[:batch].permute(perm)[:, :, :length]``, ``[B, Hkv, L, D]``.

    Attributes
    ----------
    perm : tuple of int or None
        Buffer dims in view order ``(B, Hkv, L, D)``; None for the identity.
    batch : int or None
        Rows of the buffer read (a ``[:batch]`` slice), None for all of them.
    length : int, SymInt or None
        Keys read along the sequence (a ``[:length]`` prefix), None for the whole buffer.
    """

    perm: Optional[Tuple[int, ...]] = None
    batch: Optional[int] = None
    length: Any = None

    @property
    def seq_dim(self) -> int:
        return 2 if self.perm is None else self.perm[2]

    @property
    def batch_dim(self) -> int:
        return 0 if self.perm is None else self.perm[0]

    def full(self, buffer: torch.Tensor) -> Tuple[int, ...]:
        """The ``[B, Hkv, L, D]`` shape of the whole view (hints for symbolic sizes)."""
        shape = [hint(s) for s in buffer.shape]
        if self.batch is not None:
            shape[self.batch_dim] = self.batch
        perm = self.perm or (0, 1, 2, 3)
        return tuple(shape[p] for p in perm)


def _replay(base: fx.Node, chain: List[fx.Node], code: torch.Tensor) -> torch.Tensor:
    """Run ``chain`` on ``code`` (standing in for ``base``), sizes taken from their hints."""

    def val(a):
        if a in env:
            return env[a]
        ex = _example(a)
        if isinstance(ex, (torch.SymInt, int)):
            return hint(ex)
        raise ValueError(f"view chain argument {a.name} is neither a view nor a size")

    env = {base: code}
    for n in chain:
        args = fx.node.map_arg(n.args, val)
        kwargs = fx.node.map_arg(n.kwargs, val)
        if n.op == "call_method":
            self_obj, *rest = args
            env[n] = getattr(self_obj, n.target)(*rest, **kwargs)
        else:
            env[n] = n.target(*args, **kwargs)
    return env[chain[-1]] if chain else code


def cache_layout(base: fx.Node, chain: List[fx.Node], n_q_heads: int, enable_gqa: bool,
                 operand: Optional[torch.Tensor] = None) -> Union[CacheLayout, str]:
    """Find how ``chain`` reads the 4-D buffer ``base``: a :class:`CacheLayout`, or the reason it is none.

    The chain is re-executed on an integer tensor that encodes every element's
    coordinates in the buffer. The result must read, at ``(b, h, l, d)``, the
    element ``(b, h // G, l, d)`` of ``buffer[:batch].permute(perm)`` for some
    ``perm`` that keeps ``D`` at unit stride, for ``l`` below a prefix length
    (``G = Hq / Hkv``; ``h`` itself under ``enable_gqa``). ``operand`` is SDPA's
    K/V example value (its symbolic sequence length becomes ``length``).
    """
    bt = fake(base)
    if bt is None:
        return "K/V cache buffer has no recorded shape"
    if bt.dim() != 4:
        return f"K/V cache buffer is {bt.dim()}-D {tuple(hint(s) for s in bt.shape)}, not a 4-D [B, Hkv, L, D] layout"
    shape = tuple(hint(s) for s in bt.shape)
    numel = 1
    for s in shape:
        numel *= s
    code = torch.arange(numel, dtype=torch.int32 if numel < 2 ** 31 else torch.int64).reshape(shape)
    try:
        out = _replay(base, chain, code)
    except Exception as e:  # noqa: BLE001 - shapes baked into the chain that we cannot replay
        return f"cannot replay the K/V view chain ({type(e).__name__}: {str(e)[:80]})"
    if out.dim() != 4:
        return f"K/V view chain gives a {out.dim()}-D operand {tuple(out.shape)}, not [B, H, L, D]"
    b, h_out, l_out, d_out = out.shape
    want = None
    candidates = []  # buffer dims read as (B, Hkv, L, D), by size
    for perm in itertools.permutations(range(4)):
        B, Hkv, L, D = (shape[p] for p in perm)
        if D == d_out and b <= B and l_out <= L:
            candidates.append(perm)
    for perm in candidates:
        B, Hkv, L, D = (shape[p] for p in perm)
        want = Hkv if enable_gqa else n_q_heads
        if h_out != want or n_q_heads % Hkv:
            continue
        expect = code.permute(perm)[:b, :, :l_out]
        if not enable_gqa and n_q_heads > Hkv:
            expect = expect.repeat_interleave(n_q_heads // Hkv, dim=1)
        if not torch.equal(out, expect):
            continue
        if bt.stride()[perm[3]] != 1:
            return (f"cache layout {layout_name(perm)} stores head_dim with stride {bt.stride()[perm[3]]} "
                    f"(the op reads D at unit stride)")
        batch = None if b == B else b
        if batch is not None and operand is not None and not isinstance(operand.shape[0], int):
            return f"K/V read a dynamic number of the cache's {B} rows (batch slice of symbolic size)"
        length = None
        if l_out != L:
            length = operand.shape[2] if operand is not None else l_out
        return CacheLayout(None if perm == (0, 1, 2, 3) else tuple(perm), batch, length)
    near = [p for p in candidates if h_out in (n_q_heads, shape[p[1]])] or candidates
    return _layout_reason(code, out, shape, n_q_heads, enable_gqa, near[0] if near else None)


def _layout_reason(code, out, shape, n_q_heads, enable_gqa, perm) -> str:
    """The reason no layout matched, naming the nearest one (``perm``, or the identity)."""
    b, h_out, l_out, d_out = out.shape
    perm = perm or (0, 1, 2, 3)
    B, Hkv, L, D = (shape[p] for p in perm)
    name = layout_name(perm if perm != (0, 1, 2, 3) else None)
    if D != d_out:
        return f"K/V view chain gives shape {tuple(out.shape)}: no cache dim of size head_dim={d_out}"
    if not enable_gqa and n_q_heads % Hkv:
        return f"query heads ({n_q_heads}) are not a multiple of cache heads ({Hkv}, cache layout {name})"
    want = Hkv if enable_gqa else n_q_heads
    if h_out != want:
        return f"K/V view chain gives shape {tuple(out.shape)}, expected {want} heads (cache layout {name})"
    view = code.permute(perm)[:b]
    G = n_q_heads // Hkv
    if l_out <= L and G > 1 and not enable_gqa and torch.equal(out, view.repeat(1, G, 1, 1)[:, :, :l_out]):
        return (f"grouped heads: K/V heads are tiled (query head h reads cache head h % {Hkv}), "
                f"not repeat_kv (h // {G})")
    first = int(out.reshape(-1)[0])
    coords, rest = [], first
    for s in reversed(shape):
        coords.append(rest % s)
        rest //= s
    coords.reverse()
    start = coords[perm[2]]
    if l_out <= L - start:
        window = view[:, :, start:start + l_out]
        if not enable_gqa and G > 1:
            window = window.repeat_interleave(G, dim=1)
        if torch.equal(out, window):
            return (f"K/V read cache positions [{start}, {start + l_out}) of {L}: a window that does not start "
                    f"at 0 (sliding-window read)")
    return f"K/V view chain is not repeat_kv of the cache (head order or layout differs; nearest layout {name})"


def chain_is_repeat_kv(base: fx.Node, chain: List[fx.Node], n_q_heads: int, enable_gqa: bool) -> Optional[str]:
    """None when ``chain`` reads ``base`` as the whole ``[B, Hkv, L, D]`` buffer through ``repeat_kv``, else why not."""
    lay = cache_layout(base, chain, n_q_heads, enable_gqa)
    if isinstance(lay, str):
        return lay
    if lay.perm is not None or lay.batch is not None or lay.length is not None:
        return f"cache layout {layout_name(lay.perm)} read through a view"
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
    """One recognised write into a cache buffer along its sequence dim.

    ``kind`` is ``index_copy_``, ``setitem``, ``index_put_`` or ``slice_copy_``;
    ``positions`` is a node (int64 positions) or a ``(start, stop)`` pair of
    int/SymInt nodes, indexing the buffer's sequence dim. ``src`` is in the
    buffer's own layout: ``src.permute(perm)`` is ``[B, Hkv, n, D]``, written into
    ``buffer[:batch].permute(perm)`` at ``positions`` along dim 2 (``perm`` None:
    the identity; ``batch`` None: every row).
    """

    node: fx.Node
    kind: str
    src: fx.Node
    positions: Any
    extra_nodes: List[fx.Node] = field(default_factory=list)
    perm: Optional[Tuple[int, ...]] = None
    batch: Optional[int] = None


def _full(s) -> bool:
    return isinstance(s, slice) and s == slice(None, None, None)


def _expand_key(key, ndim: int) -> Optional[list]:
    """A ``__setitem__``/``__getitem__`` key as one entry per dim (None: not a plain per-dim key)."""
    key = list(key) if isinstance(key, tuple) else [key]
    if any(k is None for k in key) or sum(k is Ellipsis for k in key) > 1:
        return None
    if Ellipsis in key:
        i = key.index(Ellipsis)
        key = key[:i] + [slice(None)] * (ndim - len(key) + 1) + key[i + 1:]
    if len(key) > ndim:
        return None
    return key + [slice(None)] * (ndim - len(key))


def _batch_rows(entry, size) -> Union[None, int, str]:
    """None for all ``size`` rows, an int for a ``[:b]`` prefix, "bad" for anything else."""
    if _full(entry):
        return None
    if isinstance(entry, slice) and entry.start in (None, 0) and entry.step in (None, 1):
        stop = _example(entry.stop) if isinstance(entry.stop, fx.Node) else entry.stop
        if isinstance(stop, int) and not isinstance(stop, bool):
            return None if stop >= size else stop
    return "bad"


def match_cache_write(base: fx.Node, node: fx.Node, layout: Optional[CacheLayout] = None) -> Optional[CacheWrite]:
    """Recognise ``node`` as a sequence-dim write into ``base`` read through ``layout`` (default ``[B, Hkv, L, D]``)."""
    layout = layout or CacheLayout()
    sd, bd = layout.seq_dim, layout.batch_dim
    bt = fake(base)
    size = {i: hint(s) for i, s in enumerate(bt.shape)} if bt is not None else {}

    def per_dim(key, what_ok) -> Optional[Tuple[Any, Optional[int]]]:
        """``(entry of the sequence dim, batch rows)`` when every other dim is whole (batch: a prefix)."""
        ks = _expand_key(key, 4)
        if ks is None:
            return None
        rows = _batch_rows(ks[bd], size.get(bd, 0))
        if rows == "bad" or rows != layout.batch:
            return None
        if not all(_full(k) for i, k in enumerate(ks) if i not in (sd, bd)):
            return None
        return (ks[sd], rows) if what_ok(ks[sd]) else None

    def is_index(idx) -> bool:
        t = fake(idx)
        return isinstance(idx, fx.Node) and t is not None and not t.is_floating_point() and t.dtype != torch.bool \
            and t.dim() <= 1

    def is_range(idx) -> bool:
        return isinstance(idx, slice) and idx.step in (None, 1) and idx.start is not None and idx.stop is not None

    def make(kind, src, idx, rows, extra=()) -> Optional[CacheWrite]:
        if not isinstance(src, fx.Node):
            return None
        pos = idx if isinstance(idx, fx.Node) else (idx.start, idx.stop)
        return CacheWrite(node, kind, src, pos, list(extra), layout.perm, rows)

    if node.op == "call_method" and node.target == "index_copy_" and node.args[0] is base:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        index = node.args[2] if len(node.args) > 2 else node.kwargs.get("index")
        src = node.args[3] if len(node.args) > 3 else node.kwargs.get("source")
        if isinstance(dim, int) and dim % 4 == sd and layout.batch is None and isinstance(index, fx.Node):
            return make("index_copy_", src, index, None)
        return None
    if node.op == "call_function" and node.target is operator.setitem and node.args[0] is base:
        m = per_dim(node.args[1], lambda i: is_index(i) or is_range(i))
        return make("setitem", node.args[2], m[0], m[1]) if m else None
    if node.op == "call_method" and node.target == "index_put_" and node.args[0] is base:
        indices, src = node.args[1], node.args[2]
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        if isinstance(indices, (tuple, list)) and len(indices) == sd + 1 and all(i is None for i in indices[:sd]) \
                and is_index(indices[sd]) and not accumulate and layout.batch is None:
            return make("index_put_", src, indices[sd], None)
        return None
    if node.op == "call_method" and node.target == "copy_":
        dst = node.args[0]
        if isinstance(dst, fx.Node) and dst.op == "call_function" and dst.target is operator.getitem \
                and dst.args[0] is base:
            m = per_dim(dst.args[1], is_range)
            return make("slice_copy_", node.args[1], m[0], m[1], [dst]) if m else None
    return None


def cache_writes(base: fx.Node, layout: Optional[CacheLayout] = None) -> Tuple[List[CacheWrite], List[fx.Node]]:
    """Recognised writes into ``base`` and the in-place ops on it (or its views) that are not."""
    writes, unknown = [], []
    for v in views_of(base):
        for u in v.users:
            if not _is_inplace(u):
                continue
            w = match_cache_write(base, u, layout)
            if w is None:
                unknown.append(u)
            elif all(w.node is not x.node for x in writes):
                writes.append(w)
    return writes, unknown


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


def first_non_view(node: fx.Node) -> fx.Node:
    """The first node above ``node`` that is not a single-tensor view step."""
    cur = node
    while is_view_step(cur) and len(_tensor_inputs(cur)) == 1 and cur.args and cur.args[0] is _tensor_inputs(cur)[0]:
        cur = cur.args[0]
    return cur


def is_written_in_place(node: fx.Node) -> bool:
    """True when a graph input is mutated in place by the graph (a cache buffer)."""
    return any(_is_inplace(u) and u.args and u.args[0] is v for v in views_of(node) for u in v.users)


def is_sliding_window_write(base: fx.Node, node: fx.Node) -> bool:
    """``base.copy_(src)`` (the whole buffer) with ``src`` derived from ``base.roll(...)``: a rolling window cache."""
    if not (node.op == "call_method" and node.target == "copy_" and node.args[0] is base and len(node.args) > 1):
        return False
    src = node.args[1]
    return isinstance(src, fx.Node) and any(
        getattr(a.target, "__name__", a.target) == "roll" and a.args and a.args[0] is base
        for a in [src] + ancestors(src))


def describe_write(node: fx.Node) -> str:
    """A short readable form of an in-place node, for reasons."""
    if node.op == "call_function" and node.target is operator.setitem:
        return f"cache[{_fmt_key(node.args[1])}] = ..."
    if node.op == "call_method" and node.target == "copy_" and isinstance(node.args[0], fx.Node) \
            and node.args[0].target is operator.getitem:
        return f"cache[{_fmt_key(node.args[0].args[1])}].copy_(...)"
    if node.op == "call_method":
        args = ", ".join(_fmt(a) for a in node.args[1:])
        return f"{node.target}({args})"
    return str(getattr(node.target, "__name__", node.target))


def _fmt(a) -> str:
    if isinstance(a, fx.Node):
        ex = _example(a)
        if isinstance(ex, torch.Tensor):
            return f"<{str(ex.dtype).replace('torch.', '')}{list(hint(s) for s in ex.shape)}>"
        return a.name
    if isinstance(a, slice):
        parts = ["" if x is None else _fmt(x) for x in (a.start, a.stop)]
        return ":".join(parts) + ("" if a.step in (None, 1) else f":{_fmt(a.step)}")
    if isinstance(a, (tuple, list)):
        return "(" + ", ".join(_fmt(x) for x in a) + ")"
    return "..." if a is Ellipsis else repr(a)


def _fmt_key(key) -> str:
    return ", ".join(_fmt(k) for k in (key if isinstance(key, tuple) else (key,)))


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


def cache_view(graph: fx.Graph, buffer: fx.Node, perm: Optional[Tuple[int, ...]], batch: Optional[int],
               batch_dim: int = 0) -> fx.Node:
    """Insert ``buffer[:batch].permute(perm)`` (the ``[B, Hkv, L, D]`` view the ops take); ``buffer`` itself when trivial."""
    out = buffer
    if batch is not None:
        out = graph.call_function(torch.ops.aten.slice.Tensor, (out, batch_dim, 0, batch))
    if perm is not None:
        out = graph.call_function(torch.ops.aten.permute.default, (out, list(perm)))
    return out


def size_node(graph: fx.Graph, size: Any) -> Any:
    """An int as itself, or the graph node whose SymInt value provably equals ``size`` (None when there is none)."""
    if isinstance(size, int):
        return size
    for n in graph.nodes:
        if n.op != "output" and isinstance(_example(n), torch.SymInt) and same_int(_example(n), size):
            return n
    return None


def decode_valid_len(graph: fx.Graph, k_view: fx.Node, attn_mask: Optional[fx.Node], length: Any,
                     device) -> fx.Node:
    """Insert the int64 ``[1]`` valid length of a rewritten decode site: the keys dense SDPA can attend.

    With a mask, one past the newest position the mask allows in any row (later
    keys are masked for every row); without one, every key read: the ``[:n]``
    prefix ``length`` (an int or a SymInt node) or the whole sequence dim of
    ``k_view`` (``[B, Hkv, L, D]``). This is how
    :func:`tinyserve_compile.testing.reference_sparse_attention` reads it too.
    """
    call = graph.call_function
    aten = torch.ops.aten
    if attn_mask is None:
        n = length if length is not None else call(aten.sym_size.int, (k_view, 2))
        return call(aten.full.default, ([1], n), {"dtype": torch.int64, "device": device})
    L = call(aten.sym_size.int, (attn_mask, -1))
    mt = fake(attn_mask)
    allowed = attn_mask if mt is not None and mt.dtype == torch.bool else \
        call(aten.gt.Scalar, (attn_mask, float("-inf")))
    ends = call(aten.arange.start, (1, call(operator.add, (L, 1))), {"dtype": torch.int64, "device": device})
    last = call(aten.amax.default, (call(aten.mul.Tensor, (allowed, ends)), []))  # newest allowed + 1
    return call(aten.reshape.default, (last, [1]))
