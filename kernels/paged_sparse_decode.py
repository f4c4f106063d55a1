"""Query-aware sparse decode over a paged KV buffer shared by many requests (continuous batching).

The static path (:mod:`reference`) owns one contiguous ``[B, Hkv, L, D]`` cache per batch row. A continuous-batching
engine instead keeps one flat token buffer per layer, ``[N, Hkv, D]``, carved into pages that requests borrow and
give back. Here each decode row ``r`` is described by its page table:

* ``page_rows[r, p]``: the buffer row holding the first token of the request's ``p``-th page (its tokens are the
  ``page_size`` rows that follow);
* ``page_ids[r, p]``: the physical page id, which indexes the page bounds (bounds live with the buffer, keyed by
  physical page, so a page keeps its bound whichever request reads it);
* ``seq_lens[r]``: the request's length; pages past it are padding.

Selection is exactly the static path's, per row: the bound ``r_j = sum_i max(q_i*M_ji, q_i*m_ji)`` of
:func:`reference.page_scores`, the newest page and the sink pages forced, dense when every page of the row fits in
the budget or is a candidate (:attr:`.spec.SelectionSpec.n_dense_pages`), and the two-stage
candidates of :func:`reference.candidate_pages` ranked by exact logits
(:func:`reference.rank_candidates` / :func:`reference.rank_candidate_tokens`). The reference
(:func:`paged_sparse_decode_reference`) copies each row's history into a contiguous cache and calls
:func:`reference.sparse_decode_reference`; the fast path (:func:`paged_sparse_decode`) reads only the bounds of the
row's pages and the keys and values of the pages and tokens it selects, through the page table.

Bounds are maintained by :func:`paged_write_` (the write of new keys and values plus the bounds of the pages they
touch): a page's bound is rebuilt from its slots ``0..s`` where ``s`` is the highest slot written, so a write at a
page's first slot discards whatever a previous owner of the page left there.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch

from .native import when_loaded
from .spec import PAGED_KERNELS, SelectionSpec
from .reference import PageBounds, sparse_decode_reference, store_bounds
from .torch_sparse_decode import sparse_decode_torch

__all__ = [
    "gather_pages",
    "rebuild_pages_",
    "paged_page_bounds",
    "paged_write_",
    "paged_sparse_decode_reference",
    "paged_sparse_decode",
]


def _check_table(page_rows: torch.Tensor, page_ids: torch.Tensor, seq_lens: torch.Tensor, q: Optional[torch.Tensor]):
    if page_rows.dim() != 2 or page_ids.shape != page_rows.shape:
        raise ValueError(f"argument 'page_rows' and 'page_ids' must be [R, P] of one shape, got "
                         f"{tuple(page_rows.shape)} and {tuple(page_ids.shape)}")
    if seq_lens.shape != (page_rows.shape[0],):
        raise ValueError(f"argument 'seq_lens' must be [R] = [{page_rows.shape[0]}], got {tuple(seq_lens.shape)}")
    if q is not None and (q.dim() != 4 or q.shape[0] != page_rows.shape[0] or q.shape[2] != 1):
        raise ValueError(f"argument 'q' must be [R, Hq, 1, D] with R = {page_rows.shape[0]}, got {tuple(q.shape)}")


def gather_pages(tokens: torch.Tensor, page_rows: torch.Tensor, page_size: int) -> torch.Tensor:
    """Every slot of the listed pages, in page order.

    Parameters
    ----------
    tokens : torch.Tensor
        ``[N, Hkv, D]`` the paged buffer of one layer (keys or values), any dtype.
    page_rows : torch.Tensor
        int64 ``[R, P]`` first buffer row of each page.
    page_size : int

    Returns
    -------
    torch.Tensor
        ``[R, Hkv, P * page_size, D]``, dtype of ``tokens``.
    """
    R, P = page_rows.shape
    rows = (page_rows[:, :, None] + torch.arange(page_size, device=page_rows.device)).reshape(R, P * page_size)
    return tokens[rows].permute(0, 2, 1, 3)  # [R,P*S,Hkv,D] -> [R,Hkv,P*S,D]


def paged_page_bounds(tokens: torch.Tensor, page_rows: torch.Tensor, n_slots: torch.Tensor, page_size: int,
                      dtype: torch.dtype = torch.float32) -> PageBounds:
    """Bounds of single pages over their first ``n_slots`` slots, as :func:`reference.page_bounds` computes them.

    Parameters
    ----------
    tokens : torch.Tensor
        ``[N, Hkv, D]`` keys of one layer.
    page_rows : torch.Tensor
        int64 ``[n]`` first buffer row of each page.
    n_slots : torch.Tensor
        int64 ``[n]`` valid slots of each page (``0..page_size``; 0 gives the zero bounds of an empty page).
    page_size : int
    dtype : torch.dtype
        Storage dtype of ``kmax``/``kmin`` (see :func:`reference.store_bounds`).

    Returns
    -------
    PageBounds
        ``kmax``/``kmin`` ``[n, Hkv, D]``, ``kabs`` ``[n, Hkv]``.
    """
    k = gather_pages(tokens, page_rows[:, None], page_size).float()  # [n,Hkv,S,D]
    keep = (torch.arange(page_size, device=k.device)[None, :] < n_slots[:, None])[:, None, :, None]  # [n,1,S,1]
    kmax = torch.where(keep, k, float("-inf")).amax(2)  # [n,Hkv,D]
    kmin = torch.where(keep, k, float("inf")).amin(2)
    empty = torch.isinf(kmax)
    return store_bounds(kmax.masked_fill(empty, 0.0), kmin.masked_fill(empty, 0.0), dtype)


def paged_write_(k_tokens: torch.Tensor, v_tokens: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 write_rows: torch.Tensor, bounds: PageBounds, fresh: torch.Tensor, page_size: int,
                 rows_per_block: int, pages_per_block: int, kernel: str = "auto") -> torch.Tensor:
    """Write new keys and values into the paged buffer and rebuild the bounds of every page they touch.

    A page's bound is rebuilt over its slots ``0..s`` with ``s`` the highest slot written in it by this call
    (requests write their pages in order, so those are exactly its valid slots): a write at the first slot of a
    page given back by a finished request resets its bound.

    Parameters
    ----------
    k_tokens, v_tokens : torch.Tensor
        ``[N, Hkv, D]`` the layer's paged buffer (views; written in place).
    key, value : torch.Tensor
        ``[T, Hkv, D]`` new keys and values, dtype of the buffer.
    write_rows : torch.Tensor
        int64 ``[T]`` buffer row of each new token.
    bounds : PageBounds
        ``kmax``/``kmin`` ``[NP, Hkv, D]``, ``kabs`` ``[NP, Hkv]`` indexed by physical page id (updated in place).
    fresh : torch.Tensor
        bool ``[NP]``: the page's bound is current (set for the pages rebuilt here).
    page_size : int
        Tokens per page ``S``.
    rows_per_block, pages_per_block : int
        The buffer is a sequence of blocks of ``rows_per_block`` rows whose first ``pages_per_block * S`` rows
        are this layer's pages: the page of row ``w`` is ``(w // rows_per_block) * pages_per_block
        + (w % rows_per_block) // S`` and its first row is ``w - (w % rows_per_block) % S``.
    kernel : {"auto", "native", "torch"}
        ``auto``: the native CPU kernel when it is loaded and the bounds are contiguous CPU tensors, else the
        PyTorch path (same result).

    Returns
    -------
    torch.Tensor
        int64 ``[n]`` the physical ids of the pages rebuilt.
    """
    if _native_ok(kernel, k_tokens, bounds, fresh):
        from .native import native_module

        return native_module().paged_write(k_tokens, v_tokens, key, value, write_rows, *bounds, fresh, page_size,
                                           rows_per_block, pages_per_block)
    # ---- stage 1: the write itself
    k_tokens.index_copy_(0, write_rows, key)
    v_tokens.index_copy_(0, write_rows, value)
    # ---- stage 2: touched pages and the highest slot written in each
    off = write_rows % rows_per_block
    pid = (write_rows // rows_per_block) * pages_per_block + off // page_size  # [T]
    pages, inv = torch.unique(pid, return_inverse=True)
    slot = off % page_size
    top = torch.zeros_like(pages).scatter_reduce_(0, inv, slot, "amax", include_self=False)
    first = torch.zeros_like(pages).scatter_reduce_(0, inv, write_rows - slot, "amax", include_self=False)
    # ---- stage 3: rebuild their bounds from the buffer
    new = paged_page_bounds(k_tokens, first, top + 1, page_size, bounds.kmax.dtype)
    bounds.kmax[pages] = new.kmax
    bounds.kmin[pages] = new.kmin
    bounds.kabs[pages] = new.kabs
    fresh[pages] = True
    return pages


def _row_bounds(bounds: PageBounds, page_ids: torch.Tensor) -> PageBounds:
    """Bounds of each row's pages: ``[R, Hkv, P, D]`` (``kabs`` ``[R, Hkv, P]``)."""
    return PageBounds(bounds.kmax[page_ids].permute(0, 2, 1, 3), bounds.kmin[page_ids].permute(0, 2, 1, 3),
                      bounds.kabs[page_ids].permute(0, 2, 1))


