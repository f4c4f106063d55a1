"""Attention of the reference: dense SDPA with a token mask over the selection, and the dropped-mass bound.

Part of :mod:`tinyserve_compile.kernels.reference` (the pure-PyTorch source of truth); the conventions are in its docstring.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .bounds import PageBounds, _as_valid_len, page_bounds
from .select import Selection, _gathered_mask, choose, mask_page_max, page_scores, selected_token_mask
from ..spec import SelectionSpec

def sparse_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    valid_len,
    attn_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    spec: Optional[SelectionSpec] = None,
    bounds: Optional[PageBounds] = None,
) -> torch.Tensor:
    """Sparse decode attention, written for clarity: dense SDPA with a token mask.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, 1, D]``.
    k_cache, v_cache : torch.Tensor
        ``[B, Hkv, L, D]``, same dtype as ``q``.
    valid_len : torch.Tensor or int
        int64 ``[B]``.
    attn_mask : torch.Tensor, optional
        Broadcastable to ``[B, Hq, 1, L]``, bool or additive float.
    scale : float, optional
        Defaults to ``1/sqrt(D)`` as in SDPA.
    spec : SelectionSpec, optional
        The selection (:class:`~tinyserve_compile.kernels.spec.SelectionSpec`); defaults to the
        ``TinyServeConfig`` defaults, with the bounds dtype of ``bounds`` when those are given.
    bounds : PageBounds, optional
        Defaults to :func:`.bounds.page_bounds` over all ``L`` slots, stored as ``spec.bounds_dtype``.

    Returns
    -------
    torch.Tensor
        ``[B, Hq, 1, D]``, dtype of ``q``.
    """
    B, Hq, _, D = q.shape
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    vl = _as_valid_len(valid_len, B, q.device)
    if spec is None:
        spec = SelectionSpec.default() if bounds is None else SelectionSpec.default(bounds_dtype=bounds.kmax.dtype)
    if bounds is None:
        bounds = page_bounds(k_cache, spec.page_size, dtype=spec.bounds_dtype)
    sel, unit = choose(q, k_cache, bounds, vl, attn_mask, scale, spec)
    keep = torch.arange(L, device=q.device)[None, None, :] < vl[:, None, None]  # [B,1,L]
    if sel is not None:
        keep = keep & selected_token_mask(sel, unit, L, vl)  # [B,Hkv,L]
    keep = keep.expand(B, Hkv, L).repeat_interleave(G, dim=1)[:, :, None, :]  # [B,Hq,1,L]
    add = torch.zeros(B, Hq, 1, L, dtype=torch.float32, device=q.device).masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        m = attn_mask
        if m.dtype == torch.bool:
            m = torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill(~m, float("-inf"))
        add = add + m.float()
    k = k_cache.float().repeat_interleave(G, dim=1)
    v = v_cache.float().repeat_interleave(G, dim=1)
    logits = (q.float() @ k.transpose(-1, -2)) * scale + add  # [B,Hq,1,L]
    return softmax_attend(logits, v).to(q.dtype)


def softmax_attend(logits: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``softmax(logits) @ v`` in fp32; a row with no finite logit gives zeros, as SDPA does.

    Parameters
    ----------
    logits : torch.Tensor
        ``[..., T]`` fp32.
    v : torch.Tensor
        ``[..., T, D]`` fp32.
    """
    m = logits.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(logits - m)
    den = p.sum(-1, keepdim=True)
    return (p @ v) / torch.where(den > 0, den, torch.ones_like(den))


