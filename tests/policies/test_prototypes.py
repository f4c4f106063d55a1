"""The selection prototypes of bench/prototypes.py (hierarchical bounds, key sketch for the second stage), against the
reference: superpage bounds are still upper bounds; with every superpage kept the hierarchical selection is the
one-stage bound's; with a fine sketch the second stage is the exact two-stage selection; byte counts agree with
tinyserve_compile.cost where the algorithms coincide."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench.prototypes import (HIER, SKETCH, HierarchicalPolicy, SketchPolicy, proto_site_bytes,  # noqa: E402
                              sketch_keys, superpage_bounds)
from tinyserve_compile.cost import sparse_site_bytes  # noqa: E402
from tinyserve_compile.kernels.spec import SelectionSpec  # noqa: E402
from tinyserve_compile.kernels.reference import choose_pages, page_bounds  # noqa: E402
from tinyserve_compile.policies import DecodeContext, get_policy  # noqa: E402


def _case(seed, L=200, D=16, Hq=4, Hkv=2, dtype=torch.bfloat16, S=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, Hq, 1, D, generator=g)
    k = torch.randn(1, Hkv, L, D, generator=g) * (1 + 3 * torch.rand(1, Hkv, L, 1, generator=g))
    v = torch.randn(1, Hkv, L, D, generator=g)
    return q, k, v, page_bounds(k, S, dtype=dtype)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), R=st.sampled_from([2, 3, 4, 8]), L=st.integers(9, 190))
def test_superpage_scores_bound_every_logit_inside(seed, R, L):
    S, D = 8, 16
    q, k, _, b = _case(seed, L=L, D=D, S=S)
    sb = superpage_bounds(b, R)
    from tinyserve_compile.kernels.reference import page_scores

    scores = page_scores(q, sb, 0.25, None, group_reduce=False)  # [1,Hq,Psup]
    logits = (q.float().reshape(1, 2, 2, D) @ k.float().transpose(-1, -2)).reshape(1, 4, L) * 0.25
    for j in range(sb.kmax.shape[2]):
        lo, hi = j * R * S, min(L, (j + 1) * R * S)
        worst = (logits[:, :, lo:hi].amax(-1) - scores[:, :, j]).max()
        assert worst <= 0, f"superpage {j}: logit above its bound by {float(worst):.3e}"


@pytest.mark.parametrize("sink", [0, 1])
def test_hierarchical_keeping_every_superpage_is_the_one_stage_bound(sink):
    q, k, v, b = _case(3, L=400)
    vl = torch.tensor([397])
    ctx = DecodeContext(q, k, v, b, vl, None, 0.25, _spec(8, 64, sink, 1), {})
    pol = get_policy("hier8x4")  # 4 * 8 pages / 8 = 4 superpages of 7 kept: a real first stage
    want = choose_pages(q, k, b, vl, None, 0.25, _spec(8, 64, sink, 1))
    got_all = type("H", (HierarchicalPolicy,), dict(pages_per_super=8, factor=1000))().select(ctx)
    assert torch.equal(got_all.idx, want.idx) and torch.equal(got_all.ok, want.ok)
    got = pol.select(ctx)
    assert got.idx.shape == want.idx.shape and bool(got.ok.all())
    newest = (397 - 1) // 8
    assert bool((got.idx == newest).any(-1).all())  # the forced pages survive the superpage stage
    if sink:
        assert bool((got.idx == 0).any(-1).all())
    supers = torch.unique(got.idx // 8)
    assert supers.numel() <= 2 * 4, supers  # at most 4 kept superpages per KV head (+ forced), 2 heads


@pytest.mark.parametrize("c", [2, 4])
def test_fine_sketch_is_the_exact_two_stage_selection(c):
    q, k, v, b = _case(5, L=300, dtype=torch.float32)
    vl = torch.tensor([300])
    ctx = DecodeContext(q, k, v, b, vl, None, 0.25, _spec(8, 64, 1, c), {})
    fine = type("F", (SketchPolicy,), dict(bits=20))().select(ctx)
    want = choose_pages(q, k, b, vl, None, 0.25, _spec(8, 64, 1, c))
    assert torch.equal(fine.idx, want.idx) and torch.equal(fine.ok, want.ok)
    coarse = get_policy("sketch4").select(ctx)
    assert coarse.idx.shape == want.idx.shape


@pytest.mark.parametrize("bits", [4, 8])
def test_sketch_error_is_half_a_grid_step(bits):
    q, k, v, b = _case(7, L=100, dtype=torch.bfloat16)
    ks = sketch_keys(k, b, 8, bits)
    step = (b.kmax.float() - b.kmin.float()).repeat_interleave(8, dim=2)[:, :, :100] / (2 ** bits - 1)
    err = (ks - k.float()).abs()
    assert bool((err <= step / 2 + 1e-6).all()), float((err - step / 2).max())


def test_prototype_bytes_match_the_cost_model_where_the_algorithms_coincide():
    h, d, it = 3, 64, 4
    for ctx in (4096, 8192):  # 4 * 2048 / 8 pages cover every superpage: hier is the one-stage bound
        for bi in (2, 4):
            assert proto_site_bytes("hier8x4", ctx, h, d, it, 8, 2048, 1, bi) == \
                sparse_site_bytes(ctx, h, d, it, 8, 2048, 1, bi)
    # a first stage that keeps a quarter of the superpages reads less than the one-stage bound
    assert proto_site_bytes("hier8x4", 32768, h, d, it, 8, 2048, 1, 2) < sparse_site_bytes(32768, h, d, it, 8, 2048, 1, 2)
    # a sketch of b bits reads b/32 of the candidates' fp32 keys on top of the bounds and the kept K/V
    s4 = proto_site_bytes("sketch4", 32768, h, d, it, 16, 2048, 4, 2)
    assert s4 == sparse_site_bytes(32768, h, d, it, 16, 2048, 1, 2) + h * 4 * 2048 * d // 2
    assert proto_site_bytes("sketch8", 1024, h, d, it, 16, 2048, 4, 2) == 2 * h * 1024 * d * it  # dense fit
    assert set(HIER) >= {"hier8x4"} and set(SKETCH) == {"sketch4", "sketch8"}


def test_hierarchical_sketch_reduces_to_its_parts():
    q, k, v, b = _case(11, L=400, dtype=torch.float32)
    vl = torch.tensor([400])
    ctx = DecodeContext(q, k, v, b, vl, None, 0.25, _spec(8, 64, 1, 2), {})
    # every superpage kept and a fine sketch: the exact two-stage selection
    fine = type("HF", (SketchPolicy,), dict(bits=20, pages_per_super=8, factor=1000))().select(ctx)
    want = choose_pages(q, k, b, vl, None, 0.25, _spec(8, 64, 1, 2))
    assert torch.equal(fine.idx, want.idx) and torch.equal(fine.ok, want.ok)
    # with a real superpage stage, every kept page lies in a kept superpage (at most 4 per head + forced)
    got = get_policy("hier8x4sketch4").select(ctx)
    for h in range(got.idx.shape[1]):
        assert torch.unique(got.idx[0, h] // 8).numel() <= 4 + 1
    h, d, it = 3, 64, 4
    assert proto_site_bytes("hier8x4sketch4", 8192, h, d, it, 8, 2048, 2, 2) == \
        proto_site_bytes("sketch4", 8192, h, d, it, 8, 2048, 2, 2)  # 8K: the superpage stage is skipped
    assert proto_site_bytes("hier8x4sketch4", 32768, h, d, it, 8, 2048, 2, 2) < \
        proto_site_bytes("sketch4", 32768, h, d, it, 8, 2048, 2, 2)


@pytest.mark.parametrize("name,bq,keep", [("tl1e512", "", False), ("tl1e512tok", "", True),
                                          ("tl1e512tokint8", "int8", True)])
def test_two_level_with_fine_bounds_is_the_backend_selection(name, bq, keep):
    """Bounds on pages of one page (``coarse=1``) make the two-level prototype the backend's own two-stage
    selection with 512 extra candidates (int8 bounds decoded as the backend decodes them), on 99 valid pages
    (more than the 72 candidates: not dense)."""
    from tinyserve_compile.kernels.reference import sparse_decode_reference

    q, k, v, b = _case(3, L=800)  # bf16 bounds: the prototype quantizes them itself (bq)
    vl = torch.tensor([790])
    ctx = DecodeContext(q, k, v, b, vl, None, 0.25, _spec(8, 64, 1, 1), {})
    got = get_policy(name)(ctx)
    if bq:  # the backend stores int8 codes of the exact bounds
        b = page_bounds(k, 8, dtype=torch.int8)
    want = sparse_decode_reference(q, k, v, vl, None, 0.25, _spec(8, 64, 1, 1, 512, keep), b)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    other = sparse_decode_reference(q, k, v, vl, None, 0.25, _spec(8, 64, 1, 1, 512, not keep), b)
    assert not torch.allclose(got, other, atol=1e-4), "pages and tokens should keep different sets here"


def test_two_level_bytes_are_the_cost_model_for_fine_bounds():
    for ctx in (8192, 32768):
        assert proto_site_bytes("tl1e1024", ctx, 3, 64, 4, 8, 2048, 1, 2) == \
            sparse_site_bytes(ctx, 3, 64, 4, 8, 2048, 1, 2, 1024)


def _spec(S, budget, sinks, cf, extra=0, keep_tokens=False):
    return SelectionSpec(S, budget, sinks, cf, extra, keep_tokens, torch.float32)
