"""Run-time state of rewritten graphs: page bounds that live as long as the key-cache buffer.

The passes give every compiled graph four extra inputs per key-cache buffer it
writes, and the backend's wrapper hands them in on each call:

``kmax``, ``kmin``, ``kabs``
    The buffer's :class:`~tinyserve_compile.kernels.reference.PageBounds`.
``ctrl``
    int32 ``[4]`` (:data:`~tinyserve_compile.kernels.bounds.CTRL_SIZE`). ``ctrl[0]``: the bounds are stale
    (someone else wrote the cache), so the graph's write op rebuilds them after writing. ``ctrl[1]``:
    this layer attends densely (it is among the first ``dense_layers`` layers). ``ctrl[2:4]`` belong to the write
    op: the position after its last write (a write that does not go on from there rebuilds too) and the Triton
    kernel's arrival counter (:mod:`~tinyserve_compile.kernels.bounds`).
    For a CPU cache it lives on the CPU: the host writes it through a numpy view
    and the native write op clears ``ctrl[0]`` after the rebuild. For a CUDA cache
    it lives on the cache's device, so the graph has no CPU input and can run
    under CUDA graphs: the kernels read it there and never write it, and the host
    keeps a mirror of what it holds and copies new flags in (one small
    ``non_blocking`` copy) only when they change, so a steady decode loop copies
    nothing; ``ctrl[0]`` is cleared by the host on the next call.

So no op does host bookkeeping per layer. Once per call, before it,
:func:`enter` checks each buffer's version counter against the value recorded
after our last call (:func:`leave`): any other write in between (an eager
prefill, ``cache.reset()``, a roll-back) moved it, and sets ``ctrl[0]``.
Without the host, the write op itself sees a write by someone else that moved where the sequence ends (it
compares its positions with ``ctrl[2]`` on the ctrl's device): this is what keeps the bounds exact for an
inference tensor (no version counter) and under an outer CUDA graph capture (whose replays run no host code).

The bounds and a device ``ctrl`` keep their address for the buffer's life; the
graph's placeholders for them are marked as static inputs
(:mod:`~tinyserve_compile.passes.keep_bounds_on_cache_writes`), so that CUDA
graphs neither copy them on replay nor record again.

Layers are ranked by the order in which their key-cache buffers are first
written: a new buffer takes the next rank, and a call that writes an already
ranked buffer restarts the count, so a new cache's buffers (a new ``StaticCache``,
another request's cache) are ranked from 0 again. This is execution order
whether Dynamo made one graph or one graph per layer, so ``dense_layers`` means
the first layers of the model.

Ops put into graphs (every one takes the selection as one packed ``int[] spec``,
:class:`~tinyserve_compile.kernels.spec.SelectionSpec`):

``tinyserve::cache_write(k_cache, kmax, kmin, kabs, ctrl, positions, src, spec)``
    ``k_cache.index_copy_(2, positions, src)``, then keep the bounds exact
    (:mod:`.kernels.bounds`; native on CPU, Triton on CUDA).
``tinyserve::sparse_decode(q, k_cache, v_cache, kmax, kmin, kabs, valid_len, mask, scale, spec, kernel, ctrl)``
    Query-aware decode attention (:mod:`.kernels.sparse_decode`; native on CPU, Triton on CUDA).
``tinyserve::policy_attention(q, k_cache, v_cache, kmax, kmin, kabs, ctrl, valid_len, mask, scale, spec, policy, kernel)``
    Decode attention through another policy (``full``, ``streaming``, ``h2o``, ``oracle``;
    :mod:`.policies.op`), which reads the bounds, ``ctrl`` (:func:`ctrl_flags`) and the policies' per-buffer
    state (:attr:`StaticKVState.policy_state`) that this module keeps.
"""
from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .kernels.bounds import CTRL_SIZE, allocate_bounds, new_ctrl
from .kernels.reference import PageBounds
from .kernels.sparse_decode import resolve_kernel

__all__ = ["BoundsSlot", "StaticKVState", "state_for", "state_of_bounds", "ctrl_flags", "enter", "leave",
           "runtime_stats", "reset_runtime", "write_op", "decode_kernel", "native_unavailable_reason", "device_ctrl"]

#: run-time counters: bounds rebuilds and updates, foreign writes, decode calls (sparse / dense layers), copies of
#: new flags into a device ``ctrl`` (``ctrl_copies``)
runtime_stats: Counter = Counter()


def device_ctrl(device) -> bool:
    """Whether a key cache on ``device`` gets its ``ctrl`` on that device (CUDA), mirrored on the host.

    Otherwise ``ctrl`` is a CPU tensor that the host writes directly.
    """
    return torch.device(device).type == "cuda"


def _ctrl_device(device) -> torch.device:
    return torch.device(device) if device_ctrl(device) else torch.device("cpu")


