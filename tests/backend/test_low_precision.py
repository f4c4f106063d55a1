"""Lower-precision models through ``backend="tinyserve"``: a bf16 model, and torchao's weight-only int8 and
int4 (``bench/weights.py``) applied before ``torch.compile``. The attention sites are still found and
rewritten, a budget covering the context gives the same quantized model's eager tokens, and a small budget
gives the reference rule's logits on the same quantized model."""
from __future__ import annotations

import pytest
import torch

import tinyserve_compile as tc
from tests.support.backend_helpers import hf_decode, prompt, torchao_problem, worst
from tests.support.backend_models import hf_model

from bench.weights import INT4_GROUP, prepare_weights, tensor_nbytes

N_LAYERS = 4
PROMPT = 90
#: case -> (activation dtype, weights); int8/int4 keep the activations (and the KV cache) in that dtype
CASES = {
    "bf16": (torch.bfloat16, "bf16"),
    "int8": (torch.float32, "int8"),
    "int4": (torch.float32, "int4"),
    "int8 bf16 activations": (torch.bfloat16, "int8"),
}
#: logits tolerance per activation dtype. bf16: the logits of this model are below 0.5 in size, where bf16
#: steps by 2**-9 to 2**-11; eager and compiled round differently (measured: up to 2.4e-3 with a budget covering
#: the context, 2e-2 with int8 weights and a small budget); dropping pages moves logits by about 0.5
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2.5e-2, rtol=0.0)}

#: torchao >= 0.18 for the quantized cases (it does not import on torch 2.8)
needs_torchao = pytest.mark.skipif(torchao_problem() is not None, reason=str(torchao_problem()))


def _cases(names):
    return [pytest.param(c, marks=needs_torchao) if CASES[c][1] != "bf16" else c for c in sorted(names)]


def _model(case: str):
    act, weights = CASES[case]
    model = prepare_weights(hf_model("llama").to(act), weights)
    w = model.model.layers[0].self_attn.q_proj.weight
    if weights in ("int8", "int4"):  # really quantized: torchao's subclass, fewer bytes than the dense weight
        assert type(w).__name__ == {"int8": "Int8Tensor", "int4": "Int4OpaqueTensor"}[weights]
        assert tensor_nbytes(w) < w.numel() * torch.empty((), dtype=act).element_size()
    else:
        assert w.dtype == act
    return model


def _assert_not_fp32_model(case, ids, logits):
    """The logits are the low-precision model's: bf16 activations give bf16 logits; with fp32 activations the
    quantized weights move the logits outside the tolerance (int8 by about 5e-3, int4 by about 0.1)."""
    act = CASES[case][0]
    assert logits.dtype == act
    if act == torch.float32:
        _, fp32_logits, _ = hf_decode(hf_model("llama"), hf_model("llama"), ids, logits.shape[0])
        assert not torch.allclose(logits, fp32_logits, **TOL[act]), f"{case}: logits equal the fp32 model's"


@pytest.mark.parametrize("case", _cases(CASES))
def test_budget_covering_context_gives_eager_tokens(case):
    model = _model(case)
    ids = prompt(PROMPT)
    ref_toks, ref_logits, _ = hf_decode(model, model, ids, 5)
    opts = {"token_budget": 256}  # lower="inductor", the default: Inductor lowers the quantized linears
    toks, logits, _ = hf_decode(model, torch.compile(model, backend="tinyserve", options=opts), ids, 5)
    assert torch.equal(toks, ref_toks), worst(logits, ref_logits)
    assert torch.allclose(logits, ref_logits, **TOL[CASES[case][0]]), worst(logits, ref_logits)
    c = tc.counters
    assert c["decode_sites"] == N_LAYERS and c["rewritten"] == N_LAYERS and c["dense"] == 0, tc.explain()
    assert c["graphs"] == 1, tc.explain()
    rt = tc.explain().runtime
    assert rt["dense_layer_calls"] == 5 * 2 and rt["decode_calls"] == 5 * (N_LAYERS - 2), rt
    _assert_not_fp32_model(case, ids, logits)


@pytest.mark.parametrize("case", _cases(CASES))
def test_small_budget_matches_reference_rule(case):
    model = _model(case)
    ids = prompt(PROMPT, seed=1)
    opts = {"token_budget": 32, "page_size": 16, "candidate_extra": 32, "lower": "eager"}
    ref_toks, ref_logits, _ = hf_decode(model, None, ids, 5, reference=opts)
    toks, logits, _ = hf_decode(model, torch.compile(model, backend="tinyserve", options=opts), ids, 5)
    assert torch.allclose(logits, ref_logits, **TOL[CASES[case][0]]), worst(logits, ref_logits)
    assert torch.equal(toks, ref_toks)
    assert tc.counters["rewritten"] == N_LAYERS, tc.explain()
    assert tc.explain().runtime["decode_calls"] == 5 * (N_LAYERS - 2)
    _, dense_logits, _ = hf_decode(model, model, ids, 5)  # pages really dropped: dense attention differs
    assert not torch.allclose(logits, dense_logits, atol=5e-2), "sparse logits equal dense ones: nothing dropped"


@needs_torchao
def test_prepare_weights_rejects_bad_input():
    with pytest.raises(ValueError, match="weights"):
        prepare_weights(hf_model("llama"), "int3")
    with pytest.raises(ValueError, match="weights"):
        prepare_weights(hf_model("llama"), "bf16")  # an fp32 model is not a bf16 one
    small = torch.nn.Sequential(torch.nn.Linear(INT4_GROUP + 8, 16))  # no input width divisible by the group
    with pytest.raises(ValueError, match="quantized no linear layer"):
        prepare_weights(small, "int4")
