"""Bounds maintenance (incremental updates equal a rebuild, the cache-write op's opcheck, bad input).

(f) After any sequence of writes to the key cache (appends, overwrites, roll-backs,
    multi-position prefill writes), bounds kept with ``update_bounds_`` equal a
    ``rebuild_bounds_`` from scratch, bit for bit.
"""
from __future__ import annotations

import pytest
from unittest import mock
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.kernel_checks import DTYPES, cache_write_path, make_gen, randn
from tinyserve_compile.kernels import allocate_bounds, rebuild_bounds_, update_bounds_
from tinyserve_compile.kernels import reference as ref

WRITE = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 9)),  # n new tokens at the end
    st.tuples(st.just("overwrite"), st.lists(st.integers(0, 63), min_size=1, max_size=6)),  # arbitrary slots
    st.tuples(st.just("rollback"), st.integers(0, 63)),  # drop back to a shorter length
    st.tuples(st.just("rollback_zero"), st.integers(0, 63)),  # roll back and zero the dropped slots
    st.tuples(st.just("prefill"), st.integers(0, 63)),  # rewrite everything from a position on
)


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    bad = (a != b).nonzero()
    i = tuple(int(x) for x in bad[0])
    return f"{len(bad)} entries differ; first at {i}: maintained={float(a[i])!r} rebuilt={float(b[i])!r}"


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    S=st.sampled_from([1, 3, 4, 16]),
    L=st.integers(1, 64),
    B=st.integers(1, 2),
    writes=st.lists(WRITE, min_size=1, max_size=8),
    int32_pos=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_incremental_bounds_equal_rebuild(dtype, S, L, B, writes, int32_pos, seed):
    """(f) update_bounds_ after every write == rebuild_bounds_ from scratch (exactly)."""
    dt = DTYPES[dtype]
    gen = make_gen(seed)
    H, D = 2, 5
    k = torch.zeros(B, H, L, D, dtype=dt)
    bounds = rebuild_bounds_(k, allocate_bounds(k, S), S)
    cur = 0
    for step, (kind, arg) in enumerate(writes):
        if kind == "append":
            pos = torch.arange(cur, min(cur + arg, L))
            cur = min(cur + arg, L)
        elif kind == "overwrite":
            pos = torch.tensor([p % L for p in arg])  # duplicates and any order
        elif kind == "prefill":
            pos = torch.arange(arg % L, L).flip(0)
            cur = L
        else:
            new = min(arg, cur)
            pos = torch.arange(new, cur)
            cur = new
        if pos.numel() and kind != "rollback":
            vals = randn((B, H, pos.numel(), D), gen, dt, scale=float(10 ** (step % 4 - 1)))
            if kind == "rollback_zero":
                vals = torch.zeros_like(vals)
            k[:, :, pos] = vals
        if int32_pos:
            pos = pos.to(torch.int32)
        update_bounds_(k, bounds, pos, S)
        fresh = rebuild_bounds_(k, allocate_bounds(k, S), S)
        for name, a, b in zip(("kmax", "kmin", "kabs"), bounds, fresh):
            assert torch.equal(a, b), f"after write {step} {kind} {pos.tolist()}: {name}: {_first_diff(a, b)}"


def test_update_ignores_out_of_range_and_empty_positions():
    k = randn((1, 2, 10, 3), make_gen(1))
    bounds = rebuild_bounds_(k, allocate_bounds(k, 4), 4)
    before = [t.clone() for t in bounds]
    update_bounds_(k, bounds, torch.tensor([], dtype=torch.int64), 4)
    update_bounds_(k, bounds, torch.tensor([-3, 12, 40]), 4)
    for a, b in zip(bounds, before):
        assert torch.equal(a, b)


def test_rebuild_matches_page_bounds():
    k = randn((2, 3, 21, 4), make_gen(2), torch.bfloat16)
    bounds = rebuild_bounds_(k, allocate_bounds(k, 8), 8)
    want = ref.page_bounds(k, 8)
    for a, b in zip(bounds, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_opcheck_cache_write_torch_path(dtype):
    """``tinyserve::cache_write`` through its PyTorch path (the native kernel's opcheck is in test_native_bounds)."""
    from tinyserve_compile.kernels import bounds as bounds_mod
    from tinyserve_compile.kernels.spec import SelectionSpec

    gen = make_gen(3)
    k = randn((2, 2, 19, 8), gen, dtype)
    b = allocate_bounds(k, 4)
    spec = SelectionSpec(4, 8, 0, 1, 0, False, torch.float32).to_list()
    calls = []
    torch_path = bounds_mod.CACHE_WRITE_IMPLS["torch"]
    with mock.patch.dict(bounds_mod.CACHE_WRITE_IMPLS, torch=lambda *a: calls.append(1) or torch_path(*a)), \
            cache_write_path("torch"):
        for stale, pos in ((1, torch.tensor([0, 5, 18])), (0, torch.tensor(6, dtype=torch.int32))):
            ctrl = torch.tensor([stale, 0], dtype=torch.int32)
            torch.library.opcheck(torch.ops.tinyserve.cache_write.default,
                                  (k, *b, ctrl, pos, randn((2, 2, pos.numel(), 8), gen, dtype), spec))
    assert calls, "the PyTorch path did not run"


def _bounds_args():
    k = randn((1, 2, 12, 4), make_gen(4))
    return k, allocate_bounds(k, 4)


@pytest.mark.parametrize(
    "case, name",
    [
        ("page_size_zero", "page_size"),
        ("page_size_neg", "page_size"),
        ("k_3d", "k_cache"),
        ("k_int", "k_cache"),
        ("k_meta", "k_cache"),
        ("kmax_shape", "kmax"),
        ("kmin_dtype", "kmin"),
        ("kabs_shape", "kabs"),
        ("kmax_meta", "kmax"),
        ("positions_float", "positions"),
    ],
)
def test_bounds_bad_input_names_argument(case, name):
    k, b = _bounds_args()
    S, pos = 4, torch.tensor([1])
    if case == "page_size_zero":
        S = 0
    elif case == "page_size_neg":
        S = -4
    elif case == "k_3d":
        k = k[0]
    elif case == "k_int":
        k = k.to(torch.int32)
    elif case == "k_meta":
        k = k.to("meta")
    elif case == "kmax_shape":
        b = ref.PageBounds(b.kmax[:, :, :2], b.kmin, b.kabs)
    elif case == "kmin_dtype":
        b = ref.PageBounds(b.kmax, b.kmin.double(), b.kabs)
    elif case == "kabs_shape":
        b = ref.PageBounds(b.kmax, b.kmin, b.kabs[..., None])
    elif case == "kmax_meta":
        b = ref.PageBounds(b.kmax.to("meta"), b.kmin, b.kabs)
    elif case == "positions_float":
        pos = torch.tensor([1.0])
    with pytest.raises(ValueError, match=f"'{name}'"):
        update_bounds_(k, b, pos, S)
    if case != "positions_float":
        with pytest.raises(ValueError, match=f"'{name}'"):
            rebuild_bounds_(k, b, S)


def test_allocate_bounds_bad_input():
    with pytest.raises(ValueError, match="'page_size'"):
        allocate_bounds(torch.zeros(1, 1, 4, 2), 0)
    with pytest.raises(ValueError, match="'k_cache'"):
        allocate_bounds(torch.zeros(4, 2), 2)
