"""Kernels: the pure-PyTorch reference, the registered ops and their launchers.

Importing this package registers ``torch.ops.tinyserve.sparse_decode``,
``torch.ops.tinyserve.rebuild_bounds`` and ``torch.ops.tinyserve.update_bounds``.
"""
from .reference import PageBounds, Selection, page_bounds, page_scores, sparse_decode_reference
from .bounds import allocate_bounds, rebuild_bounds_, update_bounds_
from .sparse_decode import sparse_decode

__all__ = [
    "PageBounds",
    "Selection",
    "page_bounds",
    "page_scores",
    "sparse_decode_reference",
    "allocate_bounds",
    "rebuild_bounds_",
    "update_bounds_",
    "sparse_decode",
]
