"""Continuous-batching workloads shared by the serving tests: a tiny Llama, prompts of mixed lengths, and runs
through ``generate_batch`` or a manager that takes requests while it runs."""
from __future__ import annotations

import torch

VOCAB = 96


def tiny_llama(seed: int = 0, layers: int = 4):
    """A random-init Llama with GQA (4 query heads, 2 KV heads) and SDPA attention."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.1)
    return tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def prompts(lengths, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def gen_config(max_new_tokens: int, **kw):
    from transformers import GenerationConfig

    base = dict(do_sample=False, eos_token_id=-1, pad_token_id=0)
    base.update(kw)
    return GenerationConfig(max_new_tokens=max_new_tokens, **base)


def cb_config(**kw):
    """Small pages and a small token budget per step: long prompts are prefilled in chunks, so steps mix prefill
    and decode rows."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    base = dict(page_size=16, num_blocks=48, max_batch_tokens=48, max_requests_per_batch=8)
    base.update(kw)
    return ContinuousBatchingConfig(**base)


@torch.no_grad()
def run_batch(model, inputs, max_new_tokens, **cb):
    """``generate_batch`` of ``inputs``: the generated tokens of each, in input order."""
    out = model.generate_batch(inputs, generation_config=gen_config(max_new_tokens),
                               continuous_batching_config=cb_config(**cb), progress_bar=False)
    assert not [r.error for r in out.values() if r.error], [r.error for r in out.values()]
    return [list(r.generated_tokens) for r in out.values()]


@torch.no_grad()
def run_staggered(model, first, later, max_new, **cb):
    """A manager running ``first`` (prompts with their ``max_new`` tokens); ``later`` joins once the first
    request has streamed a token. Returns ``{index: tokens}`` over ``first + later``."""
    import time

    manager = model.init_continuous_batching(generation_config=gen_config(max(max_new)),
                                             continuous_batching_config=cb_config(**cb))
    manager.start()
    try:
        ids = {}
        for i, p in enumerate(first):
            ids[manager.add_request(p, request_id=f"r{i}", max_new_tokens=max_new[i], streaming=i == 0)] = i
        deadline = time.monotonic() + 300
        results = {}
        while True:  # wait for the first streamed token of r0
            r = manager.get_result(timeout=1)
            assert time.monotonic() < deadline, "no token streamed"
            if r is not None and r.request_id == "r0":
                if r.is_finished():
                    results[0] = list(r.generated_tokens)
                break
        for j, p in enumerate(later):
            i = len(first) + j
            ids[manager.add_request(p, request_id=f"r{i}", max_new_tokens=max_new[i])] = i
        while len(results) < len(ids):
            r = manager.get_result(timeout=1)
            assert time.monotonic() < deadline, f"only {len(results)} of {len(ids)} requests finished"
            if r is not None and r.is_finished():
                assert r.error is None, r.error
                results[ids[r.request_id]] = list(r.generated_tokens)
        return results
    finally:
        manager.stop(block=True, timeout=60)
        model.destroy_cached_continuous_batching_manager()


@torch.no_grad()
def static_alone(model, ids, n_tokens, options):
    """``ids`` decoded alone through the static-cache backend: eager prefill into a StaticCache, then
    ``n_tokens - 1`` greedy steps through ``torch.compile(model, backend="tinyserve", options=options)``."""
    from tests.support.backend_helpers import hf_decode

    step = torch.compile(model, backend="tinyserve", options=options)
    toks, _, _ = hf_decode(model, step, torch.tensor([ids]), n_tokens - 1, max_cache_len=len(ids) + n_tokens + 8)
    return toks[0].tolist()
