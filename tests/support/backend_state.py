"""The autouse fixture shared by the backend and export tests: every test starts from fresh Dynamo and
tinyserve state (compiled graphs, counters, explain records, paged-cache registry)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_backend_state():
    import tinyserve_compile as tc

    torch._dynamo.reset()
    tc.reset()
    yield
    torch._dynamo.reset()
