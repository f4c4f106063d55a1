"""What the passes hand each other about a graph: one :class:`PassState`, at ``gm.meta["tinyserve"]``.

:func:`~.find_decode_attention.find_decode_attention` records the graph's attention sites (:class:`AttentionSite`,
:attr:`PassState.sites`); :func:`~.keep_bounds_on_cache_writes.keep_bounds_on_cache_writes` the key-cache buffers
whose writes it made bounds-keeping (:class:`~tinyserve_compile.runtime.BoundsSlot`, :attr:`PassState.bounds`),
which :func:`~.sparse_decode_attention.sparse_decode_attention` reads and the backend hands to the run time;
:func:`~.decode_linear.decode_linear` what it did to the graph's linears (:class:`LinearReport`,
:attr:`PassState.linears`). Every reader, the backend and :func:`tinyserve_compile.explain` included, finds the
state through :func:`pass_state`.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch.fx as fx

from tinyserve_compile.runtime import BoundsSlot

from ._cache_writes import CacheWrite
from ._views import CacheLayout, layout_name

__all__ = ["PassState", "pass_state", "AttentionSite", "LinearReport", "META_KEY"]

#: the key of a graph's :class:`PassState` in ``gm.meta``
META_KEY = "tinyserve"


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
    k_layout: Optional[CacheLayout] = None  #: how the key operand reads ``k_base``
    v_layout: Optional[CacheLayout] = None
    k_write: Optional[CacheWrite] = None
    kv_len: Any = None  #: keys read when SDPA reads a ``[:n]`` prefix (an int or a SymInt node), else None
    positions: Any = None  #: node holding the written positions (set by the write pass)
    bounds: Any = None  #: the kmax, kmin, kabs, ctrl placeholders of the key cache (set by the write pass)
    slot: Optional[int] = None  #: index of the key cache's BoundsSlot in :attr:`PassState.bounds` (write pass)
    #: why the op attends this site densely from its shapes (the cost model, :mod:`..dense_by_cost`), else ""
    dense_by_cost: str = ""
    args: dict = field(default_factory=dict)

    @property
    def k_perm(self) -> Optional[Tuple[int, ...]]:
        """``k_base.permute(k_perm)`` is the ``[B, Hkv, L, D]`` key cache (None: the buffer itself)."""
        return self.k_layout.perm if self.k_layout is not None else None

    @property
    def v_perm(self) -> Optional[Tuple[int, ...]]:
        return self.v_layout.perm if self.v_layout is not None else None

    def describe(self) -> dict:
        out = {"index": self.index, "node": self.node.name, "query_len": self.query_len, "status": self.status,
               "reason": self.reason}
        if self.k_base is not None:  # a tensor attribute by its path (torch 2.8: ...layers_3_keys), an input by name
            out["cache"] = self.k_base.target if self.k_base.op == "get_attr" else self.k_base.name
        if self.k_layout is not None and self.k_layout.perm is not None:
            out["layout"] = layout_name(self.k_layout.perm)
        if self.dense_by_cost and self.status == "sparse":
            out["dense_by_cost"] = self.dense_by_cost
        return out


@dataclass
class LinearReport:
    """What :func:`~.decode_linear.decode_linear` did to a graph's linears.

    Attributes
    ----------
    rewritten : int
        Linears now native GEMV calls (alone or in a group), the int4 ones included.
    int4 : int
        Of those, linears of torchao int4 weights.
    int4_calls : int
        ``tinyserve::linear_int4`` calls that Int4Linear modules put in the graph themselves.
    grouped : int
        Linears and such calls now part of one shared-input call.
    groups : int
        The shared-input calls made.
    kept : collections.Counter
        Linears left to ATen, by reason.
    reason : str or None
        Why the pass rewrote nothing (the option off, TensorRT lowering), or why its candidates were kept (no
        native GEMV).
    """

    rewritten: int = 0
    int4: int = 0
    int4_calls: int = 0
    grouped: int = 0
    groups: int = 0
    kept: Counter = field(default_factory=Counter)
    reason: Optional[str] = None


@dataclass
class PassState:
    """The passes' findings about one graph.

    Attributes
    ----------
    sites : list of AttentionSite
        Every SDPA call, in graph order (:func:`~.find_decode_attention.find_decode_attention`).
    bounds : list of BoundsSlot
        The key-cache buffers whose writes keep page bounds, in the order of the graph's bounds placeholders
        (:func:`~.keep_bounds_on_cache_writes.keep_bounds_on_cache_writes`).
    linears : LinearReport or None
        What :func:`~.decode_linear.decode_linear` did (None until it runs).
    """

    sites: List[AttentionSite] = field(default_factory=list)
    bounds: List[BoundsSlot] = field(default_factory=list)
    linears: Optional[LinearReport] = None


def pass_state(gm: fx.GraphModule) -> PassState:
    """The :class:`PassState` of ``gm`` (at ``gm.meta[META_KEY]``), created empty on first use."""
    state = gm.meta.get(META_KEY)
    if state is None:
        state = gm.meta[META_KEY] = PassState()
    return state
