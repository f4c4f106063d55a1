"""Every Triton kernel of the decode step compiles for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter runs the kernels' logic on CPU tensors but never lowers them; a kernel can pass there and fail
to compile for the GPU (an unsupported op, a type Triton cannot lower, a register or shared-memory limit that
``ptxas`` enforces). ``tools/sm90_compile.py`` intercepts each launch of the op's and the cache write's kernels, with
the argument types of real calls (bf16; the defaults, the paper rule, two stages keeping pages, a dense cache;
no mask and an additive mask) and compiles it through Triton's whole pipeline to a
cubin for ``GPUTarget("cuda", 90, 32)``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.slow  # each compiles through ptxas in a subprocess: 30-60 s on 2 cores


def _run(flag: str, timeout: int):
    """``tools/sm90_compile.py flag`` in a process of its own (not interpreted); skips where Triton's NVIDIA backend (or
    its ptxas/cuobjdump) is missing (exit status 3)."""
    script = Path(__file__).resolve().parents[2] / "tools" / "sm90_compile.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, script, flag], capture_output=True, text=True, env=env, timeout=timeout)
    if run.returncode == 3:
        pytest.skip(f"Triton's NVIDIA backend, its ptxas or cuobjdump is not installed: {run.stdout.strip()[-300:]}")
    return run


def test_every_kernel_compiles_for_sm90():
    # --quick: bf16 (the GPU's dtype) with no mask and an additive per-head one, every setting; the whole grid
    # (fp16, fp32, bool masks too) is `python tools/sm90_compile.py` (about 5 minutes cold on 2 cores)
    run = _run("--quick", 900)
    assert run.returncode == 0, f"sm_90 compile failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    names = {line.split()[1] for line in run.stdout.splitlines() if line.startswith("compiled ")}
    assert {"_score_pages_kernel", "_rank_candidates_kernel", "_attend_kernel", "_cache_write_kernel"} <= names, names


def test_grids_fit_one_wave_on_an_h200():
    """Each launch's grid is one wave on an H200 (132 SMs) at the programs an SM its compiled kernel allows
    (registers and shared memory from ``ptxas``), and launch 1's at the occupancy its plan assumes
    (``_LAUNCH1_WARPS_PER_SM``), at the GPU check's shapes: the defaults and the paper rule, 32K and 128K, batch 8.
    A kernel that takes more registers than its plan allows (launch 1's select tail took 168 at 8 warps before
    ``maxnreg``: 1.94 waves) fails here."""
    run = _run("--occupancy", 600)
    assert run.returncode == 0, f"a grid does not fit its plan:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    lines = [line for line in run.stdout.splitlines() if line.endswith(": ok")]
    # 3 launches at the defaults' two points, 2 (one stage) at the paper rule's
    assert len(lines) == 10, run.stdout[-4000:]
    assert sum("_score_pages_kernel" in line for line in lines) == 4, run.stdout[-4000:]
