"""Sites the backend must not rewrite stay dense, with their reasons counted; results stay exact."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tinyserve_compile as tc
from helpers import prompt, worst
from models import hf_model

B, HQ, HKV, L, D = 1, 4, 2, 64, 16
OPTS = {"dense_layers": 0, "token_budget": 16, "page_size": 8, "lower": "eager"}


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(B, HKV, L, D, generator=g)
    vc = torch.randn(B, HKV, L, D, generator=g)
    q = torch.randn(B, HQ, 1, D, generator=g)
    k, v = torch.randn(B, HKV, 1, D, generator=g), torch.randn(B, HKV, 1, D, generator=g)
    pos = torch.tensor([40])
    mask = (torch.arange(L) <= 40)[None, None, None]
    return q, kc, vc, k, v, pos, mask


def good(q, kc, vc, k, v, pos, mask):
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, kc.repeat_interleave(2, 1), vc.repeat_interleave(2, 1), attn_mask=mask)


def causal(q, kc, vc, k, v, pos, mask):
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, kc, vc, is_causal=True, enable_gqa=True)


def not_a_cache(q, kc, vc, k, v, pos, mask):
    kk = torch.cat([kc[:, :, :40], k], dim=2)  # a fresh tensor each call
    vv = torch.cat([vc[:, :, :40], v], dim=2)
    return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)


def unknown_write(q, kc, vc, k, v, pos, mask):
    kc.index_copy_(2, pos, k)
    kc.mul_(1.0)
    vc.index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)


def write_after_read(q, kc, vc, k, v, pos, mask):
    out = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)
    kc.index_copy_(2, pos, k)
    return out


def tiled_heads(q, kc, vc, k, v, pos, mask):  # heads tiled (h % Hkv), not repeat_kv (h // G)
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, kc.repeat(1, 2, 1, 1), vc.repeat(1, 2, 1, 1), attn_mask=mask)


def short_mask(q, kc, vc, k, v, pos, mask):
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    kk, vv = kc[:, :, :48], vc[:, :, :48]
    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask[..., :48], enable_gqa=True)


def test_positive_control_is_rewritten():
    args = _inputs()
    from tinyserve_compile.testing import reference_sparse_attention

    with reference_sparse_attention(HQ, HKV, OPTS):
        ref = good(*_inputs())
    got = torch.compile(good, backend="tinyserve", options=OPTS)(*args)
    assert tc.counters["rewritten"] == 1, tc.explain()
    assert torch.allclose(got, ref, atol=1e-5), worst(got, ref)


@pytest.mark.parametrize("fn, reason", [
    (causal, "is_causal=True"),
    (not_a_cache, "K/V are not views of a graph input"),
    (unknown_write, "unrecognised in-place write to the key cache"),
    (write_after_read, "key cache must be written exactly once, before the attention"),
    (tiled_heads, "K/V view chain is not repeat_kv"),
    (short_mask, "K/V view chain gives shape"),
])
def test_left_dense_with_reason(fn, reason):
    eager = fn(*_inputs())
    got = torch.compile(fn, backend="tinyserve", options=OPTS)(*_inputs())
    rep = tc.explain()
    assert tc.counters["rewritten"] == 0, rep
    assert tc.counters["dense"] == 1, rep
    assert any(r.startswith(reason) for r in rep.dense_reasons), rep.dense_reasons
    assert torch.allclose(got, eager, atol=1e-6), worst(got, eager)


def test_strict_raises_on_a_dense_decode_site():
    with pytest.raises(Exception, match="strict"):
        torch.compile(causal, backend="tinyserve", options=dict(OPTS, strict=True))(*_inputs())


def test_dynamic_cache_stays_dense_and_exact():
    model = hf_model("llama")
    ids = prompt(50, seed=7)
    compiled = torch.compile(model, backend="tinyserve", options={"token_budget": 16, "lower": "eager"})
    with torch.no_grad():
        out = model(ids, use_cache=True)  # DynamicCache
        past = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        import copy

        ref = model(nxt, past_key_values=copy.deepcopy(past), use_cache=True).logits
        got = compiled(nxt, past_key_values=past, use_cache=True).logits
    assert torch.allclose(got, ref, atol=1e-5), worst(got, ref)
    assert tc.counters["rewritten"] == 0, tc.explain()
    assert tc.counters["dense"] == tc.counters["decode_sites"] == 4
    reasons = tc.explain().dense_reasons
    assert any(r.startswith("K/V are not views of a graph input") for r in reasons), reasons
