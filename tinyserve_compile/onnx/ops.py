"""The functional twins of the backend's ops, for the ONNX decode step (namespace ``tinyserve``).

ONNX has no in-place update, so the exported decode step returns new caches and
bounds instead of writing them. Three export-only ops stand for the parts of the
backend's graph that have no functional ATen form; they take the selection as the
same packed ``int[] spec`` as the backend's ops (:class:`~tinyserve_compile.kernels.spec.SelectionSpec`):

``tinyserve::export_kv_write(cache, position, src)``
    ``cache`` with row ``b``'s new token written at ``position[b]`` (a copy; keys and values).
``tinyserve::export_bounds_write(k_cache, kmax, kmin, kabs, position, spec)``
    the functional twin of ``tinyserve::cache_write``'s bounds: the page holding
    ``position[b]`` recomputed from ``k_cache`` (every slot of the page, as the
    backend's maintained bounds), stored as the dtype of ``kmax`` (bfloat16: rounded
    outward; int8: codes on the page's grid, ``kabs`` the exact max ``|k|``).
``tinyserve::export_sparse_decode(q, k_cache, v_cache, kmax, kmin, kabs, position, scale, spec)``
    the twin of ``tinyserve::sparse_decode`` without a mask, ``valid_len = position + 1``.

Their PyTorch implementations call :mod:`tinyserve_compile.kernels.reference`
(the single source of truth), so a decode step run eagerly in PyTorch is the
reference; :mod:`tinyserve_compile.onnx.translate` lowers them to standard ONNX
ops. Nothing here is used by the ``torch.compile`` backend.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from ..kernels.reference import PageBounds, sparse_decode_reference, store_bounds
from ..kernels.spec import SelectionSpec

__all__ = ["kv_write", "bounds_write", "sparse_decode"]


def _rows(position: torch.Tensor, batch: int) -> torch.Tensor:
    return position.reshape(-1).to(torch.int64).expand(batch)


@torch.library.custom_op("tinyserve::export_kv_write", mutates_args=())
def kv_write(cache: torch.Tensor, position: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """A copy of ``cache`` with ``src`` written at ``position``, per batch row.

    Parameters
    ----------
    cache : torch.Tensor
        ``[B, H, L, D]`` key or value cache.
    position : torch.Tensor
        int64 ``[B]``: the slot each row writes.
    src : torch.Tensor
        ``[B, H, 1, D]`` new keys or values, dtype of ``cache``.

    Returns
    -------
    torch.Tensor
        ``[B, H, L, D]``.
    """
    B = cache.shape[0]
    out = cache.clone()
    pos = _rows(position, B)
    out[torch.arange(B), :, pos] = src[:, :, 0].to(cache.dtype)  # [B,H,D] at (b, :, pos[b])
    return out


@kv_write.register_fake
def _(cache, position, src):
    return torch.empty_like(cache)


@torch.library.custom_op("tinyserve::export_bounds_write", mutates_args=())
def bounds_write(k_cache: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, kabs: torch.Tensor,
                 position: torch.Tensor, spec: List[int]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bounds with the page written at ``position`` recomputed (copies).

    Parameters
    ----------
    k_cache : torch.Tensor
        ``[B, Hkv, L, D]`` key cache after the write, ``L % page_size == 0``.
    kmax, kmin : torch.Tensor
        ``[B, Hkv, P, D]`` float32, bfloat16 (rounded outward) or int8 (codes, see
        :func:`~tinyserve_compile.kernels.reference.store_bounds`).
    kabs : torch.Tensor
        ``[B, Hkv, P]`` float32.
    position : torch.Tensor
        int64 ``[B]``.
    spec : list of int
        :meth:`~tinyserve_compile.kernels.spec.SelectionSpec.to_list` (the page size is what it reads).

    Returns
    -------
    (torch.Tensor, torch.Tensor, torch.Tensor)
        New ``kmax``, ``kmin``, ``kabs``.
    """
    B = k_cache.shape[0]
    S = SelectionSpec.from_list(spec).page_size
    kmax, kmin, kabs = kmax.clone(), kmin.clone(), kabs.clone()
    for b, pos in enumerate(_rows(position, B).tolist()):
        p = pos // S
        keys = k_cache[b, :, p * S:(p + 1) * S]  # [Hkv,S,D]
        new = store_bounds(keys.amax(1).float(), keys.amin(1).float(), kmax.dtype)  # [Hkv,D], [Hkv]
        kmax[b, :, p], kmin[b, :, p], kabs[b, :, p] = new.kmax, new.kmin, new.kabs
    return kmax, kmin, kabs


@bounds_write.register_fake
def _(k_cache, kmax, kmin, kabs, position, spec):
    return torch.empty_like(kmax), torch.empty_like(kmin), torch.empty_like(kabs)


@torch.library.custom_op("tinyserve::export_sparse_decode", mutates_args=())
def sparse_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kmax: torch.Tensor,
                  kmin: torch.Tensor, kabs: torch.Tensor, position: torch.Tensor, scale: float,
                  spec: List[int]) -> torch.Tensor:
    """Query-aware sparse decode attention of the reference, ``valid_len = position + 1``.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, 1, D]``.
    k_cache, v_cache : torch.Tensor
        ``[B, Hkv, L, D]``, already holding the token at ``position``.
    kmax, kmin, kabs : torch.Tensor
        Bounds of ``k_cache`` (see :func:`bounds_write`).
    position : torch.Tensor
        int64 ``[B]``.
    scale : float
    spec : list of int
        :meth:`~tinyserve_compile.kernels.spec.SelectionSpec.to_list`.

    Returns
    -------
    torch.Tensor
        ``[B, Hq, 1, D]``, dtype of ``q``.
    """
    B = q.shape[0]
    vl = _rows(position, B) + 1
    return sparse_decode_reference(q, k_cache, v_cache, vl, None, scale, SelectionSpec.from_list(spec),
                                   PageBounds(kmax, kmin, kabs))


@sparse_decode.register_fake
def _(q, k_cache, v_cache, kmax, kmin, kabs, position, scale, spec):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
