"""A native build that fails is never silent: :func:`load_native` warns, and the reason (from
``native_unavailable_reason`` to ``explain()``) names the torch version the build ran against and the compiler's
error line, not cpp_extension's command line.

The build is made to fail by replacing ``torch.utils.cpp_extension.load`` with one that raises what it raises on a
compile error (the error of issue 38, torch 2.11 against the 2.13-only autograd calls); nothing is compiled.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch.utils import cpp_extension

import tinyserve_compile as tc
from tinyserve_compile.kernels import native

COMPILER_ERROR = "dispatch.cpp:97:35: error: no matching function for call to 'set_history(at::Tensor&, ...)'"
BUILD_ERROR = ("Error building extension 'tinyserve_native_0': [1/9] c++ -MMD -MF dispatch.o.d -O3 -c dispatch.cpp\n"
               "FAILED: [code=1] dispatch.o\n"
               "dispatch.cpp: In function 'void autograd_passthrough(...)':\n"
               f"{COMPILER_ERROR}\n"
               "   97 |       torch::autograd::set_history((*stack)[i].toTensor(), node);\n"
               "ninja: build stopped: subcommand failed.")


@pytest.fixture
def failed_build(monkeypatch, tmp_path):
    """A fresh load attempt (the process's own outcome restored afterwards) whose build fails."""
    def load(**kwargs):
        raise RuntimeError(BUILD_ERROR)

    monkeypatch.delenv("TINYSERVE_DISABLE_NATIVE", raising=False)
    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(native, "_state", {"loaded": None, "reason": None, "module": None})
    tc.reset()
    yield
    tc.reset()


def test_the_reason_names_the_torch_version_and_the_compiler_error(failed_build):
    with pytest.warns(RuntimeWarning, match=re.escape(f"against torch {torch.__version__}")) as caught:
        assert native.load_native() is False
    why = native.native_unavailable_reason()
    assert why.startswith(f"native kernel build failed against torch {torch.__version__} (RuntimeError): "), why
    assert COMPILER_ERROR in why and "c++ -MMD" not in why, why
    assert why in str(caught[0].message)
    # once per process: a second call neither builds nor warns again
    assert native.load_native() is False and len(caught) == 1


def test_disabling_the_native_kernel_does_not_warn(failed_build, monkeypatch, recwarn):
    monkeypatch.setenv("TINYSERVE_DISABLE_NATIVE", "1")
    assert native.load_native() is False
    assert native.native_unavailable_reason() == "disabled by TINYSERVE_DISABLE_NATIVE"
    assert not [w for w in recwarn if "tinyserve-compile" in str(w.message)]


def test_explain_shows_the_failed_build(failed_build):
    torch._dynamo.reset()

    def step(q, kc, vc, k, v, pos, mask):
        kc[:, :, pos] = k
        vc[:, :, pos] = v
        return F.scaled_dot_product_attention(q, kc.repeat_interleave(2, 1), vc.repeat_interleave(2, 1),
                                              attn_mask=mask)

    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(1, 2, 64, 16, generator=g), torch.randn(1, 2, 64, 16, generator=g)
    q = torch.randn(1, 4, 1, 16, generator=g)
    k, v = torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 2, 1, 16, generator=g)
    pos, mask = torch.tensor([40], dtype=torch.int32), (torch.arange(64) <= 40)[None, None, None]
    opts = {"dense_layers": 0, "token_budget": 16, "page_size": 8, "lower": "eager"}
    with pytest.warns(RuntimeWarning, match="native kernel build failed"):
        torch.compile(step, backend="tinyserve", options=opts)(q, kc, vc, k, v, pos, mask)
    torch._dynamo.reset()
    rep = tc.explain()
    assert rep.native_kernel.startswith("unavailable, PyTorch path used: native kernel build failed against torch "
                                        f"{torch.__version__}"), rep
    assert COMPILER_ERROR in rep.native_kernel and rep.native_kernel in str(rep), rep


@pytest.mark.skipif(__import__("platform").machine().lower() not in ("x86_64", "amd64"), reason="x86-64 flags")
def test_forced_isa_builds_leave_avx512_out():
    """TINYSERVE_NATIVE_ISA=avx2 compiles the AVX-512 paths out even on an AVX-512 machine (as a Zen 3 builds), and
    =default is the portable x86-64-v2 build: the flags the CI matrix's isa edge relies on."""
    from tinyserve_compile.kernels import native

    avx2, _ = native._flags("avx2")
    assert "-mno-avx512f" in avx2 and "-march=native" in avx2 and "-DCPU_CAPABILITY=AVX2" in avx2
    portable, _ = native._flags("default")
    assert "-march=x86-64-v2" in portable and "-mno-avx512f" not in portable
    assert "-mno-avx512f" not in native._flags("avx512")[0]
