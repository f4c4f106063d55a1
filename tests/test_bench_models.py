"""The layer-by-layer model builder of the benchmarks (``bench/models.py``, issue 50): Llama-3.2-1B's shape in each
format it makes, its peak memory near the final size, and ``python -m bench decode --model llama3-1b`` using it.

Each build runs in a subprocess of its own, so that its peak resident memory is its own: Llama-3.2-1B with two of
its layers holds a 128256 x 2048 embedding (0.5 GB in bf16, 1 GB in fp32), the largest unit a build materialises.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: peak resident memory a build may add over the bytes of the model it returns: one block of rows in fp32 and the
#: allocator's slack (the whole-model build of the head alone took 1.9 GB more)
SLACK_MB = 300

CHILD = """
import json, resource, sys, torch
import transformers, torchao, bench.weights, tinyserve_compile.quantization  # imported before the baseline
from bench.models import LLAMA3_1B_SHAPE, build_llama
KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "tie_word_embeddings")
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
m = build_llama("llama3-1b", 2, sys.argv[1])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
held = {id(t): t for t in list(m.parameters()) + list(m.buffers())}
size = sum(t.numel() * t.element_size() for t in held.values())
layer = m.model.layers[0]
lin = {n: (type(getattr(layer.self_attn if n[0] in "qkvo" else layer.mlp, n)).__name__,
           getattr(layer.self_attn if n[0] in "qkvo" else layer.mlp, n).out_features)
       for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
with torch.no_grad():
    logits = m(torch.tensor([[1, 2, 3]])).logits
print(json.dumps(dict(
    peak_mb=peak / 1024, size_mb=size / 2**20, layers=len(m.model.layers), lin=lin,
    head=[type(m.lm_head).__name__, m.lm_head.out_features], tied=m.lm_head.weight is m.model.embed_tokens.weight
    if hasattr(m.lm_head, "weight") else False,
    embed=[list(m.model.embed_tokens.weight.shape), str(m.model.embed_tokens.weight.dtype)],
    norm=str(m.model.norm.weight.dtype), rope=str(m.model.rotary_emb.inv_freq.device),
    logits=[list(logits.shape), bool(torch.isfinite(logits).all()), float(logits.float().std())],
    config=all(getattr(m.config, k) == LLAMA3_1B_SHAPE[k] for k in KEYS))))
"""


def _build(weights: str) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, weights], capture_output=True, text=True, cwd=ROOT,
                       timeout=600, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("weights, dtype, linear", [("int4-plain", "torch.bfloat16", "Int4Linear"),
                                                     ("bf16", "torch.bfloat16", "Linear"),
                                                     ("fp32", "torch.float32", "Linear")])
def test_llama3_1b_is_built_layer_by_layer_in_its_format(weights, dtype, linear):
    pytest.importorskip("torchao")
    r = _build(weights)
    assert r["config"] and r["layers"] == 2
    assert r["lin"] == {"q_proj": [linear, 2048], "k_proj": [linear, 512], "v_proj": [linear, 512],
                        "o_proj": [linear, 2048], "gate_proj": [linear, 8192], "up_proj": [linear, 8192],
                        "down_proj": [linear, 2048]}
    assert r["embed"] == [[128256, 2048], dtype] and r["norm"] == dtype and r["rope"] == "cpu"
    # tied embeddings: the head is the embedding (fp32/bf16), or a quantized copy of it (int4-plain)
    assert r["head"] == [linear, 128256] and r["tied"] == (weights != "int4-plain")
    assert r["logits"][0] == [1, 3, 128256] and r["logits"][1] and 0.1 < r["logits"][2] < 10
    assert r["peak_mb"] < r["size_mb"] + SLACK_MB, r


def test_bench_decode_builds_the_llama3_shapes_in_the_measured_format(monkeypatch):
    """``model_in_format`` takes the layered builder for the Llama-3 shapes on the CPU in fp32/bf16/int4-plain
    (no second, quantized copy), and ``model_for``'s whole model otherwise."""
    import torch

    from bench import decode as bd

    built = []
    monkeypatch.setattr(bd, "build_llama", lambda kind, layers, fmt: built.append((kind, layers, fmt)) or
                        torch.nn.Linear(1, 1))
    base, model, name = bd.model_in_format("llama3-1b", 8192, torch.bfloat16, torch.device("cpu"), 3, "int4-plain")
    assert built == [("llama3-1b", 3, "int4-plain")] and base is model and "Llama-3.2-1B" in name
    bd.model_in_format("llama3-8b", 8192, torch.float32, torch.device("cpu"), None, None)
    assert built[-1] == ("llama3-8b", None, "fp32")
    base, model, name = bd.model_in_format("tiny", 64, torch.float32, torch.device("cpu"), None, None)
    assert len(built) == 2 and base is model and name == "tiny random llama"


@pytest.mark.parametrize("weights", ["fp32", "int4-plain"])
def test_llama3_1b_shape_at_a_full_budget_gives_the_stock_tokens(weights):
    """Issue 50's target at the sizes users run: with a budget covering the context, ``backend="tinyserve"`` gives the
    tokens of the stock model, at Llama-3.2-1B's shape (two of its layers, random init) in fp32 and in int4-plain
    (bf16 activations), decoding greedily after an eager prefill of 200 tokens."""
    import torch

    if weights == "int4-plain":
        pytest.importorskip("torchao")
    import tinyserve_compile as tc
    from bench.models import build_llama
    from tests.support.backend_helpers import hf_decode, worst

    torch._dynamo.reset()
    tc.reset()
    model = build_llama("llama3-1b", 2, weights)
    ids = torch.randint(0, 128256, (1, 200), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want_toks, want_logits, _ = hf_decode(model, model, ids, 8, max_cache_len=256)
        step = torch.compile(model, backend="tinyserve", options={"token_budget": 256, "lower": "eager"})
        toks, logits, _ = hf_decode(model, step, ids, 8, max_cache_len=256)
    assert tc.counters["rewritten"] == 2, tc.explain()
    assert torch.equal(toks, want_toks), (toks, want_toks, worst(logits, want_logits))
    # bf16 activations (int4-plain): logits of about 3 in size agree to a few of bf16's steps (1/64 there)
    atol, rtol = (1e-4, 1e-4) if weights == "fp32" else (8e-2, 2e-2)
    assert torch.allclose(logits.float(), want_logits.float(), atol=atol, rtol=rtol), worst(logits, want_logits)
