"""``dense_layers`` counts the model's layers in execution order, however many graphs Dynamo makes."""
from __future__ import annotations

import pytest
import torch

import tinyserve_compile as tc
from tests.support.backend_helpers import worst
from tests.support.backend_models import gpt_fast_model
from test_hf_models import _gpt_fast_run

OPTS = {"token_budget": 32, "page_size": 16, "candidate_extra": 32, "dense_layers": 2}
N_NEW = 6


@pytest.mark.parametrize("lower", ["eager", "inductor"])
def test_graph_break_per_layer_rewrites_the_same_sites_with_the_same_logits(lower):
    opts = dict(OPTS, lower=lower)
    whole = gpt_fast_model()
    ref = _gpt_fast_run(whole, None, n_new=N_NEW, reference=opts)
    got_whole = _gpt_fast_run(whole, torch.compile(whole, backend="tinyserve", options=opts), n_new=N_NEW)
    whole_counts = (tc.counters["rewritten"], tc.explain().runtime["decode_calls"],
                    tc.explain().runtime["dense_layer_calls"])
    assert tc.counters["graphs"] == 1, tc.explain()  # the decode step (the prefill runs eagerly)
    tc.reset()
    torch._dynamo.reset()

    broken = gpt_fast_model(graph_breaks=True)
    got = _gpt_fast_run(broken, torch.compile(broken, backend="tinyserve", options=opts), n_new=N_NEW)
    rt = tc.explain().runtime
    assert tc.counters["graphs"] > 1, "the model did not graph-break"
    # the same layers attend sparsely and densely as without the breaks: 2 dense, 2 sparse per step
    assert (rt["decode_calls"], rt["dense_layer_calls"]) == whole_counts[1:] == (2 * N_NEW, 2 * N_NEW), rt
    assert torch.allclose(got, got_whole, atol=1e-5, rtol=1e-5), worst(got, got_whole)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), worst(got, ref)
    dense = _gpt_fast_run(broken, broken, n_new=N_NEW)
    assert not torch.allclose(got, dense, atol=1e-4), "sparse layers should change the logits"
