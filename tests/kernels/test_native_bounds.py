"""The native bounds kernels (``cache_write``, the CPU kernel of ``tinyserve::cache_write``, and ``rebuild_bounds``).

Both must equal the reference :func:`reference.page_bounds` (fp32, bf16 rounded
outward, or int8 codes on the page's grid with the exact ``kabs``) bit for bit, and
``cache_write`` must write the keys exactly as ``index_copy_``. The decode loop of every writer over the
conformance table is in tests/conformance; here are strided caches, extreme scales and the stale flag.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.kernel_checks import make_gen, randn
from tinyserve_compile.kernels import reference as ref
from tinyserve_compile.kernels.native import load_native, native_module, native_unavailable_reason
from tinyserve_compile.kernels.spec import SelectionSpec

pytestmark = pytest.mark.skipif(not load_native(), reason=f"native kernel unavailable: {native_unavailable_reason()}")

KV = [torch.float32, torch.bfloat16, torch.float16]
BOUNDS = [torch.float32, torch.bfloat16, torch.int8]


def _alloc(k, S, bdt, fill=0.0):
    B, H, L, D = k.shape
    P = ref.num_pages(L, S)
    return (torch.full((B, H, P, D), fill, dtype=bdt), torch.full((B, H, P, D), fill, dtype=bdt),
            torch.full((B, H, P), fill, dtype=torch.float32))


def _assert_bits(got, k, S, bdt, what):
    """``got`` (kmax, kmin, kabs) equals ``reference.page_bounds(k, S, dtype=bdt)`` exactly; names the first mismatch."""
    want = ref.page_bounds(k, S, dtype=bdt)
    for name, g, w in zip(("kmax", "kmin", "kabs"), got, want):
        assert g.dtype == w.dtype, f"{what}: {name} dtype {g.dtype} != {w.dtype}"
        bad = g != w
        if bool(bad.any()):
            idx = tuple(int(i) for i in bad.nonzero()[0])
            raise AssertionError(f"{what}: {name} differs at {int(bad.sum())} places; first {idx}: "
                                 f"got {float(g[idx])!r} want {float(w[idx])!r}")


def _keys(shape, gen, dtype, transposed):
    """Keys with a wide range of magnitudes and signs (every rounding case of bf16), maybe a strided view."""
    B, H, L, D = shape
    x = randn((B, L, H, D) if transposed else shape, gen, torch.float32)
    e = 10 if dtype == torch.float16 else 20  # finite in the key dtype
    x = x * torch.exp2(torch.randint(-e, e, x.shape, generator=gen).float())
    x = x.to(dtype)
    return x.transpose(1, 2) if transposed else x


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("bdt", BOUNDS)
@pytest.mark.parametrize("dtype", KV)
@pytest.mark.parametrize("S, L, D", [(8, 203, 64), (16, 64, 16), (5, 23, 12)])
def test_rebuild_bounds_bit_exact(dtype, bdt, transposed, S, L, D):
    k = _keys((2, 3, L, D), make_gen(L + D), dtype, transposed)
    got = _alloc(k, S, bdt, fill=7.0)
    native_module().rebuild_bounds(k, *got, S)
    _assert_bits(got, k, S, bdt, f"rebuild_bounds {dtype} bounds={bdt} S={S} L={L} D={D} transposed={transposed}")


@pytest.mark.parametrize("bdt", BOUNDS)
@pytest.mark.parametrize("dtype", KV)
def test_cache_write_decode_loop_bit_exact_on_a_strided_cache(dtype, bdt):
    """Prefill, then a decode loop that crosses pages, into a ``[B, L, H, D]`` buffer read transposed: keys as
    index_copy_, bounds as a rebuild, every step."""
    transposed = True
    S, L, D, B, H = 8, 60, 32, 2, 2
    gen = make_gen(3)
    k = _keys((B, H, L, D), gen, dtype, transposed)
    k.zero_()
    want_k = torch.zeros(B, H, L, D, dtype=dtype)
    b = _alloc(k, S, bdt)
    ctrl = torch.tensor([1, 0], dtype=torch.int32)  # stale: the first write rebuilds everything
    op = native_module().cache_write
    # ---- prefill 21 tokens (pages 0..2, the last partial)
    pos = torch.arange(21)
    src = randn((B, H, 21, D), gen, torch.float32, 3.0).to(dtype)
    op(k, *b, ctrl, pos, src, S)
    want_k.index_copy_(2, pos, src)
    assert torch.equal(k, want_k) and int(ctrl[0]) == 0 and int(ctrl[1]) == 0
    _assert_bits(b, k, S, bdt, f"prefill {dtype} {bdt}")
    # ---- decode steps 21..44: one position per step, through pages 2..5
    for t in range(21, 45):
        src = randn((B, H, 1, D), gen, torch.float32, 3.0).to(dtype)
        op(k, *b, ctrl, torch.tensor([t]), src, S)
        want_k.index_copy_(2, torch.tensor([t]), src)
        assert torch.equal(k, want_k), f"keys differ after step {t}"
        _assert_bits(b, k, S, bdt, f"decode step {t} {dtype} bounds={bdt} transposed={transposed}")
    # ---- an overwrite of older positions (a roll-back), int32 positions, two pages at once
    pos = torch.tensor([3, 17, 16], dtype=torch.int32)
    src = randn((B, H, 3, D), gen, torch.float32, 3.0).to(dtype)
    op(k, *b, ctrl, pos, src, S)
    want_k.index_copy_(2, pos.long(), src)
    assert torch.equal(k, want_k)
    _assert_bits(b, k, S, bdt, f"overwrite {dtype} {bdt}")


@pytest.mark.parametrize("dtype", KV)
def test_int8_bounds_extreme_scales_bit_exact(dtype):
    """int8 bounds at the edges of the grid: zero pages (step at its 2^-126 floor), tiny keys (fp32 subnormal range,
    below 126 * 2^-126), huge keys, one-sided pages (all positive / all negative), and a page whose max sits exactly
    on a grid point; rebuild and a decode write both equal the reference, and the decoded box holds every key."""
    S, L, D = 4, 36, 24
    gen = make_gen(29)
    k = randn((1, 2, L, D), gen, torch.float32)
    k[:, :, 0:4] = 0.0  # page 0: all zero
    if dtype == torch.float32:
        k[:, :, 4:8] *= 2.0**-135  # page 1: subnormal keys
        k[:, :, 8:12] *= 2.0**100  # page 2: huge keys
    else:
        k[:, :, 4:8] *= 2.0**-12
        k[:, :, 8:12] *= 2.0**10
    k[:, :, 12:16] = k[:, :, 12:16].abs() + 0.5  # page 3: all positive
    k[:, :, 16:20] = -k[:, :, 16:20].abs() - 0.5  # page 4: all negative
    k[:, :, 20:24] = 0.25
    k[:, :, 20, 0] = 126.0  # page 5: kabs = 126, step 1, max on the grid
    k = k.to(dtype)
    got = _alloc(k, S, torch.int8, fill=3.0)
    native_module().rebuild_bounds(k, *got, S)
    _assert_bits(got, k, S, torch.int8, f"rebuild_bounds int8 extreme scales {dtype}")
    hi, lo = ref.bounds_f32(ref.PageBounds(*got))
    kp = torch.nn.functional.pad(k.float(), (0, 0, 0, ref.num_pages(L, S) * S - L)).unflatten(2, (-1, S))
    assert bool((hi >= kp.amax(3)).all()) and bool((lo <= kp.amin(3)).all()), "decoded int8 box must hold the keys"
    b = _alloc(k, S, torch.int8)
    ctrl = torch.tensor([0, 0], dtype=torch.int32)
    native_module().rebuild_bounds(k, *b, S)
    src = (randn((1, 2, 1, D), gen, torch.float32) * 2.0**-130).to(dtype)  # a tiny key into the huge page
    native_module().cache_write(k, *b, ctrl, torch.tensor([9]), src, S)
    _assert_bits(b, k, S, torch.int8, f"cache_write int8 extreme scales {dtype}")


def test_cache_write_row_copy_and_index_copy_agree():
    """The keys are copied row by row for a ``[B, Hkv, n, D]`` source of the cache's dtype, by ``index_copy_`` for
    any other source (here a view with a stride on D): both write what ``index_copy_`` writes, and a position
    outside the cache raises ``IndexError`` before anything is written."""
    S, L, D = 4, 16, 8
    gen = make_gen(9)
    op = native_module().cache_write
    for src in (randn((1, 2, 2, D), gen), randn((1, 2, 2, 2 * D), gen)[..., ::2]):
        k = torch.zeros(1, 2, L, D)
        b = _alloc(k, S, torch.float32)
        ctrl = torch.tensor([0, 0], dtype=torch.int32)
        op(k, *b, ctrl, torch.tensor([5, 11]), src, S)
        assert torch.equal(k, torch.zeros(1, 2, L, D).index_copy_(2, torch.tensor([5, 11]), src))
        _assert_bits(b, k, S, torch.float32, f"row copy, source strides {src.stride()}")
        for bad in (L, -1):
            with pytest.raises(IndexError, match="positions"):
                op(k, *b, ctrl, torch.tensor([3, bad]), src, S)
            assert not bool(k[:, :, 3].any()), "a bad position must leave the cache alone"


@pytest.mark.parametrize("bdt", BOUNDS)
def test_cache_write_stale_flag_rebuilds_every_page(bdt):
    """``ctrl[0] != 0`` (the cache was written behind our back): every page is rebuilt, and the flag is cleared;
    without it only the touched page is recomputed."""
    S, L, D = 8, 48, 16
    gen = make_gen(5)
    k = _keys((1, 2, L, D), gen, torch.float32, False)
    b = _alloc(k, S, bdt, fill=-5.0)  # garbage bounds
    ctrl = torch.tensor([0, 1], dtype=torch.int32)
    op = native_module().cache_write
    op(k, *b, ctrl, torch.tensor([9]), randn((1, 2, 1, D), gen), S)
    assert bool((b[0][:, :, 0] == -5.0).all()), "flag clear: untouched pages must be left alone"
    assert bool((b[0][:, :, 1] != -5.0).any()), "flag clear: the written page must be recomputed"
    ctrl[0] = 1
    op(k, *b, ctrl, torch.tensor([10]), randn((1, 2, 1, D), gen), S)
    assert ctrl.tolist() == [0, 1], "the stale flag is cleared, ctrl[1] kept"
    _assert_bits(b, k, S, bdt, f"stale rebuild bounds={bdt}")


@pytest.mark.parametrize("bdt", BOUNDS)
@pytest.mark.parametrize("dtype", KV)
def test_opcheck_cache_write_native(dtype, bdt):
    """``tinyserve::cache_write`` on CPU (the native kernel) passes opcheck, stale or not, any integer positions."""
    gen = make_gen(17)
    k = randn((2, 2, 21, 8), gen, dtype)
    b = _alloc(k, 4, bdt)
    spec = SelectionSpec(4, 8, 0, 1, 0, False, bdt).to_list()
    for stale, pos in ((1, torch.tensor([4, 20])), (0, torch.tensor(7, dtype=torch.int16))):
        ctrl = torch.tensor([stale, 0], dtype=torch.int32)
        torch.library.opcheck(torch.ops.tinyserve.cache_write.default,
                              (k, *b, ctrl, pos, randn((2, 2, pos.numel(), 8), gen, dtype), spec))
