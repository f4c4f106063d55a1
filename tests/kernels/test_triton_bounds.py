"""The Triton KV append fused with the page-bounds update (issue 4), under the Triton interpreter.

:func:`append_kv_and_update_bounds_triton` must leave the caches and the bounds
bit-identical to ``index_copy_`` of the new rows followed by
``tinyserve::update_bounds`` (bounds are a max/min, so there is no rounding).
"""
from __future__ import annotations


import pytest
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


# The two-kernel path writes duplicate positions in any order (as index_copy_ does): fused only for those.
APPEND_CASES = [(p, d, f) for p in POSITIONS for d in ("fp32", "fp16", "bf16") for f in (True, False)
                if not (p == "duplicate" and not f)]


@pytest.mark.parametrize("pos_kind,dname,fused", APPEND_CASES,
                         ids=[f"{p}-{d}-{'fused' if f else 'scatter+bounds'}" for p, d, f in APPEND_CASES])
def test_append_equals_index_copy_and_update_bounds(pos_kind, dname, fused):
    dtype = DTYPES[dname]
    B, H, L, D, S = 2, 3, 43, 24, 8  # L % S != 0, D not a power of 2
    gen = make_gen(len(pos_kind) * 7 + len(dname))
    k, v = randn((B, H, L, D), gen, dtype), randn((B, H, L, D), gen, dtype)
    bounds = ref.page_bounds(k, S)
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


@pytest.mark.parametrize("dname", ["fp32", "bf16"])
def test_decode_loop_equals_rebuild(dname):
    """Token-by-token appends into a zero cache keep the bounds equal to a rebuild from scratch."""
    dtype = DTYPES[dname]
    B, H, L, D, S = 1, 2, 21, 16, 4
    gen = make_gen(3)
    k = torch.zeros(B, H, L, D, dtype=dtype)
    v = torch.zeros(B, H, L, D, dtype=dtype)
    bounds = rebuild_bounds_(k, allocate_bounds(k, S), S)
    for t in range(L):
        kn, vn = randn((B, H, 1, D), gen, dtype), randn((B, H, 1, D), gen, dtype)
        tb.append_kv_and_update_bounds_triton(k, v, kn, vn, torch.tensor([t]), *bounds, S)
        assert torch.equal(k[:, :, t], kn[:, :, 0]) and torch.equal(v[:, :, t], vn[:, :, 0])
    fresh = ref.page_bounds(k, S)
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
