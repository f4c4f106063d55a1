"""``cache_write_triton``, the CUDA kernel of ``tinyserve::cache_write``, under the Triton interpreter.

One launch writes the keys and keeps the bounds, reading the stale flag ``ctrl[0]`` inside the kernel, with no
host-synchronising op (so that CUDA graphs capture it). Checked here:

* the cache and all three bounds are bit-identical to :func:`.bounds.cache_write_torch` (given only the
  positions inside ``[0, L)``, which the kernel skips the others of), for every key and bounds dtype, page sizes
  8, 16 and 6 with ``L % S != 0``, decode / chunk / unordered-with-duplicate / descending strided / outside
  positions of several integer dtypes, stale or not (stale: from garbage bounds, which end as a rebuild);
* exactly one Triton launch per call, and no ATen op but views and allocations around it
  (:class:`no_host_sync.ForbidHostSync`; on the CPU every tensor is a CPU tensor, so the check is a whitelist);
* ``ctrl[0]`` is read inside the kernel (flipping it between two identical calls changes what is recomputed),
  and ``ctrl`` is never written by the kernel.

The interpreter runs the programs one after another in grid order, so both orders of "a page's recompute" and
"another program's store into that page" occur: in the chunk cases program ``n = 0`` recomputes its page before
the programs of the page's later positions store their rows; with the bounds stale, program ``j`` rebuilds
page ``j`` before the later programs store. Bounds that read those stores instead of the overlaid ``src`` rows
would differ. The same cases run again with the programs in reverse order (a duplicated position's earlier
``n`` then runs last, and must not store).
"""
from __future__ import annotations

import sys

import pytest
import torch

from tests.support.triton_interp import _import_interpreted  # noqa: E402

tb = _import_interpreted("tinyserve_compile.kernels.triton_bounds")

from tests.support.kernel_checks import DTYPES, assert_equal_report, make_gen, randn  # noqa: E402
from tests.support.no_host_sync import VIEWS_AND_ALLOCATIONS, ForbidHostSync, count_triton_launches  # noqa: E402
from tinyserve_compile.kernels import PageBounds  # noqa: E402
from tinyserve_compile.kernels import reference as ref  # noqa: E402
from tinyserve_compile.kernels.bounds import _cache_write_triton, cache_write_torch  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


BOUNDS_DTYPES = {"b32": torch.float32, "b16": torch.bfloat16, "b8": torch.int8}

B, H, L, D = 2, 2, 43, 12  # L % S != 0 for S = 6, 8, 16; D not a power of two

#: written positions: name -> tensor (int dtypes, 0-d / [1] / [N], strided)
POSITIONS = {
    "decode_0d_i32": lambda: torch.tensor(37, dtype=torch.int32),
    "decode_1_i64": lambda: torch.tensor([42], dtype=torch.int64),  # the partial last page's last slot
    "chunk": lambda: torch.arange(13, 30, dtype=torch.int64),  # crosses 2-4 pages
    "unordered_dup": lambda: torch.tensor([30, 2, 31, 17, 2, 3], dtype=torch.int32),  # 2 twice: the last n wins
    "descending_strided": lambda: torch.arange(40, 0, -1, dtype=torch.int16)[::5],  # [40, 35, ..., 5], stride 5
    "outside": lambda: torch.tensor([-1, 5, 43, 60, 40, -9], dtype=torch.int64),  # 43: in the last page's padding
}


def _inputs(dtype, bdt, S, pos_kind, stale, seed):
    """A strided cache ``[B, L, H, D]`` read transposed, bounds (garbage when ``stale``), ``ctrl``, positions and
    a strided ``src`` ``[B, H, N, D]``."""
    gen = make_gen(seed)
    k = randn((B, L, H, D), gen, dtype).transpose(1, 2)
    bounds = ref.page_bounds(k, S, dtype=bdt)
    if stale:  # garbage: only a rebuild makes them right
        bounds.kmax.fill_(55)
        bounds.kmin.fill_(-55)
        bounds.kabs.fill_(3.0)
    positions = POSITIONS[pos_kind]()
    n = positions.numel()
    src = randn((B, n, H, D), gen, dtype, 3.0).transpose(1, 2)
    ctrl = torch.tensor([stale, 7], dtype=torch.int32)
    return k, bounds, ctrl, positions, src


def _expected(k, bounds, ctrl, positions, src, S):
    """``cache_write_torch`` on copies, given the positions inside ``[0, L)`` only (it rejects the others)."""
    k = k.clone()
    bounds = PageBounds(*(t.clone() for t in bounds))
    pos = positions.reshape(-1).to(torch.int64)
    keep = (pos >= 0) & (pos < L)
    cache_write_torch(k, *bounds, ctrl.clone(), pos[keep], src[:, :, keep], S)
    return k, bounds