@dataclass(frozen=True)
class BoundsSlot:
    """A key-cache buffer that a compiled graph writes, as the passes found it.

    Attributes
    ----------
    input_index : int or None
        Position of the buffer among the graph's inputs; None when the graph reads it as a tensor attribute.
    shape : tuple
        ``(B, Hkv, L, D)`` of the cache as the ops see it.
    dtype : torch.dtype
        Cache dtype.
    page_size : int
    bounds_dtype : torch.dtype
        Storage of ``kmax``/``kmin``.
    decode_sites : int
        Decode attention sites of the graph that read this buffer.
    perm : tuple or None
        Permutation from the buffer to ``[B, Hkv, L, D]`` (None: the buffer is in that layout).
    rows : int or None
        The ops read rows ``[:rows]`` of the buffer's batch dim (None: all of them).
    attr : torch.Tensor or None
        The buffer itself when the graph reads it as a ``get_attr`` (torch 2.8's Dynamo installs a tensor marked
        with ``mark_static_address`` so, guarded by identity), else None.
    """

    input_index: Optional[int]
    shape: Tuple[int, ...]
    dtype: torch.dtype
    page_size: int
    bounds_dtype: torch.dtype
    decode_sites: int = 0
    perm: Optional[Tuple[int, ...]] = None
    rows: Optional[int] = None
    attr: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)

    def cache(self, args: Sequence) -> torch.Tensor:
        """The key-cache buffer of a call with inputs ``args``."""
        return self.attr if self.input_index is None else args[self.input_index]

    def example_inputs(self, device) -> List[torch.Tensor]:
        """Zero ``kmax, kmin, kabs, ctrl`` of the right shapes, for lowering the graph.

        Parameters
        ----------
        device : torch.device or str
            The cache's device: the bounds live there, and ``ctrl`` too when it is a CUDA device
            (:func:`device_ctrl`), else on the CPU.
        """
        cache = torch.empty(self.shape, dtype=self.dtype, device="meta")
        b = allocate_bounds(cache, self.page_size, self.bounds_dtype)
        return [t.new_zeros(t.shape, device=device) for t in b] + [
            torch.zeros(CTRL_SIZE, dtype=torch.int32, device=_ctrl_device(device))]


@dataclass
class StaticKVState:
    """Bounds of one key-cache buffer, and what is known about its writes.

    The buffer is a static cache's: one tensor per layer that the graph writes in place, a row per sequence (HF's
    ``StaticCache``, gpt-fast's and litgpt's caches). Continuous batching's paged cache, whose pages the sequences
    share through page tables, keeps its bounds in :mod:`tinyserve_compile.continuous_batching` instead.

    Attributes
    ----------
    mirror : bool, optional
        Keep a host mirror of ``ctrl`` and copy flags into it only when they change (:func:`_push_flags`), for a
        ``ctrl`` the host cannot write directly. None: mirrored when ``ctrl`` is not on the CPU.
    """

    cache_ref: "weakref.ref"
    key: tuple  #: (page_size, bounds dtype, view shape): a buffer read another way gets its own state
    bounds: PageBounds
    ctrl: torch.Tensor  #: int32 [CTRL_SIZE]: stale, dense layer, the write op's end and arrivals (on the cache's
    #: device for CUDA, else the CPU)
    rank: int  #: layer rank: order of first write within a step (0 = first layer)
    version: int = -1  #: cache._version right after our last call
    policy_state: Dict[str, torch.Tensor] = field(default_factory=dict)
    mirror: Optional[bool] = None

    @property
    def stale(self) -> bool:
        """The bounds do not follow the cache yet: the graph's next write op rebuilds them."""
        return self._rebuild if self.mirror else bool(self._flags[0])

    def __post_init__(self):
        if self.mirror is None:
            self.mirror = self.ctrl.device.type != "cpu"
        if self.mirror:
            # what ctrl holds (the kernels never write a mirrored ctrl): compared before every copy into it
            self._flags = np.array(self.ctrl[:2].tolist(), dtype=np.int32)
            self._rebuild = bool(self._flags[0])  # ctrl[0] asked for a rebuild that no call has made yet
        else:
            self._flags = self.ctrl[:2].numpy()  # shares memory: flag writes cost no dispatch


#: (stale, dense, pinned) -> an int32 [2] host tensor holding those flags, never written after it is made
_FLAG_SOURCES: Dict[Tuple[int, int, bool], torch.Tensor] = {}


def _flag_source(stale: int, dense: int, pin: bool) -> torch.Tensor:
    """A host tensor holding ``[stale, dense]``, one per value and never written.

    A ``non_blocking`` copy reads its source when the stream runs it, possibly after the host moved on to the
    next call: a source that never changes gives the right flags however late that is.
    """
    key = (stale, dense, pin)
    t = _FLAG_SOURCES.get(key)
    if t is None:
        t = torch.tensor([stale, dense], dtype=torch.int32)
        _FLAG_SOURCES[key] = t = t.pin_memory() if pin else t
    return t


