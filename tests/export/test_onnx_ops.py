"""The ONNX lowerings of the export-only ops against their PyTorch implementations (the reference).

The conformance suite (tests/conformance) runs its table of selection cases through the ONNX twin too; here
are the export-specific checks: whole-step outputs and states, dense fits, and the writers at extreme values.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.export_helpers import export_module, ort_run, worst
from tinyserve_compile.onnx import ops as onnx_ops  # noqa: F401  (registers the ops)
from tinyserve_compile.kernels.reference import PageBounds, page_bounds, sparse_decode_reference, store_bounds
from tinyserve_compile.kernels.spec import SelectionSpec

ns = torch.ops.tinyserve


def _spec(S, budget=None, sinks=0, cf=1, extra=0, keep_tokens=False, bdt=torch.float32):
    return SelectionSpec(S, budget or S, sinks, cf, extra, keep_tokens, bdt)


class Step(torch.nn.Module):
    """Write the new K/V, update the bounds, attend: the three ops in the order of the exported step."""

    def __init__(self, spec: SelectionSpec, scale=0.3):
        super().__init__()
        self.spec, self.scale = spec.to_list(), scale

    def forward(self, q, k, v, kmax, kmin, kabs, pos, k_new, v_new):
        k2, v2 = ns.export_kv_write(k, pos, k_new), ns.export_kv_write(v, pos, v_new)
        b = ns.export_bounds_write(k2, kmax, kmin, kabs, pos, self.spec)
        out = ns.export_sparse_decode(q, k2, v2, *b, pos, self.scale, self.spec)
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
    spec = _spec(S, budget, sinks, cf, extra, keep_tokens, bounds_dtype)
    module = Step(spec)
    want = module(*args)
    # the op's PyTorch implementation is the reference with these options
    ref = sparse_decode_reference(args[0], want[1], want[2], torch.tensor(positions) + 1, None, 0.3, spec,
                                  PageBounds(*want[3:]))
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
    dense = sparse_decode_reference(q, k2, v2, torch.tensor(positions) + 1, None, 0.3, _spec(S, L, bdt=bounds_dtype),
                                    PageBounds(*want[3:]))
    return got[0], dense


def test_budget_covering_the_cache_is_dense(tmp_path):
    out, dense = check_step(tmp_path, budget=128, cf=4)
    assert torch.allclose(out, dense, atol=1e-5), worst(out, dense)


def test_row_that_fits_its_budget_is_dense_inside_a_sparse_batch(tmp_path):
    # row 1 holds 20 tokens = 3 pages <= K = 4: every valid page is kept although row 0 is sparse
    out, dense = check_step(tmp_path, positions=(120, 19), cf=1)
    assert torch.allclose(out[1], dense[1], atol=1e-5), worst(out[1], dense[1])
    assert (out[0] - dense[0]).abs().max() > 1e-3


def test_keep_tokens_is_ignored_by_one_stage(tmp_path):
    # N1 = K: one stage, keep_tokens has nothing to refine; the result is the one-stage page selection
    args = make_inputs(2, 4, 2, 128, 16, 8, (100, 61))
    got = ort_run(export_module(Step(_spec(8, 32, 1, 1, keep_tokens=True)), args, tmp_path / "a.onnx"), args)[0]
    want = Step(_spec(8, 32, 1, 1))(*args)[0]
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), worst(got, want)


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
            return ns.export_bounds_write(k, kmax, kmin, kabs, pos, _spec(1).to_list())

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
            return ns.export_bounds_write(k, kmax, kmin, kabs, pos, _spec(S).to_list())

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
