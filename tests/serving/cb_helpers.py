"""Kept for ``test_server.py``, which imports ``cb_helpers`` by its bare name (pytest puts this folder on
the import path); the helpers live in :mod:`tests.support.cb_helpers`. Remove this file once test_server.py imports
``from tests.support.cb_helpers import ...``."""
from tests.support.cb_helpers import *  # noqa: F401,F403
