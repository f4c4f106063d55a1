"""The native CPU kernel of ``tinyserve::paged_sparse_decode`` (kernels/csrc/paged.cpp) against the paged reference
and dense attention, over a case table and hypothesis; the native paged write and stale-page rebuild against their
PyTorch paths; bad page tables refused by name.

Skipped, with the reason, only where the native kernel cannot be built."""
from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyserve_compile.kernels import reference as ref
from tinyserve_compile.kernels.native import load_native, native_unavailable_reason
from tinyserve_compile.kernels.paged_sparse_decode import (
    paged_sparse_decode,
    paged_sparse_decode_reference,
    paged_write_,
    rebuild_pages_,
)
from tinyserve_compile.kernels.spec import SelectionSpec

from test_paged_sparse_decode import PagedBuffer, _assert_bounds_current

pytestmark = pytest.mark.skipif(not load_native(), reason=f"native kernel unavailable: {native_unavailable_reason()}")

BOUNDS = [torch.float32, torch.bfloat16, torch.int8]


def _buffer(lens, S, m, Hkv, D, bdt, seed, dtype=torch.float32, shuffle=True, reuse=False):
    """A paged buffer holding requests of ``lens`` tokens, written in chunks then token by token. ``shuffle``: the
    free blocks in random physical order; ``reuse``: a first request fills blocks and leaves, the others reuse them."""
    gen = torch.Generator().manual_seed(seed)
    n_blocks = sum(math.ceil(n / (S * m)) for n in lens) + 3
    buf = PagedBuffer(n_blocks, m, S, Hkv, D, bdt, gen, dtype)
    if shuffle:
        random.Random(seed).shuffle(buf.free)
    if reuse:
        T = min(3 * S * m, (n_blocks - 1) * S * m)
        buf.write("old", 0, 20 * torch.randn(T, Hkv, D, generator=gen).to(dtype),
                  torch.randn(T, Hkv, D, generator=gen).to(dtype))
        buf.release("old")
    done = [0] * len(lens)
    while any(d < n for d, n in zip(done, lens)):
        for r, n in enumerate(lens):
            if done[r] < n:
                T = min(11 if done[r] == 0 else 1, n - done[r])
                buf.write(r, done[r], torch.randn(T, Hkv, D, generator=gen).to(dtype),
                          torch.randn(T, Hkv, D, generator=gen).to(dtype))
                done[r] += T
    return buf, gen


def _run(buf, gen, lens, G, spec, dtype=torch.float32, scale=0.35):
    rows, ids = buf.table(list(range(len(lens))), lens)
    Hkv, D = buf.k.shape[1], buf.k.shape[2]
    q = torch.randn(len(lens), Hkv * G, 1, D, generator=gen).to(dtype)
    sl = torch.tensor(lens)
    got = paged_sparse_decode(q, buf.k, buf.v, rows, ids, sl, buf.bounds, scale, spec, kernel="native")
    torch_path = paged_sparse_decode(q, buf.k, buf.v, rows, ids, sl, buf.bounds, scale, spec, kernel="torch")
    want = paged_sparse_decode_reference(q, buf.k, buf.v, rows, ids, sl, buf.bounds, scale, spec)
    return q, rows, sl, got, torch_path, want


def _dense(buf, q, lens, scale):
    """Dense attention of each row over its own history ``[R, Hq, 1, D]`` (fp32)."""
    out = []
    for i, n in enumerate(lens):
        k, v = buf.history(i, n)
        G = q.shape[1] // k.shape[1]
        out.append(F.scaled_dot_product_attention(q[i:i + 1].float(), k.float().repeat_interleave(G, 1),
                                                  v.float().repeat_interleave(G, 1), scale=scale))
    return torch.cat(out)


