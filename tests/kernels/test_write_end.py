"""The write op's own staleness check: ``ctrl[CTRL_END]``, kept by ``tinyserve::cache_write`` on the ctrl's device.

A write whose positions do not start where the op's last write ended rebuilds every page, in every
implementation (PyTorch, native, Triton under the interpreter), with no help from the host: this is what keeps
the bounds exact for a cache without a version counter (an inference tensor) and under an outer CUDA graph
capture, whose replays run no host code. A write that goes on from the end recomputes only its pages.

Each case plants a value in the bounds of a page that the write does not touch: it survives a write that goes on,
and is gone after a rebuild.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.kernel_checks import cache_write_path, make_gen, randn
from tests.support.triton_interp import _import_interpreted
from tinyserve_compile.kernels import reference as ref
from tinyserve_compile.kernels.bounds import CTRL_ARRIVALS, CTRL_END, CTRL_SIZE, CTRL_STALE, new_ctrl
from tinyserve_compile.kernels.spec import SelectionSpec

B, H, L, D, S = 2, 2, 40, 8, 4
PLANTED_PAGE = 9  # positions 36..39: no case writes there
SPEC = SelectionSpec(S, 8, 0, 1, 0, False, torch.float32).to_list()

#: name -> (end recorded before the write, positions written, whether every page is rebuilt)
CASES = {
    "goes_on_decode": (20, [20], False),
    "goes_on_chunk": (20, list(range(20, 28)), False),
    "skips_ahead": (20, [25], True),  # 20..24 written by someone else
    "rewinds": (20, [3], True),  # a new sequence, or a roll-back
    "rewinds_to_zero_chunk": (20, list(range(0, 12)), True),  # a new prompt's prefill
    "nothing_recorded": (-1, [20], True),  # a fresh ctrl
}


def _setup(end: int, positions, seed: int):
    gen = make_gen(seed)
    k = randn((B, H, L, D), gen)
    bounds = ref.page_bounds(k, S)
    bounds.kabs[:, :, PLANTED_PAGE] = 123.0  # a value no rebuild computes
    ctrl = new_ctrl(stale=False)
    ctrl[CTRL_END] = end
    pos = torch.tensor(positions, dtype=torch.int64)
    src = randn((B, H, len(positions), D), gen, scale=2.0)
    return k, bounds, ctrl, pos, src


def _write(impl: str, k, bounds, ctrl, pos, src):
    if impl == "triton":
        _import_interpreted("tinyserve_compile.kernels.triton_bounds")
        from tinyserve_compile.kernels.bounds import _cache_write_triton

        _cache_write_triton(k, *bounds, ctrl, pos, src, S)
    else:
        with cache_write_path(impl):
            torch.ops.tinyserve.cache_write(k, *bounds, ctrl, pos, src, SPEC)


@pytest.fixture
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", ["torch", "native", "triton"])
def test_a_write_that_does_not_go_on_from_the_end_rebuilds(impl, case, _interpret):
    if impl == "native":
        from tinyserve_compile.kernels.native import load_native, native_unavailable_reason

        assert load_native(), native_unavailable_reason()
    end, positions, rebuilds = CASES[case]
    k, bounds, ctrl, pos, src = _setup(end, positions, seed=len(case))
    _write(impl, k, bounds, ctrl, pos, src)
    want_k = k.clone()
    assert torch.equal(k[:, :, pos], src), "the keys were not written"
    planted = bounds.kabs[:, :, PLANTED_PAGE]
    fresh = ref.page_bounds(want_k, S)
    if rebuilds:
        for name, got, want in zip(("kmax", "kmin", "kabs"), bounds, fresh):
            assert torch.equal(got, want), f"{impl}/{case}: {name} is not a rebuild"
    else:
        assert bool((planted == 123.0).all()), f"{impl}/{case}: an untouched page was recomputed (a rebuild)"
        touched = sorted({p // S for p in positions})
        for name, got, want in zip(("kmax", "kmin", "kabs"), bounds, fresh):
            assert torch.equal(got[:, :, touched], want[:, :, touched]), f"{impl}/{case}: {name} of the written pages"
    assert ctrl.tolist()[CTRL_END] == max(positions) + 1, ctrl.tolist()
    assert ctrl.tolist()[CTRL_ARRIVALS] == 0 and ctrl.tolist()[CTRL_STALE] == 0, ctrl.tolist()


@pytest.mark.parametrize("impl", ["torch", "native", "triton"])
def test_a_ctrl_of_two_elements_records_no_end(impl, _interpret):
    """The old form of ``ctrl``: only its stale flag decides, and nothing past it is read or written."""
    k, bounds, _, pos, src = _setup(20, [25], seed=5)
    ctrl = torch.tensor([0, 0], dtype=torch.int32)
    _write(impl, k, bounds, ctrl, pos, src)
    assert bool((bounds.kabs[:, :, PLANTED_PAGE] == 123.0).all()), f"{impl}: rebuilt without a stale flag"
    assert ctrl.tolist() == [0, 0]


@pytest.mark.parametrize("impl", ["torch", "native"])
@pytest.mark.parametrize("size", [1, 3, 5])
def test_a_ctrl_of_another_size_is_refused_by_name(impl, size):
    k, bounds, _, pos, src = _setup(20, [20], seed=6)
    with cache_write_path(impl), pytest.raises(ValueError, match="'ctrl'"):
        torch.ops.tinyserve.cache_write(k, *bounds, torch.zeros(size, dtype=torch.int32), pos, src, SPEC)


def test_new_ctrl_is_stale_with_no_end():
    c = new_ctrl()
    assert c.dtype == torch.int32 and tuple(c.shape) == (CTRL_SIZE,)
    assert c.tolist() == [1, 0, -1, 0]
