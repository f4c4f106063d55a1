"""int8 page bounds, extra candidates and token-level keep in the reference (every implementation runs them in
the conformance suite, tests/conformance)."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyserve_compile.cost import sparse_site_bytes
from tinyserve_compile.kernels import reference as ref
from tinyserve_compile.kernels.spec import SelectionSpec


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), S=st.sampled_from([1, 3, 8]), L=st.integers(1, 60),
       exp=st.integers(-130, 60), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_int8_bounds_contain_the_keys_and_round_trip_exactly(seed, S, L, exp, dtype):
    """Decoded int8 bounds bracket every key of the page; codes stay in [-127, 127]; the step is the documented one."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.float16:
        exp = max(-24, min(exp, 14))
    lim = torch.finfo(dtype).max
    k = (torch.randn(2, 3, L, 16, generator=g, dtype=torch.float64) * 2.0 ** exp).clamp(-lim, lim).to(dtype)
    b = ref.page_bounds(k, S, dtype=torch.int8)
    exact = ref.page_bounds(k, S)
    assert b.kmax.dtype == torch.int8 and b.kabs.dtype == torch.float32
    assert int(b.kmax.abs().max()) <= 127 and int(b.kmin.abs().max()) <= 127
    hi, lo = ref.bounds_f32(b)
    assert bool((hi >= exact.kmax).all()) and bool((lo <= exact.kmin).all()), (hi - exact.kmax).min()
    # kabs is the exact max |k| of the page; the grid step is max(kabs / 126, 2^-126)
    torch.testing.assert_close(b.kabs, torch.maximum(exact.kmax.abs(), exact.kmin.abs()).amax(-1), rtol=0, atol=0)
    step = ref.int8_bounds_step(b.kabs)
    assert torch.equal(step, torch.clamp_min(b.kabs / 126.0, 2.0**-126))
    # tight: one code inward would cut the box (or the code is at the grid's edge)
    inner_hi = (b.kmax.float() - 1) * step[..., None]
    assert bool(((inner_hi < exact.kmax) | (b.kmax == -127)).all())


def test_int8_scores_are_close_to_fp32_scores():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 512, 64, generator=g) * torch.rand(64, generator=g) * 4
    q = torch.randn(1, 6, 1, 64, generator=g)
    s32 = ref.page_scores(q, ref.page_bounds(k, 8), 0.125)
    s8 = ref.page_scores(q, ref.page_bounds(k, 8, dtype=torch.int8), 0.125)
    assert bool((s8 >= s32).all())
    # looser by at most |q|_1 * step per page: a few percent of the score spread
    assert float((s8 - s32).max()) < 0.1 * float(s32.max() - s32.min()), float((s8 - s32).max())


def test_candidate_pages_rule():
    assert ref.candidate_pages(8, 2048, 1, 0) == 256  # one stage
    assert ref.candidate_pages(8, 2048, 2, 0) == 512
    assert ref.candidate_pages(8, 2048, 1, 1024) == 384
    assert ref.candidate_pages(8, 512, 1, 1024) == 192
    assert ref.candidate_pages(8, 2048, 1, 7) == 256  # rounded down to pages


def _case(seed, B=2, Hq=6, Hkv=2, L=300, D=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, 1, D, generator=g).to(dtype)
    k = (torch.randn(B, Hkv, L, D, generator=g) * (1 + 3 * torch.rand(D, generator=g))).to(dtype)
    v = torch.randn(B, Hkv, L, D, generator=g).to(dtype)
    return q, k, v


def test_token_keep_keeps_the_top_share_tokens_and_the_forced_ones():
    """Ranking candidates that are every valid page, the kept tokens are the forced ones plus the best others by
    share; ``choose`` attends such a row densely (32 valid pages, 37 candidates)."""
    q, k, v = _case(1, B=1)
    S, budget, sinks, n = 8, 64, 1, 250
    b = ref.page_bounds(k, S)
    spec = SelectionSpec(S, budget, sinks, 1, 232, True, torch.float32)
    assert spec.n_candidates == 37
    assert ref.choose(q, k, b, torch.tensor([n]), None, 0.25, spec) == (None, S)
    G, P = q.shape[1] // k.shape[1], -(-n // S)
    idx = torch.arange(P).expand(1, 2, P)
    cand = ref.Selection(idx, torch.ones(1, 2, P, dtype=torch.bool))
    lg = (q.float().reshape(1, 2, G, 16) @ k[:, :, :P * S].float().transpose(-1, -2)) * 0.25  # [1,2,G,P*S]
    lg = lg.masked_fill(torch.arange(P * S) >= n, float("-inf"))
    sel, _ = ref.rank_candidate_tokens(lg, cand, torch.tensor([n]), S, budget, sinks)
    assert sel.idx.shape[-1] == budget
    share = (lg[..., :n] - lg[..., :n].logsumexp(-1, keepdim=True)).amax(2)  # [1,2,n]
    forced = (torch.arange(n) // S == (n - 1) // S) | (torch.arange(n) < sinks * S)
    share = share.masked_fill(forced, float("inf"))
    want = share.topk(budget, -1).indices.sort(-1).values
    assert torch.equal(sel.idx.sort(-1).values, want)
    assert bool(sel.ok.all())


def test_more_candidates_never_lose_mass_on_average():
    """Token keep over more candidates attends at least the softmax mass of page keep, on average."""
    q, k, v = _case(4, B=4, L=512)
    S, budget, vl = 8, 64, torch.full((4,), 500)
    b = ref.page_bounds(k, S, dtype=torch.int8)
    G = 3
    lg = (q.float().reshape(4, 2, G, 16) @ k[:, :, :500].float().transpose(-1, -2)) * 0.25
    p = lg.softmax(-1)  # [B,Hkv,G,n]

    def mass(sel, unit):
        m = ref.selected_token_mask(sel, unit, k.shape[2], vl)[..., :500]  # [B,Hkv,n]
        return float((p * m[:, :, None, :]).sum(-1).mean())

    spec = SelectionSpec(S, budget, 1, 2, 0, False, torch.int8)
    pages = mass(*ref.choose(q, k, b, vl, None, 0.25, spec))
    tokens = mass(*ref.choose(q, k, b, vl, None, 0.25, spec.replace(keep_tokens=True)))
    assert tokens >= pages, (tokens, pages)


def test_cost_counts_extra_candidates_and_int8_bounds():
    h, d, it = 3, 64, 4
    pages8k = 8192 // 8
    bounds8 = h * pages8k * (2 * d * 1 + 4)
    got = sparse_site_bytes(8192, h, d, it, 8, 2048, 1, 1, 1024)
    assert got == bounds8 + h * 3072 * d * it + h * 2048 * d * it
    # the byte targets of the selection study at 8K and 32K, budget 2048, fp32 cache
    dense = lambda ctx: 2 * ctx * h * d * it  # noqa: E731
    assert got / dense(8192) <= 0.35
    assert sparse_site_bytes(32768, h, d, it, 8, 2048, 1, 1, 1024) / dense(32768) <= 0.12
    # candidates covering every page: dense (SelectionSpec.dense_cache), every key and value
    assert sparse_site_bytes(4096, h, d, it, 8, 2048, 1, 1, 4096) == 2 * h * 4096 * d * it
    assert sparse_site_bytes(3072, h, d, it, 8, 2048, 1, 1, 1024) == 2 * h * 3072 * d * it  # the defaults' N1
    assert sparse_site_bytes(3080, h, d, it, 8, 2048, 1, 1, 1024) < 2 * h * 3080 * d * it
