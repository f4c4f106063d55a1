"""Random-init HF models (static cache, SDPA) and a gpt-fast-style model through the backend."""
from __future__ import annotations

import pytest
import torch

import tinyserve_compile as tc
from tests.support.backend_helpers import hf_decode, position_kwargs, prompt, worst
from tests.support.backend_models import HF_FAMILIES, gpt_fast_model, hf_model, n_heads
from tinyserve_compile.runtime import state_for
from tinyserve_compile.kernels.reference import page_bounds

N_LAYERS = 4
PROMPT = 90


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_budget_above_context_gives_eager_tokens(family):
    model = hf_model(family)
    ids = prompt(PROMPT)
    ref_toks, ref_logits, _ = hf_decode(model, model, ids, 6)
    opts = {"token_budget": 256, "lower": "eager"}
    toks, logits, _ = hf_decode(model, torch.compile(model, backend="tinyserve", options=opts), ids, 6)
    assert torch.equal(toks, ref_toks), worst(logits, ref_logits)
    assert torch.allclose(logits, ref_logits, atol=1e-4, rtol=1e-4), worst(logits, ref_logits)
    c = tc.counters
    assert c["decode_sites"] == N_LAYERS
    assert c["rewritten"] == N_LAYERS, tc.explain()  # every layer; the first dense_layers=2 attend densely at run time
    rt = tc.explain().runtime
    assert rt["dense_layer_calls"] == 6 * 2 and rt["decode_calls"] == 6 * (N_LAYERS - 2), rt


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_small_budget_matches_sparse_reference(family):
    model = hf_model(family)
    ids = prompt(PROMPT, seed=1)
    opts = {"token_budget": 32, "page_size": 16, "candidate_extra": 32, "lower": "eager"}
    ref_toks, ref_logits, _ = hf_decode(model, None, ids, 5, reference=opts)
    toks, logits, cache = hf_decode(model, torch.compile(model, backend="tinyserve", options=opts), ids, 5)
    assert torch.allclose(logits, ref_logits, atol=2e-5, rtol=1e-4), worst(logits, ref_logits)
    assert torch.equal(toks, ref_toks)
    assert tc.explain().runtime["decode_calls"] == 5 * (N_LAYERS - 2)
    # the rewritten layers really drop pages: dense attention gives other logits
    _, dense_logits, _ = hf_decode(model, model, ids, 5)
    assert not torch.allclose(logits, dense_logits, atol=1e-3), "sparse logits equal dense ones: nothing was dropped"
    # maintained bounds equal a rebuild from scratch
    for layer in cache.layers:
        st = state_for(layer.keys, 16)
        assert not st.stale
        fresh = page_bounds(layer.keys, 16, dtype=st.bounds.kmax.dtype)
        assert torch.equal(st.bounds.kmax, fresh.kmax) and torch.equal(st.bounds.kmin, fresh.kmin)


SELECTIONS = {  # the default selection (int8 bounds, extra candidates, kept tokens), and each alone
    "int8+extra+tokens": {"bounds_dtype": "int8", "candidate_factor": 1, "candidate_extra": 32, "keep_tokens": True},
    "extra pages": {"candidate_factor": 1, "candidate_extra": 16, "keep_tokens": False, "bounds_dtype": "bfloat16"},
    "int8 one stage": {"bounds_dtype": "int8", "candidate_factor": 1, "candidate_extra": 0},
}


@pytest.mark.parametrize("lower", ["eager", "inductor"])
@pytest.mark.parametrize("selection", sorted(SELECTIONS))
def test_new_selection_options_match_reference(selection, lower):
    model = hf_model("llama")
    ids = prompt(PROMPT, seed=5)
    opts = {"token_budget": 32, "page_size": 8, "lower": lower, **SELECTIONS[selection]}
    ref_toks, ref_logits, _ = hf_decode(model, None, ids, 5, reference=opts)
    toks, logits, cache = hf_decode(model, torch.compile(model, backend="tinyserve", options=opts), ids, 5)
    assert torch.allclose(logits, ref_logits, atol=2e-5, rtol=1e-4), worst(logits, ref_logits)
    assert torch.equal(toks, ref_toks)
    assert tc.explain().runtime["decode_calls"] == 5 * (N_LAYERS - 2)
    for layer in cache.layers:  # maintained bounds (int8 codes included) equal a rebuild from scratch
        st = state_for(layer.keys, 8)
        assert st.bounds.kmax.dtype == getattr(torch, opts["bounds_dtype"])
        fresh = page_bounds(layer.keys, 8, dtype=st.bounds.kmax.dtype)
        assert torch.equal(st.bounds.kmax, fresh.kmax) and torch.equal(st.bounds.kmin, fresh.kmin)
        assert torch.equal(st.bounds.kabs, fresh.kabs)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_inductor_lowering_matches_reference_without_recompiles(family):
    model = hf_model(family)
    ids = prompt(PROMPT, seed=2)
    opts = {"token_budget": 32, "page_size": 16, "candidate_extra": 32}  # lower="inductor" is the default
    ref_toks, ref_logits, _ = hf_decode(model, None, ids, 6, reference=opts)
    toks, logits, _ = hf_decode(model, torch.compile(model, backend="tinyserve", options=opts), ids, 6)
    assert torch.allclose(logits, ref_logits, atol=1e-4, rtol=1e-4), worst(logits, ref_logits)
    # as many graphs as stock torch.compile makes of the same decode loop: one since transformers 5.x; transformers
    # 4.56 (the oldest supported) recompiles its decode step itself (3 graphs with backend="eager" too)
    from torch._dynamo.utils import counters as dynamo_counters

    torch._dynamo.reset()
    dynamo_counters.clear()
    hf_decode(model, torch.compile(model, backend="eager"), ids, 6)
    stock = dynamo_counters["stats"]["unique_graphs"]
    assert tc.counters["graphs"] == stock, f"{tc.counters['graphs']} decode graphs, stock torch.compile made {stock}"
    assert tc.counters["rewritten"] == N_LAYERS
    rt = tc.explain().runtime
    assert rt["bounds_rebuilds"] == N_LAYERS, rt  # once, after the eager prefill
    assert rt["bounds_updates"] == 5 * N_LAYERS, rt  # then one page per step


