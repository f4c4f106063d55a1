"""Cache-write idioms: in-place writes into a cache buffer along its sequence dim, matched and described."""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, List, NamedTuple, Optional, Tuple

import torch
import torch.fx as fx

from ._node_meta import ancestors, example_value, fake, hint, is_inplace
from ._views import CacheLayout, coordinate_code, is_written_in_place, replay, trace_view_chain, views_of


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
            ex = example_value(x)
            if not isinstance(ex, (int, torch.SymInt)):
                return None
            x = hint(ex)
        parts.append(x)
    return slice(*parts)


class _Refused(Exception):
    """A write of a known form that does not fit; the message says why (raised and caught inside this module)."""


class _NotAWrite(Exception):
    """Not a write of a known form into the buffer (raised and caught inside this module)."""


class _Written(NamedTuple):
    """The parts of an in-place node that may write a cache."""

    kind: str  #: ``index_copy_``, ``setitem``, ``index_put_`` or ``slice_copy_``
    target: Any  #: the tensor written into
    key: Any  #: the per-dim entries applied to ``target`` (``index_copy_``: None)
    index_copy: Optional[Tuple[Any, Any]]  #: ``(dim, index)`` of an ``index_copy_``, else None
    src: Any  #: what is written
    extra: List[fx.Node]  #: nodes that go with the write (a ``slice_copy_``'s getitem)


def _written_part(node: fx.Node) -> _Written:
    """The parts of an in-place node.

    Raises ``_Refused`` for a known form that cannot be a write of new positions, ``_NotAWrite`` for any other node.
    """
    def arg(i, name, default=None):
        return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)

    if node.op == "call_method" and node.target == "index_copy_":
        dim, index, src = arg(1, "dim"), arg(2, "index"), arg(3, "source")
        if not isinstance(dim, int):
            raise _Refused("index_copy_ along a dim that is not a constant")
        return _Written("index_copy_", node.args[0], None, (dim, index), src, [])
    if node.op == "call_function" and node.target is operator.setitem:
        return _Written("setitem", node.args[0], node.args[1], None, node.args[2], [])
    if node.op == "call_method" and node.target == "index_put_":
        indices, src, accumulate = arg(1, "indices"), arg(2, "values"), arg(3, "accumulate", False)
        if accumulate:
            raise _Refused("index_put_ with accumulate=True adds into the cache instead of writing it")
        if not isinstance(indices, (tuple, list)):
            raise _NotAWrite
        given = [i for i, x in enumerate(indices) if x is not None]
        if len(given) != 1:
            raise _Refused(f"index_put_ indexes {len(given)} dims of the cache (only the sequence dim may be indexed)")
        key = [slice(None)] * given[0] + [indices[given[0]]]
        return _Written("index_put_", node.args[0], tuple(key), None, src, [])
    if node.op == "call_method" and node.target == "copy_":
        dst = node.args[0]
        if isinstance(dst, fx.Node) and dst.op == "call_function" and dst.target is operator.getitem:
            return _Written("slice_copy_", dst.args[0], dst.args[1], None, node.args[1], [dst])
    raise _NotAWrite


@dataclass(frozen=True)
class CacheWriteMatch:
    """What :func:`match_cache_write` made of an in-place node.

    Attributes
    ----------
    write : CacheWrite or None
        The recognised write; None when the node is not one.
    reason : str
        Why a write of a known form does not fit; empty for a recognised write, and for any other in-place op.
    """

    write: Optional[CacheWrite] = None
    reason: str = ""


def match_cache_write(base: fx.Node, node: fx.Node, layout: Optional[CacheLayout] = None) -> CacheWriteMatch:
    """Recognise ``node`` as a sequence-dim write into ``base`` read through ``layout`` (default ``[B, Hkv, L, D]``).

    The tensor written may be any view of ``base`` that :func:`trace_view_chain`
    follows: the write's region is found by replaying that chain on a tensor that
    encodes element coordinates, so a ``[:b]`` batch slice, a ``[:n]`` prefix of
    the sequence dim, a transpose or a negative dim all resolve to the buffer's
    own dims. Returns the :class:`CacheWrite`; for a write of a known form that
    does not fit, no write and the reason; for any other in-place op, neither.
    """
    try:
        return CacheWriteMatch(_match(base, node, layout or CacheLayout()))
    except _Refused as e:
        return CacheWriteMatch(reason=str(e))
    except _NotAWrite:
        return CacheWriteMatch()


