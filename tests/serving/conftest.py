import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "backend"))  # models.py, helpers.py


from backend_state import _fresh_backend_state  # noqa: E402,F401 (autouse)
