"""The shape-static dense rule (issue 51, item 3): the cost model decides at compile time, from a site's static
cache shape and device, that its page selection cannot pay; the site is rewritten and its op attends every key.

On a GPU the rule weighs the selection's extra dependent phases against the bytes they save; on the CPU (one native
call in every mode) the bytes alone, so that the selection always pays there. The compiled path is tested on the CPU
with a CPU phase cost patched in (nothing here has a GPU)."""
from __future__ import annotations

from unittest import mock

import pytest
import torch

import tinyserve_compile as tc
from tests.backend.test_cache_idioms import gpt_fast_generate
from tests.support.backend_helpers import worst
from tests.support.backend_models import gpt_fast_model
from tinyserve_compile import cost
from tinyserve_compile.config import TinyServeConfig
from tinyserve_compile.kernels.spec import SelectionSpec

#: 4 layers, caches of 256 tokens (32 pages of 8): a budget of 2 pages and 2 extra candidates select
OPTS = {"token_budget": 16, "page_size": 8, "candidate_extra": 16, "dense_layers": 0, "lower": "eager"}


def test_the_cost_model_on_the_gpu_targets_shapes():
    """Llama-3-8B's K/V shape (8 heads of 128, bf16) at the defaults on a GPU: batch 8 selects at 32K and 128K and
    attends densely at 4K; the CPU and a device without a model always select; the phase cost moves the line."""
    c = TinyServeConfig()
    pays, why = cost.selection_pays(4096, 8, 8, 128, 2, c, "cuda")
    assert not pays and "4096 tokens x batch 8 on cuda" in why and "dependent phases" in why
    assert cost.selection_pays(32768, 8, 8, 128, 2, c, "cuda") == (True, "")
    assert cost.selection_pays(131072, 8, 8, 128, 2, c, "cuda") == (True, "")
    for length in (4096, 32768):
        assert cost.selection_pays(length, 1, 8, 128, 2, c, "cpu") == (True, "")
        assert cost.selection_pays(length, 8, 8, 128, 2, c, "mps") == (True, "")  # no model of it
    assert cost.selection_pays(2048, 8, 8, 128, 2, c, "cuda") == (True, "")  # dense by the spec already
    with mock.patch.dict(cost.DEVICE_COSTS, cuda=cost.DeviceCost(gbs=3350.0, phase_s=0.0)):
        assert cost.selection_pays(4096, 8, 8, 128, 2, c, "cuda") == (True, "")  # the bytes alone
    with pytest.raises(ValueError, match="dense_by_cost"):
        TinyServeConfig(dense_by_cost="yes")


def test_dense_for_is_the_smallest_spec_that_attends_every_key():
    spec = SelectionSpec.from_config(TinyServeConfig())
    for length in (1, 8, 4095, 4096, 4100):
        d = spec.dense_for(length)
        pages = -(-length // 8)
        assert d.dense_cache(pages) and d.token_budget == pages * 8 and d.candidate_extra == 0
        assert d.sink_pages == min(1, pages - 1) and d.page_size == spec.page_size
        assert not spec.dense_cache(pages) or spec.for_cache(length) == d or spec.for_cache(length) is spec


@pytest.mark.parametrize("rule", [True, False])
def test_a_site_ruled_dense_attends_every_key(rule):
    """With a phase cost that no byte saving repays, every rewritten site is ruled dense (counted, its reason in
    explain()) and decodes exactly as dense attention; with the rule off the same budget selects (the sparse
    reference's logits, which differ from dense)."""
    model = gpt_fast_model(seed=3)
    dense = gpt_fast_generate(model, model)
    sparse = gpt_fast_generate(model, None, reference=OPTS)
    assert not torch.allclose(dense, sparse, atol=1e-3)  # the budget selects: the two answers differ
    with mock.patch.dict(cost.DEVICE_COSTS, cpu=cost.DeviceCost(gbs=20.0, phase_s=1.0)):
        compiled = torch.compile(model, backend="tinyserve", options=dict(OPTS, dense_by_cost=rule))
        got = gpt_fast_generate(model, compiled)
    assert tc.counters["rewritten"] == 4, tc.explain()
    assert tc.counters["dense_by_cost"] == (4 if rule else 0), tc.explain()
    ruled = [s["dense_by_cost"] for g in tc.explain().graphs for s in g["sites"] if s.get("dense_by_cost")]
    assert len(ruled) == (4 if rule else 0) and all("256 tokens x batch 1 on cpu" in w for w in ruled)
    if rule:
        assert "every key, by the cost model" in str(tc.explain())
    want = dense if rule else sparse
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), worst(got, want)


@pytest.mark.parametrize("how", ["dynamic", "streaming"])
def test_the_rule_leaves_symbolic_caches_and_baseline_policies_alone(how):
    """A cache of symbolic length (dynamic shapes: the op's length is known only per call) and a baseline policy
    (the cost model is the query-aware op's) keep their selection, whatever the phase cost."""
    from tests.backend.test_cache_idioms import _case, setitem_site

    q, kbuf, vbuf, k, v, mask = _case(seed=5)
    pos = torch.tensor([40])
    opts = dict(OPTS, policy="streaming") if how == "streaming" else OPTS
    with mock.patch.dict(cost.DEVICE_COSTS, cpu=cost.DeviceCost(gbs=20.0, phase_s=1.0)):
        step = torch.compile(setitem_site, backend="tinyserve", options=opts, dynamic=how == "dynamic")
        step(q, kbuf.clone(), vbuf.clone(), k, v, pos, mask)
    assert tc.counters["rewritten"] == 1 and tc.counters["dense_by_cost"] == 0, tc.explain()
