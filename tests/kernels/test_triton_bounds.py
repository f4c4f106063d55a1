"""The Triton bounds kernels (the CUDA kernel of ``tinyserve::cache_write``), under the Triton interpreter.

:func:`update_bounds_triton` after the key write must leave the bounds bit-identical to
:func:`update_bounds_`, and :func:`rebuild_bounds_triton` to ``reference.page_bounds``, for
every storage dtype of the bounds: fp32 (a max/min, no rounding), bf16 (rounded outward)
and int8 (codes on the page's grid, ``reference.store_bounds(..., torch.int8)``). The
decode loop of every writer over the conformance table is in tests/conformance.
"""
from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch


from tests.support.triton_interp import _import_interpreted  # noqa: E402


tb = _import_interpreted("tinyserve_compile.kernels.triton_bounds")

from tests.support.kernel_checks import DTYPES, assert_equal_report, make_gen, randn  # noqa: E402
from tinyserve_compile.kernels import PageBounds, allocate_bounds, update_bounds_  # noqa: E402
from tinyserve_compile.kernels import reference as ref  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


BOUNDS_DTYPES = {"b32": torch.float32, "b16": torch.bfloat16, "b8": torch.int8}

POSITIONS = {
    "decode": [37],
    "two_pages": [5, 6, 7, 20],
    "duplicate": [3, 9, 3],
    "partial_last_page": [39, 40, 41, 42],
    "prefill_chunk": list(range(0, 30)),
    "unsorted": [30, 2, 31, 17, 3],
}


@pytest.mark.parametrize("bname", list(BOUNDS_DTYPES))
@pytest.mark.parametrize("pos_kind", list(POSITIONS))
def test_update_equals_update_bounds(pos_kind, bname):
    """The key write, then ``update_bounds_triton``, on a strided ``[B, L, H, D]`` buffer read transposed (the
    pages of duplicated and unsorted positions recomputed, no host sync): bit-identical to ``update_bounds_``."""
    B, H, L, D, S = 2, 3, 43, 24, 8  # L % S != 0, D not a power of 2
    gen = make_gen(len(pos_kind) * 7 + len(bname))
    k = randn((B, L, H, D), gen, torch.bfloat16).transpose(1, 2)
    bounds = ref.page_bounds(k, S, dtype=BOUNDS_DTYPES[bname])
    positions = torch.tensor(POSITIONS[pos_kind], dtype=torch.int64)
    k.index_copy_(2, positions, randn((B, H, positions.numel(), D), gen, torch.bfloat16, 3.0))
    want = PageBounds(*(t.clone() for t in bounds))
    update_bounds_(k, want, positions, S)
    tb.update_bounds_triton(k, *bounds, positions, S)
    for name, got, w in zip(("kmax", "kmin", "kabs"), bounds, want):
        assert_equal_report(got, w, name)


BOUNDS_DTYPES = {"b32": torch.float32, "b16": torch.bfloat16, "b8": torch.int8}

def _hard_keys(B, H, L, D, dtype, gen):
    """Keys that stress the int8 grid and the bf16 rounding: exact grid multiples, tiny, huge, zero, one-sign pages."""
    k = randn((B, H, L, D), gen, torch.float32)
    k[0, 0, :8] = 0.0  # an all-zero page: step 2^-126, codes 0
    k[0, 1, :8] = torch.randint(-126, 127, (8, D), generator=gen).float() * 0.25  # kabs/126 divides every key
    k[0, 1, 0, 0] = 31.5  # kabs = 126 * 0.25
    if B > 1:
        k[1, 0, 8:16] = k[1, 0, 8:16] * 1e-38  # subnormal keys (fp32 / bf16 caches)
        k[1, 1, 8:16] = k[1, 1, 8:16].abs() + 3.0  # all positive: kmin > 0
        k[1, 2 % H, 16:24] = k[1, 2 % H, 16:24] * 3e3  # large keys (finite in fp16)
    return k.to(dtype)


@pytest.mark.parametrize("bname", list(BOUNDS_DTYPES))
@pytest.mark.parametrize("dname", ["fp32", "fp16", "bf16"])
def test_rebuild_equals_reference(dname, bname):
    """``rebuild_bounds_triton`` gives ``reference.page_bounds(k, S, dtype)`` bit for bit (hard values included)."""
    dtype, bdt = DTYPES[dname], BOUNDS_DTYPES[bname]
    B, H, L, D, S = 2, 3, 43, 24, 8
    gen = make_gen(17 + len(dname))
    k = _hard_keys(B, H, L, D, dtype, gen)
    want = ref.page_bounds(k, S, dtype=bdt)
    got = allocate_bounds(k, S, bdt)
    got.kmax.fill_(55)
    got.kmin.fill_(-55)
    tb.rebuild_bounds_triton(k, *got, S)
    for name, g, w in zip(("kmax", "kmin", "kabs"), got, want):
        assert_equal_report(g, w, f"{name} ({dname} keys, {bdt} bounds)")
    if bdt == torch.int8:  # the decoded box contains every key
        kmax, kmin = ref.bounds_f32(got)
        pk = ref._paged(k.float(), S, 0.0)  # [B,H,P,S,D]
        inside = (torch.arange(pk.shape[2] * S) < L).reshape(1, 1, -1, S, 1)
        assert bool(((pk <= kmax[:, :, :, None]) | ~inside).all()) and bool(((pk >= kmin[:, :, :, None]) | ~inside).all())


def test_bounds_dtype_checked():
    k = torch.zeros(1, 1, 8, 4)
    b = allocate_bounds(k, 4)
    with pytest.raises(ValueError, match="kmax"):
        tb.rebuild_bounds_triton(k, b.kmax.to(torch.float16), b.kmin.to(torch.float16), b.kabs, 4)
    with pytest.raises(ValueError, match="kmin"):
        tb.rebuild_bounds_triton(k, b.kmax, b.kmin.to(torch.int8), b.kabs, 4)


@settings(max_examples=12, deadline=None)
@given(exp=st.integers(-140, 60), seed=st.integers(0, 2 ** 16), S=st.sampled_from([3, 4, 8]),
       bname=st.sampled_from(["b16", "b8"]), dname=st.sampled_from(["fp32", "bf16"]))
def test_rebuild_equals_reference_any_scale(exp, seed, S, bname, dname):
    """Property: for keys of any scale ``2^exp`` the Triton rebuild equals ``reference.page_bounds`` bit for bit."""
    gen = make_gen(seed)
    k = (randn((1, 2, 11, 5), gen, torch.float32) * 2.0 ** exp).to(DTYPES[dname])
    want = ref.page_bounds(k, S, dtype=BOUNDS_DTYPES[bname])
    got = allocate_bounds(k, S, BOUNDS_DTYPES[bname])
    tb.rebuild_bounds_triton(k, *got, S)
    for name, g, w in zip(("kmax", "kmin", "kabs"), got, want):
        assert_equal_report(g, w, f"{name} (scale 2^{exp}, {dname} keys, {bname} bounds, S={S})")
