"""The ``tinyserve::policy_attention`` op: decode attention through a baseline policy.

``tinyserve::policy_attention(q, k_cache, v_cache, kmax, kmin, kabs, ctrl, valid_len, mask, scale, spec, policy,
kernel)`` is what the passes put in place of a decode SDPA when the configured policy is another than
``query_aware`` (``full``, ``streaming``, ``h2o``, ``oracle``): Python classes with per-buffer Python state
(:mod:`tinyserve_compile.policies`), research baselines with no device kernel, so they stay one Python op of their
own. It reads the page bounds and the ``ctrl`` flags that :mod:`tinyserve_compile.runtime` keeps for the key-cache
buffer, and the policies' per-buffer state held there (:attr:`~tinyserve_compile.runtime.StaticKVState.policy_state`).
``query_aware`` sites call ``tinyserve::sparse_decode`` instead (:mod:`tinyserve_compile.kernels.sparse_decode`).
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..kernels.bounds import rebuild_bounds_impl
from ..kernels.reference import PageBounds
from ..kernels.spec import SelectionSpec
from ..runtime import ctrl_flags, state_of_bounds
from .base import DecodeContext, get_policy

__all__ = ["policy_attention", "POLICY_ATTENTION"]


@torch.library.custom_op("tinyserve::policy_attention", mutates_args=())
def policy_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kmax: torch.Tensor,
    kmin: torch.Tensor,
    kabs: torch.Tensor,
    ctrl: torch.Tensor,
    valid_len: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    scale: float,
    spec: List[int],
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
    kmax, kmin, kabs : torch.Tensor
        The key cache's page bounds (kept by ``tinyserve::cache_write``).
    ctrl : torch.Tensor
        int32 ``[2]``; ``ctrl[0] != 0`` rebuilds the bounds first, ``ctrl[1] != 0`` attends densely (a dense
        layer). A CPU tensor is read in place; a device one through the host mirror of its state
        (:class:`~tinyserve_compile.runtime.StaticKVState`), without a device sync (read from the device only when
        no state owns ``kmax``).
    valid_len : torch.Tensor
        int64 ``[1]`` or ``[B]``: newest written position + 1.
    attn_mask : torch.Tensor, optional
        Bool or additive float, broadcastable to ``[B, Hq, 1, L]``.
    scale : float
    spec : list of int
        :meth:`~tinyserve_compile.kernels.spec.SelectionSpec.to_list`.
    policy, kernel : str

    Returns
    -------
    torch.Tensor
        ``[B, Hq, 1, D]``, dtype of ``q``.
    """
    bounds = PageBounds(kmax, kmin, kabs)
    sel = SelectionSpec.from_list(spec).for_cache(k_cache.shape[2])  # sizes bounded by the cache
    st = state_of_bounds(kmax)
    flags = ctrl_flags(st, ctrl)
    if flags[0]:  # never read stale bounds (a CPU write op clears this first; a device ctrl keeps it for the call)
        rebuild_bounds_impl(k_cache, kmax, kmin, kabs, sel.page_size)
    B = q.shape[0]
    vl = valid_len.reshape(-1).to(torch.int64).expand(B)
    ctx = DecodeContext(q, k_cache, v_cache, bounds, vl, attn_mask, scale, sel,
                        st.policy_state if st is not None else {}, kernel)
    return get_policy("full" if flags[1] else policy)(ctx)


@policy_attention.register_fake
def _(q, k_cache, v_cache, kmax, kmin, kabs, ctrl, valid_len, attn_mask, scale, spec, policy, kernel):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


#: the op's overload, which the rewritten graphs call
POLICY_ATTENTION = torch.ops.tinyserve.policy_attention.default
