"""The choice of the int4 linears' kernel (``kernels/linear.py``): the native GEMV or ATen's
``_weight_int4pack_mm_for_cpu``, whichever is faster on the machine, timed at load, or forced by
``TINYSERVE_INT4_GEMV``. Both give the op's results; the choice follows the timing; a bad value is named."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

L = importlib.import_module("tinyserve_compile.kernels.linear")

CHILD = """
import importlib, json, torch
L = importlib.import_module("tinyserve_compile.kernels.linear")
assert L.load_native_linear(), L.native_linear_reason()
gen = torch.Generator().manual_seed(3)
N, K = 128, 256
q = torch.randint(0, 16, (N, K), dtype=torch.int32, generator=gen)
qd = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
sz = torch.stack([torch.rand(K // 32, N, generator=gen) * 0.1, torch.randn(K // 32, N, generator=gen) * 0.1],
                 -1).to(torch.bfloat16)
x = torch.randn(2, K, generator=gen).to(torch.bfloat16)
with torch.profiler.profile() as prof:
    got = torch.ops.tinyserve.linear_int4(x, qd, sz, 32, N)
    grp = torch.ops.tinyserve.linear_int4_group(x, [qd, qd], [sz, sz], 32, [N, N])
aten_calls = sum(e.count for e in prof.key_averages() if e.key == "aten::_weight_int4pack_mm_for_cpu")
aten = torch.ops.aten._weight_int4pack_mm_for_cpu(x, qd, 32, sz)
print(json.dumps(dict(choice=list(L.int4_kernel()), aten_calls=aten_calls, equal_aten=bool(torch.equal(got, aten)),
                      group_equal=bool(torch.equal(grp, torch.cat([got, got], -1))),
                      err=float((got.float() - aten.float()).abs().max()))))
"""


def _child(value):
    import json
    import os

    env = {k: v for k, v in os.environ.items() if k != "TINYSERVE_INT4_GEMV"}
    if value is not None:
        env["TINYSERVE_INT4_GEMV"] = value
    p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


@pytest.fixture(scope="module", autouse=True)
def _native():
    from tinyserve_compile.kernels.native import load_native, native_unavailable_reason

    assert load_native(), native_unavailable_reason()
    if L.int4_layout_problem() is not None:
        pytest.skip(f"the int4 GEMV cannot read ATen's layout here: {L.int4_layout_problem()}")


def test_forced_aten_runs_atens_kernel_for_single_and_grouped_calls():
    r, _ = _child("aten")
    assert r["choice"] == ["aten", "TINYSERVE_INT4_GEMV=aten"]
    assert r["aten_calls"] == 3 and r["equal_aten"] and r["group_equal"], r  # one single, two grouped


def test_forced_native_runs_the_gemv_within_bf16_of_aten():
    r, _ = _child("native")
    assert r["choice"] == ["native", "TINYSERVE_INT4_GEMV=native"]
    assert r["aten_calls"] == 0 and r["err"] < 0.05 and r["group_equal"], r


def test_auto_is_timed_and_an_unknown_value_is_named():
    r, err = _child("fast-please")
    assert "TINYSERVE_INT4_GEMV='fast-please'" in err
    kernel, why = r["choice"]
    assert kernel in ("native", "aten") and why.startswith("timed at load"), r
    assert r["aten_calls"] == (3 if kernel == "aten" else 0), r


@pytest.mark.parametrize("native_ms, aten_ms, want", [(1.0, 0.5, "aten"), (1.0, 0.97, "native"), (0.5, 1.0, "native")])
def test_auto_takes_aten_only_when_it_is_clearly_faster(monkeypatch, native_ms, aten_ms, want):
    monkeypatch.delenv("TINYSERVE_INT4_GEMV", raising=False)
    monkeypatch.setattr(L, "_time_int4", lambda lib: {"native": native_ms, "aten": aten_ms})
    assert L._choose_int4_kernel(object())[0] == want


def test_the_timing_leaves_the_gemv_chosen():
    from tinyserve_compile.kernels.native import native_module

    lib = native_module()
    before = lib.int4_aten()
    t = L._time_int4(lib, reps=1)
    assert set(t) == {"native", "aten"} and all(v > 0 for v in t.values())
    assert lib.int4_aten() is False
    lib.set_int4_aten(before)
