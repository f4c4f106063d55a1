"""transformers' continuous batching (CB) through tinyserve on its paged cache: with a budget covering every request
the tokens equal stock CB's; with a small budget each request's tokens equal that request decoded alone through the
static-cache backend with the same options. Requests of different lengths, chunked prefills mixed with decodes,
requests joining and leaving mid-run, block reuse and forks; enabling is explicit, checked and reversible."""
from __future__ import annotations

import math

import pytest
import torch

import tinyserve_compile as tc
from tests.support.cb_helpers import cb_config, gen_config, prompts, run_batch, run_staggered, static_alone, tiny_llama
from tinyserve_compile import continuous_batching as cbm

LENGTHS = [5, 37, 60, 90, 137]
N_NEW = 10
N_LAYERS = 4
#: 2 pages of budget, 2 extra candidate pages, kept tokens, int8 bounds (the defaults otherwise)
SMALL = {"token_budget": 16, "page_size": 8, "candidate_extra": 16, "lower": "eager"}


@pytest.fixture
def model():
    m = tiny_llama()
    yield m
    cbm.disable_continuous_batching(m)


@pytest.fixture
def checked_bounds(monkeypatch):
    """Every call of the paged op first checks that the bound of each page it may read equals a rebuild from the
    page's valid slots in the buffer as it is now. Returns the number of pages checked (a list of one int)."""
    from tinyserve_compile.kernels.paged_sparse_decode import paged_page_bounds

    real, checked = cbm.paged_sparse_decode, [0]

    def check(q, k_tokens, v_tokens, page_rows, page_ids, seq_lens, bounds, scale, spec, kernel="auto"):
        S = spec.page_size
        for r, L in enumerate(seq_lens.tolist()):
            P = math.ceil(L / S)
            slots = torch.tensor([min(S, L - p * S) for p in range(P)])
            want = paged_page_bounds(k_tokens, page_rows[r, :P], slots, S, bounds.kmax.dtype)
            ids = page_ids[r, :P]
            assert torch.equal(bounds.kmax[ids], want.kmax) and torch.equal(bounds.kmin[ids], want.kmin)
            assert torch.equal(bounds.kabs[ids], want.kabs)
            checked[0] += P
        return real(q, k_tokens, v_tokens, page_rows, page_ids, seq_lens, bounds, scale, spec, kernel)

    monkeypatch.setattr(cbm, "paged_sparse_decode", check)
    return checked


def test_budget_covering_every_request_gives_stock_tokens(model):
    inputs = prompts(LENGTHS)
    stock = run_batch(model, inputs, N_NEW)
    tc.enable_continuous_batching(model, {"token_budget": 512, "page_size": 8})
    assert run_batch(model, inputs, N_NEW) == stock
    c = tc.counters
    # every decode row of layers 2 and 3 went through the paged op; layers 0 and 1 are dense_layers=2
    assert c["cb_sparse_rows"] == c["cb_dense:first dense_layers layers"] == c["cb_dense_rows"] > 0
    assert c["cb_prefill_rows"] > 0 and c["cb_mixed_steps"] > 0  # chunked prefills shared steps with decodes
    report = str(tc.explain())
    assert "continuous batching:" in report and "dense:first dense_layers layers=" in report


def test_small_budget_each_request_equals_static_backend_alone(model):
    inputs = prompts(LENGTHS, seed=1)
    stock = run_batch(model, inputs, N_NEW)
    tc.enable_continuous_batching(model, SMALL)
    got = run_batch(model, inputs, N_NEW)
    assert tc.counters["cb_sparse_rows"] > 0 and tc.counters["cb_mixed_steps"] > 0
    cbm.disable_continuous_batching(model)
    assert got != stock, "the small budget changed no token: nothing was dropped"
    for ids, toks in zip(inputs, got):
        assert toks == static_alone(model, ids, N_NEW, SMALL), f"request of {len(ids)} tokens"


def test_requests_joining_and_leaving_reuse_blocks(model, checked_bounds):
    first = prompts([70, 9, 120], seed=2)
    later = prompts([33, 101, 64], seed=3)
    max_new = [12, 3, 6, 9, 4, 11]
    # 6 blocks of 16 tokens: the requests need 19 blocks in all, so blocks given back are handed out again
    cb = dict(num_blocks=12, max_batch_tokens=40)
    assert sum(math.ceil((len(p) + n) / 16) for p, n in zip(first + later, max_new)) > 12
    tc.enable_continuous_batching(model, SMALL)
    got = run_staggered(model, first, later, max_new, **cb)
    assert tc.counters["cb_sparse_rows"] > 0 and checked_bounds[0] > 0
    cbm.disable_continuous_batching(model)
    for i, ids in enumerate(first + later):
        assert got[i] == static_alone(model, ids, max_new[i], SMALL), f"request {i} ({len(ids)} tokens)"


def test_foreign_writes_make_bounds_stale(model, checked_bounds):
    """A write to the cache tensor that is not ours (here: every key and value negated between two runs that share
    a prompt prefix, whose full blocks the second run reuses unwritten) makes every bound stale; the pages read next
    are rebuilt from what the buffer holds."""
    inputs = prompts([70, 41], seed=6)
    tc.enable_continuous_batching(model, SMALL)
    with torch.no_grad():
        model.generate_batch(inputs, generation_config=gen_config(4), continuous_batching_config=cb_config(),
                             progress_bar=False, persistent_manager=True)
        manager = model._cached_continuous_batching_manager
        cache = manager.batch_processor.cache
        before = tc.counters["cb_rebuilt_pages"]
        for allocator in cache.cache_allocators.values():
            allocator.cache_tensor.neg_()
        out = model.generate_batch(inputs, generation_config=gen_config(4), progress_bar=False,
                                   persistent_manager=True)
    with pytest.raises(ValueError, match="destroy_cached_continuous_batching_manager"):
        tc.disable_continuous_batching(model)  # its manager has no mask for stock attention
    model.destroy_cached_continuous_batching_manager()
    assert len(out) == 2 and all(r.error is None for r in out.values()), [r.error for r in out.values()]
    assert tc.counters["cb_stale"] >= 1 and tc.counters["cb_rebuilt_pages"] > before and checked_bounds[0] > 0


