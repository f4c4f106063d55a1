"""``python -m bench gpu --dry-run`` and ``bench/gpu_check.sh --dry-run``: the GPU benchmark's and the GPU
check's logic on tiny CPU shapes (Triton interpreter, tiny random Llama). The ``defaults`` setting runs the
shipped selection: two stages keeping single tokens, int8 bounds."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]


def test_bench_kernel_gpu_dry_run(tmp_path):
    from tinyserve_compile.config import TinyServeConfig

    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "bench", "gpu", "--dry-run", "--contexts", "128", "--batches", "2", "--dtypes",
           "bf16", "--settings", "defaults", "--out-dir", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads((tmp_path / "bench_kernel_gpu.json").read_text())
    (row,) = data["rows"]
    assert row["ok"] and row["pages_agree"] == 1.0, row
    # the shipped defaults: every selection field of TinyServeConfig(), two stages keeping single tokens; the extra
    # candidates scaled with the dry run's budget (else its 128-token cache would be all candidates: dense)
    c = TinyServeConfig()
    assert (row["page"], row["sink_pages"], row["candidate_factor"], row["candidate_extra"], row["keep_tokens"],
            row["bounds_dtype"]) == (c.page_size, c.sink_pages, c.candidate_factor,
                                     c.candidate_extra * row["budget"] // c.token_budget, c.keep_tokens, c.bounds_dtype)
    assert (row["stages"], row["kept"], row["ref_kept"]) == (2, "tokens", "tokens"), row
    assert row["sparse_ms"] > 0 and row["dense_ms"] > 0 and row["select_ms"] > 0
    assert (tmp_path / "bench_kernel_gpu.csv").stat().st_size > 0
    assert (tmp_path / "bench_kernel_gpu.png").stat().st_size > 0


needs_shell = pytest.mark.skipif(not (shutil.which("bash") and shutil.which("timeout")), reason="bash + timeout")


@needs_shell
def test_gpu_check_dry_run(tmp_path):
    """Every step of the GPU check runs (kernel check at both selection settings, kernel bench, decode at two
    contexts) and the summary collects them."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, TIMEOUT_SCALE="4")  # a shared CPU
    res = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], capture_output=True, text=True,
                         env=env, timeout=1800)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"]
    assert [s["step"] for s in summary["steps"]] == ["env", "kernel_check", "kernel_bench", "decode_8k", "decode_32k"]
    assert sum(s["limit"] for s in summary["steps"]) <= 8 * 60  # the whole check fits in 8 minutes
    check = json.loads((tmp_path / "kernel_check" / "bench_kernel_gpu.json").read_text())
    assert [r["setting"] for r in check["rows"]] == ["defaults", "paper"]
    assert all(r["ok"] and r["pages_agree"] == 1.0 for r in check["rows"]), check["rows"]
    assert summary["kernel_check"]["failures"] == 0
    assert summary["kernel_check"]["paths"] == {"defaults": ["2/tokens"], "paper": ["1/pages"]}
    # the kernel bench times the shipped defaults first: two stages, kept tokens, int8 bounds
    bench = summary["kernel_bench"]
    assert [(r["setting"], r["stages"], r["kept"], r["bounds_dtype"]) for r in bench] == [
        ("defaults", 2, "tokens", "int8"), ("paper", 1, "pages", "float32")]
    assert all(r["sparse_ms"] > 0 for r in bench)
    dec = summary["decode"]
    assert [(r["context"], r["provider"]) for r in dec] == [(384, "eager"), (384, "tinyserve"), (512, "eager"),
                                                            (512, "tinyserve")]
    assert all(r["ms_per_token"] > 0 and r["dtype"] == "bfloat16" for r in dec)
    assert "gpu_check summary" in res.stdout


@needs_shell
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU exit")
def test_gpu_check_without_gpu_exits_with_a_message(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, TIMEOUT_SCALE="4")
    res = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 2, res.stdout[-3000:]
    assert "no usable CUDA GPU" in res.stdout
    assert not (tmp_path / "kernel_check").exists()