def paged_sparse_decode_reference(
    q: torch.Tensor,
    k_tokens: torch.Tensor,
    v_tokens: torch.Tensor,
    page_rows: torch.Tensor,
    page_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    bounds: PageBounds,
    scale: Optional[float] = None,
    spec: Optional[SelectionSpec] = None,
) -> torch.Tensor:
    """Paged sparse decode, written for clarity: each row's history copied out and passed to
    :func:`reference.sparse_decode_reference` with the bounds of its pages.

    Parameters
    ----------
    q : torch.Tensor
        ``[R, Hq, 1, D]`` one query token per row.
    k_tokens, v_tokens : torch.Tensor
        ``[N, Hkv, D]`` the layer's paged buffer, dtype of ``q``.
    page_rows, page_ids : torch.Tensor
        int64 ``[R, P]`` first buffer row and physical id of each page of each row (entries past the row's pages
        are ignored).
    seq_lens : torch.Tensor
        int64 ``[R]`` tokens of each row (``>= 1``).
    bounds : PageBounds
        ``[NP, Hkv, D]`` / ``[NP, Hkv]`` indexed by physical page id.
    scale : float, optional
    spec : SelectionSpec, optional
        As in :func:`reference.sparse_decode_reference` (default: the :class:`TinyServeConfig` defaults).

    Returns
    -------
    torch.Tensor
        ``[R, Hq, 1, D]``, dtype of ``q``.
    """
    _check_table(page_rows, page_ids, seq_lens, q)
    spec = SelectionSpec.default(bounds_dtype=bounds.kmax.dtype) if spec is None else spec
    page_size = spec.page_size
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = []
    for r in range(q.shape[0]):
        L = int(seq_lens[r])
        P = (L + page_size - 1) // page_size
        k = gather_pages(k_tokens, page_rows[r:r + 1, :P], page_size)[:, :, :L]  # [1,Hkv,L,D]
        v = gather_pages(v_tokens, page_rows[r:r + 1, :P], page_size)[:, :, :L]
        b = _row_bounds(bounds, page_ids[r:r + 1, :P])
        out.append(sparse_decode_reference(q[r:r + 1], k, v, L, None, scale, spec, b))
    return torch.cat(out, 0)


