"""The ONNX lowerings of the export-only ops against their PyTorch implementations (the reference)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from export_helpers import export_module, ort_run, worst
from tinyserve_compile import onnx_ops  # noqa: F401  (registers the ops)
from tinyserve_compile.kernels.reference import PageBounds, page_bounds, sparse_decode_reference, store_bounds

ns = torch.ops.tinyserve_export


class Step(torch.nn.Module):
    """Write the new K/V, update the bounds, attend: the three ops in the order of the exported step."""

    def __init__(self, page_size, token_budget, sink_pages, candidate_factor, scale=0.3, extra=0, keep_tokens=False):
        super().__init__()
        self.a = (page_size, token_budget, sink_pages, candidate_factor)
        self.scale, self.extra, self.keep_tokens = scale, extra, keep_tokens

    def forward(self, q, k, v, kmax, kmin, kabs, pos, k_new, v_new):
        S, budget, sinks, cf = self.a
        k2, v2 = ns.cache_write(k, pos, k_new), ns.cache_write(v, pos, v_new)
        b = ns.bounds_write(k2, kmax, kmin, kabs, pos, S)
        if self.extra or self.keep_tokens:
            out = ns.sparse_attention(q, k2, v2, *b, pos, self.scale, S, budget, sinks, cf, self.extra, self.keep_tokens)
        else:  # the old call, trailing arguments left to their defaults
            out = ns.sparse_attention(q, k2, v2, *b, pos, self.scale, S, budget, sinks, cf)
        return (out, k2, v2, *b)


def make_inputs(B, Hq, Hkv, L, D, S, positions, bounds_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, Hkv, L, D, generator=g)
    v = torch.randn(B, Hkv, L, D, generator=g)
    for b, p in enumerate(positions):  # slots past the row's tokens are empty, as in a static cache
        k[b, :, p:] = 0
        v[b, :, p:] = 0
    bd = page_bounds(k, S, dtype=bounds_dtype)
    q = torch.randn(B, Hq, 1, D, generator=g) * 2
    return (q, k, v, bd.kmax, bd.kmin, bd.kabs, torch.tensor(positions), torch.randn(B, Hkv, 1, D, generator=g),
            torch.randn(B, Hkv, 1, D, generator=g))


def check_step(tmp_path, B=2, Hq=4, Hkv=2, L=128, D=16, S=8, budget=32, sinks=1, cf=2, positions=(100, 61),
               bounds_dtype=torch.float32, seed=0, extra=0, keep_tokens=False, int8_write="tensorrt"):
    args = make_inputs(B, Hq, Hkv, L, D, S, positions, bounds_dtype, seed)
    module = Step(S, budget, sinks, cf, extra=extra, keep_tokens=keep_tokens)
    want = module(*args)
    # the op's PyTorch implementation is the reference with these options
    ref = sparse_decode_reference(args[0], want[1], want[2], torch.tensor(positions) + 1, None, 0.3, S, budget, sinks,
                                  cf, bounds=PageBounds(*want[3:]), candidate_extra=extra, keep_tokens=keep_tokens)
    assert torch.equal(want[0], ref)
    got = ort_run(export_module(module, args, tmp_path / "step.onnx", int8_write), args)
    assert torch.allclose(got[0], want[0], atol=1e-5, rtol=1e-5), worst(got[0], want[0])
    for name, g, w in zip(("k", "v", "kmax", "kmin", "kabs"), got[1:], want[1:]):
        assert g.dtype == w.dtype and torch.equal(g, w), (name, worst(g, w))
    # the maintained bounds equal a rebuild of the written cache
    fresh = page_bounds(want[1], S, dtype=bounds_dtype)
    assert torch.equal(got[3], fresh.kmax) and torch.equal(got[4], fresh.kmin) and torch.equal(got[5], fresh.kabs)
    # dense attention over the valid tokens, for the "selection dropped pages" checks
    q, k2, v2 = args[0], want[1], want[2]
    dense = sparse_decode_reference(q, k2, v2, torch.tensor(positions) + 1, None, 0.3, S, L, 0, 1)
    return got[0], dense


@pytest.mark.parametrize("budget,cf", [(32, 1), (16, 2), (32, 2), (32, 8)],
                         ids=["one-stage", "two-stage-gathered", "two-stage-full-logits", "two-stage-all-candidates"])
def test_sparse_step_matches_reference_and_drops_pages(tmp_path, budget, cf):
    # P = 16 pages: 2 x 4 candidates gathered; 2 x 8 >= 16 logits over every key; 4 x 8 >= 16 no bound scan
    out, dense = check_step(tmp_path, budget=budget, cf=cf)
    # row 0 holds 101 tokens = 13 pages > K: pages were dropped, the output differs from dense
    assert (out[0] - dense[0]).abs().max() > 1e-3, worst(out[0], dense[0])


def test_budget_covering_the_cache_is_dense(tmp_path):
    out, dense = check_step(tmp_path, budget=128, cf=4)
    assert torch.allclose(out, dense, atol=1e-5), worst(out, dense)


def test_row_that_fits_its_budget_is_dense_inside_a_sparse_batch(tmp_path):
    # row 1 holds 20 tokens = 3 pages <= K = 4: every valid page is kept although row 0 is sparse
    out, dense = check_step(tmp_path, positions=(120, 19), cf=1)
    assert torch.allclose(out[1], dense[1], atol=1e-5), worst(out[1], dense[1])
    assert (out[0] - dense[0]).abs().max() > 1e-3


@pytest.mark.parametrize("cf", [1, 4])
def test_bf16_bounds(tmp_path, cf):
    check_step(tmp_path, bounds_dtype=torch.bfloat16, cf=cf, sinks=0)


@pytest.mark.parametrize("budget,cf,extra", [(16, 1, 16), (16, 2, 16), (32, 2, 16), (32, 1, 96)],
                         ids=["extra-only-gathered", "factor-and-extra-gathered", "full-logits", "all-candidates"])
@pytest.mark.parametrize("keep_tokens", [False, True], ids=["pages", "tokens"])
def test_candidate_extra_and_keep_tokens_match_reference(tmp_path, budget, cf, extra, keep_tokens):
    # P = 16 pages, S = 8: N1 = cf*K + extra//S = 4, 6, 10, 16 candidates (two stages in each case)
    out, dense = check_step(tmp_path, budget=budget, cf=cf, extra=extra, keep_tokens=keep_tokens)
    assert (out[0] - dense[0]).abs().max() > 1e-3, worst(out[0], dense[0])


def test_keep_tokens_is_ignored_by_one_stage(tmp_path):
    # N1 = K: one stage, keep_tokens has nothing to refine; the result is the one-stage page selection
    args = make_inputs(2, 4, 2, 128, 16, 8, (100, 61))
    got = ort_run(export_module(Step(8, 32, 1, 1, keep_tokens=True), args, tmp_path / "a.onnx"), args)[0]
    want = Step(8, 32, 1, 1)(*args)[0]
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), worst(got, want)


@pytest.mark.parametrize("int8_write", ["tensorrt", "inplace"])
@pytest.mark.parametrize("extra,keep_tokens", [(0, False), (16, True)])
def test_int8_bounds(tmp_path, extra, keep_tokens, int8_write):
    # S = 8, budget 32: K = 4; extra = 2*S
    out, dense = check_step(tmp_path, bounds_dtype=torch.int8, cf=2, extra=extra, keep_tokens=keep_tokens,
                            int8_write=int8_write)
    assert (out[0] - dense[0]).abs().max() > 1e-3, worst(out[0], dense[0])


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(B=st.integers(1, 2), Hkv=st.integers(1, 2), G=st.sampled_from([1, 3]), S=st.sampled_from([4, 8]),
       K=st.integers(2, 6), sinks=st.integers(0, 1), cf=st.integers(1, 3), seed=st.integers(0, 2**16),
       fill=st.floats(0.05, 1.0), bdt=st.sampled_from([torch.float32, torch.bfloat16, torch.int8]),
       extra_pages=st.integers(0, 3), keep_tokens=st.booleans())
def test_random_configurations(tmp_path, B, Hkv, G, S, K, sinks, cf, seed, fill, bdt, extra_pages, keep_tokens):
    L = 12 * S
    rng = np.random.default_rng(seed)
    positions = tuple(int(x) for x in rng.integers(max(1, int(fill * (L - 1)) // 2), int(fill * (L - 1)) + 1, B))
    check_step(tmp_path, B=B, Hq=Hkv * G, Hkv=Hkv, L=L, D=8, S=S, budget=K * S, sinks=min(sinks, K - 1), cf=cf,
               positions=positions, bounds_dtype=bdt, seed=seed, extra=extra_pages * S + seed % S,
               keep_tokens=keep_tokens)


def test_bf16_outward_rounding_matches_reference_bit_for_bit(tmp_path):
    """``bounds_write`` rounds the page max up and the min down exactly as ``reference.store_bounds``.

    Pages of one token, one channel per value: 200k random fp32 bit patterns plus
    powers of two, their neighbours, subnormals and values near the bf16 maximum.
    """
    g = np.random.default_rng(0)
    x = g.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    pw = np.ldexp(np.float32(1.0), np.arange(-149, 128)).astype(np.float32)
    near = [np.nextafter(pw, np.float32(0)), np.nextafter(pw, np.float32(np.inf))]
    special = np.array([0.0, 1.0, 2.0**-126, 2.0**-133 * 1.5, 1e-40, 3.3e38, 1.0000001, 0.9999999], np.float32)
    x = np.concatenate([x, pw, *near, special])
    x = np.concatenate([x, -x])
    x = x[np.isfinite(x)].astype(np.float32)
    N = x.size
    k = torch.from_numpy(x).reshape(1, 1, 1, N)

    class Write(torch.nn.Module):
        def forward(self, k, kmax, kmin, kabs, pos):
            return ns.bounds_write(k, kmax, kmin, kabs, pos, 1)

    z = torch.zeros(1, 1, 1, N, dtype=torch.bfloat16)
    args = (k, z, z.clone(), torch.zeros(1, 1, 1), torch.tensor([0]))
    got = ort_run(export_module(Write(), args, tmp_path / "round.onnx"), args)
    want = store_bounds(k[0, 0], k[0, 0], torch.bfloat16)
    for name, g_, w in zip(("kmax", "kmin", "kabs"), got, want):
        g_ = g_.reshape(w.shape)
        bad = g_.float() != w.float()  # value equality (the sign of a zero does not matter to a bound)
        assert not bad.any(), (name, int(bad.sum()), x[bad.reshape(-1).numpy()][:5] if name != "kabs" else "")
    assert bool((got[0].float().reshape(-1) >= k.reshape(-1)).all()) and bool((got[1].float().reshape(-1) <= k.reshape(-1)).all())


@pytest.mark.parametrize("int8_write", ["tensorrt", "inplace"])
def test_int8_writer_matches_reference_bit_for_bit(tmp_path, int8_write):
    """``bounds_write`` stores the int8 codes and ``kabs`` of ``reference.store_bounds`` exactly.

    4096 pages of 4 tokens x 8 channels, each page at its own scale from 2^-140 (subnormal keys, the step floor)
    to 2^100, plus pages of zeros, of one repeated value, and of exact multiples of the grid step.
    """
    g = torch.Generator().manual_seed(0)
    N, S, D = 4096, 4, 8
    k = torch.randn(N, 1, S, D, generator=g) * torch.exp2(torch.randint(-140, 100, (N, 1, 1, 1), generator=g).float())
    k[:8] = 0.0
    k[8:16] = 1.2345
    k[16:24] = torch.randint(-126, 127, (8, 1, S, D), generator=g).float() * (3.0 / 126.0)  # on the grid
    k[16:24, :, 0, 0] = 3.0  # kabs = 3
    k[24:32] = -torch.rand(8, 1, S, D, generator=g) * 1e-39  # subnormal, one sign

    class Write(torch.nn.Module):
        def forward(self, k, kmax, kmin, kabs, pos):
            return ns.bounds_write(k, kmax, kmin, kabs, pos, S)

    z = torch.zeros(N, 1, 1, D, dtype=torch.int8)
    args = (k, z, z.clone(), torch.zeros(N, 1, 1), torch.zeros(N, dtype=torch.int64))
    got = ort_run(export_module(Write(), args, tmp_path / "int8.onnx", int8_write), args)
    want = page_bounds(k, S, dtype=torch.int8)
    assert want.kmax.dtype == torch.int8 and want.kmax.shape == (N, 1, 1, D)
    for name, g_, w in zip(("kmax", "kmin", "kabs"), got, want):
        assert g_.dtype == w.dtype and torch.equal(g_, w), (name, int((g_ != w).sum()), worst(g_, w))
    # the decoded box contains every key of its page
    from tinyserve_compile.kernels.reference import bounds_f32

    hi, lo = bounds_f32(PageBounds(*got))
    assert bool((hi[:, :, 0, None, :] >= k).all()) and bool((lo[:, :, 0, None, :] <= k).all())