def test_forked_requests_rebuild_stale_bounds(model, checked_bounds):
    """Forks copy blocks outside the write: the bounds go stale and are rebuilt from the copied keys."""
    inputs = prompts([21, 45], seed=4)
    tc.enable_continuous_batching(model, SMALL)
    out = model.generate_batch(inputs, generation_config=gen_config(8, num_return_sequences=2, do_sample=True,
                                                                    top_k=1),
                               continuous_batching_config=cb_config(), progress_bar=False)
    assert len(out) == 4 and all(r.error is None for r in out.values()), [r.error for r in out.values()]
    assert tc.counters["cb_stale"] >= 1 and tc.counters["cb_rebuilt_pages"] > 0 and checked_bounds[0] > 0
    cbm.disable_continuous_batching(model)
    for i, ids in enumerate(inputs):
        want = static_alone(model, ids, 8, SMALL)
        assert list(out[f"req_{i}"].generated_tokens) == want
        assert list(out[f"req_{i}__child#0"].generated_tokens) == want


def test_compiled_varlen_path_gives_the_eager_tokens(model):
    """CB's compiled forward (Inductor; inputs padded to fixed intervals) around the paged attention, which runs
    eagerly between graphs as CB's own cache update does: the same tokens as eager CB + tinyserve."""
    from transformers import CompileConfig

    inputs = prompts([9, 50, 100], seed=7)
    tc.enable_continuous_batching(model, SMALL)
    eager = run_batch(model, inputs, 6)
    rows = tc.counters["cb_sparse_rows"]
    compiled = run_batch(model, inputs, 6, varlen_compile_config=CompileConfig(backend="inductor", mode=None),
                         q_padding_interval_size=16, kv_padding_interval_size=128)
    assert compiled == eager
    assert tc.counters["cb_sparse_rows"] > rows  # the compiled run went through the paged op too


def test_enable_is_explicit_and_reversible(model):
    from transformers import AttentionInterface
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    update, switch = PagedAttentionCache.update, ContinuousBatchingManager.switch_to_cb_friendly_attn
    assert cbm.ATTENTION_NAME not in AttentionInterface._global_mapping  # nothing at import
    inputs = prompts([30, 50], seed=5)
    stock = run_batch(model, inputs, 6)
    tc.enable_continuous_batching(model, SMALL)
    assert model.config._attn_implementation == cbm.ATTENTION_NAME and cbm.continuous_batching_enabled(model)
    assert PagedAttentionCache.update is not update
    other = tiny_llama(seed=1)  # a model that is not enabled runs stock CB while the patches are in
    other_stock = run_batch(other, inputs, 6)
    tc.disable_continuous_batching(model)
    assert model.config._attn_implementation == "sdpa" and not cbm.continuous_batching_enabled(model)
    assert PagedAttentionCache.update is update and ContinuousBatchingManager.switch_to_cb_friendly_attn is switch
    assert cbm.ATTENTION_NAME not in AttentionInterface._global_mapping
    tc.reset()
    assert run_batch(model, inputs, 6) == stock and run_batch(other, inputs, 6) == other_stock
    assert tc.counters["cb_sparse_rows"] == 0


def test_unsupported_transformers_version_is_refused(model, monkeypatch):
    import transformers

    for older_or_newer in ("5.18.0", "5.26.0"):
        monkeypatch.setattr(transformers, "__version__", older_or_newer)
        expected = rf"supports transformers 5\.19\.x.*5\.25\.x.*installed: {older_or_newer}"
        with pytest.raises(RuntimeError, match=expected):
            tc.enable_continuous_batching(model)
        assert not cbm.continuous_batching_enabled(model)


def test_bad_models_and_options_are_refused_by_name(model):
    import transformers as tf

    with pytest.raises(ValueError, match="'policy'"):
        tc.enable_continuous_batching(model, {"policy": "streaming"})
    with pytest.raises(ValueError, match="'token_budget'"):
        tc.enable_continuous_batching(model, {"token_budget": 0})
    cfg = tf.MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=32)
    mistral = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with pytest.raises(ValueError, match="full-attention layers only"):
        tc.enable_continuous_batching(mistral)
    cfg = tf.DeepseekV3Config(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                              q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                              n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2)
    mla = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with pytest.raises(ValueError, match="multi-head latent attention"):
        tc.enable_continuous_batching(mla)
    assert not cbm._ORIGINAL  # nothing stayed installed


def test_cb_page_size_not_a_multiple_fails_the_requests_with_the_reason(model):
    tc.enable_continuous_batching(model, {"page_size": 16, "token_budget": 64})
    out = model.generate_batch(prompts([20]), generation_config=gen_config(3),
                               continuous_batching_config=cb_config(page_size=8), progress_bar=False)
    errors = [str(r.error) for r in out.values()]
    assert errors and all("'page_size' (16) must divide" in e for e in errors), errors