def _native_ok(kernel: str, tokens: torch.Tensor, bounds: PageBounds, fresh: Optional[torch.Tensor] = None) -> bool:
    """Whether the native CPU kernel runs (``kernel`` ``auto`` or ``native``): CPU tensors, contiguous bounds
    (and ``fresh``), a loaded native module. ``native`` raises naming ``kernel`` when it cannot run."""
    if kernel not in PAGED_KERNELS:
        raise ValueError(f"paged: argument 'kernel' must be one of {PAGED_KERNELS}, got {kernel!r}")
    if kernel == "torch":
        return False
    from .native import load_native, native_unavailable_reason

    layout_ok = (tokens.device.type == "cpu" and all(t.is_contiguous() for t in bounds)
                 and (fresh is None or fresh.is_contiguous()))
    if layout_ok and load_native():
        return True
    if kernel == "native":
        why = ("it needs CPU tensors and contiguous bounds" if not layout_ok else
               f"the native kernel is unavailable: {native_unavailable_reason()}")
        raise ValueError(f"paged: argument 'kernel'='native' cannot run: {why}")
    return False




def rebuild_pages_(k_tokens: torch.Tensor, bounds: PageBounds, fresh: torch.Tensor, page_rows: torch.Tensor,
                   n_slots: torch.Tensor, page_ids: torch.Tensor, page_size: int, kernel: str = "auto") -> None:
    """Rebuild the bounds of listed pages from their first ``n_slots`` slots and mark them fresh (stale pages).

    Parameters
    ----------
    k_tokens : torch.Tensor
        ``[N, Hkv, D]`` keys of one layer.
    bounds : PageBounds
        ``[NP, Hkv, D]`` / ``[NP, Hkv]`` by physical page id (updated in place).
    fresh : torch.Tensor
        bool ``[NP]`` (set for the listed pages).
    page_rows, n_slots, page_ids : torch.Tensor
        int64 ``[n]``: first buffer row, valid slots (``1..page_size``) and physical id of each page.
    page_size : int
    kernel : {"auto", "native", "torch"}
    """
    if _native_ok(kernel, k_tokens, bounds, fresh):
        from .native import native_module

        native_module().paged_bounds_rebuild(k_tokens, *bounds, page_rows, n_slots, page_ids, page_size)
    else:
        new = paged_page_bounds(k_tokens, page_rows, n_slots, page_size, bounds.kmax.dtype)
        bounds.kmax[page_ids], bounds.kmin[page_ids], bounds.kabs[page_ids] = new.kmax, new.kmin, new.kabs
    fresh[page_ids] = True


