"""FX helpers shared by the passes: node metadata, view chains, cache layouts, cache-write idioms."""
from __future__ import annotations

import contextlib
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
    tensor operand ends the walk. An in-place method (``index_copy_``,
    ``copy_``, ...) returns its own ``self``: the walk goes on through it (it is
    in the chain, and :func:`_replay` treats it as the identity).

    Returns
    -------
    (base, chain)
        ``base`` is the placeholder reached (or None), ``chain`` the view steps
        from base (exclusive) to ``node`` (inclusive), in execution order.
    """
    chain: List[fx.Node] = []
    cur = node
    while cur.op != "placeholder":
        if returns_self(cur):  # x.index_copy_(...) and friends return x itself: an alias, not a new value
            chain.append(cur)
            cur = cur.args[0]
            continue
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
        if returns_self(n):
            env[n] = env[n.args[0]]
            continue
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
        # the operand holds the cache heads themselves (enable_gqa, or one head that SDPA broadcasts: MQA), or
        # repeat_kv of them (one per query head)
        direct = h_out == Hkv and (enable_gqa or Hkv in (1, n_q_heads))
        if not (direct or (not enable_gqa and h_out == n_q_heads)) or n_q_heads % Hkv:
            continue
        expect = code.permute(perm)[:b, :, :l_out]
        if not direct:
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


def views_of(base: fx.Node) -> List[fx.Node]:
    """``base`` and every node reachable from it through view-like steps (and in-place results, which alias)."""
    seen, todo = [base], [base]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in seen:
                continue
            if (is_view_step(u) and _tensor_inputs(u)[:1] == [n]) or (returns_self(u) and u.args[0] is n):
                seen.append(u)
                todo.append(u)
    return seen


@dataclass
class CacheWrite:
    """One recognised write into a cache buffer along its sequence dim.

    ``kind`` is ``index_copy_``, ``setitem``, ``index_put_`` or ``slice_copy_``;
    ``positions`` is a node (integer positions of any dtype, 0-d or 1-D) or a
    ``(start, stop)`` pair of ints/SymInt nodes, indexing the buffer's sequence
    dim. The write goes into ``buffer[:batch].permute(perm)`` (``[B, Hkv, L, D]``;
    ``perm`` None: the identity; ``batch`` None: every row) at ``positions`` along
    dim 2, and writes ``src.unsqueeze(src_unsqueeze).permute(src_perm)``
    (``[B, Hkv, n, D]``; each step skipped when None). The write may go through
    a view of the buffer (a ``[:b]`` batch slice, a ``[:n]`` sequence prefix, a
    transpose, negative dims); ``src`` is in that view's dim order.
    """

    node: fx.Node
    kind: str
    src: fx.Node
    positions: Any
    extra_nodes: List[fx.Node] = field(default_factory=list)
    perm: Optional[Tuple[int, ...]] = None
    batch: Optional[int] = None
    src_perm: Optional[Tuple[int, ...]] = None
    src_unsqueeze: Optional[int] = None


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


def _coordinate_code(shape: Tuple[int, ...]) -> torch.Tensor:
    """An integer tensor of ``shape`` whose elements are their own flat index (it encodes coordinates)."""
    numel = 1
    for s in shape:
        numel *= s
    return torch.arange(numel, dtype=torch.int32 if numel < 2 ** 31 else torch.int64).reshape(shape)


def _region(code: torch.Tensor, shape: Tuple[int, ...], r: torch.Tensor):
    """``(perm, start, size)`` when ``r`` (a view of ``code``) is ``code.permute(perm)`` cut to a box, else None.

    ``perm[d]`` is the buffer dim that dim ``d`` of ``r`` walks along (stride +1);
    ``start`` and ``size`` are per buffer dim.
    """
    nd = len(shape)
    if r.dim() != nd or r.numel() == 0:
        return None

    def coords(flat: int) -> List[int]:
        out = []
        for s in reversed(shape):
            out.append(flat % s)
            flat //= s
        return out[::-1]

    first = coords(int(r.reshape(-1)[0]))
    perm: List[Optional[int]] = [None] * nd
    for d in range(nd):
        if r.shape[d] < 2:
            continue
        idx = [0] * nd
        idx[d] = 1
        delta = [a - b for a, b in zip(coords(int(r[tuple(idx)])), first)]
        moved = [i for i, x in enumerate(delta) if x != 0]
        if len(moved) != 1 or delta[moved[0]] != 1 or moved[0] in perm:
            return None
        perm[d] = moved[0]
    free = [b for b in range(nd) if b not in perm]
    for d in range(nd):
        if perm[d] is None:
            perm[d] = free.pop(0)
    start = tuple(first)
    size = [0] * nd
    for d in range(nd):
        size[perm[d]] = int(r.shape[d])
    box = code.permute(perm)[tuple(slice(start[perm[d]], start[perm[d]] + size[perm[d]]) for d in range(nd))]
    if not torch.equal(r, box):
        return None
    return tuple(perm), start, tuple(size)


def _hint_slice(entry) -> Optional[slice]:
    """A slice key entry with its int/SymInt nodes replaced by their size hints (None: not such a slice)."""
    if not isinstance(entry, slice):
        return None
    parts = []
    for x in (entry.start, entry.stop, entry.step):
        if isinstance(x, fx.Node):
            ex = _example(x)
            if not isinstance(ex, (int, torch.SymInt)):
                return None
            x = hint(ex)
        parts.append(x)
    return slice(*parts)


def _written_part(node: fx.Node):
    """``(kind, target, key, index_copy, src, extra)`` of an in-place node, a reason string, or None.

    ``target`` is the tensor written into; ``key`` the per-dim entries applied to
    it (``index_copy_``: None, and ``index_copy`` holds ``(dim, index)``).
    """
    def arg(i, name, default=None):
        return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)

    if node.op == "call_method" and node.target == "index_copy_":
        dim, index, src = arg(1, "dim"), arg(2, "index"), arg(3, "source")
        if not isinstance(dim, int):
            return "index_copy_ along a dim that is not a constant"
        return "index_copy_", node.args[0], None, (dim, index), src, []
    if node.op == "call_function" and node.target is operator.setitem:
        return "setitem", node.args[0], node.args[1], None, node.args[2], []
    if node.op == "call_method" and node.target == "index_put_":
        indices, src, accumulate = arg(1, "indices"), arg(2, "values"), arg(3, "accumulate", False)
        if accumulate:
            return "index_put_ with accumulate=True adds into the cache instead of writing it"
        if not isinstance(indices, (tuple, list)):
            return None
        given = [i for i, x in enumerate(indices) if x is not None]
        if len(given) != 1:
            return f"index_put_ indexes {len(given)} dims of the cache (only the sequence dim may be indexed)"
        key = [slice(None)] * given[0] + [indices[given[0]]]
        return "index_put_", node.args[0], tuple(key), None, src, []
    if node.op == "call_method" and node.target == "copy_":
        dst = node.args[0]
        if isinstance(dst, fx.Node) and dst.op == "call_function" and dst.target is operator.getitem:
            return "slice_copy_", dst.args[0], dst.args[1], None, node.args[1], [dst]
    return None


def match_cache_write(base: fx.Node, node: fx.Node, layout: Optional[CacheLayout] = None) -> Union[CacheWrite, str, None]:
    """Recognise ``node`` as a sequence-dim write into ``base`` read through ``layout`` (default ``[B, Hkv, L, D]``).

    The tensor written may be any view of ``base`` that :func:`trace_view_chain`
    follows: the write's region is found by replaying that chain on a tensor that
    encodes element coordinates, so a ``[:b]`` batch slice, a ``[:n]`` prefix of
    the sequence dim, a transpose or a negative dim all resolve to the buffer's
    own dims. Returns the :class:`CacheWrite`, a reason string for a write of a
    known form that does not fit, or None for any other in-place op.
    """
    layout = layout or CacheLayout()
    bt = fake(base)
    if bt is None or bt.dim() != 4:
        return None
    parts = _written_part(node)
    if not isinstance(parts, tuple):
        return parts
    kind, target, key, index_copy, src, extra = parts
    if not isinstance(target, fx.Node) or not isinstance(src, fx.Node):
        return None
    root, chain = trace_view_chain(target)
    if root is not base:
        return None
    shape = tuple(hint(s) for s in bt.shape)
    code = _coordinate_code(shape)
    try:
        t = _replay(base, chain, code)
    except Exception:  # noqa: BLE001 - a view chain that cannot be replayed
        return None
    if t.dim() != 4:
        return f"the write goes through a {t.dim()}-D view of the cache, not one with its 4 dims"
    lay_perm = layout.perm or (0, 1, 2, 3)
    sd_buf, bd_buf = layout.seq_dim, layout.batch_dim
    tgt = _region(code, shape, t)
    if tgt is None:
        return "the write goes through a view of the cache that is not a box of it (a reshape or a gather)"
    sd = tgt[0].index(sd_buf)  # the sequence dim, counted in the written view
    squeeze = None
    if index_copy is not None:
        dim, pos = index_copy
        if dim % 4 != sd:
            return f"along dim {dim} of the written view, not its sequence dim {sd}"
        region = t
    else:
        ks = _expand_key(key, 4)
        if ks is None:
            return f"the write's index {_fmt_key(key)} is not one entry per cache dim"
        pos = ks[sd]
        rest = []
        for i, k in enumerate(ks):
            hk = slice(None) if i == sd else _hint_slice(k)
            if hk is None:
                return (f"the write indexes dim {i} of the cache with {_fmt(k)} "
                        f"(only the sequence dim {sd} may hold positions)")
            rest.append(hk)
        region = t[tuple(rest)]
        if isinstance(pos, slice):
            if pos.step not in (None, 1) or pos.stop is None:
                return f"the write takes the slice {_fmt(pos)} of the sequence dim (no end, or a step)"
        elif not isinstance(pos, fx.Node):
            return f"the sequence dim is indexed with {_fmt(pos)}, not with positions"
        elif fake(pos) is not None and fake(pos).dim() == 0:
            squeeze = sd  # a 0-d position drops the sequence dim: the source has none
    if isinstance(pos, fx.Node):
        pt = fake(pos)
        if pt is None or pt.is_floating_point() or pt.is_complex() or pt.dtype == torch.bool:
            return "the positions written are not an integer tensor"
        if pt.dim() > 1:
            return (f"the positions written are a {pt.dim()}-D tensor {tuple(hint(s) for s in pt.shape)} "
                    f"(per-row positions); the write op writes the same positions in every row")
    got = _region(code, shape, region)
    if got is None:
        return "the write goes through a view of the cache that is not a box of it"
    r_perm, start, size = got
    if r_perm.index(sd_buf) != sd:
        return "the written view reorders the sequence dim"
    if start[sd_buf] != 0:
        return (f"the write goes through a view that starts at sequence position {start[sd_buf]} "
                f"(the positions would be offset)")
    for b in range(4):
        if b not in (sd_buf, bd_buf) and (start[b] != 0 or size[b] != shape[b]):
            return (f"the write covers [{start[b]}, {start[b] + size[b]}) of cache dim {b} (size {shape[b]}), "
                    f"not all of it")
    if start[bd_buf] != 0:
        return f"the write goes through rows [{start[bd_buf]}, ...) of the cache, not a [:b] prefix"
    rows = None if size[bd_buf] == shape[bd_buf] else size[bd_buf]
    if rows != layout.batch:
        read = "all rows" if layout.batch is None else f"rows [:{layout.batch}]"
        wrote = "all rows" if rows is None else f"rows [:{rows}]"
        return f"the write covers {wrote} of the cache while the attention reads {read}"
    st = fake(src)
    if st is None:
        return None
    if st.dim() + (squeeze is not None) != 4:
        return f"the written source is {st.dim()}-D {tuple(hint(s) for s in st.shape)}, not one entry per cache dim"
    src_shape = [hint(x) for x in st.shape]
    if squeeze is not None:
        src_shape.insert(squeeze, 1)
    want = [int(x) for x in region.shape]
    if any(a != b for d, (a, b) in enumerate(zip(src_shape, want)) if d != sd):
        return (f"the written source {tuple(hint(x) for x in st.shape)} is broadcast into the cache view "
                f"{tuple(want)} (the write op takes one source entry per element written)")
    src_perm = tuple(r_perm.index(b) for b in lay_perm)  # source dims (the view's order) -> [B, Hkv, n, D]
    positions = pos if isinstance(pos, fx.Node) else (0 if pos.start is None else pos.start, pos.stop)
    return CacheWrite(node, kind, src, positions, list(extra), layout.perm, rows,
                      None if src_perm == (0, 1, 2, 3) else src_perm, squeeze)


def cache_writes(base: fx.Node, layout: Optional[CacheLayout] = None
                 ) -> Tuple[List[CacheWrite], List[Tuple[fx.Node, str]]]:
    """Recognised writes into ``base``, and the in-place ops on it (or its views) that are not, each with why."""
    writes, unknown = [], []
    for v in views_of(base):
        for u in v.users:
            if not is_inplace(u) or not u.args or u.args[0] is not v:
                continue  # not in place, or in place on another tensor that only reads the cache
            w = match_cache_write(base, u, layout)
            if not isinstance(w, CacheWrite):
                if all(u is not x for x, _ in unknown):
                    unknown.append((u, w or ""))
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
    return any(is_inplace(u) and u.args and u.args[0] is v for v in views_of(node) for u in v.users)


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


def pad_mask(graph: fx.Graph, attn_mask: Optional[fx.Node], kv_len: Any, length: int) -> Optional[fx.Node]:
    """Insert ``attn_mask`` padded along its last dim from ``kv_len`` keys to ``length`` with "not attended".

    A mask over a ``[:n]`` prefix read (``kv_len`` an int or a SymInt node) is
    padded with False (bool) or -inf (additive) up to the cache length the ops
    read; without a prefix (``kv_len`` None) or a mask, it is returned as is.
    """
    if attn_mask is None or kv_len is None:
        return attn_mask
    mt = fake(attn_mask)
    if mt is None:
        raise ValueError("pad_mask: the mask has no recorded example value")
    fill = False if mt.dtype == torch.bool else float("-inf")
    aten = torch.ops.aten
    extra = length - kv_len if isinstance(kv_len, int) else graph.call_function(operator.sub, (length, kv_len))
    # [..., 1] of the mask, filled, expanded to [..., L - n], appended (cat: the sizes may be symbolic)
    call = graph.call_function
    edge = call(aten.full_like.default, (call(aten.slice.Tensor, (attn_mask, -1, 0, 1)), fill))
    tail = call(aten.expand.default, (edge, [-1] * (mt.dim() - 1) + [extra]))
    out = call(aten.cat.default, ([attn_mask, tail], -1))
    # its example value (the later steps read the mask's dtype and shape from it), under the mask's fake mode
    n = kv_len if isinstance(kv_len, int) else _example(kv_len)
    mode = getattr(mt, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        e = aten.full_like.default(aten.slice.Tensor(mt, -1, 0, 1), fill)
        out.meta["example_value"] = aten.cat.default([mt, aten.expand.default(e, [-1] * (mt.dim() - 1) + [length - n])], -1)
    return out


def compact_mask(graph: fx.Graph, attn_mask: Optional[fx.Node]) -> Optional[fx.Node]:
    """Insert one contiguous copy of ``attn_mask``, its broadcast (stride-0) leading dims narrowed to size 1.

    The decode mask of an HF model is a view (an ``expand`` of a comparison), and Inductor materializes a view
    that an extern kernel reads once per reader: 30 copies of the mask per step for 30 rewritten layers. Inductor
    removes a ``clone`` whose metadata matches its input, so the copy is ``prims.inductor_force_stride_order``
    (Inductor's own "copy unless it has these strides"): one buffer that every site reads (the ops broadcast a
    ``[B, 1, 1, L]`` mask themselves). A mask with symbolic sizes is returned as is.
    """
    mt = fake(attn_mask) if attn_mask is not None else None
    if mt is None or not all(isinstance(s, int) for s in mt.shape):
        return attn_mask
    import torch._inductor.inductor_prims  # noqa: F401  (defines prims.inductor_force_stride_order)

    call = graph.call_function
    aten = torch.ops.aten
    out = attn_mask
    narrow = [d for d in range(mt.dim() - 1) if mt.stride(d) == 0 and mt.shape[d] != 1]
    for d in narrow:
        out = call(aten.slice.Tensor, (out, d, 0, 1))
    mode = getattr(mt, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        e = mt
        for d in narrow:
            e = aten.slice.Tensor(e, d, 0, 1)
        e = e.contiguous()
    out = call(torch.ops.prims.inductor_force_stride_order.default, (out, list(e.stride())))
    out.meta["example_value"] = e
    return out
