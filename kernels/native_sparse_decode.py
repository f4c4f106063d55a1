"""The native CPU sparse-decode op: launcher and fake implementations (Liger-Kernel layout).

The kernel itself, ``_sparse_decode_kernel`` in spirit, is C++
(``kernels/csrc/tinyserve_cpu.cpp``, built by :mod:`.native`); this module holds the
Python launchers that call the registered ops and the fake (meta) implementations
that let ``torch.compile`` trace them:

* ``torch.ops.tinyserve_native.sparse_decode``: one call per sparse layer and step;
* ``torch.ops.tinyserve_native.kept_pages``: the pages that call keeps (tests, debugging);
* ``torch.ops.tinyserve_native.cache_write``: the key write plus the bounds of the
  pages it touches (all pages when ``ctrl[0] != 0``);
* ``torch.ops.tinyserve_native.rebuild_bounds``: every page's bounds.

Semantics: :func:`.reference.sparse_decode_reference` and :func:`.reference.page_bounds`.
"""
from __future__ import annotations

from typing import Optional

import torch

from .native import load_native, native_unavailable_reason

__all__ = [
    "sparse_decode_native",
    "kept_pages_native",
    "cache_write_native",
    "rebuild_bounds_native",
]

_fakes_registered = False


def _register_fakes() -> None:
    """Fake implementations of the native ops (called once, after the library is loaded)."""
    global _fakes_registered
    if _fakes_registered:
        return

    @torch.library.register_fake("tinyserve_native::sparse_decode")
    def _(q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, page_size, token_budget, sink_pages,
          candidate_factor, ctrl, candidate_extra=0, keep_tokens=False):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("tinyserve_native::kept_pages")
    def _(q, k_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, page_size, token_budget, sink_pages,
          candidate_factor, ctrl, candidate_extra=0, keep_tokens=False):
        return kabs.new_empty(kabs.shape, dtype=torch.bool)

    @torch.library.register_fake("tinyserve_native::cache_write")
    def _(k_cache, kmax, kmin, kabs, ctrl, positions, src, page_size):
        return None

    @torch.library.register_fake("tinyserve_native::rebuild_bounds")
    def _(k_cache, kmax, kmin, kabs, page_size):
        return None

    _fakes_registered = True


def _require():
    if not load_native():
        raise RuntimeError(f"tinyserve native kernel unavailable: {native_unavailable_reason()}")


def sparse_decode_native(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kmax: torch.Tensor,
    kmin: torch.Tensor,
    kabs: torch.Tensor,
    valid_len: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    scale: float,
    page_size: int,
    token_budget: int,
    sink_pages: int,
    candidate_factor: int,
    ctrl: Optional[torch.Tensor] = None,
    candidate_extra: int = 0,
    keep_tokens: bool = False,
) -> torch.Tensor:
    """Query-aware sparse decode attention in one native call.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, 1, D]`` float32/bfloat16/float16.
    k_cache, v_cache : torch.Tensor
        ``[B, Hkv, L, D]``, dtype of ``q``, any strides with a unit stride on ``D``
        (a ``.transpose(1, 2)`` view of a ``[B, L, Hkv, D]`` buffer is read in place).
    kmax, kmin : torch.Tensor
        ``[B, Hkv, P, D]`` page bounds, ``P = ceil(L / S)``: float32, bfloat16 (outward-rounded) or int8
        (codes on the page's grid, :func:`.reference.int8_bounds_step`), as :func:`.reference.store_bounds`.
    kabs : torch.Tensor
        ``[B, Hkv, P]`` float32 (for int8 bounds: the page's exact max ``|k|``, which sizes the grid).
    valid_len : torch.Tensor
        int64 ``[1]`` or ``[B]``.
    attn_mask : torch.Tensor, optional
        Bool (True = attend) or additive float, broadcastable to ``[B, Hq, 1, L]``.
    scale : float
    page_size, token_budget, sink_pages, candidate_factor : int
        Selection knobs, as in :func:`.reference.sparse_decode_reference`.
    ctrl : torch.Tensor, optional
        int32 ``[2]`` CPU tensor; ``ctrl[1] != 0`` attends densely over every valid token.
    candidate_extra : int
        Extra candidate tokens (>= 0): ``N1 = candidate_factor * K + candidate_extra // page_size`` candidate
        pages, two-stage iff ``N1 > K`` (:func:`.reference.candidate_pages`).
    keep_tokens : bool
        Two-stage only: keep the ``K * page_size`` candidate tokens of highest softmax share instead of ``K``
        pages (:func:`.reference.rank_candidate_tokens`).

    Returns
    -------
    torch.Tensor
        ``[B, Hq, 1, D]`` contiguous, dtype of ``q``.
    """
    _require()
    return torch.ops.tinyserve_native.sparse_decode(q, k_cache, v_cache, kmax, kmin, kabs, valid_len, attn_mask,
                                                    float(scale), page_size, token_budget, sink_pages,
                                                    candidate_factor, ctrl, int(candidate_extra), bool(keep_tokens))


def kept_pages_native(q, k_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, page_size, token_budget, sink_pages,
                      candidate_factor, ctrl=None, candidate_extra: int = 0, keep_tokens: bool = False) -> torch.Tensor:
    """The pages :func:`sparse_decode_native` attends to: bool ``[B, Hkv, P]``.

    Arguments as in :func:`sparse_decode_native` (no values). A row attended densely
    marks every valid page; with ``keep_tokens`` (two-stage) a page is marked when any
    of its tokens is kept.
    """
    _require()
    return torch.ops.tinyserve_native.kept_pages(q, k_cache, kmax, kmin, kabs, valid_len, attn_mask, float(scale),
                                                 page_size, token_budget, sink_pages, candidate_factor, ctrl,
                                                 int(candidate_extra), bool(keep_tokens))


def cache_write_native(k_cache, kmax, kmin, kabs, ctrl, positions, src, page_size: int) -> None:
    """``k_cache.index_copy_(2, positions, src)``, then the bounds of the pages it touched.

    Parameters
    ----------
    k_cache : torch.Tensor
        ``[B, Hkv, L, D]`` (a strided view is fine), written in place.
    kmax, kmin : torch.Tensor
        ``[B, Hkv, P, D]`` float32, bfloat16 or int8, contiguous, written in place (as
        :func:`.reference.store_bounds` of the exact page max/min).
    kabs : torch.Tensor
        ``[B, Hkv, P]`` float32, written in place.
    ctrl : torch.Tensor
        int32 ``[2]`` CPU tensor: when ``ctrl[0] != 0`` every page is rebuilt and
        ``ctrl[0]`` is reset to 0.
    positions : torch.Tensor
        int64 ``[n]`` positions written.
    src : torch.Tensor
        ``[B, Hkv, n, D]`` new keys, dtype of ``k_cache``.
    page_size : int
    """
    _require()
    torch.ops.tinyserve_native.cache_write(k_cache, kmax, kmin, kabs, ctrl, positions, src, page_size)


def rebuild_bounds_native(k_cache, kmax, kmin, kabs, page_size: int) -> None:
    """Every page's bounds from ``k_cache`` ``[B, Hkv, L, D]`` (equal to :func:`.reference.page_bounds`)."""
    _require()
    torch.ops.tinyserve_native.rebuild_bounds(k_cache, kmax, kmin, kabs, page_size)
