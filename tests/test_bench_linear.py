"""bench linear on one tiny shape: every method runs (no error rows) and the records carry the same-run bandwidth."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.linear import run, table  # noqa: E402
from tinyserve_compile.kernels.linear import load_native_linear  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_run_has_every_method(dtype):
    records = run([1, 3], [1], [dtype], reps=1, autotune=False, shapes=((24, 32),), stack_bytes=16384)
    assert not [r for r in records if "error" in r], table(records)
    methods = {r["method"] for r in records}
    assert {"aten", "mv"} <= methods and ("native" in methods) == load_native_linear(), methods
    assert all(r["gbs"] > 0 and r["read_bw_gbs"] > 0 for r in records)
    assert "| 1 |" in table(records)


def test_tiny_int4_run_has_every_method():
    pytest.importorskip("torchao")
    from tinyserve_compile.kernels.linear import int4_layout_problem

    records = run([1, 3], [1], ["int4"], reps=1, autotune=False, shapes=((64, 64),), stack_bytes=16384)
    assert not [r for r in records if "error" in r], table(records)
    methods = {r["method"] for r in records}
    native = load_native_linear() and int4_layout_problem() is None
    assert {"aten", "torchao"} <= methods and ("native" in methods) == native, methods
    assert all(r["dtype"] == "int4" and r["gbs"] > 0 and r["read_bw_gbs"] > 0 for r in records)
    assert all(r["vs_aten"] > 0 for r in records)
    assert "| int4 | 1 | 64x64 | native |" in table(records) or not native
