"""Kernels: the pure-PyTorch reference, the registered ops and their launchers.

Importing this package as ``tinyserve_compile.kernels`` registers the ops
``torch.ops.tinyserve.sparse_decode`` (:mod:`.sparse_decode`),
``torch.ops.tinyserve.cache_write`` (:mod:`.bounds`) and
``torch.ops.tinyserve.paged_sparse_decode`` (:mod:`.paged_sparse_decode`), each with its kernel per device
(native C++ on CPU, Triton on CUDA, the PyTorch path elsewhere); each op module makes its native kernel
the op's CPU kernel once the native module loads (:func:`.native.when_loaded`). Every op takes the
selection as one packed ``int[] spec`` (:class:`.spec.SelectionSpec`).

This folder sits at the top of the repository, so with the repository root on
``sys.path`` (``python -m pytest`` or ``python -m bench`` from the root, say) it is also
importable as a top-level ``kernels``, the name of HuggingFace's kernels library, which
transformers imports (since 5.25 it is one of its dependencies, imported whenever
``transformers.activations`` is). Imported that way, this folder hands the name over to
that library when it is installed elsewhere on ``sys.path`` (``sys.modules["kernels"]``
becomes the library), and otherwise stays inert: no ops are registered twice, and
transformers sees a package without a version.
"""
if __name__ == "tinyserve_compile.kernels":
    from .spec import SelectionSpec
    from .reference import PageBounds, Selection, page_bounds, page_scores, sparse_decode_reference
    from .bounds import allocate_bounds, rebuild_bounds_, update_bounds_
    from .sparse_decode import sparse_decode
    from . import paged_sparse_decode as _paged  # noqa: F401  (registers tinyserve::paged_sparse_decode)
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

    def _hand_over() -> None:
        """Load the ``kernels`` found on ``sys.path`` outside this repository in place of this folder."""
        import importlib.machinery
        import importlib.util
        import os
        import sys

        if getattr(sys, "_tinyserve_kernels_hand_over", False):
            return  # another copy of this folder is handing over to this one: stay inert
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
        spec = importlib.machinery.PathFinder.find_spec(__name__, path)
        if spec is None or spec.loader is None:
            return  # no other library of that name: stay inert
        library = importlib.util.module_from_spec(spec)
        this = sys.modules[__name__]
        sys.modules[__name__] = library  # the import statement returns what sys.modules holds after this runs
        sys._tinyserve_kernels_hand_over = True
        try:
            spec.loader.exec_module(library)
        except BaseException:
            sys.modules[__name__] = this
            raise
        finally:
            del sys._tinyserve_kernels_hand_over

    _hand_over()
    del _hand_over