# (lens, S, pages per CB block, Hkv, G, bounds, budget pages, sinks, candidate_factor, extra pages, keep_tokens)
CASES = [
    ([37, 5, 80, 64], 4, 2, 2, 2, torch.float32, 3, 1, 1, 0, False),  # one stage, GQA 2, ragged
    ([37, 5, 80, 64], 4, 2, 2, 2, torch.bfloat16, 3, 1, 1, 0, False),
    ([37, 5, 80, 64], 4, 2, 2, 2, torch.int8, 3, 1, 1, 0, False),
    ([120, 33, 9], 8, 1, 1, 4, torch.int8, 4, 1, 2, 0, False),  # two stages (factor), MQA-like G=4
    ([120, 33, 9], 8, 1, 1, 4, torch.bfloat16, 4, 1, 1, 3, True),  # two stages, kept tokens
    ([200, 17, 150, 1], 16, 2, 2, 3, torch.float32, 3, 0, 1, 4, True),  # page 16, a row of one token
    ([200, 17, 150, 1], 16, 2, 2, 3, torch.int8, 3, 2, 3, 0, False),
    ([64, 64, 64], 2, 2, 3, 1, torch.float32, 5, 1, 1, 6, False),  # one length for all, page 2, no GQA
    ([95, 47], 4, 1, 2, 2, torch.bfloat16, 30, 1, 1, 0, False),  # budget covers every row: dense
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
@pytest.mark.parametrize("reuse", [False, True], ids=["fresh", "reused"])
def test_native_equals_reference_over_case_table(case, reuse):
    lens, S, m, Hkv, G, bdt, kp, sinks, cf, extra, keep = case
    D = 16
    buf, gen = _buffer(lens, S, m, Hkv, D, bdt, seed=len(lens) * 7 + S, reuse=reuse)
    spec = SelectionSpec(S, kp * S, sinks, cf, extra * S, keep, bdt)
    q, rows, sl, got, torch_path, want = _run(buf, gen, lens, G, spec)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(torch_path, want, atol=2e-5, rtol=2e-5)
    dense = _dense(buf, q, lens, 0.35)
    covers = max(math.ceil(n / S) for n in lens) <= kp
    if covers:
        torch.testing.assert_close(got, dense, atol=2e-5, rtol=2e-5)
    else:  # the budget really drops tokens of the long rows
        long_rows = [i for i, n in enumerate(lens) if math.ceil(n / S) > kp]
        assert not torch.allclose(got[long_rows], dense[long_rows], atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_half_caches(dtype):
    lens, S = [70, 23, 41], 8
    buf, gen = _buffer(lens, S, 2, 2, 32, torch.int8, seed=5, dtype=dtype)
    spec = SelectionSpec(S, 3 * S, 1, 1, 2 * S, True, torch.int8)
    _, _, _, got, _, want = _run(buf, gen, lens, 2, spec, dtype=dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@settings(max_examples=40, deadline=None)
@given(S=st.sampled_from([2, 4, 8]), m=st.sampled_from([1, 2]), bdt=st.sampled_from(BOUNDS),
       lens=st.lists(st.integers(1, 90), min_size=1, max_size=5), budget_pages=st.integers(1, 6),
       sink=st.integers(0, 2), cf=st.integers(1, 3), extra_pages=st.integers(0, 4), keep_tokens=st.booleans(),
       G=st.sampled_from([1, 2, 3]), reuse=st.booleans(), seed=st.integers(0, 999))
def test_native_equals_reference_property(S, m, bdt, lens, budget_pages, sink, cf, extra_pages, keep_tokens, G,
                                          reuse, seed):
    sink = min(sink, budget_pages - 1)
    buf, gen = _buffer(lens, S, m, 2, 8, bdt, seed, reuse=reuse)
    spec = SelectionSpec(S, budget_pages * S, sink, cf, extra_pages * S, keep_tokens, bdt)
    _, _, _, got, torch_path, want = _run(buf, gen, lens, G, spec)
    torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(torch_path, want, atol=3e-5, rtol=3e-5)


@settings(max_examples=25, deadline=None)
@given(S=st.sampled_from([2, 4, 8]), m=st.sampled_from([1, 2]), bdt=st.sampled_from(BOUNDS),
       lens=st.lists(st.integers(1, 60), min_size=1, max_size=4), chunk=st.integers(1, 30), seed=st.integers(0, 99))
def test_native_write_equals_torch_write(S, m, bdt, lens, chunk, seed):
    """The same writes through the native and the PyTorch paged write leave equal buffers, bounds and fresh flags,
    and return the same pages."""
    gen = torch.Generator().manual_seed(seed)
    Hkv, D = 2, 8
    n_blocks = sum(math.ceil(n / (S * m)) for n in lens) + 2
    a = PagedBuffer(n_blocks, m, S, Hkv, D, bdt, torch.Generator().manual_seed(seed))
    b = PagedBuffer(n_blocks, m, S, Hkv, D, bdt, torch.Generator().manual_seed(seed))
    done = [0] * len(lens)
    while any(d < n for d, n in zip(done, lens)):
        for r, n in enumerate(lens):
            if done[r] < n:
                T = min(chunk if done[r] == 0 else 1, n - done[r])
                key, value = torch.randn(T, Hkv, D, generator=gen), torch.randn(T, Hkv, D, generator=gen)
                for buf in (a, b):  # the same blocks in both
                    blocks = buf.blocks.setdefault(r, [])
                    while len(blocks) < math.ceil((done[r] + T) / (S * m)):
                        blocks.append(buf.free.pop(0))
                pos = torch.arange(done[r], done[r] + T)
                page_rows, _ = b.page_rows_of(r, math.ceil((done[r] + T) / S))
                rows = torch.tensor(page_rows)[pos // S] + pos % S
                got_native = paged_write_(a.k, a.v, key, value, rows, a.bounds, a.fresh, S, a.rows_per_block, m,
                                          kernel="native")
                got_torch = paged_write_(b.k, b.v, key, value, rows, b.bounds, b.fresh, S, b.rows_per_block, m,
                                         kernel="torch")
                assert torch.equal(got_native, got_torch)
                done[r] += T
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(a.fresh, b.fresh)
    for x, y in zip(a.bounds, b.bounds):
        assert torch.equal(x, y)
    _assert_bounds_current(a, range(len(lens)), lens)


@pytest.mark.parametrize("bdt", BOUNDS)
def test_native_rebuild_of_stale_pages(bdt):
    """Stale pages rebuilt by the native kernel equal the PyTorch rebuild from the buffer as it is."""
    lens, S = [29, 40], 4
    buf, _ = _buffer(lens, S, 2, 2, 8, bdt, seed=11)
    buf.k.neg_()  # a write that was not ours
    rows, ids = buf.table([0, 1], lens)
    P = rows.shape[1]
    valid = torch.arange(P)[None, :] * S < torch.tensor(lens)[:, None]
    slots = (torch.tensor(lens)[:, None] - torch.arange(P)[None, :] * S).clamp(max=S)[valid]
    other = ref.PageBounds(*[t.clone() for t in buf.bounds])
    fresh_a, fresh_b = torch.zeros_like(buf.fresh), torch.zeros_like(buf.fresh)
    rebuild_pages_(buf.k, buf.bounds, fresh_a, rows[valid], slots, ids[valid], S, kernel="native")
    rebuild_pages_(buf.k, other, fresh_b, rows[valid], slots, ids[valid], S, kernel="torch")
    assert torch.equal(fresh_a, fresh_b) and int(fresh_a.sum()) == int(valid.sum())
    for x, y in zip(buf.bounds, other):
        assert torch.equal(x, y)
    buf.fresh.copy_(fresh_a)
    _assert_bounds_current(buf, [0, 1], lens)


def test_native_refuses_a_bad_page_table_by_name():
    buf, gen = _buffer([20, 9], 4, 1, 1, 8, torch.float32, seed=1)
    rows, ids = buf.table([0, 1], [20, 9])
    q = torch.randn(2, 2, 1, 8, generator=gen)
    spec = SelectionSpec(4, 8, 0, 1, 0, False, torch.float32)
    sl = torch.tensor([20, 9])
    bad_ids = ids.clone()
    bad_ids[0, 1] = buf.bounds.kmax.shape[0]
    with pytest.raises(ValueError, match="page_ids"):
        paged_sparse_decode(q, buf.k, buf.v, rows, bad_ids, sl, buf.bounds, spec=spec, kernel="native")
    bad_rows = rows.clone()
    bad_rows[1, 0] = buf.k.shape[0] - 2
    with pytest.raises(ValueError, match="page_rows"):
        paged_sparse_decode(q, buf.k, buf.v, bad_rows, ids, sl, buf.bounds, spec=spec, kernel="native")
    with pytest.raises(ValueError, match="seq_lens"):
        paged_sparse_decode(q, buf.k, buf.v, rows, ids, torch.tensor([20, 99]), buf.bounds, spec=spec, kernel="native")
    with pytest.raises(ValueError, match="kernel"):
        paged_sparse_decode(q, buf.k, buf.v, rows, ids, sl, buf.bounds, spec=spec, kernel="triton")
    with pytest.raises(ValueError, match="write_rows"):
        paged_write_(buf.k, buf.v, torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), torch.tensor([buf.k.shape[0]]),
                     buf.bounds, buf.fresh, 4, buf.rows_per_block, 1, kernel="native")


def test_dispatcher_reaches_the_native_kernel():
    """With the native module loaded, the op's CPU kernel is the C++ one: the Python kernel is not called."""
    import tinyserve_compile.kernels.paged_sparse_decode as psd

    buf, gen = _buffer([30, 12], 4, 1, 1, 8, torch.float32, seed=2)
    rows, ids = buf.table([0, 1], [30, 12])
    q = torch.randn(2, 2, 1, 8, generator=gen)
    spec = SelectionSpec(4, 8, 0, 1, 0, False, torch.float32)
    calls = []
    real = psd._paged_sparse_decode_torch
    psd._paged_sparse_decode_torch = lambda *a: calls.append(1) or real(*a)
    try:
        paged_sparse_decode(q, buf.k, buf.v, rows, ids, torch.tensor([30, 12]), buf.bounds, spec=spec)
        assert calls == []
        paged_sparse_decode(q, buf.k, buf.v, rows, ids, torch.tensor([30, 12]), buf.bounds, spec=spec, kernel="torch")
        assert calls == [1]
    finally:
        psd._paged_sparse_decode_torch = real


def test_native_key_and_value_views_of_different_lengths():
    """An engine's key and value views of one cache tensor may hold different numbers of rows (CB's do): every row
    a table names is in both, and the result is the reference's."""
    lens, S = [33, 12], 4
    buf, gen = _buffer(lens, S, 1, 2, 8, torch.int8, seed=4, shuffle=False)
    rows, ids = buf.table([0, 1], lens)
    used = int((rows + S).max())
    v_short = buf.v[:used]  # fewer rows than the keys
    assert v_short.shape[0] < buf.k.shape[0]
    q = torch.randn(2, 4, 1, 8, generator=gen)
    spec = SelectionSpec(S, 2 * S, 1, 1, S, True, torch.int8)
    sl = torch.tensor(lens)
    got = paged_sparse_decode(q, buf.k, v_short, rows, ids, sl, buf.bounds, 0.3, spec, kernel="native")
    want = paged_sparse_decode_reference(q, buf.k, v_short, rows, ids, sl, buf.bounds, 0.3, spec)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
