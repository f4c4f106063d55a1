"""The Triton KV append fused with the page-bounds update (issue 4), under the Triton interpreter.

:func:`append_kv_and_update_bounds_triton` must leave the caches and the bounds
bit-identical to ``index_copy_`` of the new rows followed by
``tinyserve::update_bounds``, and :func:`rebuild_bounds_triton` to ``reference.page_bounds``,
for every storage dtype of the bounds: fp32 (a max/min, no rounding), bf16 (rounded
outward) and int8 (codes on the page's grid, ``reference.store_bounds(..., torch.int8)``).
"""
from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch


from triton_interp import _import_interpreted  # noqa: E402


tb = _import_interpreted("tinyserve_compile.kernels.triton_bounds")

from kernel_checks import DTYPES, make_gen, randn  # noqa: E402
from tinyserve_compile.kernels import PageBounds, allocate_bounds, rebuild_bounds_, update_bounds_  # noqa: E402
from tinyserve_compile.kernels import reference as ref  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _assert_equal_report(actual, expected, what):
    if torch.equal(actual, expected):
        return
    a, e = actual.double(), expected.double()
    bad = ~((a == e) | (torch.isnan(a) & torch.isnan(e)))
    idx = tuple(int(i) for i in bad.nonzero()[0])
    raise AssertionError(f"{what}: {int(bad.sum())}/{a.numel()} differ; first at {idx}: "
                         f"actual={float(a[idx]):.8e} expected={float(e[idx]):.8e}")


def _expected(k, v, kn, vn, positions, bounds, S):
    """index_copy_ (sequentially, so the last duplicate wins) + update_bounds_."""
    k, v = k.clone(), v.clone()
    for i, p in enumerate(positions.tolist()):
        k[:, :, p] = kn[:, :, i]
        v[:, :, p] = vn[:, :, i]
    b = PageBounds(*(t.clone() for t in bounds))
    update_bounds_(k, b, positions, S)
    return k, v, b


POSITIONS = {
    "decode": [37],
    "two_pages": [5, 6, 7, 20],
    "duplicate": [3, 9, 3],
    "partial_last_page": [39, 40, 41, 42],
    "prefill_chunk": list(range(0, 30)),
}


BOUNDS_DTYPES = {"b32": torch.float32, "b16": torch.bfloat16, "b8": torch.int8}

# The two-kernel path writes duplicate positions in any order (as index_copy_ does): fused only for those.
# fp32 bounds with every cache dtype; bf16 and int8 bounds with fp32 and bf16 caches (the long fused prefill
# chunk, slow in the interpreter, with fp32 bounds only).
APPEND_CASES = [(p, d, f, bd) for p in POSITIONS for d in ("fp32", "fp16", "bf16") for f in (True, False)
                for bd in BOUNDS_DTYPES
                if not (p == "duplicate" and not f)
                and not (bd != "b32" and (d == "fp16" or (p == "prefill_chunk" and f)))]


@pytest.mark.parametrize("pos_kind,dname,fused,bname", APPEND_CASES,
                         ids=[f"{p}-{d}-{'fused' if f else 'scatter+bounds'}-{bd}" for p, d, f, bd in APPEND_CASES])
def test_append_equals_index_copy_and_update_bounds(pos_kind, dname, fused, bname):
    dtype = DTYPES[dname]
    B, H, L, D, S = 2, 3, 43, 24, 8  # L % S != 0, D not a power of 2
    gen = make_gen(len(pos_kind) * 7 + len(dname))
    k, v = randn((B, H, L, D), gen, dtype), randn((B, H, L, D), gen, dtype)
    bounds = ref.page_bounds(k, S, dtype=BOUNDS_DTYPES[bname])
    positions = torch.tensor(POSITIONS[pos_kind], dtype=torch.int64)
    N = positions.numel()
    kn, vn = randn((B, H, N, D), gen, dtype, 3.0), randn((B, H, N, D), gen, dtype)
    k_want, v_want, b_want = _expected(k, v, kn, vn, positions, bounds, S)
    k_got, v_got = k.clone(), v.clone()
    b_got = PageBounds(*(t.clone() for t in bounds))
    tb.append_kv_and_update_bounds_triton(k_got, v_got, kn, vn, positions, *b_got, S, fused=fused)
    _assert_equal_report(k_got, k_want, "k_cache")
    _assert_equal_report(v_got, v_want, "v_cache")
    for name, got, want in zip(("kmax", "kmin", "kabs"), b_got, b_want):
        _assert_equal_report(got, want, name)


@pytest.mark.parametrize("bname", list(BOUNDS_DTYPES))
@pytest.mark.parametrize("dname", ["fp32", "bf16"])
def test_decode_loop_equals_rebuild(dname, bname):
    """Token-by-token appends into a zero cache keep the bounds equal to a rebuild from scratch."""
    dtype = DTYPES[dname]
    B, H, L, D, S = 1, 2, 21, 16, 4
    gen = make_gen(3)
    k = torch.zeros(B, H, L, D, dtype=dtype)
    v = torch.zeros(B, H, L, D, dtype=dtype)
    bounds = rebuild_bounds_(k, allocate_bounds(k, S, BOUNDS_DTYPES[bname]), S)
    for t in range(L):
        kn, vn = randn((B, H, 1, D), gen, dtype), randn((B, H, 1, D), gen, dtype)
        tb.append_kv_and_update_bounds_triton(k, v, kn, vn, torch.tensor([t]), *bounds, S)
        assert torch.equal(k[:, :, t], kn[:, :, 0]) and torch.equal(v[:, :, t], vn[:, :, 0])
    fresh = ref.page_bounds(k, S, dtype=BOUNDS_DTYPES[bname])
    for name, got, want in zip(("kmax", "kmin", "kabs"), bounds, fresh):
        _assert_equal_report(got, want, f"{name} after {L} appends")


def test_strided_caches():
    """Non-contiguous cache views (e.g. a [B, L, H, D] buffer transposed) are written in place."""
    B, H, L, D, S = 2, 2, 20, 16, 4
    gen = make_gen(9)
    buf_k = randn((B, L, H, D), gen)
    buf_v = randn((B, L, H, D), gen)
    k, v = buf_k.transpose(1, 2), buf_v.transpose(1, 2)
    bounds = ref.page_bounds(k, S)
    positions = torch.tensor([13, 14])
    kn, vn = randn((B, H, 2, D), gen), randn((B, H, 2, D), gen)
    k_want, v_want, b_want = _expected(k, v, kn, vn, positions, bounds, S)
    b_got = PageBounds(*(t.clone() for t in bounds))
    tb.append_kv_and_update_bounds_triton(k, v, kn, vn, positions, *b_got, S)
    _assert_equal_report(k, k_want, "k_cache (strided)")
    _assert_equal_report(v, v_want, "v_cache (strided)")
    for name, got, want in zip(("kmax", "kmin", "kabs"), b_got, b_want):
        _assert_equal_report(got, want, name)


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
        _assert_equal_report(g, w, f"{name} ({dname} keys, {bdt} bounds)")
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
        _assert_equal_report(g, w, f"{name} (scale 2^{exp}, {dname} keys, {bname} bounds, S={S})")