def _check_write(dtype, bdt, S, pos_kind, stale, seed):
    k, bounds, ctrl, positions, src = _inputs(dtype, bdt, S, pos_kind, stale, seed)
    want_k, want = _expected(k, bounds, ctrl, positions, src, S)
    tb.cache_write_triton(k, *bounds, ctrl, positions, src, S)
    what = f"({pos_kind}, {dtype} keys, {bdt} bounds, S={S}, stale={stale})"
    assert_equal_report(k, want_k, f"k_cache {what}")
    for name, got, w in zip(("kmax", "kmin", "kabs"), bounds, want):
        assert_equal_report(got, w, f"{name} {what}")
    for name, got, w in zip(("kmax", "kmin", "kabs"), bounds, ref.page_bounds(k, S, dtype=bdt)):
        assert_equal_report(got, w, f"{name} against a rebuild {what}")
    assert ctrl.tolist() == [stale, 7], f"the kernel wrote ctrl: {ctrl.tolist()} {what}"
    if pos_kind == "unordered_dup":  # position 2 holds the row of its last n (4), not of its first (1)
        assert_equal_report(k[:, :, 2], src[:, :, 4], f"duplicate position {what}")


@pytest.mark.parametrize("stale", [0, 1])
@pytest.mark.parametrize("pos_kind", list(POSITIONS))
@pytest.mark.parametrize("bname", list(BOUNDS_DTYPES))
@pytest.mark.parametrize("dname", ["fp32", "bf16", "fp16"])
def test_equals_cache_write_torch(dname, bname, pos_kind, stale):
    """Page size 8: cache and bounds bit-identical to ``cache_write_torch`` and to a rebuild; ctrl untouched."""
    _check_write(DTYPES[dname], BOUNDS_DTYPES[bname], 8, pos_kind, stale,
                 seed=len(dname) * 100 + len(bname) * 10 + len(pos_kind) + stale)


@pytest.mark.parametrize("stale", [0, 1])
@pytest.mark.parametrize("pos_kind", list(POSITIONS))
@pytest.mark.parametrize("S, dname, bname", [(16, "bf16", "b8"), (6, "fp16", "b16")])
def test_equals_cache_write_torch_other_page_sizes(S, dname, bname, pos_kind, stale):
    """Page sizes 16 and 6 (not a power of two: padded slots in every page tile)."""
    _check_write(DTYPES[dname], BOUNDS_DTYPES[bname], S, pos_kind, stale, seed=S * 31 + len(pos_kind) + stale)


@pytest.fixture
def reversed_programs(monkeypatch):
    """Run the interpreter's programs in reverse grid order (its builder maps each program id to the mirror one);
    the list it returns records the program ids ``(x, y)`` in the order they ran."""
    builder = sys.modules[type(tb._cache_write_kernel).__module__].interpreter_builder
    forward = builder.set_grid_idx
    ran = []

    def mirrored(x, y, z):
        nx, ny, nz = builder.grid_dim
        ran.append((nx - 1 - x, ny - 1 - y))
        forward(nx - 1 - x, ny - 1 - y, nz - 1 - z)

    monkeypatch.setattr(builder, "set_grid_idx", mirrored)
    return ran


@pytest.mark.parametrize("stale", [0, 1])
@pytest.mark.parametrize("pos_kind", ["chunk", "unordered_dup", "descending_strided", "outside"])
def test_program_order_does_not_matter(pos_kind, stale, reversed_programs):
    """Programs in reverse order: still bit-identical (no program depends on another's store, and of a duplicated
    position only the last n stores)."""
    _check_write(torch.bfloat16, torch.bfloat16, 8, pos_kind, stale, seed=77 + len(pos_kind) + stale)
    head0 = [x for x, y in reversed_programs if y == 0]
    assert len(head0) > 1 and head0 == sorted(head0, reverse=True), "the programs did not run in reverse order"


@pytest.mark.parametrize("pos_kind, stale", [("decode_0d_i32", 0), ("decode_1_i64", 0), ("chunk", 0),
                                             ("unordered_dup", 0), ("decode_0d_i32", 1), ("chunk", 1)])
def test_one_launch_and_no_host_sync(pos_kind, stale):
    """One launch of ``_cache_write_kernel``, grid ``(max(N, min(P, 32)), B * H)``, and around it no ATen op but
    views and empty allocations (no ``.item()``, ``nonzero``, ``index_copy_``, no cast of the positions)."""
    S = 8
    P = (L + S - 1) // S
    k, bounds, ctrl, positions, src = _inputs(torch.bfloat16, torch.int8, S, pos_kind, stale, seed=5)
    want_k, want = _expected(k, bounds, ctrl, positions, src, S)
    with ForbidHostSync(allowed=VIEWS_AND_ALLOCATIONS) as mode:
        with count_triton_launches(tb._cache_write_kernel, mode) as launches:
            tb.cache_write_triton(k, *bounds, ctrl, positions, src, S)
    assert mode.violations == []
    assert all(name.startswith(VIEWS_AND_ALLOCATIONS) for name in mode.seen), mode.seen
    assert launches == [("_cache_write_kernel", (max(positions.numel(), min(P, 32)), B * H))], launches
    assert_equal_report(k, want_k, "k_cache")
    for name, got, w in zip(("kmax", "kmin", "kabs"), bounds, want):
        assert_equal_report(got, w, name)


