"""The native op's partial selection (``select_top`` in kernels/csrc/radix_select.h) against a sort.

Four paths give one result: a sampled threshold where at most a fifth is kept (n >= 4096), a sampled bracket around
the threshold (n >= 512), a heap of the few left out where all but at most 64 are kept, radix select otherwise or when
a sample misses. Each is checked against a stable sort on the same float order (NaN above +inf, -0.0 below +0.0, ties
to the lowest index, -inf never kept), and the op's kept pages at a context long enough for the sampled path against
the reference selection.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyserve_compile.kernels import reference as ref
from tinyserve_compile.kernels.native import load_native, native_module, native_unavailable_reason
from tinyserve_compile.kernels.spec import SelectionSpec

pytestmark = pytest.mark.skipif(not load_native(), reason=f"native kernel unavailable: {native_unavailable_reason()}")


def _sorted_top(w: torch.Tensor, n_keep: int) -> list[int]:
    """Indices of the n_keep largest of w by a stable sort on the order-preserving uint32 key, ascending."""
    u = w.numpy().view(np.uint32).astype(np.int64)
    key = np.where(u & 0x80000000, ~u & 0xFFFFFFFF, u | 0x80000000)
    key = np.where(np.isnan(w.numpy()), 0xFFFFFFFF, key)
    order = np.argsort(-key, kind="stable")[:n_keep]
    return sorted(int(i) for i in order if w[i] != float("-inf"))


def _both(w: torch.Tensor, n_keep: int) -> tuple[list[int], list[int]]:
    """(the op's selection, its radix path alone)."""
    m = native_module()
    return m.select_top(w, n_keep, False).tolist(), m.select_top(w, n_keep, True).tolist()


_SPECIAL = st.sampled_from([float("-inf"), float("inf"), float("nan"), 0.0, -0.0, 1.0, -1.0, 3.5])


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 6000),
    frac=st.floats(0.0, 1.1),
    levels=st.sampled_from([0, 3, 50]),
    n_special=st.integers(0, 40),
    seed=st.integers(0, 2**31 - 1),
    special=st.lists(_SPECIAL, min_size=1, max_size=4),
)
def test_select_top_is_a_stable_sort(n, frac, levels, n_special, seed, special):
    """Any scores (continuous, a few tied levels, infinities, NaN, signed zeros): both paths equal the sort."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g)
    if levels:
        w = torch.randint(0, levels, (n,), generator=g).float()
    pos = torch.randint(0, n, (n_special,), generator=g)
    for i, p in enumerate(pos.tolist()):
        w[p] = special[i % len(special)]
    n_keep = int(frac * n)
    want = _sorted_top(w, n_keep)
    fast, radix = _both(w, n_keep)
    assert radix == want, f"radix path: n={n} n_keep={n_keep}"
    assert fast == want, f"sampled, bracket or heap path: n={n} n_keep={n_keep}"


@pytest.mark.parametrize(
    "name",
    ["normal", "ascending", "descending", "all_tied", "sample_positions_high", "mostly_neg_inf", "peaks"],
)
@pytest.mark.parametrize("n, n_keep", [(8192, 384), (3072, 2048), (1024, 384), (2100, 2048)])
def test_select_top_sampled_paths_and_their_fallbacks(name, n, n_keep):
    """Shapes of the sampled path (8192 keys, a fifth or less kept) and of the bracket (3072, 1024 and 2100 keys),
    including samples that miss: every key tied (too many at the sample's threshold, or in the bracket), and high
    keys exactly at the sampled positions (too few)."""
    g = torch.Generator().manual_seed(7)
    w = {
        "normal": lambda: torch.randn(n, generator=g),
        "ascending": lambda: torch.arange(n, dtype=torch.float32),
        "descending": lambda: -torch.arange(n, dtype=torch.float32),
        "all_tied": lambda: torch.full((n,), 2.0),
        "sample_positions_high": lambda: torch.zeros(n).index_fill_(0, torch.arange(256) * n // 256, 1.0),
        "mostly_neg_inf": lambda: torch.where(torch.rand(n, generator=g) < 0.97, float("-inf"), 1.0),
        "peaks": lambda: torch.randn(n, generator=g) + 40.0 * (torch.arange(n) % 997 < 3).float(),
    }[name]()
    want = _sorted_top(w, n_keep)
    fast, radix = _both(w, n_keep)
    assert radix == want
    assert fast == want
    assert len(want) == min(n_keep, int((w != float("-inf")).sum()))


@pytest.mark.parametrize("n", [70, 2056, 5000])
@pytest.mark.parametrize("d", [1, 8, 64, 65])
@pytest.mark.parametrize("kind", ["normal", "tied", "special", "descending"])
def test_select_top_all_but_a_few(n, d, kind):
    """All but d kept (the heap path for d <= 64 below 512 keys, or where the bracket misses; the bracket or radix
    select otherwise): ties, infinities and NaN among the few."""
    g = torch.Generator().manual_seed(n * 100 + d)
    w = {
        "normal": lambda: torch.randn(n, generator=g),
        "tied": lambda: torch.randint(0, 4, (n,), generator=g).float(),
        "special": lambda: torch.randn(n, generator=g).index_put_(
            (torch.randint(0, n, (3 * d,), generator=g),),
            torch.tensor([float("-inf"), float("nan"), float("inf")]).repeat(d)),
        "descending": lambda: -torch.arange(n, dtype=torch.float32),
    }[kind]()
    n_keep = n - d
    want = _sorted_top(w, n_keep)
    fast, radix = _both(w, n_keep)
    assert radix == want
    assert fast == want


def test_select_top_names_bad_arguments():
    m = native_module()
    with pytest.raises(RuntimeError, match="argument 'w'"):
        m.select_top(torch.zeros(4, dtype=torch.float64), 2, True)
    with pytest.raises(RuntimeError, match="argument 'n_keep'"):
        m.select_top(torch.zeros(4), -1, True)


@pytest.mark.parametrize("seed", [0, 1])
def test_long_context_selection_matches_the_reference(seed):
    """16K tokens in pages of 8 (2048 pages, 160 candidates: the sampled path): the op's kept pages and output
    against the reference's."""
    B, Hkv, G, L, D, S = 1, 2, 3, 16384, 32, 8
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, 1, D, generator=g)
    k = torch.randn(B, Hkv, L, D, generator=g)
    v = torch.randn(B, Hkv, L, D, generator=g)
    k[:, :, 5000:5100] += 2.0 * q[:, ::G].transpose(1, 2).reshape(B, Hkv, 1, D)  # a region the query attends to
    bounds = ref.page_bounds(k, S, dtype=torch.int8)
    vl = torch.tensor([L])
    scale = D**-0.5
    spec = SelectionSpec(S, 1024, 1, 1, 256, False, torch.int8)  # 128 + 32 candidate pages, no token keep
    m = native_module()
    out = m.sparse_decode(q, k, v, bounds.kmax, bounds.kmin, bounds.kabs, vl, None, scale, spec.to_list(), None)
    kept = m.kept_pages(q, k, bounds.kmax, bounds.kmin, bounds.kabs, vl, None, scale, spec.to_list(), None)
    sel, unit = ref.choose(q, k, bounds, vl, None, scale, spec)
    tok = ref.selected_token_mask(sel, unit, L, vl)  # [B,Hkv,L]
    want_pages = tok.reshape(B, Hkv, L // S, S).any(-1)
    assert torch.equal(kept, want_pages), f"{int((kept != want_pages).sum())} pages differ"
    want = ref.sparse_decode_reference(q, k, v, vl, None, scale, spec, bounds)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
