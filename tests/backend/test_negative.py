"""Sites the backend must not rewrite stay dense, with their reasons counted; results stay exact."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tinyserve_compile as tc
from tests.support.backend_helpers import prompt, worst
from tests.support.backend_models import hf_model

B, HQ, HKV, L, D = 1, 4, 2, 64, 16
OPTS = {"dense_layers": 0, "token_budget": 16, "page_size": 8, "lower": "eager"}


def _inputs(seed=0, layout="bhld"):
    """Caches ``[B, Hkv, L, D]`` (``bhld``), ``[B, L, Hkv, D]`` (``blhd``) or ``[B, Hkv, D, L]`` (``bhdl``)."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(B, HKV, L, D, generator=g)
    vc = torch.randn(B, HKV, L, D, generator=g)
    if layout == "blhd":
        kc, vc = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
    elif layout == "bhdl":
        kc, vc = kc.transpose(2, 3).contiguous(), vc.transpose(2, 3).contiguous()
    q = torch.randn(B, HQ, 1, D, generator=g)
    k, v = torch.randn(B, HKV, 1, D, generator=g), torch.randn(B, HKV, 1, D, generator=g)
    if layout == "mqa":  # one KV head
        kc, vc, k, v = kc[:, :1].contiguous(), vc[:, :1].contiguous(), k[:, :1], v[:, :1]
    pos = torch.tensor([40])
    mask = (torch.arange(L) <= 40)[None, None, None]
    return q, kc, vc, k, v, pos, mask


def good(q, kc, vc, k, v, pos, mask):
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, kc.repeat_interleave(2, 1), vc.repeat_interleave(2, 1), attn_mask=mask)


def good_blhd(q, kc, vc, k, v, pos, mask):  # [B, L, H, D] written along dim 1, transposed for SDPA
    kc[:, pos] = k.transpose(1, 2)
    vc[:, pos] = v.transpose(1, 2)
    return F.scaled_dot_product_attention(q, kc.transpose(1, 2), vc.transpose(1, 2), attn_mask=mask, enable_gqa=True)


def good_mqa_broadcast(q, kc, vc, k, v, pos, mask):  # one KV head that SDPA broadcasts over the query heads
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask)


def causal(q, kc, vc, k, v, pos, mask):
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, kc, vc, is_causal=True, enable_gqa=True)


def not_a_cache(q, kc, vc, k, v, pos, mask):
    kk = torch.cat([kc[:, :, :40], k], dim=2)  # a fresh tensor each call
    vv = torch.cat([vc[:, :, :40], v], dim=2)
    return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)


def computed_from_cache(q, kc, vc, k, v, pos, mask):  # keys rebuilt from what is stored (a latent / quantised cache)
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, kc * 0.5, vc, attn_mask=mask, enable_gqa=True)


def unknown_write(q, kc, vc, k, v, pos, mask):
    kc.index_copy_(2, pos, k)
    kc.mul_(1.0)
    vc.index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)


def scatter_write(q, kc, vc, k, v, pos, mask):  # write idiom: scatter_ instead of an indexed copy
    kc.scatter_(2, pos.reshape(1, 1, 1, 1).expand(B, HKV, 1, D), k)
    vc.index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)


def write_along_heads(q, kc, vc, k, v, pos, mask):  # [B, L, H, D] cache written along its head dim
    kc.index_copy_(2, torch.tensor([0]), k.transpose(1, 2)[:, :, :1].expand(B, L, 1, D).contiguous())
    vc[:, pos] = v.transpose(1, 2)
    return F.scaled_dot_product_attention(q, kc.transpose(1, 2), vc.transpose(1, 2), attn_mask=mask, enable_gqa=True)


def write_after_read(q, kc, vc, k, v, pos, mask):
    out = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)
    kc.index_copy_(2, pos, k)
    return out


def tiled_heads(q, kc, vc, k, v, pos, mask):  # heads tiled (h % Hkv), not repeat_kv (h // G)
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, kc.repeat(1, 2, 1, 1), vc.repeat(1, 2, 1, 1), attn_mask=mask)


def tiled_heads_blhd(q, kc, vc, k, v, pos, mask):  # the same on a [B, L, H, D] cache
    kc[:, pos] = k.transpose(1, 2)
    vc[:, pos] = v.transpose(1, 2)
    kk, vv = kc.repeat(1, 1, 2, 1).transpose(1, 2), vc.repeat(1, 1, 2, 1).transpose(1, 2)
    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)


def head_dim_strided(q, kc, vc, k, v, pos, mask):  # [B, H, D, L]: keys stored transposed
    kc[:, :, :, pos] = k.transpose(2, 3)
    vc[:, :, :, pos] = v.transpose(2, 3)
    return F.scaled_dot_product_attention(q, kc.transpose(2, 3), vc.transpose(2, 3), attn_mask=mask, enable_gqa=True)


