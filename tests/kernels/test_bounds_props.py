"""Properties of the page bound and of page selection.

(a) ``page_scores`` (with its rounding slack) is at least ``scale * max q.k`` over a
    page's valid keys, whether that logit is computed exactly (float64 from the
    stored key values) or by an fp32 matmul as the op does.
(b) Under GQA the KV-head score is at least every query head's true page max.
(a) and (b) hold for bounds stored as fp32, bf16 and int8 (both rounded outward).
(d) The page of the newest token and the sink pages are always selected; nothing
    past ``valid_len`` ever is.
"""
from __future__ import annotations

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.support.kernel_checks import DTYPES, assert_ge_report, make_gen, randn
from tinyserve_compile.kernels.spec import SelectionSpec
from tinyserve_compile.kernels import reference as ref

# magnitudes per dtype: fp16 tops out at 65504, keep products finite in fp32 for all
MAGS = {
    "fp32": [0.0, 1e-20, 1e-3, 1.0, 30.0, 1e4],
    "fp16": [0.0, 1e-4, 1.0, 30.0, 6e4],
    "bf16": [0.0, 1e-20, 1e-3, 1.0, 30.0, 1e4],
}


@st.composite
def bound_case(draw, gqa: bool):
    """A random key cache, query and layout; the data itself comes from a seeded generator."""
    dtype_name = draw(st.sampled_from(sorted(DTYPES)))
    S = draw(st.sampled_from([1, 2, 3, 4, 8]))
    L = draw(st.integers(1, 40))
    D = draw(st.sampled_from([1, 2, 3, 8, 16, 64]))
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.integers(1, 3)) if gqa else 1
    valid_len = draw(st.lists(st.integers(1, L), min_size=B, max_size=B))
    kmag = draw(st.sampled_from(MAGS[dtype_name]))
    qmag = draw(st.sampled_from(MAGS[dtype_name]))
    pattern = draw(st.sampled_from(["normal", "negative", "positive", "sparse_zeros", "constant"]))
    scale = draw(st.sampled_from([None, 1.0, 0.01, 3.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    bounds_dtype = draw(st.sampled_from(["float32", "bfloat16", "int8"]))
    return dict(dtype=DTYPES[dtype_name], S=S, L=L, D=D, B=B, Hkv=Hkv, G=G, valid_len=valid_len, kmag=kmag,
                qmag=qmag, pattern=pattern, scale=scale, seed=seed, bounds_dtype=bounds_dtype)


def _build(c):
    """Keys ``[B,Hkv,L,D]`` and query ``[B,Hq,1,D]`` in ``c['dtype']`` following ``c['pattern']``."""
    gen = make_gen(c["seed"])
    B, Hkv, L, D, dt = c["B"], c["Hkv"], c["L"], c["D"], c["dtype"]
    k = randn((B, Hkv, L, D), gen, torch.float64, c["kmag"])
    if c["pattern"] == "negative":
        k = -k.abs()
    elif c["pattern"] == "positive":
        k = k.abs()
    elif c["pattern"] == "sparse_zeros":
        k = k * (torch.rand(k.shape, generator=gen, dtype=torch.float64) < 0.3)
    elif c["pattern"] == "constant":
        k = k[:, :, :1].expand(B, Hkv, L, D)
    lim = torch.finfo(dt).max
    k = k.clamp(-lim, lim).to(dt)
    q = randn((B, Hkv * c["G"], 1, D), gen, dt, c["qmag"])
    scale = c["scale"] if c["scale"] is not None else 1.0 / D**0.5
    return q, k, scale


def _true_page_max(q, k, valid_len, S, scale, exact: bool):
    """``[B, Hq, P]`` max logit over each page's valid keys (-inf for pages with none).

    exact=True: float64 from the stored values (exact products, ~exact sums);
    exact=False: fp32 matmul, the way the op computes its logits.
    """
    B, Hq, _, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    if exact:
        logits = (q.double() @ k.double().repeat_interleave(G, 1).transpose(-1, -2)) * scale  # [B,Hq,1,L]
    else:
        logits = (q.float().reshape(B, Hkv, G, D) @ k.float().transpose(-1, -2)) * scale  # [B,Hkv,G,L]
        logits = logits.reshape(B, Hq, 1, L).double()
    logits = logits[:, :, 0, :]
    vl = torch.tensor(valid_len)
    logits = logits.masked_fill(~(torch.arange(L)[None, :] < vl[:, None])[:, None, :], float("-inf"))
    P = ref.num_pages(L, S)
    pad = P * S - L
    logits = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
    return logits.reshape(B, Hq, P, S).amax(-1)


@settings(max_examples=150, deadline=None)
@given(bound_case(gqa=False))
def test_page_score_bounds_every_valid_key(c):
    """(a) score >= scale*q.k for every valid key of the page, exact and fp32-matmul logits."""
    q, k, scale = _build(c)
    vl = torch.tensor(c["valid_len"])
    bounds = ref.page_bounds(k, c["S"], vl, dtype=getattr(torch, c["bounds_dtype"]))
    scores = ref.page_scores(q, bounds, scale, group_reduce=False)  # [B,Hq,P]
    assert scores.dtype == torch.float32
    assert bool(torch.isfinite(scores).all()), f"non-finite score: {scores}"
    for exact in (True, False):
        true_max = _true_page_max(q, k, c["valid_len"], c["S"], scale, exact)  # [B,Hq,P]
        has_key = torch.isfinite(true_max)
        assert_ge_report(scores.masked_fill(~has_key, 0.0), true_max.masked_fill(~has_key, 0.0),
                         f"page score vs {'exact' if exact else 'fp32'} logits, case {c}")


@settings(max_examples=100, deadline=None)
@given(bound_case(gqa=True))
def test_group_score_bounds_every_head(c):
    """(b) the GQA group score bounds each query head's true page max."""
    q, k, scale = _build(c)
    vl = torch.tensor(c["valid_len"])
    bounds = ref.page_bounds(k, c["S"], vl, dtype=getattr(torch, c["bounds_dtype"]))
    group = ref.page_scores(q, bounds, scale)  # [B,Hkv,P]
    B, Hkv, P = group.shape
    assert group.shape == (c["B"], c["Hkv"], ref.num_pages(c["L"], c["S"]))
    per_head = group.repeat_interleave(c["G"], dim=1)  # [B,Hq,P]
    for exact in (True, False):
        true_max = _true_page_max(q, k, c["valid_len"], c["S"], scale, exact)
        has_key = torch.isfinite(true_max)
        assert_ge_report(per_head.masked_fill(~has_key, 0.0), true_max.masked_fill(~has_key, 0.0),
                         f"group score vs {'exact' if exact else 'fp32'} per-head logits, case {c}")


def test_page_bounds_partial_page_and_valid_len_exact():
    """kmax/kmin equal a per-page loop over the valid keys; empty pages hold zeros."""
    gen = make_gen(0)
    k = randn((2, 3, 13, 5), gen)
    vl = torch.tensor([13, 6])
    b = ref.page_bounds(k, 4, vl)
    assert b.kmax.shape == (2, 3, 4, 5) and b.kabs.shape == (2, 3, 4)
    for bi in range(2):
        for p in range(4):
            lo, hi = p * 4, min(p * 4 + 4, int(vl[bi]))
            if lo >= hi:
                assert torch.equal(b.kmax[bi, :, p], torch.zeros(3, 5)), (bi, p)
                assert torch.equal(b.kmin[bi, :, p], torch.zeros(3, 5)), (bi, p)
                continue
            assert torch.equal(b.kmax[bi, :, p], k[bi, :, lo:hi].amax(1)), (bi, p)
            assert torch.equal(b.kmin[bi, :, p], k[bi, :, lo:hi].amin(1)), (bi, p)
            want_abs = torch.maximum(k[bi, :, lo:hi].amax(1).abs(), k[bi, :, lo:hi].amin(1).abs()).amax(-1)
            assert torch.equal(b.kabs[bi, :, p], want_abs), (bi, p)


@st.composite
def selection_case(draw):
    S = draw(st.sampled_from([1, 2, 4, 8]))
    K = draw(st.integers(1, 6))
    P = draw(st.integers(1, 24))
    L = draw(st.integers(max(1, (P - 1) * S + 1), P * S))
    B = draw(st.integers(1, 3))
    valid_len = draw(st.lists(st.integers(1, L), min_size=B, max_size=B))
    sink = draw(st.integers(0, K - 1))
    cf = draw(st.sampled_from([1, 1, 2, 3]))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.integers(1, 3))
    mask_kind = draw(st.sampled_from([None, "hide_newest_page", "random_bool", "additive"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(S=S, K=K, L=L, B=B, valid_len=valid_len, sink=sink, cf=cf, Hkv=Hkv, G=G, mask_kind=mask_kind,
                seed=seed)


@settings(max_examples=150, deadline=None)
@given(selection_case())
# found by the suite: row 1's page 1 hidden by the mask from its only head, left out of the dense row's list
@example(dict(S=1, K=2, L=5, B=3, valid_len=[1, 3, 5], sink=0, cf=2, Hkv=1, G=1, mask_kind="random_bool", seed=0))
def test_newest_and_sink_pages_always_selected(c):
    """(d) the newest token's page and the sink pages are in every selection; no page past valid_len is."""
    gen = make_gen(c["seed"])
    B, Hkv, G, L, S, D = c["B"], c["Hkv"], c["G"], c["L"], c["S"], 4
    Hq = Hkv * G
    q = randn((B, Hq, 1, D), gen)
    k = randn((B, Hkv, L, D), gen)
    # make the newest page look unattractive: its keys anti-align with the query
    vl = torch.tensor(c["valid_len"])
    newest_page = (vl - 1) // S  # [B]
    for b in range(B):
        lo = int(newest_page[b]) * S
        k[b, :, lo:lo + S] = -10.0 * q[b].reshape(Hkv, G, D).mean(1, keepdim=True).sign()
    mask = None
    if c["mask_kind"] == "hide_newest_page":
        mask = torch.ones(B, 1, 1, L, dtype=torch.bool)
        for b in range(B):
            lo = int(newest_page[b]) * S
            mask[b, :, :, lo:lo + S] = False
    elif c["mask_kind"] == "random_bool":
        mask = torch.rand(B, Hq, 1, L, generator=gen) < 0.6
    elif c["mask_kind"] == "additive":
        mask = randn((B, 1, 1, L), gen, scale=5.0)
    bounds = ref.page_bounds(k, S)
    spec = SelectionSpec(S, c["K"] * S, c["sink"], c["cf"], 0, False, torch.float32)
    sel = ref.choose_pages(q, k, bounds, vl, mask, 1.0, spec)
    n_valid = (vl + S - 1) // S
    if sel is None:
        assert int(n_valid.max()) <= spec.n_dense_pages, \
            f"dense only when every row's valid pages fit the budget or are all candidates: {n_valid}, {c}"
    else:
        assert int(n_valid.max()) > spec.n_dense_pages, f"rows of at most max(K, N1) pages are dense: {c}"
        # two-stage, rows whose valid pages are all candidates keep every one (dense): the lists are N1 wide
        dense_row = (n_valid <= spec.n_candidates) & spec.two_stage  # [B]
        width = spec.n_candidates if bool(dense_row.any()) else c["K"]
        assert sel.idx.shape == (B, Hkv, min(width, ref.num_pages(L, S))), sel.idx.shape
        chosen = torch.zeros(B, Hkv, ref.num_pages(L, S), dtype=torch.bool)
        chosen.scatter_(2, sel.idx, sel.ok)
        for b in range(B):
            nb = int(newest_page[b])
            assert bool(chosen[b, :, nb].all()), f"newest page {nb} of row {b} not selected: {sel}, {c}"
            for p in range(min(c["sink"], int(n_valid[b]))):
                assert bool(chosen[b, :, p].all()), f"sink page {p} of row {b} not selected: {sel}, {c}"
            assert not bool(chosen[b, :, int(n_valid[b]):].any()), f"page past valid_len selected: {sel}, {c}"
        tokens = ref.selected_token_mask(sel, S, L, vl)  # [B,Hkv,L]
        for b in range(B):
            assert bool(tokens[b, :, int(vl[b]) - 1].all()), f"newest token of row {b} not read"
            assert not bool(tokens[b, :, int(vl[b]):].any()), f"token past valid_len read in row {b}"
        # indices strictly ascending (each page once); at most K pages, or every valid page of a dense row
        assert bool((sel.idx[..., 1:] > sel.idx[..., :-1]).all()), sel.idx
        # a page whose every token the bool mask hides from every query head of the group scores -inf and may be
        # left out of a dense row's list: its tokens have no weight either way
        P = ref.num_pages(L, S)
        hidden = torch.zeros(B, Hkv, P, dtype=torch.bool)
        if mask is not None and mask.dtype == torch.bool:
            seen = torch.nn.functional.pad(mask.expand(B, Hq, 1, L)[:, :, 0], (0, P * S - L))  # [B,Hq,P*S]
            hidden = ~seen.reshape(B, Hkv, G, P, S).any(-1).any(2)  # [B,Hkv,P]
        for b in range(B):
            if bool(dense_row[b]):
                nv = int(n_valid[b])
                assert bool((chosen[b, :, :nv] | hidden[b, :, :nv]).all()), f"dense row {b} misses a page: {sel}, {c}"
            else:
                assert int(sel.ok[b].sum(-1).max()) <= c["K"], f"row {b} keeps more than K pages: {sel}, {c}"


def test_select_pages_everything_fits_is_dense():
    """When all valid pages fit the budget the selection is None (exact dense)."""
    scores = torch.randn(2, 3, 10)
    assert ref.select_pages(scores, torch.tensor([40, 17]), 4, 40) is None
    sel = ref.select_pages(scores, torch.tensor([41, 17]), 4, 40)
    assert sel is not None and sel.idx.shape == (2, 3, 10)