def _push_flags(st: StaticKVState, stale: bool, dense: bool) -> bool:
    """Set ``st.ctrl`` to ``[stale, dense]``; return whether that took a copy into ``ctrl``.

    A host ``ctrl`` is written through its numpy view (never a copy). A mirrored one (a CUDA ``ctrl``) gets one
    ``non_blocking`` copy from a pinned source when the flags differ from the mirror (what was last copied in),
    and none otherwise, except that a rebuild request is always copied: the PyTorch fallback of the write op
    clears ``ctrl[0]`` on the device, which the mirror does not see. A steady decode loop (no rebuild, the same
    layer) copies nothing.
    """
    flags = st._flags
    s, d = int(stale), int(dense)
    if not st.mirror:
        flags[0], flags[1] = s, d
        return False
    if not s and flags[0] == s and flags[1] == d:
        return False
    st.ctrl[:2].copy_(_flag_source(s, d, st.ctrl.is_cuda), non_blocking=True)  # the flags; the op owns the rest
    flags[0], flags[1] = s, d
    runtime_stats["ctrl_copies"] += 1
    return True


_STATES: Dict[int, StaticKVState] = {}
_BY_BOUNDS: Dict[int, StaticKVState] = {}  #: id(kmax) -> state, for the policies' per-buffer state
_NEXT_RANK = [0]  #: rank of the next new buffer; back to 0 whenever a ranked buffer is written


def reset_runtime() -> None:
    """Forget every cache's bounds and clear :data:`runtime_stats`."""
    _STATES.clear()
    _BY_BOUNDS.clear()
    _NEXT_RANK[0] = 0
    runtime_stats.clear()


def _forget(key: int, st_ref) -> None:
    st = st_ref()
    if st is None or _STATES.get(key) is not st:
        return
    del _STATES[key]
    _BY_BOUNDS.pop(id(st.bounds.kmax), None)


def _view(cache: torch.Tensor, perm, rows: Optional[int] = None) -> torch.Tensor:
    if rows is not None:  # a [:rows] slice of the batch dim (perm[0] of the buffer)
        cache = cache.narrow(perm[0] if perm is not None else 0, 0, rows)
    return cache if perm is None else cache.permute(perm)


def state_for(cache: torch.Tensor, page_size: int, bounds_dtype: Optional[torch.dtype] = None,
              perm: Optional[Sequence[int]] = None, rows: Optional[int] = None) -> StaticKVState:
    """The state of the key-cache buffer ``cache``, created (stale) for a new buffer.

    Parameters
    ----------
    cache : torch.Tensor
        The buffer the graph writes; ``cache.permute(perm)`` is ``[B, Hkv, L, D]``.
    page_size : int
    bounds_dtype : torch.dtype, optional
        Storage of ``kmax``/``kmin``; None looks up an existing state of any dtype
        (and creates a float32 one).
    perm : sequence of int, optional
    rows : int, optional
        Rows ``[:rows]`` of the buffer's batch dim read by the ops.
    """
    perm = tuple(perm) if perm is not None else None
    view = _view(cache, perm, rows)
    st = _STATES.get(id(cache))
    if st is not None and st.cache_ref() is cache and st.key[0] == page_size and st.key[2] == tuple(view.shape) \
            and bounds_dtype in (None, st.key[1]):
        return st
    bounds_dtype = bounds_dtype or torch.float32
    bounds = allocate_bounds(view, page_size, bounds_dtype)
    # created stale: the first write rebuilds every page
    ctrl = new_ctrl(_ctrl_device(cache.device))
    if device_ctrl(cache.device):
        from torch._dynamo import mark_static_address

        # addresses that hold for the buffer's life: CUDA graphs may keep them (an unguarded mark, no recompile)
        for t in (*bounds, ctrl):
            mark_static_address(t, guard=False)
    st = StaticKVState(None, (page_size, bounds_dtype, tuple(view.shape)), bounds, ctrl, _NEXT_RANK[0],
                       mirror=device_ctrl(cache.device))
    _NEXT_RANK[0] += 1
    key = id(cache)
    st.cache_ref = weakref.ref(cache, lambda _r, k=key, s=weakref.ref(st): _forget(k, s))
    old = _STATES.get(key)
    if old is not None:
        _forget(key, weakref.ref(old))
    _STATES[key] = st
    _BY_BOUNDS[id(st.bounds.kmax)] = st
    runtime_stats["states_created"] += 1
    return st


