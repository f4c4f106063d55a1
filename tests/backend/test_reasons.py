"""Every decode site left dense names its true cause: one tiny function per reason, the reason asserted, and the
compiled output equal to eager (the reasons of ``test_negative.py`` are not repeated here)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tinyserve_compile as tc
from tests.support.backend_helpers import worst

B, HQ, HKV, L, D = 1, 4, 2, 64, 16
OPTS = {"dense_layers": 0, "token_budget": 16, "page_size": 8, "lower": "eager"}


def _inputs(seed=0, rows=1, batch=1, dtype=torch.float32, dv=D, combined=False, vrows=None):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(rows, HKV, L, D, generator=g).to(dtype)
    vc = torch.randn(rows if vrows is None else vrows, HKV, L, dv, generator=g).to(dtype)
    q = torch.randn(batch, HQ, 1, D, generator=g)
    k, v = torch.randn(batch, HKV, 1, D, generator=g), torch.randn(batch, HKV, 1, dv, generator=g)
    pos = torch.tensor([40])
    mask = (torch.arange(L) <= 40)[None, None, None]
    if combined:  # one [2, B, Hkv, L, D] buffer for K and V
        return q, torch.stack([kc, vc]), None, k, v, pos, mask
    return q, kc, vc, k, v, pos, mask


def graph_break_between(q, kc, vc, k, v, pos, mask):
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    torch._dynamo.graph_break()
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)


def written_twice(q, kc, vc, k, v, pos, mask):
    kc.index_copy_(2, pos, k)
    kc.index_copy_(2, pos + 1, k)
    vc.index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)


def converted_cache(q, kc, vc, k, v, pos, mask):  # a bf16 cache read in fp32
    kc.index_copy_(2, pos, k.to(kc.dtype))
    vc.index_copy_(2, pos, v.to(vc.dtype))
    return F.scaled_dot_product_attention(q, kc.float(), vc.float(), attn_mask=mask, enable_gqa=True)


def same_buffer(q, kc, vc, k, v, pos, mask):
    kc.index_copy_(2, pos, k)
    return F.scaled_dot_product_attention(q, kc, kc, attn_mask=mask, enable_gqa=True)


def dropout(q, kc, vc, k, v, pos, mask):
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, dropout_p=0.5, enable_gqa=True)


def other_value_dim(q, kc, vc, k, v, pos, mask):  # V heads of 8 channels, K of 16
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)


def different_rows(q, kc, vc, k, v, pos, mask):  # K reads rows [:1] of a 2-row cache, V all of a 1-row cache
    kk = kc[:1, ...].index_copy_(-2, pos, k)
    vc.index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, kk, vc, attn_mask=mask, enable_gqa=True)


def three_d(q, kc, vc, k, v, pos, mask):  # unbatched [H, L, D] attention
    kc, vc = kc[0], vc[0]
    kc.index_copy_(1, pos, k[0])
    vc.index_copy_(1, pos, v[0])
    return F.scaled_dot_product_attention(q[0], kc.repeat_interleave(2, 0), vc.repeat_interleave(2, 0),
                                          attn_mask=mask[0])


def combined_buffer(q, kv, _, k, v, pos, mask):  # K and V in one [2, B, Hkv, L, D] buffer
    kv[0].index_copy_(2, pos, k)
    kv[1].index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, enable_gqa=True)


def one_head_of_two(q, kc, vc, k, v, pos, mask):  # reads cache head 0 only, broadcast over the query heads
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, kc[:, :1], vc[:, :1], attn_mask=mask)


def rows_and_positions(q, kc, vc, k, v, pos, mask):  # positions index the batch dim too
    kc[torch.tensor([0]), :, pos] = k[:, :, 0]
    vc[torch.tensor([0]), :, pos] = v[:, :, 0]
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)


def offset_view_write(q, kc, vc, k, v, pos, mask):  # written through kc[:, :, 8:], positions relative to it
    kc[:, :, 8:].index_copy_(2, pos - 8, k)
    vc[:, :, 8:].index_copy_(2, pos - 8, v)
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)


def some_rows_written(q, kc, vc, k, v, pos, mask):  # row 0 of 2 written, both rows attended
    kc[:1].index_copy_(2, pos, k[:1])
    vc[:1].index_copy_(2, pos, v[:1])
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)


def broadcast_source(q, kc, vc, k, v, pos, mask):  # one row of keys broadcast into both rows of the cache
    kc[:, :, pos] = k[:1]
    vc[:, :, pos] = v[:1]
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)


CASES = [
    (graph_break_between, {}, "key cache is not written in this graph"),
    (written_twice, {}, "key cache is written 2 times in this graph"),
    (converted_cache, {"dtype": torch.bfloat16},
     "K/V are not views of a graph input: the cache buffer is converted by float each step"),
    (same_buffer, {}, "K and V read the same buffer"),
    (other_value_dim, {"dv": 8}, "K and V caches differ in shape or dtype"),
    (different_rows, {"rows": 2, "vrows": 1}, "K and V read different parts of their caches"),
    (three_d, {}, "query shape unknown or not 4-D [B, H, Lq, D]"),
    (combined_buffer, {"combined": True}, "K/V cache buffer is 5-D (2, 1, 2, 64, 16), not a 4-D [B, Hkv, L, D]"),
    (one_head_of_two, {"rows": 2, "batch": 2}, "K/V view chain gives shape (2, 1, 64, 16), expected 4 heads"),
    (rows_and_positions, {},
     "unrecognised in-place write to the key cache: cache[<int64[1]>, :, <int64[1]>] = ...: the write indexes "
     "dim 0 of the cache with <int64[1]> (only the sequence dim 2 may hold positions)"),
    (offset_view_write, {}, "unrecognised in-place write to the key cache: index_copy_(2, "),
    (some_rows_written, {"rows": 2, "batch": 2},
     "unrecognised in-place write to the key cache: index_copy_(2, "),
    (broadcast_source, {"rows": 2, "batch": 2},
     "unrecognised in-place write to the key cache: cache[:, :, <int64[1]>] = ...: the written source (1, 2, 1, 16) "
     "is broadcast into the cache view (2, 2, 64, 16)"),
]
#: the second part of the two reasons above whose first part is the generic prefix
TAILS = {offset_view_write: "the write goes through a view that starts at sequence position 8",
         some_rows_written: "the write covers rows [:1] of the cache while the attention reads all rows"}


@pytest.mark.parametrize("fn, kw, reason", CASES, ids=[c[0].__name__ for c in CASES])
def test_dense_site_names_its_cause(fn, kw, reason):
    eager = fn(*_inputs(**kw))
    got = torch.compile(fn, backend="tinyserve", options=OPTS)(*_inputs(**kw))
    rep = tc.explain()
    assert tc.counters["rewritten"] == 0, rep
    assert tc.counters["dense"] == 1, rep
    (why,) = rep.dense_reasons
    assert why.startswith(reason), why
    assert TAILS.get(fn, "") in why, why
    assert torch.allclose(got.float(), eager.float(), atol=1e-6), worst(got, eager)


def test_dropout_site_names_its_cause():
    """With dropout the output is random; the same seed gives eager's draw, since the site stays SDPA."""
    torch.manual_seed(0)
    eager = dropout(*_inputs())
    compiled = torch.compile(dropout, backend="tinyserve", options=OPTS)
    compiled(*_inputs())  # compiles
    (why,) = tc.explain().dense_reasons
    assert why == "dropout_p != 0", why
    torch.manual_seed(0)
    got = compiled(*_inputs())
    assert torch.allclose(got, eager, atol=1e-6), worst(got, eager)


