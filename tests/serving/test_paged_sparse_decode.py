"""Paged sparse decode over a shared paged buffer: the write keeps the bounds of every touched page equal to a rebuild
from scratch (page reuse included), and the fast path equals the per-row reference, which is the static path's
reference on each row's history."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyserve_compile.kernels import reference as ref
from tinyserve_compile.kernels.spec import SelectionSpec
from tinyserve_compile.kernels.paged_sparse_decode import (
    gather_pages,
    paged_page_bounds,
    paged_sparse_decode,
    paged_sparse_decode_reference,
    paged_write_,
)

BOUNDS = [torch.float32, torch.bfloat16, torch.int8]


class PagedBuffer:
    """A paged buffer laid out like an engine's: blocks of ``rows_per_block`` rows whose first
    ``pages_per_block * S`` rows belong to this layer (the rest to other layers, never read here)."""

    def __init__(self, n_blocks, pages_per_block, S, Hkv, D, bounds_dtype, gen, dtype=torch.float32):
        self.S, self.m = S, pages_per_block
        self.rows_per_block = 2 * pages_per_block * S + 3  # an odd stride, as if other layers sat in between
        n_rows = n_blocks * self.rows_per_block
        self.k = torch.randn(n_rows, Hkv, D, generator=gen).to(dtype)  # junk left by earlier owners
        self.v = torch.randn(n_rows, Hkv, D, generator=gen).to(dtype)
        NP = n_blocks * pages_per_block
        z = ref.store_bounds(torch.zeros(NP, Hkv, D), torch.zeros(NP, Hkv, D), bounds_dtype)
        self.bounds = ref.PageBounds(z.kmax.clone(), z.kmin.clone(), z.kabs.clone())
        self.fresh = torch.zeros(NP, dtype=torch.bool)
        self.free = list(range(n_blocks))
        self.blocks = {}  # request -> its blocks

    def page_rows_of(self, req, n_pages):
        """(first row, physical id) of the request's first ``n_pages`` pages."""
        rows, ids = [], []
        for p in range(n_pages):
            b, sub = self.blocks[req][p // self.m], p % self.m
            rows.append(b * self.rows_per_block + sub * self.S)
            ids.append(b * self.m + sub)
        return rows, ids

    def write(self, req, past, key, value):
        """Append ``key``/``value`` ``[T, Hkv, D]`` to request ``req`` holding ``past`` tokens."""
        T = key.shape[0]
        need = math.ceil((past + T) / (self.S * self.m))
        blocks = self.blocks.setdefault(req, [])
        while len(blocks) < need:
            blocks.append(self.free.pop(0))
        pos = torch.arange(past, past + T)
        page_rows, _ = self.page_rows_of(req, math.ceil((past + T) / self.S))
        rows = torch.tensor(page_rows)[pos // self.S] + pos % self.S
        paged_write_(self.k, self.v, key, value, rows, self.bounds, self.fresh, self.S, self.rows_per_block, self.m)

    def release(self, req):
        self.free = self.blocks.pop(req) + self.free  # reused first

    def table(self, reqs, lens):
        P = max(math.ceil(n / self.S) for n in lens)
        rows = torch.zeros(len(reqs), P, dtype=torch.int64)
        ids = torch.zeros(len(reqs), P, dtype=torch.int64)
        for i, (r, n) in enumerate(zip(reqs, lens)):
            pr, pi = self.page_rows_of(r, math.ceil(n / self.S))
            rows[i, :len(pr)], ids[i, :len(pi)] = torch.tensor(pr), torch.tensor(pi)
        return rows, ids

    def history(self, req, n):
        """The request's keys and values ``[1, Hkv, n, D]``, copied out."""
        rows, _ = self.page_rows_of(req, math.ceil(n / self.S))
        t = torch.tensor(rows)[None]
        return gather_pages(self.k, t, self.S)[:, :, :n], gather_pages(self.v, t, self.S)[:, :, :n]


def _fill(buf, lens, Hkv, D, gen, chunk, released=()):
    """Write each request in chunks of ``chunk`` tokens (prefill) then one token at a time, interleaved."""
    done = {r: 0 for r in range(len(lens))}
    while any(done[r] < n for r, n in enumerate(lens)):
        for r, n in enumerate(lens):
            if done[r] < n:
                T = min(chunk if done[r] == 0 else 1, n - done[r])
                buf.write(r, done[r], torch.randn(T, Hkv, D, generator=gen), torch.randn(T, Hkv, D, generator=gen))
                done[r] += T


def _assert_bounds_current(buf, reqs, lens):
    for r, n in zip(reqs, lens):
        P = math.ceil(n / buf.S)
        rows, ids = buf.page_rows_of(r, P)
        slots = torch.tensor([min(buf.S, n - p * buf.S) for p in range(P)])
        fresh = paged_page_bounds(buf.k, torch.tensor(rows), slots, buf.S, buf.bounds.kmax.dtype)
        ids = torch.tensor(ids)
        assert bool(buf.fresh[ids].all())
        assert torch.equal(buf.bounds.kmax[ids], fresh.kmax) and torch.equal(buf.bounds.kmin[ids], fresh.kmin)
        assert torch.equal(buf.bounds.kabs[ids], fresh.kabs)
        # and they are the static path's bounds of the request's contiguous history
        k, _ = buf.history(r, n)
        st_b = ref.page_bounds(k, buf.S, dtype=buf.bounds.kmax.dtype)
        assert torch.equal(st_b.kmax[0].transpose(0, 1), fresh.kmax) and torch.equal(st_b.kabs[0].T, fresh.kabs)


@settings(max_examples=40, deadline=None)
@given(S=st.sampled_from([2, 4, 8]), m=st.sampled_from([1, 2]), bdt=st.sampled_from(BOUNDS),
       lens=st.lists(st.integers(1, 70), min_size=1, max_size=4), chunk=st.integers(1, 40), seed=st.integers(0, 99))
def test_write_keeps_bounds_of_touched_pages_equal_to_a_rebuild(S, m, bdt, lens, chunk, seed):
    gen = torch.Generator().manual_seed(seed)
    Hkv, D = 2, 8
    n_blocks = sum(math.ceil(n / (S * m)) for n in lens) + 2
    buf = PagedBuffer(n_blocks, m, S, Hkv, D, bdt, gen)
    _fill(buf, lens, Hkv, D, gen, chunk)
    _assert_bounds_current(buf, range(len(lens)), lens)


def test_reused_pages_forget_their_previous_owner():
    gen = torch.Generator().manual_seed(3)
    S, Hkv, D = 4, 2, 8
    buf = PagedBuffer(6, 1, S, Hkv, D, torch.float32, gen)
    buf.write("a", 0, 50 * torch.ones(22, Hkv, D), torch.ones(22, Hkv, D))  # huge keys fill 6 pages
    blocks_a = list(buf.blocks["a"])
    buf.release("a")
    buf.write("b", 0, torch.randn(5, Hkv, D, generator=gen), torch.randn(5, Hkv, D, generator=gen))
    assert buf.blocks["b"] == blocks_a[:2]  # the same physical pages
    _assert_bounds_current(buf, ["b"], [5])
    assert float(buf.bounds.kmax[blocks_a[1]].max()) < 50  # the partial page's bound no longer sees a's keys


@settings(max_examples=60, deadline=None)
@given(S=st.sampled_from([2, 4, 8]), m=st.sampled_from([1, 2]), bdt=st.sampled_from(BOUNDS),
       lens=st.lists(st.integers(1, 80), min_size=1, max_size=4), budget_pages=st.integers(1, 6),
       sink=st.integers(0, 2), extra_pages=st.integers(0, 4), keep_tokens=st.booleans(), G=st.sampled_from([1, 2]),
       seed=st.integers(0, 999))
def test_fast_path_equals_per_row_reference(S, m, bdt, lens, budget_pages, sink, extra_pages, keep_tokens, G, seed):
    sink = min(sink, budget_pages - 1)
    gen = torch.Generator().manual_seed(seed)
    Hkv, D = 2, 8
    n_blocks = sum(math.ceil(n / (S * m)) for n in lens) + 1
    buf = PagedBuffer(n_blocks, m, S, Hkv, D, bdt, gen)
    _fill(buf, lens, Hkv, D, gen, chunk=7)
    reqs = list(range(len(lens)))
    rows, ids = buf.table(reqs, lens)
    q = torch.randn(len(lens), Hkv * G, 1, D, generator=gen)
    sl = torch.tensor(lens)
    kw = dict(scale=0.3, spec=SelectionSpec(S, budget_pages * S, sink, 1, extra_pages * S, keep_tokens,
                                            buf.bounds.kmax.dtype))
    want = paged_sparse_decode_reference(q, buf.k, buf.v, rows, ids, sl, buf.bounds, **kw)
    got = paged_sparse_decode(q, buf.k, buf.v, rows, ids, sl, buf.bounds, **kw)
    torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)
    # the reference is the static path's reference on each row's contiguous history
    for i, (r, n) in enumerate(zip(reqs, lens)):
        k, v = buf.history(r, n)
        one = ref.sparse_decode_reference(q[i:i + 1], k, v, n, bounds=ref.page_bounds(k, S, dtype=bdt), **kw)
        torch.testing.assert_close(want[i:i + 1], one, atol=0, rtol=0)


def test_small_budget_drops_tokens():
    """The op is not dense attention in disguise: with a budget of two pages out of twelve (and two more candidates:
    rows of more than four pages are sparse), the output differs."""
    gen = torch.Generator().manual_seed(0)
    S, Hkv, D = 4, 2, 8
    buf = PagedBuffer(20, 1, S, Hkv, D, torch.float32, gen)
    _fill(buf, [48, 30], Hkv, D, gen, chunk=48)
    rows, ids = buf.table([0, 1], [48, 30])
    q = 3 * torch.randn(2, 4, 1, D, generator=gen)
    got = paged_sparse_decode(q, buf.k, buf.v, rows, ids, torch.tensor([48, 30]), buf.bounds,
                              spec=SelectionSpec.default(page_size=S, token_budget=2 * S, sink_pages=0,
                                                         candidate_extra=2 * S, bounds_dtype=buf.bounds.kmax.dtype))
    dense = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        q[i:i + 1], *[t.repeat_interleave(2, 1) for t in buf.history(i, n)]) for i, n in enumerate([48, 30])])
    for i in range(2):
        assert not torch.allclose(got[i], dense[i], atol=1e-3), f"row {i}"


def test_bad_table_is_refused_by_name():
    k = torch.zeros(16, 1, 4)
    b = ref.store_bounds(torch.zeros(4, 1, 4), torch.zeros(4, 1, 4))
    with pytest.raises(ValueError, match="seq_lens"):
        paged_sparse_decode(torch.zeros(2, 1, 1, 4), k, k, torch.zeros(2, 1, dtype=torch.int64),
                            torch.zeros(2, 1, dtype=torch.int64), torch.tensor([1]), b,
                            spec=SelectionSpec.default(page_size=4, token_budget=8, sink_pages=0))
    with pytest.raises(ValueError, match="page_ids"):
        paged_sparse_decode(torch.zeros(2, 1, 1, 4), k, k, torch.zeros(2, 1, dtype=torch.int64),
                            torch.zeros(2, 2, dtype=torch.int64), torch.tensor([1, 1]), b,
                            spec=SelectionSpec.default(page_size=4, token_budget=8, sink_pages=0))