def dropped_mass_bound(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    bounds: PageBounds,
    sel: Optional[Selection],
    valid_len,
    attn_mask: Optional[torch.Tensor],
    scale: float,
    page_size: int,
):
    """Certified upper bound on the softmax mass a selection leaves out, next to the true value.

    For query head ``h`` let ``Z_in = sum_{t selected} exp(l_t)`` (exact logits) and,
    for every valid page ``j`` not selected for ``h``'s KV head,
    ``n_j * exp(u_hj)`` with ``u_hj`` the page's logit upper bound
    (:func:`page_scores` per query head, rounding slack and mask included) and
    ``n_j`` its number of valid tokens. With ``Z_out_ub = sum_j n_j exp(u_hj) >= Z_out``
    and ``x -> x / (Z_in + x)`` increasing,

    ``dropped_h = Z_out / (Z_in + Z_out) <= Z_out_ub / (Z_in + Z_out_ub)``.

    Computed in log space (shifted by the row max) so nothing overflows. This
    reads every key only to return the *measured* dropped mass next to the bound;
    the bound itself needs only ``Z_in`` (from the attended tokens) and the bounds.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, 1, D]``.
    k_cache : torch.Tensor
        ``[B, Hkv, L, D]``.
    bounds : PageBounds
        Bounds covering ``k_cache`` (``P = ceil(L / S)`` pages).
    sel : Selection or None
        Kept pages ``[B, Hkv, K]``; None means dense (nothing dropped).
    valid_len : torch.Tensor or int
    attn_mask : torch.Tensor, optional
        As in :func:`sparse_decode_reference`.
    scale : float
    page_size : int

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``(bound, measured)``, both fp32 ``[B, Hq]`` in ``[0, 1]``; ``bound >= measured``
        up to fp32 rounding of the final division.
    """
    B, Hq, _, D = q.shape
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    G, S = Hq // Hkv, page_size
    P = bounds.kmax.shape[2]
    vl = _as_valid_len(valid_len, B, q.device)
    if sel is None:
        z = torch.zeros(B, Hq, device=q.device)
        return z, z
    valid_tok = torch.arange(L, device=q.device)[None, :] < vl[:, None]  # [B,L]
    kept_tok = selected_token_mask(sel, S, L, vl) & valid_tok[:, None, :]  # [B,Hkv,L]
    logits = (q.float().reshape(B, Hkv, G, D) @ k_cache.float().transpose(-1, -2)) * scale  # [B,Hkv,G,L]
    logits = logits + _gathered_mask(attn_mask, torch.arange(L, device=q.device).expand(B, Hkv, L), B, Hq, L)
    logits = logits.masked_fill(~valid_tok[:, None, None, :], float("-inf"))
    lse_in = logits.masked_fill(~kept_tok[:, :, None, :], float("-inf")).logsumexp(-1)  # [B,Hkv,G]
    lse_out = logits.masked_fill(kept_tok[:, :, None, :], float("-inf")).logsumexp(-1)
    measured = torch.sigmoid(lse_out - lse_in).nan_to_num(nan=0.0)
    # ---- the bound: unselected valid pages, n_j * exp(u_hj)
    ub = page_scores(q, bounds, scale, mask_page_max(attn_mask, B, Hq, L, S), group_reduce=False)  # [B,Hq,P]
    ub = ub.reshape(B, Hkv, G, P)
    page = torch.arange(P, device=q.device)
    n_tok = (vl[:, None] - page[None, :] * S).clamp(min=0, max=S)  # [B,P]
    kept_page = torch.zeros(B, Hkv, P, dtype=torch.bool, device=q.device)
    kept_page.scatter_(2, sel.idx.clamp(max=P - 1), sel.ok)
    out_page = (~kept_page) & (n_tok > 0)[:, None, :]  # [B,Hkv,P]
    log_terms = ub + torch.log(n_tok.float().clamp(min=1))[:, None, None, :]
    lse_out_ub = log_terms.masked_fill(~out_page[:, :, None, :], float("-inf")).logsumexp(-1)  # [B,Hkv,G]
    bound = torch.sigmoid(lse_out_ub - lse_in).nan_to_num(nan=0.0)
    return bound.reshape(B, Hq), measured.reshape(B, Hq)
