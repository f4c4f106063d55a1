"""tinyserve-compile: query-aware paged sparse decode attention as a torch.compile backend."""
from . import kernels  # noqa: F401  (registers the tinyserve ops)

__version__ = "0.1.0"
