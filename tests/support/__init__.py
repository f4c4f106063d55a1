"""Helpers shared by the tests, imported as users import a package: ``from tests.support.backend_models import
hf_model``. pyproject's ``[tool.pytest.ini_options] pythonpath`` puts the repository root on the import path, so
this works for ``python -m pytest tests``, ``pytest tests/x/test_y.py`` and in spawned child processes (which start
with their parent's import path). No test edits the import path.

* ``backend_models``, ``backend_helpers``: tiny models (HF families, gpt-fast style) and their decode loops;
* ``backend_state``: the autouse fixture that resets Dynamo and tinyserve (backend, export, serving tests);
* ``kernel_checks``, ``triton_interp``, ``no_host_sync``: kernel test checks, the Triton interpreter import,
  and the host-sync guard;
* ``export_helpers``: ONNX export and ONNX Runtime runs;
* ``conformance_cases``: the conformance table of cases and implementations;
* ``cb_helpers``: continuous-batching workloads;
* ``tp_worker``: one rank of the tensor-parallel test.
"""