def masked_prefix(q, kc, vc, k, v, pos, mask):  # a [:48] prefix read with a mask over it (rewritten)
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    kk, vv = kc[:, :, :48], vc[:, :, :48]
    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask[..., :48], enable_gqa=True)


def broadcast_mask_prefix(q, kc, vc, k, v, pos, mask):  # a [:48] prefix read with a mask broadcast over its keys
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    kk, vv = kc[:, :, :48], vc[:, :, :48]
    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask[..., :1], enable_gqa=True)


def rolled_window(q, kc, vc, k, v, pos, mask):  # a full sliding window: roll left, write the last slot
    kc.copy_(kc.roll(-1, dims=2))
    kc[:, :, -1:] = k
    vc.copy_(vc.roll(-1, dims=2))
    vc[:, :, -1:] = v
    return F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)


def window_read(q, kc, vc, k, v, pos, mask):  # attends the last 48 positions of the cache only
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, kc[:, :, 16:], vc[:, :, 16:], enable_gqa=True)


@pytest.mark.parametrize("fn, layout", [(good, "bhld"), (good_blhd, "blhd"), (good_mqa_broadcast, "mqa"),
                                        (masked_prefix, "bhld")])
def test_positive_control_is_rewritten(fn, layout):
    from tinyserve_compile.testing import reference_sparse_attention

    with reference_sparse_attention(HQ, 1 if layout == "mqa" else HKV, OPTS):
        ref = fn(*_inputs(layout=layout))
    got = torch.compile(fn, backend="tinyserve", options=OPTS)(*_inputs(layout=layout))
    assert tc.counters["rewritten"] == 1, tc.explain()
    assert torch.allclose(got, ref, atol=1e-5), worst(got, ref)


@pytest.mark.parametrize("fn, layout, reason", [
    (causal, "bhld", "is_causal=True"),
    (not_a_cache, "bhld", "K/V are not views of a graph input: built by torch.cat"),
    (computed_from_cache, "bhld", "K/V are not views of a graph input: computed each step by mul from a cache buffer"),
    (unknown_write, "bhld", "unrecognised in-place write to the key cache: mul_(1.0)"),
    (scatter_write, "bhld", "unrecognised in-place write to the key cache: scatter_("),
    (write_along_heads, "blhd", "unrecognised in-place write to the key cache: index_copy_(2, "),
    (write_after_read, "bhld", "key cache is written after the attention in this graph"),
    (tiled_heads, "bhld", "grouped heads: K/V heads are tiled"),
    (tiled_heads_blhd, "blhd", "grouped heads: K/V heads are tiled (query head h reads cache head h % 2)"),
    (head_dim_strided, "bhdl", "cache layout [B, Hkv, D, L] stores head_dim with stride 64"),
    (broadcast_mask_prefix, "bhld", "attention mask shape (1, 1, 1, 1) broadcasts one value over all keys"),
    (rolled_window, "bhld", "sliding-window cache: the buffer is rolled"),
    (window_read, "bhld", "K/V read cache positions [16, 64) of 64: a window that does not start at 0"),
])
def test_left_dense_with_reason(fn, layout, reason):
    eager = fn(*_inputs(layout=layout))
    got = torch.compile(fn, backend="tinyserve", options=OPTS)(*_inputs(layout=layout))
    rep = tc.explain()
    assert tc.counters["rewritten"] == 0, rep
    assert tc.counters["dense"] == 1, rep
    assert any(r.startswith(reason) for r in rep.dense_reasons), rep.dense_reasons
    assert torch.allclose(got, eager, atol=1e-6), worst(got, eager)


def test_layout_reasons_name_the_sequence_dim():
    """The write-idiom reason of a [B, L, H, D] cache names its layout and sequence dim (not dim 2), and no
    reason takes the sequence length for heads (the old "cache heads (64)")."""
    torch.compile(write_along_heads, backend="tinyserve", options=OPTS)(*_inputs(layout="blhd"))
    (reason,) = tc.explain().dense_reasons
    assert "along dim 2 of the written view, not its sequence dim 1 (cache layout [B, L, Hkv, D])" in reason, reason
    tc.reset()
    torch._dynamo.reset()
    torch.compile(tiled_heads_blhd, backend="tinyserve", options=OPTS)(*_inputs(layout="blhd"))
    (reason,) = tc.explain().dense_reasons
    assert f"({L})" not in reason and "not a multiple" not in reason, reason


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
    assert any(r.startswith("K/V are not views of a graph input: built by torch.cat") for r in reasons), reasons
