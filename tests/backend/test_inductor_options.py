"""Inductor's settings under the tinyserve backend: the C++ wrapper (the native ops called through a boxed stack
with a generic list for `spec`), freezing, and the `inductor_options` option that applies them to the decode
graph's compile only. Tokens and logits match eager; rewrites are counted."""
from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor_config

import tinyserve_compile as tc
from tests.support.backend_helpers import CACHE_IS_GRAPH_ATTRIBUTE, hf_decode, prompt, worst
from tests.support.backend_models import hf_model
from tinyserve_compile.config import TinyServeConfig
from tinyserve_compile.runtime import native_unavailable_reason

PROMPT = 40
#: the tiny Llama's 4 layers: 4 decode attention sites, 4 cache writes, 4 x 7 + 1 linears
SITES = 4
LINEARS = 4 * 7 + 1
OPTS = {"token_budget": 256}
#: torch 2.8's C++ wrapper calls every custom op back through Python (``torch._inductor.codecache.custom_op_wrapper``);
#: 2.9 and later call them through the dispatcher from C++
CPP_WRAPPER_CALLS_OPS_FROM_CPP = torch.torch_version.TorchVersion(torch.__version__) >= (2, 9)


def _check(model, compiled, ids, n=3):
    ref_toks, ref_logits, _ = hf_decode(model, model, ids, n)
    toks, logits, _ = hf_decode(model, compiled, ids, n)
    assert torch.equal(toks, ref_toks), worst(logits, ref_logits)
    assert torch.allclose(logits, ref_logits, atol=1e-4, rtol=1e-4), worst(logits, ref_logits)
    c = tc.counters
    assert c["rewritten"] == SITES and c["cache_writes_rewritten"] == SITES, dict(c)
    if native_unavailable_reason() is None:
        assert c["native_sites"] == SITES and c["linear_rewritten"] == LINEARS, dict(c)


@pytest.mark.parametrize("how", ["environment", "option"])
def test_cpp_wrapper_matches_eager(how):
    # "environment": cpp_wrapper on for the whole compile, as TORCHINDUCTOR_CPP_WRAPPER=1 sets it; "option":
    # through inductor_options. Both under no_grad: the C++ AutogradCPU pass-through in front of the CPU kernels
    from torch._inductor.utils import run_and_get_code

    model = hf_model("llama")
    ids = prompt(PROMPT)
    if how == "environment":
        with inductor_config.patch(cpp_wrapper=True):
            _, code = run_and_get_code(_check, model, torch.compile(model, backend="tinyserve", options=OPTS), ids)
    else:
        opts = dict(OPTS, inductor_options={"cpp_wrapper": True})
        _, code = run_and_get_code(_check, model, torch.compile(model, backend="tinyserve", options=opts), ids)
    assert inductor_config.cpp_wrapper is False  # the option changed nothing outside the compile
    # every tinyserve op is called from C++ (the dispatcher), none through a callback into Python: the grouped
    # linears return one tensor, not a list, for that
    code = "\n".join(code)
    if not CPP_WRAPPER_CALLS_OPS_FROM_CPP:  # torch 2.8: through Python, as any custom op there
        assert 'PyUnicode_FromString("torch.ops.tinyserve.sparse_decode.default")' in code
    else:
        assert "PyObject_CallObject" not in code
        if native_unavailable_reason() is None:
            assert 'findSchemaOrThrow("tinyserve::linear_group"' in code


@pytest.mark.skipif(native_unavailable_reason() is not None, reason="the native CPU kernels are not in use")
def test_cpp_wrapper_sparse_decode_under_inference_mode():
    # inference_mode skips the autograd keys: the C++ wrapper's boxed call (a generic list for `spec`) reaches the
    # CPU kernel directly
    from tinyserve_compile.kernels import reference as ref
    from tinyserve_compile.kernels.spec import SelectionSpec

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 1, 8, generator=g)  # [B, Hq, 1, D]
    k = torch.randn(1, 2, 64, 8, generator=g)  # [B, Hkv, L, D]
    v = torch.randn(1, 2, 64, 8, generator=g)
    b = ref.page_bounds(k, 8, dtype=torch.float32)
    vl = torch.tensor(64)
    spec = SelectionSpec(8, 16, 1, 1, 0, False, torch.float32).to_list()

    def f(q, k, v, kmax, kmin, kabs, vl):
        return torch.ops.tinyserve.sparse_decode(q, k, v, kmax, kmin, kabs, vl, None, 0.35, spec, "auto", None) * 2

    args = (q, k, v, b.kmax, b.kmin, b.kabs, vl)
    with torch.inference_mode():
        want = f(*args)
        with inductor_config.patch(cpp_wrapper=True):
            got = torch.compile(f, backend="inductor", dynamic=False)(*args)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-6), worst(got, want)


