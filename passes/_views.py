"""View chains from a cache buffer to SDPA's K/V operand, and the cache layouts they read."""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple, Union

import torch
import torch.fx as fx

from ._node_meta import example_value, fake, hint, is_inplace, returns_self

#: view-like steps allowed between a cache buffer and the K/V argument of SDPA;
#: the chain is then checked semantically (see :func:`cache_layout`)
VIEW_METHODS = {"expand", "reshape", "view", "contiguous", "repeat_interleave", "unsqueeze", "flatten", "unflatten",
                "transpose", "permute", "clone", "expand_as", "repeat", "narrow", "squeeze", "movedim", "swapaxes",
                "chunk", "split", "unbind", "tensor_split", "split_with_sizes"}
VIEW_FUNCTIONS = {operator.getitem, torch.reshape, torch.unsqueeze, torch.flatten, torch.repeat_interleave,
                  torch.transpose, torch.permute, torch.clone, torch.narrow, torch.squeeze, torch.movedim,
                  torch.swapaxes, torch.chunk, torch.split, torch.unbind, torch.tensor_split}


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
    ex = example_value(n)
    if isinstance(ex, (tuple, list)):
        return bool(ex) and all(isinstance(t, torch.Tensor) for t in ex)
    return isinstance(ex, torch.Tensor)


def _tensor_inputs(node: fx.Node) -> List[fx.Node]:
    flat: List[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: flat.append(n) if _is_tensor_node(n) else None)
    return flat


def is_buffer_node(node: fx.Node) -> bool:
    """A tensor that outlives the graph: a graph input, or a tensor attribute that the graph writes in place.

    torch 2.8's Dynamo installs a tensor marked with ``torch._dynamo.mark_static_address`` (guarded, as HF's
    ``StaticCache`` marks its layers) as a ``get_attr`` of the graph module, the tensor itself, not as an input;
    torch 2.9 and later make it an input. A ``get_attr`` that nothing writes in place (a constant) is not a buffer.
    """
    if node.op == "placeholder":
        return True
    return node.op == "get_attr" and fake(node) is not None and is_written_in_place(node)


def is_written_in_place(node: fx.Node) -> bool:
    """True when the graph mutates ``node``'s tensor in place, directly or through a view (a cache buffer)."""
    return any(is_inplace(u) and u.args and u.args[0] is v for v in views_of(node) for u in v.users)


def trace_view_chain(node: fx.Node) -> Tuple[Optional[fx.Node], List[fx.Node]]:
    """Walk up view-like steps from ``node`` to a graph input (or a written tensor attribute, :func:`is_buffer_node`).

    Size arguments (SymInt nodes) may appear in the steps; a step with a second
    tensor operand ends the walk. An in-place method (``index_copy_``,
    ``copy_``, ...) returns its own ``self``: the walk goes on through it (it is
    in the chain, and :func:`replay` treats it as the identity).

    Returns
    -------
    (base, chain)
        ``base`` is the placeholder or ``get_attr`` reached (or None), ``chain`` the view steps
        from base (exclusive) to ``node`` (inclusive), in execution order.
    """
    chain: List[fx.Node] = []
    cur = node
    while not is_buffer_node(cur):
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


def replay(base: fx.Node, chain: List[fx.Node], code: torch.Tensor) -> torch.Tensor:
    """Run ``chain`` on ``code`` (standing in for ``base``), sizes taken from their hints."""

    def val(a):
        if a in env:
            return env[a]
        ex = example_value(a)
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


def coordinate_code(shape: Tuple[int, ...]) -> torch.Tensor:
    """An integer tensor of ``shape`` whose elements are their own flat index (it encodes coordinates)."""
    numel = 1
    for s in shape:
        numel *= s
    return torch.arange(numel, dtype=torch.int32 if numel < 2 ** 31 else torch.int64).reshape(shape)


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
    code = coordinate_code(shape)
    try:
        out = replay(base, chain, code)
    except Exception as e:  # noqa: BLE001 - shapes baked into the chain that we cannot replay
        return f"cannot replay the K/V view chain ({type(e).__name__}: {str(e)[:80]})"
    if out.dim() != 4:
        return f"K/V view chain gives a {out.dim()}-D operand {tuple(out.shape)}, not [B, H, L, D]"
    b, h_out, l_out, d_out = out.shape
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


def first_non_view(node: fx.Node) -> fx.Node:
    """The first node above ``node`` that is not a single-tensor view step."""
    cur = node
    while is_view_step(cur) and len(_tensor_inputs(cur)) == 1 and cur.args and cur.args[0] is _tensor_inputs(cur)[0]:
        cur = cur.args[0]
    return cur


def cache_view(graph: fx.Graph, buffer: fx.Node, perm: Optional[Tuple[int, ...]], batch: Optional[int],
               batch_dim: int = 0) -> fx.Node:
    """Insert ``buffer[:batch].permute(perm)`` (the ``[B, Hkv, L, D]`` view the ops take); ``buffer`` itself when trivial."""
    out = buffer
    if batch is not None:
        out = graph.call_function(torch.ops.aten.slice.Tensor, (out, batch_dim, 0, batch))
    if perm is not None:
        out = graph.call_function(torch.ops.aten.permute.default, (out, list(perm)))
    return out
