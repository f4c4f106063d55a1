import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "kernels"))  # kernel_checks (cache_write_path), shared


from backend_state import _fresh_backend_state  # noqa: E402,F401 (autouse)
