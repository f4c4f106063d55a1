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
           "bf16", "--out", str(tmp_path)]
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
    # every method plain and (on CUDA) under CUDA graphs: on a CPU the graph timings are missing, with the reason,
    # and the ratios fall back to the plain timings
    for m in ("sparse", "select", "dense", "sdpa_flash", "sdpa_efficient", "sdpa_math"):
        assert f"{m}_ms" in row and row[f"{m}_graph_ms"] is None and row[f"{m}_graph_error"], m
        assert row[f"{m}_ms"] is None or "CUDA" in row[f"{m}_graph_error"], m  # a backend may refuse the shape
    assert row["speedup_basis"].startswith("do_bench") and row["speedup_vs_sdpa"] == row["speedup_vs_sdpa_plain"]
    assert row["best_sdpa"] in ("sdpa_flash", "sdpa_efficient", "sdpa_math")
    assert "copy_gbs" in data["meta"] and "datasheet_gbs" in data["meta"]
    # the op's targets are listed, not run at the dry run's shapes
    assert {(t["context"], t["batch"]) for t in data["targets"]} == {(4096, 8), (32768, 8), (131072, 8)}
    assert all(t["met"] is None for t in data["targets"])
    assert (tmp_path / "bench_kernel_gpu.csv").stat().st_size > 0
    assert (tmp_path / "bench_kernel_gpu.png").stat().st_size > 0


needs_shell = pytest.mark.skipif(not (shutil.which("bash") and shutil.which("timeout")), reason="bash + timeout")


@pytest.mark.slow  # about 70 s on 2 cores
@needs_shell
def test_gpu_check_dry_run(tmp_path):
    """Every step of the GPU check runs (env, the op checked and timed at both selection settings, decode of both
    models at two points each) and the summary collects them: the CUDA-graphs providers skipped with the reason,
    the profile fields, the layer counts, the targets."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, TIMEOUT_SCALE="4")  # a shared CPU
    env.pop("GPU_CHECK_STEPS", None)
    res = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], capture_output=True, text=True,
                         env=env, timeout=1800)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"]
    assert [s["step"] for s in summary["steps"]] == ["env", "kernel", "decode_smollm", "decode_8b"]
    assert summary["limits_total"] == sum(s["limit"] for s in summary["steps"]) + summary["summary_limit"]
    assert summary["limits_total"] <= 8 * 60  # the whole check fits in 8 minutes
    assert {"torch", "triton", "transformers", "device", "driver", "commit"} <= set(summary["env"])
    # the op: checked against the reference, then timed, the shipped defaults first
    assert summary["kernel_check"]["failures"] == 0
    assert summary["kernel_check"]["paths"] == {"defaults": ["2/tokens"], "paper": ["1/pages"]}
    bench = summary["kernel_bench"]
    assert [(r["setting"], r["stages"], r["kept"], r["bounds_dtype"]) for r in bench] == [
        ("defaults", 2, "tokens", "int8"), ("paper", 1, "pages", "float32")]
    assert all(r["sparse_ms"] > 0 and r["ok"] for r in bench)
    assert "kernel_peak" in summary and len(summary["kernel_targets"]) == 8
    # decode: both models, two points each, every provider; the CUDA-graphs ones skipped off CUDA, with the reason
    dec = summary["decode"]
    points = list(dict.fromkeys((r["step"], r["context"], r["batch"]) for r in dec))
    assert points == [("decode_smollm", 384, 1), ("decode_smollm", 512, 1), ("decode_8b", 256, 2),
                      ("decode_8b", 512, 2)]
    for step, ctx, batch in points:
        rs = {r["provider"]: r for r in dec if (r["step"], r["context"], r["batch"]) == (step, ctx, batch)}
        assert list(rs) == ["eager", "inductor-cudagraphs", "inductor-flex-cudagraphs", "tinyserve-cudagraphs",
                            "tinyserve"]
        for name in ("inductor-cudagraphs", "inductor-flex-cudagraphs", "tinyserve-cudagraphs"):
            r = rs[name]
            assert r["ms_per_token"] is None and "CUDA graphs need a CUDA device" in r["skipped"], r
            assert r["cudagraphs"] == "off" and r["cudagraphs_asked"]
        for name in ("eager", "tinyserve"):
            r = rs[name]
            assert r["ms_per_token"] > 0 and not r["skipped"] and r["complete"] and r["dtype"] == "bfloat16"
            # the profiled step: on a CPU no kernel counts, the host-sync count and the CUDA-graphs state are there
            assert r["gpu_kernels_per_step"] is None and isinstance(r["host_syncs_per_step"], int)
            assert r["cudagraphs"] == "n/a" and r["best_stock"] == "eager"
        assert rs["tinyserve"]["sparse_sites"] >= 1
        assert (rs["eager"]["layers"], rs["eager"]["full_model_layers"]) == ((4, 4) if step == "decode_smollm" else
                                                                            (3, 4))
    targets = summary["decode_targets"]
    assert [t["step"] for t in targets] == ["decode_smollm"] * 2 + ["decode_8b"] * 2
    assert all(t["dry_run"] and t["value"] is not None for t in targets)
    assert (tmp_path / "summary.csv").stat().st_size > 0
    out = res.stdout.rstrip().splitlines()
    assert "gpu_check summary" in res.stdout and out[-1] == "all steps passed"


@needs_shell
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU exit")
def test_gpu_check_without_gpu_exits_with_a_message(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, TIMEOUT_SCALE="4")
    res = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 2, res.stdout[-3000:]
    assert "no usable CUDA GPU" in res.stdout
    assert not (tmp_path / "kernel").exists()
    assert json.loads((tmp_path / "env.json").read_text())["cuda_available"] is False