def test_dynamic_length_prompt_is_a_prefill_without_recompiles():
    """A prompt of dynamic length (``dynamic=True``) is a prefill: its length is not specialised on (one graph for
    both lengths), its cache write keeps the bounds, and the output equals eager."""
    def prefill(q, kc, vc, k, v, pos):
        kc.index_copy_(2, pos, k)
        vc.index_copy_(2, pos, v)
        return F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)

    g = torch.Generator().manual_seed(1)
    compiled = torch.compile(prefill, backend="tinyserve", options=OPTS, dynamic=True)
    for n in (3, 5):
        args = (torch.randn(1, HQ, n, D, generator=g), torch.randn(1, HKV, L, D, generator=g),
                torch.randn(1, HKV, L, D, generator=g), torch.randn(1, HKV, n, D, generator=g),
                torch.randn(1, HKV, n, D, generator=g), torch.arange(n))
        want = prefill(*(a.clone() for a in args))
        got = compiled(*(a.clone() for a in args))
        assert torch.allclose(got, want, atol=1e-6), worst(got, want)
    assert tc.counters["graphs"] == 1, tc.explain()
    assert tc.counters["prefill_sites"] == 1 and tc.counters["cache_writes_rewritten"] == 1, tc.counters
    (site,) = tc.explain().graphs[0]["sites"]
    assert site["status"] == "prefill" and "dynamic" in site["reason"], site
