"""Kernels: the pure-PyTorch reference, the registered ops and their launchers.

Importing this package as ``tinyserve_compile.kernels`` registers the ops
``torch.ops.tinyserve.sparse_decode`` (:mod:`.sparse_decode`) and
``torch.ops.tinyserve.cache_write`` (:mod:`.bounds`), each with its kernel per device
(native C++ on CPU, Triton on CUDA, the PyTorch path elsewhere). Every op takes the
selection as one packed ``int[] spec`` (:class:`.spec.SelectionSpec`).

This folder sits at the top of the repository, so with the repository root on
``sys.path`` (``python -m pytest`` from the root, say) it is also importable as a
top-level ``kernels``, the name of HuggingFace's kernels library; transformers
imports that name to probe for it. Imported that way it stays inert: no ops are
registered twice, and transformers sees a package without a version.
"""
if __name__ == "tinyserve_compile.kernels":
    from .spec import SelectionSpec
    from .reference import PageBounds, Selection, page_bounds, page_scores, sparse_decode_reference
    from .bounds import allocate_bounds, rebuild_bounds_, update_bounds_
    from .sparse_decode import sparse_decode
    from .linear import linear

    __all__ = [
        "SelectionSpec",
        "PageBounds",
        "Selection",
        "page_bounds",
        "page_scores",
        "sparse_decode_reference",
        "allocate_bounds",
        "rebuild_bounds_",
        "update_bounds_",
        "sparse_decode",
        "linear",
    ]
else:
    __all__ = []
