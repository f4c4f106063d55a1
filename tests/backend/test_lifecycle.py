"""Page bounds stay equal to a rebuild from scratch for the cache buffer's whole life."""
from __future__ import annotations

import torch

import tinyserve_compile as tc
from tests.support.backend_helpers import CACHE_IS_GRAPH_ATTRIBUTE, hf_decode, position_kwargs, prompt, worst
from tests.support.backend_models import gpt_fast_model, hf_model
from test_hf_models import _gpt_fast_run
from tinyserve_compile.kernels.reference import page_bounds
from tinyserve_compile.runtime import state_for

OPTS = {"token_budget": 32, "page_size": 16, "lower": "eager"}


def _assert_bounds_fresh(caches, page_size=16):
    for k in caches:
        st = state_for(k, page_size)
        fresh = page_bounds(k, page_size, dtype=st.bounds.kmax.dtype)
        assert not st.stale
        assert torch.equal(st.bounds.kmax, fresh.kmax), "kmax differs from a rebuild"
        assert torch.equal(st.bounds.kmin, fresh.kmin), "kmin differs from a rebuild"
        assert torch.equal(st.bounds.kabs, fresh.kabs), "kabs differs from a rebuild"


def test_reset_then_shorter_and_longer_prompts_and_new_cache():
    model = hf_model("llama")
    compiled = torch.compile(model, backend="tinyserve", options=OPTS)
    _, _, cache = hf_decode(model, compiled, prompt(100, seed=1), 4)
    rebuilds = tc.explain().runtime["bounds_rebuilds"]
    for n, seed in ((60, 2), (140, 3)):  # shorter, then longer than the last prompt
        cache.reset()
        ref_toks, ref_logits, ref_cache = hf_decode(model, None, prompt(n, seed=seed), 4, reference=OPTS)
        toks, logits, _ = hf_decode(model, compiled, prompt(n, seed=seed), 4, cache=cache)
        assert torch.allclose(logits, ref_logits, atol=2e-5, rtol=1e-4), worst(logits, ref_logits)
        _assert_bounds_fresh([layer.keys for layer in cache.layers[2:]])
    # each reset + eager prefill is a foreign write: exactly one rebuild per layer per prompt
    assert tc.explain().runtime["bounds_rebuilds"] == rebuilds + 2 * 4
    assert tc.explain().runtime["foreign_writes"] >= 2 * 4
    # a new cache object of the same shape
    ref_toks, ref_logits, _ = hf_decode(model, None, prompt(80, seed=4), 4, reference=OPTS)
    toks, logits, cache2 = hf_decode(model, compiled, prompt(80, seed=4), 4)
    assert torch.allclose(logits, ref_logits, atol=2e-5, rtol=1e-4), worst(logits, ref_logits)
    _assert_bounds_fresh([layer.keys for layer in cache2.layers[2:]])
    assert tc.counters["graphs"] == (2 if CACHE_IS_GRAPH_ATTRIBUTE else 1)  # torch 2.8: the new cache recompiles


def test_rollback_and_foreign_overwrite_gpt_fast():
    model = gpt_fast_model()
    opts = dict(OPTS, dense_layers=1)
    compiled = torch.compile(model, backend="tinyserve", options=opts)
    _gpt_fast_run(model, compiled, n_prompt=70, n_new=6)
    caches = [layer.k_cache for layer in model.layers[1:]]
    _assert_bounds_fresh(caches)
    with torch.no_grad():
        # roll back: decode again from position 72, overwriting 72..75 through the compiled graph
        for i, tok in enumerate([5, 9, 13]):
            pos = torch.tensor([72 + i])
            compiled(torch.tensor([[tok]]), pos)
        _assert_bounds_fresh(caches)
        # a foreign (eager) overwrite of old positions, then one compiled step: rebuild, then exact
        for layer in model.layers:
            layer.k_cache[:, :, 3:20] = torch.randn_like(layer.k_cache[:, :, 3:20]) * 4
        before = tc.explain().runtime["bounds_rebuilds"]
        got = compiled(torch.tensor([[7]]), torch.tensor([75]))
        _assert_bounds_fresh(caches)
        assert tc.explain().runtime["bounds_rebuilds"] == before + len(model.layers)  # dense layers keep bounds too
        from tinyserve_compile.testing import reference_sparse_attention

        # same step again, eagerly through the reference (it rewrites position 75 with the same key)
        with reference_sparse_attention(4, 2, opts):
            ref = model(torch.tensor([[7]]), torch.tensor([75]))
    assert torch.allclose(got, ref, atol=2e-5, rtol=1e-4), worst(got, ref)


