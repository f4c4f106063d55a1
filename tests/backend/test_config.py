"""Configuration parsing, registration through the entry point, and the explain report."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import tinyserve_compile as tc
from tinyserve_compile.config import DEFAULT_PAGE_SIZE, DEFAULT_TOKEN_BUDGET, TinyServeConfig
from test_negative import OPTS, _inputs, good


def test_defaults_are_named_constants():
    c = TinyServeConfig()
    assert (c.page_size, c.token_budget, c.dense_layers) == (DEFAULT_PAGE_SIZE, DEFAULT_TOKEN_BUDGET, 2)
    assert (c.lower, c.kernel, c.strict, c.policy) == ("inductor", "auto", False, "query_aware")
    with pytest.raises(Exception):
        c.page_size = 8  # frozen


@pytest.mark.parametrize("options, name", [
    ({"page_sise": 16}, "page_sise"),
    ({"page_size": 0}, "page_size"),
    ({"token_budget": 4}, "token_budget"),  # smaller than one page
    ({"dense_layers": -1}, "dense_layers"),
    ({"lower": "tvm"}, "lower"),
    ({"kernel": "cuda"}, "kernel"),
    ({"strict": "yes"}, "strict"),
    ({"policy": "random"}, "policy"),
    ({"candidate_factor": 0}, "candidate_factor"),
    ({"sink_pages": 4096}, "sink_pages"),  # not fewer than the pages in the budget
])
def test_bad_option_names_the_option(options, name):
    with pytest.raises(ValueError, match=name):
        TinyServeConfig.from_options(options)


def test_unknown_option_lists_valid_ones_through_torch_compile():
    with pytest.raises(Exception, match="valid options: .*token_budget"):
        torch.compile(good, backend="tinyserve", options={"budget": 10})(*_inputs())


def test_backend_accepts_mode_kwarg_like_hf_compile_path():
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    fn = tc.tinyserve_backend(gm, [torch.ones(2)], mode="default")
    assert torch.equal(fn(torch.ones(2)), torch.full((2,), 2.0))


def test_entry_point_works_without_import_in_a_fresh_interpreter():
    code = textwrap.dedent("""
        import sys, torch
        f = torch.compile(lambda x: torch.sin(x) + 1, backend="tinyserve", options={"lower": "eager"})
        y = f(torch.zeros(3))
        assert torch.equal(y, torch.ones(3)), y
        print("loaded", "tinyserve_compile" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "loaded True" in out.stdout


def test_import_registration_is_idempotent():
    from torch._dynamo.backends.registry import lookup_backend

    tc.backend.register()
    tc.backend.register()
    assert lookup_backend("tinyserve") is tc.tinyserve_backend


def test_explain_reports_sites_and_reset_clears():
    torch.compile(good, backend="tinyserve", options=OPTS)(*_inputs())
    rep = tc.explain()
    assert rep.counters["attention_sites"] == 1 and rep.counters["rewritten"] == 1
    assert "1 rewritten" in str(rep)
    assert rep.runtime["decode_calls"] == 1
    tc.reset()
    assert tc.explain().counters == {} and tc.explain().runtime == {}


def test_tensorrt_lowering_fails_clearly_when_missing():
    try:
        import torch_tensorrt  # noqa: F401
        pytest.skip("torch-tensorrt is installed here")
    except ImportError:
        pass
    with pytest.raises(Exception, match="torch-tensorrt"):
        torch.compile(good, backend="tinyserve", options=dict(OPTS, lower="tensorrt"))(*_inputs())
