"""Load a native build by its key, beside the one ``load_native()`` uses, for side-by-side comparisons of builds
(``gemv_builds_ab.py``, ``op_builds_ab.py``)."""
import importlib.util
import os

from tinyserve_compile.kernels.native import cache_root


def load_build(key: str):
    """The extension module of the build in ``native-<key>`` under :func:`cache_root` (built before, e.g. by
    ``load_native()`` on another source tree or with other ``TINYSERVE_NATIVE_CFLAGS``)."""
    path = os.path.join(cache_root(), f"native-{key}", f"tinyserve_native_{key}.so")
    spec = importlib.util.spec_from_file_location(f"tinyserve_native_{key}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