def test_batch_with_left_padding_matches_reference():
    model = hf_model("qwen2")
    ids = prompt(90, batch=2, seed=6)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0  # row 1 is a shorter, left-padded prompt
    ref_toks, ref_logits, _ = hf_decode(model, None, ids, 4, attention_mask=mask, reference=OPTS)
    compiled = torch.compile(model, backend="tinyserve", options=OPTS)
    toks, logits, cache = hf_decode(model, compiled, ids, 4, attention_mask=mask)
    assert torch.allclose(logits, ref_logits, atol=2e-5, rtol=1e-4), worst(logits, ref_logits)
    assert torch.equal(toks, ref_toks)
    assert tc.counters["rewritten"] == 4 * tc.counters["graphs"], tc.explain()  # the growing 2-D mask recompiles once
    _assert_bounds_fresh([layer.keys for layer in cache.layers[2:]])
    # with a budget covering the context, padding is exact against eager dense attention
    dense_toks, dense_logits, _ = hf_decode(model, model, ids, 4, attention_mask=mask)
    torch._dynamo.reset()
    big = torch.compile(model, backend="tinyserve", options=dict(OPTS, token_budget=512))
    toks, logits, _ = hf_decode(model, big, ids, 4, attention_mask=mask)
    assert torch.allclose(logits, dense_logits, atol=1e-4, rtol=1e-4), worst(logits, dense_logits)


def _plant(caches, page: int):
    """A value no rebuild computes, in page ``page``'s ``kabs`` of each buffer's bounds."""
    for k in caches:
        state_for(k, 16).bounds.kabs[:, :, page] = 123.0


def _planted(caches, page: int) -> bool:
    return all(bool((state_for(k, 16).bounds.kabs[:, :, page] == 123.0).all()) for k in caches)


def test_decode_under_inference_mode_follows_outside_writes_on_the_device():
    # a cache made under inference_mode has no version counter: the write op's own end check (ctrl[2]) sees the
    # eager prefills, and a step that goes on from the last one recomputes only its page
    model = hf_model("llama")
    compiled = torch.compile(model, backend="tinyserve", options=OPTS)
    with torch.inference_mode():
        ref_toks, ref_logits, _ = hf_decode(model, None, prompt(100, seed=4), 5, reference=OPTS)
        toks, logits, cache = hf_decode(model, compiled, prompt(100, seed=4), 5)
        caches = [layer.keys for layer in cache.layers[2:]]
        assert caches[0].is_inference()
        assert torch.equal(toks, ref_toks)
        assert torch.allclose(logits, ref_logits, atol=2e-5, rtol=1e-4), worst(logits, ref_logits)
        _assert_bounds_fresh(caches)
        _plant(caches, 11)  # positions 176..191: no step writes there
        compiled(toks[:, -1:], past_key_values=cache, use_cache=True, **position_kwargs(105))
        assert _planted(caches, 11), "a step that went on from the last write rebuilt the bounds"
        for n, seed in ((60, 2), (140, 3)):  # a new prompt written eagerly (outside the graph): shorter, longer
            cache.reset()
            ref_toks, ref_logits, _ = hf_decode(model, None, prompt(n, seed=seed), 4, reference=OPTS)
            toks, logits, _ = hf_decode(model, compiled, prompt(n, seed=seed), 4, cache=cache)
            assert torch.allclose(logits, ref_logits, atol=2e-5, rtol=1e-4), worst(logits, ref_logits)
            assert not _planted(caches, 11)
            _assert_bounds_fresh(caches)
    rt = tc.explain().runtime
    assert rt["inference_cache_calls"] >= 14 * 4  # every call, every buffer: the host could not see the writes
    assert tc.counters["rewritten"] > 0


def test_frozen_host_flags_stay_exact_after_a_prefill_outside_the_graph(monkeypatch):
    # the stand-in of an outer CUDA graph capture of a whole decode step: its replays run no host code, so the
    # flags the host would push into ctrl (the stale flag from the version counter) stay as they were captured.
    # The write op's end check alone must then see a new prompt written outside the graph.
    from tinyserve_compile import runtime

    model = hf_model("llama")
    compiled = torch.compile(model, backend="tinyserve", options=OPTS)
    _, _, cache = hf_decode(model, compiled, prompt(100, seed=1), 4)
    caches = [layer.keys for layer in cache.layers[2:]]
    monkeypatch.setattr(runtime, "_push_flags", lambda st, stale, dense: False)  # "replay": flags as captured
    for n, seed in ((60, 2), (140, 3)):
        cache.reset()
        ref_toks, ref_logits, _ = hf_decode(model, None, prompt(n, seed=seed), 4, reference=OPTS)
        toks, logits, _ = hf_decode(model, compiled, prompt(n, seed=seed), 4, cache=cache)
        assert torch.allclose(logits, ref_logits, atol=2e-5, rtol=1e-4), worst(logits, ref_logits)
        for k in caches:
            fresh = page_bounds(k, 16, dtype=state_for(k, 16).bounds.kmax.dtype)
            assert torch.equal(state_for(k, 16).bounds.kmax, fresh.kmax), "kmax differs from a rebuild"
