"""The serving tests' set-up: every test starts from fresh Dynamo and tinyserve state."""
from tests.support.backend_state import _fresh_backend_state  # noqa: F401 (autouse)
