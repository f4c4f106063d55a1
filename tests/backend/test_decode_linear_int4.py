"""The decode_linear pass on torchao int4 weights (``Int4OpaqueTensor``): decode linears of a tiny random-init
Llama become tinyserve::linear_int4 (the native int4 GEMV), counted; logits match the same quantized model in
eager; a decode batch above 8 rows and output features that are not a multiple of 64 stay torchao's, with the
reason in explain()."""
from __future__ import annotations

import pytest
import torch

import tinyserve_compile as tc
from tests.support.backend_helpers import hf_decode, prompt, torchao_problem, worst
from tinyserve_compile.kernels.linear import int4_layout_problem, load_native_linear, native_linear_reason

if torchao_problem() is not None:
    pytest.skip(torchao_problem(), allow_module_level=True)
pytestmark = pytest.mark.skipif(not load_native_linear() or int4_layout_problem() is not None,
                                reason=f"native int4 GEMV unavailable: {native_linear_reason() or int4_layout_problem()}")

from bench.weights import prepare_weights  # noqa: E402

#: linears of the decode graph: 2 layers x (q, k, v, o, gate, up, down) + lm_head
LINEARS = 2 * 7 + 1
#: of which k/v have 2 KV heads x 16 = 32 output features, not a multiple of 64
KV_LINEARS = 2 * 2
PROMPT = 24
OPTS = {"token_budget": 256, "lower": "eager"}


def _model(intermediate=128, kv_heads=2):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=intermediate, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval().to(torch.bfloat16)
    return prepare_weights(model, "int4")


def test_int4_decode_rewritten_and_close():
    model = _model()
    assert type(model.model.layers[0].mlp.up_proj.weight).__name__ == "Int4OpaqueTensor"
    ids = prompt(PROMPT)
    ref_toks, ref_logits, _ = hf_decode(model, model, ids, 3)
    toks, logits, _ = hf_decode(model, torch.compile(model, backend="tinyserve", options=OPTS), ids, 3)
    # the GEMV sums in another order than ATen's kernel: bf16 rounding of the outputs apart
    assert torch.allclose(logits.float(), ref_logits.float(), atol=5e-2, rtol=5e-2), worst(logits, ref_logits)
    c = tc.counters
    assert c["linear_int4_rewritten"] == LINEARS - KV_LINEARS, dict(c)
    assert c["linear_rewritten"] == LINEARS - KV_LINEARS, dict(c)
    assert c["linear_kept:int4 output features not a multiple of 64"] == KV_LINEARS, dict(c)
    assert c["linear_grouped"] == 2 * 2, dict(c)  # gate and up of each layer in one call (q alone: k/v kept)
    assert f"({LINEARS - KV_LINEARS} int4)" in str(tc.explain())


def test_int4_qkv_and_gate_up_in_one_call_each():
    # 4 KV heads x 16 = 64 output features: k and v qualify, so q/k/v share one call and gate/up another
    model = _model(kv_heads=4)
    ids = prompt(PROMPT)
    ref_toks, ref_logits, _ = hf_decode(model, model, ids, 3)
    toks, logits, _ = hf_decode(model, torch.compile(model, backend="tinyserve", options=OPTS), ids, 3)
    assert torch.allclose(logits.float(), ref_logits.float(), atol=5e-2, rtol=5e-2), worst(logits, ref_logits)
    c = tc.counters
    assert c["linear_int4_rewritten"] == LINEARS and c["linear_grouped"] == 2 * 5, dict(c)
    assert "10 of them in 4 shared-input calls" in str(tc.explain())


def test_int4_big_batch_stays_torchao():
    model = _model()
    ids = prompt(PROMPT, batch=9)
    ref_toks, ref_logits, _ = hf_decode(model, model, ids, 1)
    toks, logits, _ = hf_decode(model, torch.compile(model, backend="tinyserve", options=OPTS), ids, 1)
    assert torch.allclose(logits.float(), ref_logits.float(), atol=5e-2, rtol=5e-2), worst(logits, ref_logits)
    c = tc.counters
    assert c["linear_int4_rewritten"] == 0, dict(c)
    assert c["linear_kept:rows > 8"] == LINEARS - KV_LINEARS, dict(c)
    assert "rows > 8" in str(tc.explain())