@torch.no_grad()
def _gpt_fast_run(model, step, n_prompt=70, n_new=6, reference=None):
    from tinyserve_compile.testing import reference_sparse_attention

    ids = prompt(n_prompt, seed=3)
    for layer in model.layers:
        layer.k_cache.zero_()
        layer.v_cache.zero_()
    logits = model(ids, torch.arange(n_prompt))
    tok, out = logits[:, -1:].argmax(-1), []
    for i in range(n_new):
        pos = torch.tensor([n_prompt + i])
        if reference is not None:
            with reference_sparse_attention(4, 2, reference):
                lg = model(tok, pos)
        else:
            lg = step(tok, pos)
        out.append(lg[:, -1])
        tok = lg[:, -1:].argmax(-1)
    return torch.stack(out)


@pytest.mark.parametrize("lower", ["eager", "inductor"])
def test_gpt_fast_setitem_and_repeat_interleave(lower):
    model = gpt_fast_model()
    opts = {"token_budget": 32, "page_size": 16, "candidate_extra": 32, "dense_layers": 1, "lower": lower}
    ref = _gpt_fast_run(model, None, reference=opts)
    got = _gpt_fast_run(model, torch.compile(model, backend="tinyserve", options=opts))
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), worst(got, ref)
    assert tc.counters["rewritten"] == 4, tc.explain()
    assert tc.explain().runtime["dense_layer_calls"] > 0 and tc.explain().runtime["decode_calls"] > 0
    dense = _gpt_fast_run(model, model)
    assert not torch.allclose(got, dense, atol=1e-4), "budget 32 of 70+ tokens should change the logits"


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_compiled_prefill_stays_dense_and_keeps_bounds(family):
    model = hf_model(family)
    ids = prompt(PROMPT, seed=4)
    opts = {"token_budget": 32, "page_size": 16, "candidate_extra": 32, "lower": "eager"}
    ref_toks, ref_logits, _ = hf_decode(model, None, ids, 4, reference=opts)
    from transformers import StaticCache

    compiled = torch.compile(model, backend="tinyserve", options=opts)
    cache = StaticCache(config=model.config, max_cache_len=192)
    with torch.no_grad():
        model(prompt(120, seed=5), past_key_values=cache, use_cache=True)  # allocates the lazy cache buffers
        cache.reset()
        out = compiled(ids, past_key_values=cache, use_cache=True)  # prefill through the backend
        c = dict(tc.counters)
        assert c["prefill_sites"] == N_LAYERS and c.get("rewritten", 0) == 0, tc.explain()
        assert c["cache_writes_rewritten"] == N_LAYERS  # every layer keeps bounds (dense_layers is a run-time rank)
        for layer in cache.layers:
            st = state_for(layer.keys, 16)  # any bounds dtype
            assert torch.equal(st.bounds.kmax, page_bounds(layer.keys, 16, dtype=st.bounds.kmax.dtype).kmax)
        toks, logits = [out.logits[:, -1:].argmax(-1)], []
        for i in range(4):
            o = compiled(toks[-1], past_key_values=cache, use_cache=True, **position_kwargs(PROMPT + i))
            logits.append(o.logits[:, -1])
            toks.append(o.logits[:, -1:].argmax(-1))
    assert torch.allclose(torch.stack(logits), ref_logits, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("policy", ["full", "streaming", "h2o", "oracle"])
def test_policy_option_reaches_the_compiled_graph(policy):
    """``options={"policy": ...}``: the compiled model equals the eager run of the same policy
    (h2o's state carried across steps by the runtime), and ``full`` equals dense eager."""
    model = hf_model("llama")
    ids = prompt(PROMPT, seed=8)
    opts = {"token_budget": 32, "page_size": 16, "candidate_extra": 32, "lower": "eager", "policy": policy}
    from tinyserve_compile.testing import reference_sparse_attention

    with reference_sparse_attention(*n_heads(model), opts, n_layers=N_LAYERS):
        ref_toks, ref_logits, _ = hf_decode(model, model, ids, 5)
    toks, logits, _ = hf_decode(model, torch.compile(model, backend="tinyserve", options=opts), ids, 5)
    assert torch.allclose(logits, ref_logits, atol=2e-5, rtol=1e-4), worst(logits, ref_logits)
    assert tc.counters["rewritten"] == N_LAYERS
    assert tc.explain().runtime["decode_calls"] == 5 * (N_LAYERS - 2)
    if policy == "full":
        _, dense_logits, _ = hf_decode(model, model, ids, 5)
        assert torch.allclose(logits, dense_logits, atol=1e-4, rtol=1e-4), worst(logits, dense_logits)