def _paged_sparse_decode_torch(q, k_tokens, v_tokens, page_rows, page_ids, seq_lens, bounds: PageBounds, scale: float,
                               spec: SelectionSpec) -> torch.Tensor:
    """The PyTorch path: each row's pages copied into a padded contiguous cache ``[R, Hkv, P*S, D]`` (entries past
    a row's pages read page 0), then the static op's PyTorch path with ``valid_len = seq_lens``: one selection flow
    for both layouts."""
    S = spec.page_size
    P = page_rows.shape[1]
    used = torch.arange(P, device=q.device)[None, :] * S < seq_lens[:, None]  # [R,P]
    rows = torch.where(used, page_rows, 0)
    ids = torch.where(used, page_ids, 0)
    k = gather_pages(k_tokens, rows, S)  # [R,Hkv,P*S,D]
    v = gather_pages(v_tokens, rows, S)
    b = _row_bounds(bounds, ids)  # [R,Hkv,P,D]
    return sparse_decode_torch(q, k, v, b.kmax, b.kmin, b.kabs, seq_lens.to(torch.int64), None, scale, spec)


def paged_python_kernel(q, k_tokens, v_tokens, page_rows, page_ids, seq_lens, kmax, kmin, kabs, scale, spec, kernel):
    """The op's kernel in Python: the native kernel for ``auto``/``native`` on CPU when it is loaded (until
    :func:`_register_native` makes it the op's CPU kernel), else the PyTorch path."""
    spec = SelectionSpec.from_list(list(spec))
    bounds = PageBounds(kmax, kmin, kabs)
    if _native_ok(kernel, k_tokens, bounds):
        from .native import native_module

        return native_module().paged_sparse_decode(q, k_tokens, v_tokens, page_rows, page_ids, seq_lens, kmax, kmin,
                                                   kabs, float(scale), spec.to_list())
    return _paged_sparse_decode_torch(q, k_tokens, v_tokens, page_rows, page_ids, seq_lens, bounds, scale, spec)


@torch.library.custom_op("tinyserve::paged_sparse_decode", mutates_args=())
def _paged_sparse_decode_op(
    q: torch.Tensor,
    k_tokens: torch.Tensor,
    v_tokens: torch.Tensor,
    page_rows: torch.Tensor,
    page_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    kmax: torch.Tensor,
    kmin: torch.Tensor,
    kabs: torch.Tensor,
    scale: float,
    spec: List[int],
    kernel: str,
) -> torch.Tensor:
    # every device, and CPU until the native module registers its kernel
    return paged_python_kernel(q, k_tokens, v_tokens, page_rows, page_ids, seq_lens, kmax, kmin, kabs, scale, spec,
                               kernel)


@_paged_sparse_decode_op.register_fake
def _(q, k_tokens, v_tokens, page_rows, page_ids, seq_lens, kmax, kmin, kabs, scale, spec, kernel):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _register_native(module) -> None:
    """Make the native kernel the CPU kernel of ``tinyserve::paged_sparse_decode`` (once the native module has
    loaded); it hands the ``kernel`` choices other than ``auto`` and ``native`` back to :func:`paged_python_kernel`."""
    module.register_paged_cpu_kernel(paged_python_kernel)
    # custom_op's Python autograd and ADInplaceOrView kernels cost ~30 us per call on CPU: a C++ pass-through
    module.register_autograd_passthrough(["paged_sparse_decode"])


when_loaded(_register_native)


def paged_sparse_decode(
    q: torch.Tensor,
    k_tokens: torch.Tensor,
    v_tokens: torch.Tensor,
    page_rows: torch.Tensor,
    page_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    bounds: PageBounds,
    scale: Optional[float] = None,
    spec: Optional[SelectionSpec] = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """Paged sparse decode for a batch of rows of different lengths, reading the buffer through the page table.

    Same arguments, result and selection as :func:`paged_sparse_decode_reference`, plus ``kernel``
    (``auto``, ``native``, ``torch``). One op, ``tinyserve::paged_sparse_decode``: on CPU the native kernel
    (``kernels/csrc/paged.cpp``, the static op's C++ pipeline through the page table, reading only the bounds of
    each row's pages and the keys and values it selects); elsewhere, or with ``kernel="torch"``, the PyTorch path
    (each row's pages copied out, then the static op's PyTorch path).
    """
    _check_table(page_rows, page_ids, seq_lens, q)
    if kernel not in PAGED_KERNELS:
        raise ValueError(f"paged_sparse_decode: argument 'kernel' must be one of {PAGED_KERNELS}, got {kernel!r}")
    spec = SelectionSpec.default(bounds_dtype=bounds.kmax.dtype) if spec is None else spec
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.ops.tinyserve.paged_sparse_decode(q, k_tokens, v_tokens, page_rows, page_ids, seq_lens, *bounds,
                                                   float(scale), spec.to_list(), kernel)
