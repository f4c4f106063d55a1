"""A compiled model on the Triton kernel: tiny random-init Llama, interpreter on CPU.

``torch.compile(model, backend="tinyserve", options={"kernel": "triton"})`` must give
the greedy tokens (and, within fp32 tolerance, the logits) of ``kernel="torch"``.
"""
from __future__ import annotations


import pytest
import torch

pytest.importorskip("transformers")


from triton_interp import _import_interpreted  # noqa: E402


_import_interpreted("tinyserve_compile.kernels.triton_sparse_decode")

import tinyserve_compile as tc  # noqa: E402

VOCAB = 96


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch._dynamo.reset()
    tc.reset()
    yield
    torch._dynamo.reset()


def _tiny_llama(seed=0):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=96, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)
    return tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


@torch.no_grad()
def _greedy(model, step, ids, n_new, max_cache_len=160):
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    out = model(ids, past_key_values=cache, use_cache=True)
    toks, logits = [out.logits[:, -1:].argmax(-1)], []
    for _ in range(n_new):
        o = step(toks[-1], past_key_values=cache, use_cache=True)
        logits.append(o.logits[:, -1])
        toks.append(o.logits[:, -1:].argmax(-1))
    return torch.cat(toks, 1), torch.stack(logits)


def _count_launcher_calls(monkeypatch):
    """Count calls of the Triton launcher that ``tinyserve::sparse_decode`` dispatches to."""
    calls = []
    sib = _import_interpreted("tinyserve_compile.kernels.triton_sparse_decode")
    launcher = sib.sparse_decode_triton

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return launcher(*args, **kwargs)

    monkeypatch.setattr(sib, "sparse_decode_triton", counting)
    return calls


@pytest.mark.parametrize("candidate_factor", [1, 2])
def test_compiled_llama_triton_equals_torch(candidate_factor, monkeypatch):
    model = _tiny_llama()
    calls = _count_launcher_calls(monkeypatch)
    ids = torch.randint(0, VOCAB, (1, 100), generator=torch.Generator().manual_seed(1))
    opts = {"token_budget": 32, "page_size": 16, "dense_layers": 1, "lower": "eager",
            "candidate_factor": candidate_factor}
    runs = {}
    for kernel in ("torch", "triton"):
        torch._dynamo.reset()
        tc.reset()
        step = torch.compile(model, backend="tinyserve", options={**opts, "kernel": kernel})
        runs[kernel] = _greedy(model, step, ids, 4)
        assert tc.counters["rewritten"] == 3, tc.explain()  # the dense layer too (dense at run time)
    # every layer runs the launcher, the dense one too: ctrl's dense flag is read on the device, so that a CUDA
    # graph replays the same launches whatever the flags say
    assert len(calls) == 4 * 3, f"the Triton launcher ran {len(calls)} times, expected 4 steps x 3 layers"
    (t_toks, t_logits), (x_toks, x_logits) = runs["torch"], runs["triton"]
    d = (x_logits - t_logits).abs()
    assert torch.allclose(x_logits, t_logits, atol=1e-4, rtol=1e-4), f"max |logit diff| {float(d.max()):.3e}"
    assert torch.equal(x_toks, t_toks), f"tokens differ: triton {x_toks.tolist()} torch {t_toks.tolist()}"
