import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "backend"))  # models.py, helpers.py

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")


@pytest.fixture(autouse=True)
def _fresh_backend_state():
    import tinyserve_compile as tc

    torch._dynamo.reset()
    tc.reset()
    yield
    torch._dynamo.reset()
