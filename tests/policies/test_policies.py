"""Policy unit tests: small shapes, compared with dense attention / the pure-PyTorch reference."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from tinyserve_compile.kernels.reference import (
    Selection, dropped_mass_bound, page_bounds, selected_token_mask, sparse_decode_reference,
)
from tinyserve_compile.policies import POLICIES, DecodeContext, get_policy
from tinyserve_compile.kernels.spec import SelectionSpec
from tinyserve_compile.policies.h2o import KEY as H2O_KEY

NEW = ("streaming", "h2o", "oracle")


def make_ctx(B=1, Hq=4, Hkv=2, L=96, D=16, S=8, budget=32, vl=None, seed=0, sink_pages=0, cf=1, state=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, 1, D, generator=g)
    k = torch.randn(B, Hkv, L, D, generator=g)
    v = torch.randn(B, Hkv, L, D, generator=g)
    vl = torch.full((B,), L if vl is None else vl, dtype=torch.int64)
    spec = SelectionSpec(S, budget, sink_pages, cf, 0, False, torch.float32)
    return DecodeContext(q, k, v, page_bounds(k, S), vl, None, 1.0 / math.sqrt(D), spec, {} if state is None else state)


def dense(ctx):
    B, Hq, _, D = ctx.q.shape
    Hkv, L = ctx.k_cache.shape[1], ctx.k_cache.shape[2]
    keep = (torch.arange(L)[None, :] < ctx.valid_len[:, None])[:, None, None, :]
    k = ctx.k_cache.repeat_interleave(Hq // Hkv, 1)
    v = ctx.v_cache.repeat_interleave(Hq // Hkv, 1)
    return F.scaled_dot_product_attention(ctx.q, k, v, attn_mask=keep, scale=ctx.scale)


def masked_attention(ctx, sel):
    """Dense SDPA restricted to the selected tokens (the reference semantics of a selection)."""
    B, Hq, _, D = ctx.q.shape
    Hkv, L = ctx.k_cache.shape[1], ctx.k_cache.shape[2]
    keep = selected_token_mask(sel, ctx.page_size, L, ctx.valid_len)
    keep = keep & (torch.arange(L)[None, None, :] < ctx.valid_len[:, None, None])
    keep = keep.repeat_interleave(Hq // Hkv, 1)[:, :, None, :]
    k = ctx.k_cache.repeat_interleave(Hq // Hkv, 1)
    v = ctx.v_cache.repeat_interleave(Hq // Hkv, 1)
    return F.scaled_dot_product_attention(ctx.q, k, v, attn_mask=keep, scale=ctx.scale)


def kept_pages(sel):
    return [[set(sel.idx[b, h][sel.ok[b, h]].tolist()) for h in range(sel.idx.shape[1])] for b in range(sel.idx.shape[0])]


def test_registered():
    for name in NEW + ("query_aware", "full"):
        assert name in POLICIES
        assert get_policy(name).name == name


@pytest.mark.parametrize("name", NEW)
@given(vl=st.integers(40, 96), budget_pages=st.integers(2, 4), seed=st.integers(0, 10_000), sinks=st.integers(0, 1))
@settings(max_examples=15, deadline=None)
def test_newest_page_kept_and_budget_respected(name, vl, budget_pages, seed, sinks):
    S = 8
    ctx = make_ctx(B=2, vl=vl, budget=budget_pages * S, S=S, seed=seed, sink_pages=sinks)
    ctx.valid_len = torch.tensor([vl, max(vl - 13, 1)])
    sel = get_policy(name).select(ctx)
    assert sel is not None  # vl >= 40 > 4 pages of 8
    K = budget_pages
    for b, heads in enumerate(kept_pages(sel)):
        newest = (int(ctx.valid_len[b]) - 1) // S
        n_valid = (int(ctx.valid_len[b]) + S - 1) // S
        for pages in heads:
            assert newest in pages
            assert len(pages) <= K
            assert all(p < n_valid for p in pages)
            assert len(pages) == min(K, n_valid)
            if sinks:
                assert 0 in pages
    # the output is attention over exactly the selected tokens
    out = get_policy(name)(make_ctx(B=2, vl=vl, budget=budget_pages * S, S=S, seed=seed, sink_pages=sinks))
    ctx2 = make_ctx(B=2, vl=vl, budget=budget_pages * S, S=S, seed=seed, sink_pages=sinks)
    torch.testing.assert_close(out, masked_attention(ctx2, get_policy(name).select(ctx2)), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("vl", [1, 17, 64])
def test_dense_when_budget_covers_context(name, vl):
    ctx = make_ctx(L=64, S=8, budget=64, vl=vl, seed=vl)
    assert get_policy(name).select(ctx) is None
    torch.testing.assert_close(get_policy(name)(ctx), dense(ctx), atol=1e-5, rtol=1e-4)


def test_streaming_keeps_exactly_sinks_and_recent():
    S, K = 8, 5
    for sinks, vl in ((0, 96), (2, 90), (1, 41)):
        ctx = make_ctx(B=1, L=96, S=S, budget=K * S, vl=vl, sink_pages=sinks, seed=vl)
        sel = get_policy("streaming").select(ctx)
        n_sink = max(sinks, 1)
        last = (vl - 1) // S
        want = set(range(n_sink)) | set(range(last - (K - n_sink) + 1, last + 1))
        for pages in kept_pages(sel)[0]:
            assert pages == want


def test_streaming_ignores_query():
    a = get_policy("streaming").select(make_ctx(seed=1))
    b = get_policy("streaming").select(make_ctx(seed=2))
    assert torch.equal(a.idx, b.idx) and torch.equal(a.ok, b.ok)


def test_h2o_state_accumulates_observed_mass():
    S, budget = 8, 32
    state = {}
    pol = get_policy("h2o")
    ctx0 = make_ctx(L=96, S=S, budget=budget, vl=59, seed=3, state=state)
    pol(ctx0)
    # the first step seeds the state with the true page mass over every valid key
    seed = state[H2O_KEY].clone()
    G = ctx0.q.shape[1] // ctx0.k_cache.shape[1]
    logits0 = (ctx0.q.reshape(1, 2, G, -1) @ ctx0.k_cache.transpose(-1, -2)) * ctx0.scale
    p0 = torch.softmax(logits0.masked_fill(torch.arange(96) >= 59, float("-inf")), -1).sum(2)
    torch.testing.assert_close(seed, p0.reshape(1, 2, 12, S).sum(-1), atol=1e-5, rtol=1e-5)
    assert torch.all(seed[:, :, :8] > 0)  # pages outside the budget were seeded too
    state[H2O_KEY] = torch.zeros_like(seed)  # start the accumulation check from zero
    ctx = make_ctx(L=96, S=S, budget=budget, vl=60, seed=3, state=state)
    sel1 = pol.select(ctx)
    pol(ctx)
    m1 = state[H2O_KEY].clone()
    # each query head spreads mass 1 over the attended tokens: per KV head the group sums to G
    torch.testing.assert_close(m1.sum(-1), torch.full_like(m1.sum(-1), float(G)))
    # only observed (selected) pages received mass
    for h, pages in enumerate(kept_pages(sel1)[0]):
        for p in range(m1.shape[-1]):
            if p not in pages:
                assert m1[0, h, p] == 0
    # the per-page mass equals the softmax over the selected tokens, summed per page and group
    keep = selected_token_mask(sel1, S, 96, ctx.valid_len) & (torch.arange(96) < 60)
    logits = (ctx.q.reshape(1, 2, G, -1) @ ctx.k_cache.transpose(-1, -2)) * ctx.scale
    p = torch.softmax(logits.masked_fill(~keep[:, :, None, :], float("-inf")), -1).sum(2)
    torch.testing.assert_close(m1, p.reshape(1, 2, 12, S).sum(-1), atol=1e-5, rtol=1e-5)
    # a second step adds to it
    ctx2 = make_ctx(L=96, S=S, budget=budget, vl=61, seed=4, state=state)
    ctx2.k_cache = ctx.k_cache
    ctx2.v_cache = ctx.v_cache
    pol(ctx2)
    assert torch.all(state[H2O_KEY] >= m1 - 1e-7)
    torch.testing.assert_close(state[H2O_KEY].sum(-1), torch.full_like(m1.sum(-1), 2.0 * G))


def test_h2o_keeps_heavy_hitter_out_of_recent_window():
    S, budget, L = 8, 32, 96
    state = {}
    ctx = make_ctx(L=L, S=S, budget=budget, vl=L, state=state)
    state[H2O_KEY] = torch.zeros(1, 2, L // S)
    state[H2O_KEY][:, :, 3] = 5.0  # page 3 is far outside the 2-page recent window
    sel = get_policy("h2o").select(ctx)
    for pages in kept_pages(sel)[0]:
        assert 3 in pages and 11 in pages and 10 in pages


def test_oracle_picks_true_top_mass_pages():
    torch.manual_seed(0)
    S, L, D, K = 4, 64, 8, 4
    ctx = make_ctx(B=1, Hq=2, Hkv=1, L=L, D=D, S=S, budget=K * S)
    ctx.k_cache = 0.01 * torch.randn(1, 1, L, D)
    q = torch.zeros(1, 2, 1, D)
    q[0, 0, 0, 0] = 4.0
    q[0, 1, 0, 1] = 4.0
    ctx.q = q
    # page 2 matters to head 0, page 9 to head 1, page 5 weakly to both
    ctx.k_cache[0, 0, 2 * S + 1, 0] = 3.0
    ctx.k_cache[0, 0, 9 * S + 2, 1] = 2.5
    ctx.k_cache[0, 0, 5 * S + 3, :2] = 1.0
    ctx.bounds = page_bounds(ctx.k_cache, S)
    sel = get_policy("oracle").select(ctx)
    assert kept_pages(sel)[0][0] == {2, 5, 9, L // S - 1}


@given(seed=st.integers(0, 10_000), budget_pages=st.integers(2, 6), cf=st.integers(1, 3),
       sinks=st.integers(0, 1), vl=st.integers(30, 96))
@settings(max_examples=25, deadline=None)
def test_oracle_never_worse_than_query_aware_in_dropped_mass(seed, budget_pages, cf, sinks, vl):
    """With one query head per KV head, the oracle keeps the most mass any selection with the same forced pages can."""
    S = 8
    ctx = make_ctx(B=1, Hq=2, Hkv=2, L=96, S=S, budget=budget_pages * S, seed=seed, sink_pages=sinks, cf=cf, vl=vl)
    so = get_policy("oracle").select(ctx)
    sq = get_policy("query_aware").select(ctx)
    _, mo = dropped_mass_bound(ctx.q, ctx.k_cache, ctx.bounds, so, ctx.valid_len, None, ctx.scale, S)
    _, mq = dropped_mass_bound(ctx.q, ctx.k_cache, ctx.bounds, sq, ctx.valid_len, None, ctx.scale, S)
    if sq is None:  # at most max(K, N1) valid pages: query_aware attends densely and drops nothing
        assert torch.all(mq == 0)
    else:
        assert torch.all(mo <= mq + 1e-6)


@given(seed=st.integers(0, 10_000), budget_pages=st.integers(1, 6), cf=st.integers(1, 3), vl=st.integers(1, 96),
       name=st.sampled_from(["query_aware", "streaming", "h2o", "oracle"]))
@settings(max_examples=40, deadline=None)
def test_dropped_mass_bound_is_certified(seed, budget_pages, cf, vl, name):
    S = 8
    ctx = make_ctx(B=1, Hq=4, Hkv=2, L=96, S=S, budget=budget_pages * S, seed=seed, cf=cf, vl=vl)
    ctx.k_cache = ctx.k_cache * 3  # peaky attention
    ctx.bounds = page_bounds(ctx.k_cache, S)
    sel = get_policy(name).select(ctx)
    bound, measured = dropped_mass_bound(ctx.q, ctx.k_cache, ctx.bounds, sel, ctx.valid_len, None, ctx.scale, S)
    assert torch.all(bound >= measured - 1e-6)
    assert torch.all((bound >= 0) & (bound <= 1))
    # measured = 1 - mass kept by exact dense attention
    if sel is None:
        assert torch.all(measured == 0)
    else:
        keep = selected_token_mask(sel, S, 96, ctx.valid_len).repeat_interleave(2, 1)
        logits = (ctx.q @ ctx.k_cache.repeat_interleave(2, 1).transpose(-1, -2))[:, :, 0] * ctx.scale
        p = torch.softmax(logits.masked_fill(torch.arange(96) >= vl, float("-inf")), -1)
        torch.testing.assert_close(measured, 1 - (p * keep).sum(-1), atol=1e-5, rtol=1e-4)


def test_query_aware_policy_matches_reference():
    for seed in range(5):
        ctx = make_ctx(B=2, L=96, S=8, budget=24, seed=seed, sink_pages=seed % 2, cf=1 + seed % 3)
        ref = sparse_decode_reference(ctx.q, ctx.k_cache, ctx.v_cache, ctx.valid_len, None, ctx.scale, ctx.spec,
                                      ctx.bounds)
        torch.testing.assert_close(get_policy("query_aware")(ctx), ref, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(masked_attention(ctx, get_policy("query_aware").select(ctx)), ref,
                                   atol=1e-5, rtol=1e-4)