def _match(base: fx.Node, node: fx.Node, layout: CacheLayout) -> CacheWrite:
    """:func:`match_cache_write`'s work: the write, or ``_Refused`` (with the reason) or ``_NotAWrite`` raised.

    The checks run in this order: the node's form, the view it writes through, the positions and the part of the
    view written, the box of the buffer that part is, the source.
    """
    bt = fake(base)
    if bt is None or bt.dim() != 4:
        raise _NotAWrite
    w = _written_part(node)
    if not isinstance(w.target, fx.Node) or not isinstance(w.src, fx.Node):
        raise _NotAWrite
    root, chain = trace_view_chain(w.target)
    if root is not base:
        raise _NotAWrite
    shape = tuple(hint(s) for s in bt.shape)
    code = coordinate_code(shape)
    try:
        t = replay(base, chain, code)
    except Exception:  # noqa: BLE001 - a view chain that cannot be replayed
        raise _NotAWrite from None
    if t.dim() != 4:
        raise _Refused(f"the write goes through a {t.dim()}-D view of the cache, not one with its 4 dims")
    tgt = _region(code, shape, t)
    if tgt is None:
        raise _Refused("the write goes through a view of the cache that is not a box of it (a reshape or a gather)")
    sd = tgt[0].index(layout.seq_dim)  # the sequence dim, counted in the written view
    pos, region, squeeze = _positions_and_region(w, t, sd)
    _check_positions(pos)
    r_perm, rows = _written_box(code, shape, region, sd, layout)
    src_perm = _source_perm(w.src, region, sd, squeeze, r_perm, layout)
    positions = pos if isinstance(pos, fx.Node) else (0 if pos.start is None else pos.start, pos.stop)
    return CacheWrite(node, w.kind, w.src, positions, list(w.extra), layout.perm, rows,
                      None if src_perm == (0, 1, 2, 3) else src_perm, squeeze)


def _positions_and_region(w: _Written, t: torch.Tensor, sd: int):
    """``(pos, region, squeeze)`` of a write through the view ``t`` (element coordinates) along its dim ``sd``.

    ``pos``: the positions written (a node, or a slice of the sequence dim); ``region``: the part of ``t`` that the
    write's other index entries select (all of ``t`` for ``index_copy_``); ``squeeze``: ``sd`` when a 0-d position
    drops the sequence dim (the source has none), else None. Raises ``_Refused``.
    """
    if w.index_copy is not None:
        dim, pos = w.index_copy
        if dim % 4 != sd:
            raise _Refused(f"along dim {dim} of the written view, not its sequence dim {sd}")
        return pos, t, None
    ks = _expand_key(w.key, 4)
    if ks is None:
        raise _Refused(f"the write's index {_fmt_key(w.key)} is not one entry per cache dim")
    pos = ks[sd]
    rest = []
    for i, k in enumerate(ks):
        hk = slice(None) if i == sd else _hint_slice(k)
        if hk is None:
            raise _Refused(f"the write indexes dim {i} of the cache with {_fmt(k)} "
                           f"(only the sequence dim {sd} may hold positions)")
        rest.append(hk)
    region = t[tuple(rest)]
    squeeze = None
    if isinstance(pos, slice):
        if pos.step not in (None, 1) or pos.stop is None:
            raise _Refused(f"the write takes the slice {_fmt(pos)} of the sequence dim (no end, or a step)")
    elif not isinstance(pos, fx.Node):
        raise _Refused(f"the sequence dim is indexed with {_fmt(pos)}, not with positions")
    elif fake(pos) is not None and fake(pos).dim() == 0:
        squeeze = sd  # a 0-d position drops the sequence dim: the source has none
    return pos, region, squeeze


