"""Run-time state of rewritten graphs: page bounds that live as long as the cache buffer.

Two ops are put into graphs by the passes:

``tinyserve::cache_write(cache, probe, positions, src)``
    The graph's own key-cache write (``index_copy_`` along the sequence dim).
    It first checks whether anyone else wrote the key cache since this backend
    last did (a foreign write: an eager prefill, ``cache.reset()``, a roll-back
    done outside the graph); then it maintains the bounds: a full rebuild after a
    foreign write or for a new buffer, otherwise only the pages touched.
``tinyserve::paged_attention(q, k_cache, v_cache, valid_len, mask, ...)``
    Decode attention through the configured policy.

Foreign writes are found with the tensor version counter. The compiled wrapper
around a graph (AOTAutograd, the dispatcher) also bumps the version of every
input that the graph mutates, by an amount that depends on the lowering, some of
it before the op's body runs. Each write site therefore gets a private *probe*
tensor, passed as an extra graph input and declared mutated by the same op, so
that it receives exactly the same framework bumps: a foreign write is a cache
bump the probe did not get.
"""
from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from .kernels.bounds import allocate_bounds, rebuild_bounds_impl, update_bounds_impl
from .kernels.reference import PageBounds
from .policies import DecodeContext, get_policy

__all__ = ["PagedKVState", "state_for", "runtime_stats", "reset_runtime"]

#: run-time counters: rebuilds, incremental updates, decode calls, tokens read ...
runtime_stats: Counter = Counter()


@dataclass
class PagedKVState:
    """Bounds of one key-cache buffer, and what is known about its writes."""

    cache_ref: "weakref.ref"
    page_size: int
    bounds: PageBounds
    version: int = -1  #: cache._version right after our last write
    probe_ref: Optional["weakref.ref"] = None
    probe_version: int = -1
    stale: bool = True  #: a full rebuild is due
    policy_state: Dict[str, torch.Tensor] = field(default_factory=dict)


_STATES: Dict[int, PagedKVState] = {}


def reset_runtime() -> None:
    """Forget every cache's bounds and clear :data:`runtime_stats`."""
    _STATES.clear()
    runtime_stats.clear()


def _state_key(cache: torch.Tensor):
    """``(owner, key)`` of the bounds of ``cache``.

    A plain buffer is keyed by itself. A view (a ``[B, L, H, D]`` cache permuted to
    ``[B, Hkv, L, D]`` in the graph) is a new tensor each call, and under inductor
    not even a tracked view (``_reinterpret_tensor``): it is keyed by its storage
    and where in it it looks, and lives as long as that storage.
    """
    if cache._base is None and cache.is_contiguous() and cache.storage_offset() == 0:
        return cache, id(cache)
    storage = cache.untyped_storage()
    return storage, (storage.data_ptr(), cache.storage_offset(), tuple(cache.shape), tuple(cache.stride()))


def state_for(cache: torch.Tensor, page_size: int) -> PagedKVState:
    """The state of ``cache`` ``[B, Hkv, L, D]`` (a buffer or a view of one), created (stale) for a new buffer."""
    owner, key = _state_key(cache)
    st = _STATES.get(key)
    if st is not None and st.cache_ref() is owner and st.page_size == page_size:
        return st
    st = PagedKVState(weakref.ref(owner, lambda _r, k=key: _STATES.pop(k, None)), page_size,
                      allocate_bounds(cache, page_size))
    _STATES[key] = st
    runtime_stats["states_created"] += 1
    return st


def _rebuild(st: PagedKVState, cache: torch.Tensor) -> None:
    rebuild_bounds_impl(cache, *st.bounds, st.page_size)
    st.policy_state.clear()
    st.stale = False
    runtime_stats["bounds_rebuilds"] += 1


# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("tinyserve::cache_write", mutates_args=("cache", "probe"))
def cache_write(cache: torch.Tensor, probe: torch.Tensor, positions: torch.Tensor, src: torch.Tensor,
                page_size: int) -> None:
    """``cache.index_copy_(2, positions, src)``, then keep the page bounds exact.

    On entry it checks for a foreign write since its last call: the cache's
    version moved by more than the probe's (both get the same framework bumps,
    before this body runs too, as both are declared mutated).

    Parameters
    ----------
    cache : torch.Tensor
        ``[B, Hkv, L, D]`` key cache, written in place.
    probe : torch.Tensor
        ``[1]`` float32 probe of this write site.
    positions : torch.Tensor
        int64 ``[n]`` sequence positions written.
    src : torch.Tensor
        ``[B, Hkv, n, D]`` new keys.
    page_size : int
    """
    st = state_for(cache, page_size)
    if not st.stale:
        same_probe = st.probe_ref is not None and st.probe_ref() is probe
        if not same_probe or (cache._version - st.version) != (probe._version - st.probe_version):
            st.stale = True
            runtime_stats["foreign_writes"] += 1
    cache.index_copy_(2, positions.reshape(-1), src.to(cache.dtype))
    if st.stale:
        _rebuild(st, cache)
    else:
        update_bounds_impl(cache, *st.bounds, positions, page_size)
        runtime_stats["bounds_updates"] += 1
    st.version = cache._version
    st.probe_ref = weakref.ref(probe)
    st.probe_version = probe._version


@cache_write.register_fake
def _(cache, probe, positions, src, page_size):
    return None


def _mask_is_trivial(attn_mask: torch.Tensor, valid_len: torch.Tensor) -> bool:
    """True when ``attn_mask`` attends every token below ``valid_len`` with weight 0.

    Tokens at or past ``valid_len`` are never attended, whatever the mask says, so
    such a mask changes nothing and can be dropped exactly.

    Parameters
    ----------
    attn_mask : torch.Tensor
        Bool or additive float, broadcastable to ``[B, Hq, 1, L]``.
    valid_len : torch.Tensor
        int64 ``[B]``.
    """
    n_lo, n_hi = int(valid_len.min()), int(valid_len.max())
    if n_lo != n_hi:
        return False
    m = attn_mask[..., :n_hi]
    return bool(m.all()) if m.dtype == torch.bool else bool((m == 0).all())


@torch.library.custom_op("tinyserve::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    valid_len: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    scale: float,
    page_size: int,
    token_budget: int,
    sink_pages: int,
    candidate_factor: int,
    policy: str,
    kernel: str,
) -> torch.Tensor:
    """Decode attention of ``q`` over the paged cache through a selection policy.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, 1, D]``.
    k_cache, v_cache : torch.Tensor
        ``[B, Hkv, L, D]``, the caches themselves (no GQA repeat).
    valid_len : torch.Tensor
        int64 ``[1]`` or ``[B]``: newest written position + 1.
    attn_mask : torch.Tensor, optional
        Bool or additive float, broadcastable to ``[B, Hq, 1, L]``.
    scale : float
    page_size, token_budget, sink_pages, candidate_factor : int
    policy, kernel : str

    Returns
    -------
    torch.Tensor
        ``[B, Hq, 1, D]``, dtype of ``q``.
    """
    st = state_for(k_cache, page_size)
    if st.stale or k_cache._version != st.version:
        # the cache changed behind the graph's write op: never read stale bounds
        _rebuild(st, k_cache)
        st.version = k_cache._version
        st.probe_ref = None  # the next cache_write rebuilds too
    B = q.shape[0]
    vl = valid_len.reshape(-1).to(torch.int64).expand(B)
    if attn_mask is not None and _mask_is_trivial(attn_mask, vl):
        attn_mask = None  # the mask adds nothing to valid_len (HF's causal decode mask): take the no-mask path
        runtime_stats["masks_elided"] += 1
    ctx = DecodeContext(q, k_cache, v_cache, st.bounds, vl, attn_mask, scale, page_size, token_budget, sink_pages,
                        candidate_factor, st.policy_state, kernel)
    runtime_stats["decode_calls"] += 1
    n_valid_tokens = int(vl.max())
    budget_tokens = min(n_valid_tokens, token_budget) if policy != "full" else n_valid_tokens
    runtime_stats["tokens_valid"] += n_valid_tokens
    runtime_stats["tokens_attended"] += budget_tokens
    return get_policy(policy)(ctx)


@paged_attention.register_fake
def _(q, k_cache, v_cache, valid_len, attn_mask, scale, page_size, token_budget, sink_pages, candidate_factor,
      policy, kernel):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
