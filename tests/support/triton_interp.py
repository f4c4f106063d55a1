"""Import kernel modules so that their Triton kernels run in the Triton interpreter (CPU)."""
from __future__ import annotations

import importlib
import os
import sys

import pytest


def _import_interpreted(name: str):
    """Import a kernel module so that its kernels run in the Triton interpreter.

    Triton picks interpreter or compiler when a function is decorated, and that
    includes its own ``tl.sum``/``tl.max``, decorated when triton is first imported.
    In a full test run triton is usually imported earlier, in compiled mode, by
    ``torch._dynamo``; then its Python modules (not the C extension) are imported
    again with ``TRITON_INTERPRET=1``. torch keeps its references to the first copy.
    """
    prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        triton = pytest.importorskip("triton")
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(triton.language.standard.sum, InterpretedFunction):
            for mod in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
                if not mod.startswith("triton._C"):
                    del sys.modules[mod]
            sys.modules.pop(name, None)
        return importlib.import_module(name)
    finally:
        if prev is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = prev