def test_op_path_one_launch_clears_a_host_flag():
    """The op's Triton path (``bounds._cache_write_triton``) with a CPU ``ctrl`` (the cache's device here): the
    same single launch and no host-synchronising op; the host flag is then cleared, as the other paths clear it."""
    S = 8
    k, bounds, ctrl, positions, src = _inputs(torch.float32, torch.float32, S, "chunk", 1, seed=9)
    want_k, want = _expected(k, bounds, ctrl, positions, src, S)
    with ForbidHostSync() as mode:
        with count_triton_launches(tb._cache_write_kernel, mode) as launches:
            _cache_write_triton(k, *bounds, ctrl, positions, src, S)
    assert mode.violations == []
    assert [name for name, _ in launches] == ["_cache_write_kernel"], launches
    assert ctrl.tolist() == [0, 7]
    assert_equal_report(k, want_k, "k_cache")
    for name, got, w in zip(("kmax", "kmin", "kabs"), bounds, want):
        assert_equal_report(got, w, name)


def test_ctrl_is_read_in_the_kernel():
    """Two calls identical but for ``ctrl[0]`` (the same tensor, flipped in between): with 0 the garbage bounds of
    pages not written survive and only the written page is recomputed; with 1 every page equals a rebuild."""
    S = 8
    k0, bounds0, ctrl, positions, src = _inputs(torch.float16, torch.bfloat16, S, "decode_0d_i32", 1, seed=11)
    k1, bounds1 = k0.clone(), PageBounds(*(t.clone() for t in bounds0))
    garbage = PageBounds(*(t.clone() for t in bounds0))
    page = int(positions) // S
    ctrl[0] = 0
    tb.cache_write_triton(k0, *bounds0, ctrl, positions, src, S)
    ctrl[0] = 1
    tb.cache_write_triton(k1, *bounds1, ctrl, positions, src, S)
    assert_equal_report(k0, k1, "k_cache (the write does not depend on the flag)")
    rebuilt = ref.page_bounds(k0, S, dtype=torch.bfloat16)
    others = [p for p in range(bounds0.kabs.shape[2]) if p != page]
    for name, g0, g1, old, w in zip(("kmax", "kmin", "kabs"), bounds0, bounds1, garbage, rebuilt):
        assert_equal_report(g0[:, :, others], old[:, :, others], f"{name}: flag 0 leaves pages not written")
        assert_equal_report(g0[:, :, page], w[:, :, page], f"{name}: flag 0 recomputes the written page")
        assert_equal_report(g1, w, f"{name}: flag 1 rebuilds every page")
    assert not torch.equal(bounds0.kabs, bounds1.kabs)


def test_forbid_host_sync_catches_a_host_read():
    """The dispatch mode itself: ``int(tensor)`` fails inside it, and a non-view fails against the whitelist."""
    t = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(AssertionError, match="_local_scalar_dense"):
        with ForbidHostSync():
            int(t[0])
    with pytest.raises(AssertionError, match="aten.add"):
        with ForbidHostSync(allowed=VIEWS_AND_ALLOCATIONS):
            t + 1
    with ForbidHostSync() as mode:
        t.reshape(-1)
    assert mode.seen == ["aten.view.default"]


def test_launch_counter_counts_each_launch():
    """``count_triton_launches`` sees the thin launchers' single launches of the same kernel."""
    k = randn((1, 2, 20, 4), make_gen(3), torch.float32)
    bounds = ref.page_bounds(k, 8)
    with count_triton_launches(tb._cache_write_kernel) as launches:
        tb.update_bounds_triton(k, *bounds, torch.tensor([3, 19]), 8)
        tb.rebuild_bounds_triton(k, *bounds, 8)
    assert launches == [("_cache_write_kernel", (2, 2)), ("_cache_write_kernel", (3, 2))]


def test_arguments_checked():
    k, bounds, ctrl, positions, src = _inputs(torch.float32, torch.float32, 8, "chunk", 0, seed=1)
    with pytest.raises(ValueError, match="'src'"):
        tb.cache_write_triton(k, *bounds, ctrl, positions, src.to(torch.bfloat16), 8)
    with pytest.raises(ValueError, match="'src'"):
        tb.cache_write_triton(k, *bounds, ctrl, positions, src[:, :, 1:], 8)
    with pytest.raises(ValueError, match="'positions'"):
        tb.cache_write_triton(k, *bounds, ctrl, positions.float(), src, 8)
    with pytest.raises(ValueError, match="'ctrl'"):
        tb.cache_write_triton(k, *bounds, ctrl.long(), positions, src, 8)
    with pytest.raises(ValueError, match="'ctrl'"):
        tb.cache_write_triton(k, *bounds, ctrl[:1], positions, src, 8)
    with pytest.raises(ValueError, match="'kmax'"):
        tb.cache_write_triton(k, bounds.kmax.half(), *bounds[1:], ctrl, positions, src, 8)
