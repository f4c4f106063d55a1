"""The suite's root conftest.

Helpers shared between test folders live in the ``tests.support`` package and are imported as
``from tests.support.<module> import ...``: pyproject's ``[tool.pytest.ini_options] pythonpath = ["."]`` puts the
repository root on the import path (for ``bench`` and ``tests.support``), whether pytest runs the whole
suite or one file. No test or conftest edits the import path. Fixtures stay in the conftest of the folder that uses
them (the autouse ``_fresh_backend_state`` of tests/backend, tests/export and tests/serving is
:mod:`tests.support.backend_state`'s).

Slow tests (a real model, a server in a subprocess, over about 30 s on 2 cores) carry ``@pytest.mark.slow``; they
run by default (``make test`` and CI run everything); ``-m "not slow"`` leaves them out of a quick local run.
"""

import os  # noqa: E402

# The int4 linears run the native GEMV in every test (tests/kernels/test_int4_kernel_choice.py tests the choice
# itself): on a machine where ATen's kernel is faster, "auto" would pick it at load, and the GEMV's own tests would
# then compare ATen with ATen. Subprocesses the tests start inherit it.
os.environ.setdefault("TINYSERVE_INT4_GEMV", "native")
