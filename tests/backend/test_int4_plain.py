"""Int4PlainWeightOnlyConfig (tinyserve_compile.quantization): torchao's quantize_ swaps every linear for an Int4Linear
whose plain buffers hold torchao's own int4 codes, scales and zero points; eager logits equal torchao's int4 model;
compiled with the backend, the int4 calls that read one activation share one grouped call (counted, in explain())
and the logits equal those of torchao's int4 model through the same backend; a decode batch above 8 rows, or
decode_linear=False, is not grouped; bad input is named."""
from __future__ import annotations

import copy

import pytest
import torch

import tinyserve_compile as tc
from tests.support.backend_helpers import hf_decode, prompt, torchao_problem, worst
from tinyserve_compile.kernels.linear import int4_layout_problem, load_native_linear, native_linear_reason

if torchao_problem() is not None:
    pytest.skip(torchao_problem(), allow_module_level=True)
from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig  # noqa: E402
from torchao.quantization import quantize_  # noqa: E402

from tinyserve_compile.quantization import Int4Linear, Int4PlainWeightOnlyConfig  # noqa: E402

needs_gemv = pytest.mark.skipif(
    not load_native_linear() or int4_layout_problem() is not None,
    reason=f"native int4 GEMV unavailable: {native_linear_reason() or int4_layout_problem()}")

#: linears of the tiny model: 2 layers x (q, k, v, o, gate, up, down) + lm_head
LINEARS = 2 * 7 + 1
#: of which q/k/v and gate/up read one activation: 5 per layer
GROUPED = 2 * 5
PROMPT = 24
OPTS = {"token_budget": 256}


def _bf16_model(dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    # 4 KV heads x 16 = 64: every linear's output features a multiple of 64, the GEMV's blocks
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval().to(dtype)


def _pair():
    """(plain, torchao) int4 copies of one bf16 model."""
    base = _bf16_model()
    plain, sub = copy.deepcopy(base), copy.deepcopy(base)
    quantize_(plain, Int4PlainWeightOnlyConfig(group_size=32))
    quantize_(sub, PrototypeInt4WeightOnlyConfig(group_size=32, set_inductor_config=False))
    return plain, sub


def test_linears_become_plain_buffers_holding_torchaos_codes():
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    plain, sub = _pair()
    mods = [m for m in plain.modules() if isinstance(m, Int4Linear)]
    assert len(mods) == LINEARS and not any(isinstance(m, torch.nn.Linear) for m in plain.modules())
    tensors = [*plain.parameters(), *plain.buffers()]
    assert not any(is_traceable_wrapper_subclass(t) for t in tensors), "a tensor subclass is left: Python guards"
    subs = [m for m in sub.modules() if isinstance(m, torch.nn.Linear)]
    for m, s in zip(mods, subs):
        assert torch.equal(m.qdata, s.weight.qdata) and torch.equal(m.scale_and_zero, s.weight.scale_and_zero)
        assert (m.in_features, m.out_features, m.group_size) == (s.in_features, s.out_features, 32)


def test_eager_prefill_equals_torchao_int4():
    plain, sub = _pair()
    ids = prompt(PROMPT)
    with torch.no_grad():
        a, b = plain(ids).logits, sub(ids).logits
    assert torch.equal(a, b), worst(a, b)  # 24 rows: ATen's int4 kernel on the same data in both


@needs_gemv
@pytest.mark.parametrize("lower", ["inductor", "eager"])
def test_compiled_decode_groups_int4_calls_and_equals_torchao_int4(lower):
    plain, sub = _pair()
    ids = prompt(PROMPT)
    opts = {**OPTS, "lower": lower}
    torch._dynamo.reset()
    _, want, _ = hf_decode(sub, torch.compile(sub, backend="tinyserve", options=opts), ids, 3)
    assert tc.counters["linear_int4_rewritten"] == LINEARS, dict(tc.counters)
    tc.reset()
    _, ref, _ = hf_decode(plain, plain, ids, 3)
    _, got, _ = hf_decode(plain, torch.compile(plain, backend="tinyserve", options=opts), ids, 3)
    c = tc.counters
    assert c["linear_int4_calls"] == LINEARS and c["linear_grouped"] == GROUPED, dict(c)
    assert c["rewritten"] >= 1, dict(c)  # the attention rewrite is unaffected
    assert f"{LINEARS} Int4Linear calls, {GROUPED} of them in 4 shared-input calls" in str(tc.explain())
    # the same GEMV on the same codes as torchao's weights through the backend
    assert torch.equal(got, want), worst(got, want)
    assert torch.allclose(got.float(), ref.float(), atol=5e-2, rtol=5e-2), worst(got, ref)


@needs_gemv
@pytest.mark.parametrize("case", ["batch 9", "decode_linear=False"])
def test_int4_calls_not_grouped(case):
    plain, _ = _pair()
    batch = 9 if case == "batch 9" else 1
    opts = {**OPTS, "decode_linear": case != "decode_linear=False"}
    ids = prompt(PROMPT, batch=batch)
    torch._dynamo.reset()
    _, ref, _ = hf_decode(plain, plain, ids, 1)
    _, got, _ = hf_decode(plain, torch.compile(plain, backend="tinyserve", options=opts), ids, 1)
    c = tc.counters
    assert c["linear_int4_calls"] == LINEARS and c["linear_grouped"] == 0, dict(c)
    if case == "decode_linear=False":
        assert "decode_linear=False" in str(tc.explain())
    assert torch.allclose(got.float(), ref.float(), atol=5e-2, rtol=5e-2), worst(got, ref)


def test_fp32_model_runs_in_bf16_and_returns_fp32():
    base = _bf16_model(torch.float32)
    plain = copy.deepcopy(base)
    quantize_(plain, Int4PlainWeightOnlyConfig())
    ref = copy.deepcopy(base).to(torch.bfloat16)
    quantize_(ref, Int4PlainWeightOnlyConfig())
    ids = prompt(PROMPT)
    with torch.no_grad():
        got, want = plain(ids).logits, ref(ids).logits
    assert got.dtype == torch.float32
    assert torch.allclose(got, want.float(), atol=5e-2, rtol=5e-2), worst(got, want)


def test_bad_group_size_is_named():
    with pytest.raises(ValueError, match="group_size"):
        Int4PlainWeightOnlyConfig(group_size=48)


def test_linear_whose_inputs_do_not_fill_groups_stays():
    model = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.Linear(64, 64)).to(torch.bfloat16)
    quantize_(model, Int4PlainWeightOnlyConfig(group_size=32))
    assert type(model[0]) is torch.nn.Linear and isinstance(model[1], Int4Linear)


def test_torchao_older_than_0_18_is_refused_by_version(monkeypatch):
    import importlib
    import sys

    import torchao

    monkeypatch.setattr(torchao, "__version__", "0.13.0")  # torch 2.8's torchao: no Int4OpaqueTensor
    monkeypatch.delitem(sys.modules, "tinyserve_compile.quantization")
    with pytest.raises(ImportError, match=r"needs torchao >= 0\.18; installed: 0\.13\.0"):
        importlib.import_module("tinyserve_compile.quantization")