@pytest.mark.parametrize("given, asserts", [(None, False), ({"size_asserts": True}, True)])
def test_size_asserts_off_by_default(given, asserts):
    # INDUCTOR_DEFAULTS: the decode graph's wrapper re-checks no input's size and stride (Dynamo's guards did),
    # unless inductor_options turns the asserts back on; the answers match eager either way
    from torch._inductor.utils import run_and_get_code

    model = hf_model("llama")
    opts = OPTS if given is None else dict(OPTS, inductor_options=given)
    _, code = run_and_get_code(_check, model, torch.compile(model, backend="tinyserve", options=opts), prompt(PROMPT))
    code = "\n".join(code)
    assert "def call(" in code  # the Python wrapper was generated (and read here)
    assert ("assert_size_stride(arg" in code) is asserts
    assert inductor_config.size_asserts is True  # nothing changed outside the compile


def test_freezing_matches_eager():
    model = hf_model("llama")
    ids = prompt(PROMPT)
    opts = dict(OPTS, inductor_options={"freezing": True})
    if CACHE_IS_GRAPH_ATTRIBUTE:  # torch 2.8: freezing would fold the caches as constants (test_attr_buffers.py)
        with pytest.raises(Exception, match=r"'inductor_options' freezing=True.*needs torch >= 2.9"):
            _check(model, torch.compile(model, backend="tinyserve", options=opts), ids)
    else:
        _check(model, torch.compile(model, backend="tinyserve", options=opts), ids)
    assert inductor_config.freezing is False


@pytest.mark.parametrize("value, match", [
    ({"no_such_setting": 1}, r"'inductor_options' has unknown torch._inductor.config key\(s\) \['no_such_setting'\]"),
    ([("cpp_wrapper", True)], "'inductor_options' must be a dict"),
    ("cpp_wrapper", "'inductor_options' must be a dict"),
])
def test_inductor_options_validation(value, match):
    with pytest.raises(ValueError, match=match):
        TinyServeConfig.from_options({"inductor_options": value})


def test_inductor_options_need_inductor():
    with pytest.raises(ValueError, match="'inductor_options' applies only with lower='inductor'"):
        TinyServeConfig.from_options({"inductor_options": {"freezing": True}, "lower": "eager"})
    # empty settings are no settings: fine with any lowering
    assert TinyServeConfig.from_options({"inductor_options": {}, "lower": "eager"}).inductor_options == {}


def test_inductor_options_copied_and_hashable():
    mine = {"cpp_wrapper": True, "cpp.threads": 1}  # nested settings by their dotted name
    cfg = TinyServeConfig.from_options({"inductor_options": mine})
    mine["freezing"] = True
    assert cfg.inductor_options == {"cpp_wrapper": True, "cpp.threads": 1, "cpp_wrapper_build_separate": True}
    assert hash(cfg) == hash(TinyServeConfig())  # a hashable config, as before the option
    assert cfg != TinyServeConfig() and cfg == TinyServeConfig.from_options({"inductor_options": dict(cfg.inductor_options)})


@pytest.mark.parametrize("given, want", [
    ({"cpp_wrapper": True}, {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}),
    ({"cpp_wrapper": True, "cpp_wrapper_build_separate": False}, {"cpp_wrapper": True, "cpp_wrapper_build_separate": False}),
    ({"cpp_wrapper": False}, {"cpp_wrapper": False}),
    ({"freezing": True}, {"freezing": True}),
])
def test_cpp_wrapper_builds_separately_unless_told(given, want):
    # the wrapper and the kernels as separate files compile SmolLM2's decode graph in 84 s instead of 412 s
    assert TinyServeConfig.from_options({"inductor_options": given}).inductor_options == want
