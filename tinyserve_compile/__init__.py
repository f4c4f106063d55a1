"""tinyserve-compile: query-aware paged sparse decode attention as a torch.compile backend.

``torch.compile(model, backend="tinyserve", options={...})`` rewrites decode-mode
scaled-dot-product attention over a KV cache into paged sparse attention.
Importing the package registers the ``tinyserve::*`` ops and the backend.
"""
from . import kernels  # noqa: F401  (registers the tinyserve ops)
from .backend import register as _register
from .backend import tinyserve_backend
from .config import TinyServeConfig
from .explain import counters, explain, reset

__version__ = "0.1.0"
__all__ = ["tinyserve_backend", "TinyServeConfig", "counters", "explain", "reset", "export_onnx",
           "enable_continuous_batching", "disable_continuous_batching"]


def __getattr__(name):
    # the ONNX export is loaded on first use: importing the package stays free of onnx/onnxscript
    if name == "export_onnx":
        from .onnx.export import export_onnx

        return export_onnx
    if name in ("enable_continuous_batching", "disable_continuous_batching"):
        # loaded on first use: nothing of transformers is touched at import
        from . import continuous_batching

        return getattr(continuous_batching, name)
    raise AttributeError(f"module 'tinyserve_compile' has no attribute {name!r}")

_register()
