"""The int4 GEMV reads the layout ATen packs on an AVX2 machine (blocks of 32 rows) as it reads AVX-512's (64).

ATen's ``_convert_weight_to_int4pack_for_cpu`` packs by the vector ISA it runs with; ``ATEN_CPU_CAPABILITY=avx2``
makes this machine's ATen pack and compute as an AVX2-only CPU's (AMD Zen 3) does, so the int4 tests (the GEMV, and
int4 models compiled with the backend) run again in a process where it is set, against the PyTorch reference,
ATen's own kernel and torchao. ``.ci/matrix.sh``'s isa edge runs
them with the native kernel built for AVX2 as well.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tinyserve_compile.kernels.linear import INT4_LAYOUTS, dequantize_int4pack, int4_block_n, load_native_linear

HERE = os.path.dirname(os.path.abspath(__file__))


def test_this_process_reads_atens_layout():
    assert int4_block_n() in INT4_LAYOUTS


def test_dequantize_names_a_bad_block_n():
    import torch
    qdata = torch.zeros(64, 16, dtype=torch.uint8)
    sz = torch.ones(1, 64, 2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block_n"):
        dequantize_int4pack(qdata, sz, 32, block_n=48)


@pytest.mark.slow  # three test files in a pytest subprocess: about 2 minutes on 2 cores
@pytest.mark.skipif(not load_native_linear(), reason="native module unavailable")
def test_int4_gemv_on_avx2_atens_layout(tmp_path):
    # an Inductor cache of its own: Inductor's cached kernels for this machine's AVX-512 widths would be reused
    # under ATen's AVX2 capability and compiled for AVX2 (wrong results, not ours to fix)
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    probe = subprocess.run([sys.executable, "-c", "from tinyserve_compile.kernels.linear import int4_block_n, "
                            "load_native_linear, native_linear_reason as r; print(int4_block_n(), "
                            "load_native_linear(), r())"], env=env, capture_output=True, text=True, timeout=600)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.split()[:2] == ["32", "True"], probe.stdout  # AVX2's layout, the GEMV registered
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                          os.path.join(HERE, "test_native_linear_int4.py"),
                          os.path.join(HERE, "..", "backend", "test_int4_plain.py"),
                          os.path.join(HERE, "..", "backend", "test_decode_linear_int4.py")],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "skipped" not in run.stdout and " passed" in run.stdout, run.stdout[-2000:]
