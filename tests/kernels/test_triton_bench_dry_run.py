"""``bench/bench_kernel_gpu.py --dry-run``: the GPU benchmark's logic on tiny CPU shapes (Triton interpreter)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]


def test_bench_kernel_gpu_dry_run(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, str(ROOT / "bench" / "bench_kernel_gpu.py"), "--dry-run", "--contexts", "128",
           "--batches", "2", "--dtypes", "bf16", "--out-dir", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads((tmp_path / "bench_kernel_gpu.json").read_text())
    (row,) = data["rows"]
    assert row["ok"] and row["pages_agree"] == 1.0, row
    assert row["sparse_ms"] > 0 and row["dense_ms"] > 0 and row["select_ms"] > 0
    assert (tmp_path / "bench_kernel_gpu.csv").stat().st_size > 0
    assert (tmp_path / "bench_kernel_gpu.png").stat().st_size > 0