def tensor_version(t: torch.Tensor) -> Optional[int]:
    """``t``'s version counter, or ``None`` for an inference tensor (made under ``torch.inference_mode()``), which
    has none: then only the write op's own check (``ctrl[2]``, the end of its last write) sees a write by someone
    else (``runtime_stats["inference_cache_calls"]`` counts such calls)."""
    return None if t.is_inference() else t._version


def enter(slots: Sequence[BoundsSlot], args: Sequence, dense_layers: int) -> List[torch.Tensor]:
    """Before a compiled call: check each written buffer once; return the graph's extra inputs.

    Parameters
    ----------
    slots : sequence of BoundsSlot
        In the order of the graph's extra placeholders.
    args : sequence
        The graph's own inputs.
    dense_layers : int
        Layers of rank below this attend densely.

    Returns
    -------
    list of torch.Tensor
        ``kmax, kmin, kabs, ctrl`` per slot.
    """
    extra: List[torch.Tensor] = []
    for slot in slots:
        cache = slot.cache(args)
        st = _STATES.get(id(cache))
        if st is not None and st.cache_ref() is cache:
            _NEXT_RANK[0] = 0  # a ranked buffer: the next new one starts a new cache's layers
        st = state_for(cache, slot.page_size, slot.bounds_dtype, slot.perm, slot.rows)
        version = tensor_version(cache)
        if version is None:  # an inference tensor: the write op's end check is the only check of other writers
            runtime_stats["inference_cache_calls"] += 1
        stale = (version is not None and version != st.version) or st.stale
        if stale:
            if st.version != -1 and version is not None and version != st.version:
                runtime_stats["foreign_writes"] += 1
            st.policy_state.clear()  # a new sequence for stateful policies
            runtime_stats["bounds_rebuilds"] += 1
        else:
            runtime_stats["bounds_updates"] += 1
        dense = st.rank < dense_layers
        # stale: the graph's write op rebuilds; else ctrl[0] = 0 (a device kernel leaves it set: cleared here)
        _push_flags(st, stale, dense)
        if st.mirror:
            st._rebuild = stale
        if slot.decode_sites:
            runtime_stats["dense_layer_calls" if dense else "decode_calls"] += slot.decode_sites
        extra.extend((*st.bounds, st.ctrl))
    return extra


def leave(slots: Sequence[BoundsSlot], args: Sequence) -> None:
    """After a compiled call returned: record each written buffer's version."""
    for slot in slots:
        cache = slot.cache(args)
        v = tensor_version(cache)
        st = _STATES[id(cache)]
        st.version = -1 if v is None else v
        if st.mirror:  # the call ran the graph's write op, which rebuilt the bounds if ctrl[0] asked for it
            st._rebuild = False


def native_unavailable_reason() -> Optional[str]:
    """Why the native CPU kernel is not used (None when it is)."""
    from .kernels import native

    return None if native.load_native() else native.native_unavailable_reason()


def write_op():
    """The cache-write op of a graph, ``tinyserve::cache_write`` (the dispatcher picks its kernel per device)."""
    return torch.ops.tinyserve.cache_write.default


def decode_kernel(device: torch.device, config) -> str:
    """The implementation that ``config``'s query-aware sites run on ``device`` (``native``, ``triton`` or
    ``torch``; :func:`~tinyserve_compile.kernels.sparse_decode.resolve_kernel`), naming the option on error."""
    try:
        return resolve_kernel(config.kernel, device)
    except ValueError as e:
        raise ValueError(f"tinyserve option 'kernel'={config.kernel!r}: {e}") from None


def state_of_bounds(kmax: torch.Tensor) -> Optional[StaticKVState]:
    """The state whose bounds ``kmax`` is (None when no state owns it): how an op of a graph, which receives the
    bounds, finds the buffer's state (the policies' per-buffer state, the host mirror of ``ctrl``)."""
    return _BY_BOUNDS.get(id(kmax))


def ctrl_flags(st: Optional[StaticKVState], ctrl: torch.Tensor) -> List[int]:
    """``[stale, dense]`` as ``ctrl`` holds them, read without a device sync where possible.

    Parameters
    ----------
    st : StaticKVState or None
        The state of the buffer whose ``ctrl`` this is (:func:`state_of_bounds`), if any.
    ctrl : torch.Tensor
        int32 ``[2]`` or ``[CTRL_SIZE]``.

    Returns
    -------
    list of int
        From the host mirror of ``st`` when ``ctrl`` is its mirrored ``ctrl`` (as the host pushed the flags: no
        sync); else read from ``ctrl`` (host memory for a CPU ``ctrl``, a device sync for a device ``ctrl`` of no
        known state).
    """
    if st is not None and st.mirror and st.ctrl.data_ptr() == ctrl.data_ptr():
        return st._flags.tolist()
    return ctrl[:2].tolist()