def _check_positions(pos) -> None:
    """Raise ``_Refused`` unless positions given as a node are an integer tensor of at most one dim."""
    if not isinstance(pos, fx.Node):
        return
    pt = fake(pos)
    if pt is None or pt.is_floating_point() or pt.is_complex() or pt.dtype == torch.bool:
        raise _Refused("the positions written are not an integer tensor")
    if pt.dim() > 1:
        raise _Refused(f"the positions written are a {pt.dim()}-D tensor {tuple(hint(s) for s in pt.shape)} "
                       f"(per-row positions); the write op writes the same positions in every row")


def _written_box(code: torch.Tensor, shape: Tuple[int, ...], region: torch.Tensor, sd: int, layout: CacheLayout):
    """``(r_perm, rows)``: the buffer dim each dim of ``region`` walks along, and the ``[:rows]`` batch prefix written
    (None: every row), for a region that spans the sequence dim from 0 and the rows the attention reads (``layout``).
    Raises ``_Refused``."""
    got = _region(code, shape, region)
    if got is None:
        raise _Refused("the write goes through a view of the cache that is not a box of it")
    r_perm, start, size = got
    sd_buf, bd_buf = layout.seq_dim, layout.batch_dim
    if r_perm.index(sd_buf) != sd:
        raise _Refused("the written view reorders the sequence dim")
    if start[sd_buf] != 0:
        raise _Refused(f"the write goes through a view that starts at sequence position {start[sd_buf]} "
                       f"(the positions would be offset)")
    for b in range(4):
        if b not in (sd_buf, bd_buf) and (start[b] != 0 or size[b] != shape[b]):
            raise _Refused(f"the write covers [{start[b]}, {start[b] + size[b]}) of cache dim {b} (size {shape[b]}), "
                           f"not all of it")
    if start[bd_buf] != 0:
        raise _Refused(f"the write goes through rows [{start[bd_buf]}, ...) of the cache, not a [:b] prefix")
    rows = None if size[bd_buf] == shape[bd_buf] else size[bd_buf]
    if rows != layout.batch:
        read = "all rows" if layout.batch is None else f"rows [:{layout.batch}]"
        wrote = "all rows" if rows is None else f"rows [:{rows}]"
        raise _Refused(f"the write covers {wrote} of the cache while the attention reads {read}")
    return r_perm, rows


def _source_perm(src: fx.Node, region: torch.Tensor, sd: int, squeeze: Optional[int], r_perm: Tuple[int, ...],
                 layout: CacheLayout) -> Tuple[int, ...]:
    """The permutation from the source's dims (the written view's order) to ``[B, Hkv, n, D]``, for a source with
    one entry per element written (``_NotAWrite`` when its value is unknown, else ``_Refused``)."""
    st = fake(src)
    if st is None:
        raise _NotAWrite
    if st.dim() + (squeeze is not None) != 4:
        raise _Refused(f"the written source is {st.dim()}-D {tuple(hint(s) for s in st.shape)}, "
                       f"not one entry per cache dim")
    src_shape = [hint(x) for x in st.shape]
    if squeeze is not None:
        src_shape.insert(squeeze, 1)
    want = [int(x) for x in region.shape]
    if any(a != b for d, (a, b) in enumerate(zip(src_shape, want)) if d != sd):
        raise _Refused(f"the written source {tuple(hint(x) for x in st.shape)} is broadcast into the cache view "
                       f"{tuple(want)} (the write op takes one source entry per element written)")
    lay_perm = layout.perm or (0, 1, 2, 3)
    return tuple(r_perm.index(b) for b in lay_perm)


def cache_writes(base: fx.Node, layout: Optional[CacheLayout] = None
                 ) -> Tuple[List[CacheWrite], List[Tuple[fx.Node, str]]]:
    """Recognised writes into ``base``, and the in-place ops on it (or its views) that are not, each with why."""
    writes, unknown = [], []
    for v in views_of(base):
        for u in v.users:
            if not is_inplace(u) or not u.args or u.args[0] is not v:
                continue  # not in place, or in place on another tensor that only reads the cache
            m = match_cache_write(base, u, layout)
            if m.write is None:
                if all(u is not x for x, _ in unknown):
                    unknown.append((u, m.reason))
            elif all(m.write.node is not x.node for x in writes):
                writes.append(m.write)
    return writes, unknown


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
        ex = example_value(a)
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
