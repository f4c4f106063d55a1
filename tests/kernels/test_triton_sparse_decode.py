"""The Triton sparse-decode kernels (issue 4), run on CPU under the Triton interpreter.

Every case compares :func:`sparse_decode_triton` with the pure-PyTorch reference
(``reference.sparse_decode_reference``) and the pages it attends
(:func:`select_pages_triton`) with ``reference.choose_pages``: the same attended
tokens (ties of the fp32 page score aside) and outputs within dtype tolerance.
fp16 runs the GPU code path (native-dtype ``tl.dot`` with fp32 accumulation);
bf16 is upcast after ``tl.load`` (the interpreter has no bf16 arithmetic).
Issue 10 phase 3 cases add int8 / bf16 page bounds, ``candidate_extra`` and
``keep_tokens`` (against ``reference.choose`` and ``sparse_decode_reference``; swapped
tokens are accepted only at near-ties of the reference's share, and printed).
"""
from __future__ import annotations

import math
import zlib

import pytest
import torch


from triton_interp import _import_interpreted  # noqa: E402


tsd = _import_interpreted("tinyserve_compile.kernels.triton_sparse_decode")

from kernel_checks import DTYPES, TOL, assert_close_report, make_gen, randn  # noqa: E402
from tinyserve_compile.kernels import reference as ref  # noqa: E402
from tinyserve_compile.kernels import sparse_decode  # noqa: E402


# log(0) = -inf is how a fully masked candidate page gets its -inf log-sum-exp; numpy warns about it
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _mask(kind, B, Hq, L, gen, dtype):
    if kind is None:
        return None
    if kind == "bool_L":
        return torch.rand(L, generator=gen) < 0.7
    if kind == "bool_per_head":
        return torch.rand(B, Hq, 1, L, generator=gen) < 0.6
    if kind == "bool_padding":  # left padding: row b starts at pad[b]
        pad = torch.randint(0, max(1, L // 2), (B,), generator=gen)
        return (torch.arange(L)[None, :] >= pad[:, None])[:, None, None, :]
    if kind == "float_shared":
        return randn((1, 1, 1, L), gen, dtype, 2.0)
    if kind == "float_per_head":
        m = randn((B, Hq, 1, L), gen, dtype, 2.0)
        return m.masked_fill(torch.rand(B, Hq, 1, L, generator=gen) < 0.2, float("-inf"))
    raise ValueError(kind)


def _inputs(B, Hkv, G, L, D, S, dtype, mask_kind, vl_kind, seed):
    gen = make_gen(seed)
    Hq = Hkv * G
    q = randn((B, Hq, 1, D), gen, dtype)
    k = randn((B, Hkv, L, D), gen, dtype)
    v = randn((B, Hkv, L, D), gen, dtype)
    # a few "hot" pages so that selection matters
    hot = torch.randint(0, L, (4,), generator=gen)
    k[:, :, hot] = (k[:, :, hot].float() + 2.0 * q.float().reshape(B, Hkv, G, D)[:, :, :1]).to(dtype)
    if vl_kind == "full":
        vl = torch.full((B,), L, dtype=torch.int64)
    elif vl_kind == "ragged":  # rows of different lengths, one short enough to be dense
        vl = torch.tensor([L - 7, 13, L, L // 2][:B], dtype=torch.int64)
    elif vl_kind == "one":  # a single element, broadcast over the batch
        vl = torch.tensor([L - 3], dtype=torch.int64)
    else:
        raise ValueError(vl_kind)
    bounds = ref.page_bounds(k, S)
    return q, k, v, vl, _mask(mask_kind, B, Hq, L, gen, dtype), bounds


def _attended(sel, B, Hkv, G, L, S, vl, mask):
    """Bool ``[B, Hkv, L]``: tokens the selection reads that some head of the group can attend to."""
    vl = vl.reshape(-1).expand(B)
    live = (torch.arange(L)[None, :] < vl[:, None])[:, None, :].expand(B, Hkv, L)
    if mask is not None:
        add = mask if mask.dtype != torch.bool else torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
        add = add.float()
        while add.dim() < 4:
            add = add.unsqueeze(0)
        fin = torch.isfinite(add.expand(B, Hkv * G, 1, L))[:, :, 0, :].reshape(B, Hkv, G, L).any(2)
        live = live & fin
    if sel is None:
        return live
    return live & ref.selected_token_mask(sel, S, L, vl)


def _check_selection(q, k, bounds, vl, mask, scale, S, budget, sink, cf):
    B, Hq, _, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    want = ref.choose_pages(q, k, bounds, vl, mask, scale, S, budget, sink, cf)
    got = tsd.select_pages_triton(q, k, *bounds, vl, mask, scale, S, budget, sink, cf)
    a_want = _attended(want, B, Hkv, G, L, S, vl, mask)
    a_got = _attended(got, B, Hkv, G, L, S, vl, mask)
    if torch.equal(a_want, a_got):
        return
    # Only near-ties of the fp32 page score may differ (summation order): report everything else.
    scores = ref.page_scores(q, bounds, scale, ref.mask_page_max(mask, B, Hq, L, S))
    diff = (a_want != a_got).nonzero().tolist()
    lines = []
    for b, h, t in diff[:8]:
        p = t // S
        lines.append(f"b={b} kvh={h} page={p}: ref reads={bool(a_want[b, h, t])} triton reads={bool(a_got[b, h, t])} "
                     f"score={float(scores[b, h, p]):.8e}")
    if cf == 1:
        for b, h in {(b, h) for b, h, _ in diff}:
            only_w = {t // S for t in (a_want[b, h] & ~a_got[b, h]).nonzero().flatten().tolist()}
            only_g = {t // S for t in (a_got[b, h] & ~a_want[b, h]).nonzero().flatten().tolist()}
            sw = torch.tensor([float(scores[b, h, p]) for p in only_w])
            sg = torch.tensor([float(scores[b, h, p]) for p in only_g])
            if len(sw) and len(sg) and float((sw.max() - sg.min()).abs()) <= 1e-5 * (1 + float(sw.abs().max())):
                continue
            raise AssertionError("selection differs beyond ties:\n" + "\n".join(lines))
        return
    raise AssertionError("selection differs:\n" + "\n".join(lines))


# (B, Hkv, G, L, D, S, budget, dtype, mask, cf, sink, valid_len)
CASES = [
    (1, 1, 1, 96, 32, 16, 32, "fp32", None, 1, 0, "full"),
    (2, 2, 3, 200, 32, 16, 64, "fp32", None, 1, 0, "ragged"),
    (2, 3, 1, 157, 32, 16, 48, "fp32", "bool_L", 1, 1, "ragged"),  # partial last page
    (2, 1, 3, 150, 32, 8, 40, "fp32", "bool_per_head", 1, 0, "full"),
    (2, 2, 3, 256, 64, 16, 64, "fp32", "float_per_head", 1, 2, "one"),
    (2, 2, 1, 130, 24, 6, 36, "fp32", "float_shared", 1, 0, "ragged"),  # non-power-of-2 D and S
    (2, 2, 3, 300, 32, 16, 48, "fp32", "bool_padding", 1, 0, "full"),
    (2, 2, 3, 200, 32, 16, 256, "fp32", None, 1, 0, "ragged"),  # dense from the shapes (P <= K)
    (1, 2, 3, 200, 32, 16, 64, "fp32", None, 2, 0, "full"),  # two-stage
    (2, 3, 1, 260, 32, 16, 48, "fp32", "float_per_head", 2, 1, "ragged"),
    (2, 1, 3, 180, 32, 16, 64, "fp32", "bool_L", 2, 0, "ragged"),  # candidates cover every page
    (2, 2, 3, 200, 32, 16, 64, "fp16", None, 1, 0, "ragged"),
    (2, 3, 1, 157, 64, 16, 48, "fp16", "bool_per_head", 1, 1, "full"),
    (2, 2, 3, 256, 32, 16, 64, "fp16", "float_per_head", 2, 0, "ragged"),
    (2, 2, 3, 200, 32, 16, 64, "bf16", None, 1, 0, "ragged"),
    (2, 1, 3, 157, 32, 16, 48, "bf16", "bool_padding", 1, 1, "full"),
    (1, 3, 3, 256, 32, 16, 64, "bf16", "float_shared", 2, 0, "full"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_matches_reference(case):
    B, Hkv, G, L, D, S, budget, dname, mask_kind, cf, sink, vl_kind = case
    dtype = DTYPES[dname]
    q, k, v, vl, mask, bounds = _inputs(B, Hkv, G, L, D, S, dtype, mask_kind, vl_kind, seed=zlib.crc32(repr(case).encode()) % 1000)
    scale = D ** -0.5
    _check_selection(q, k, bounds, vl, mask, scale, S, budget, sink, cf)
    want = ref.sparse_decode_reference(q, k, v, vl, mask, scale, S, budget, sink, cf, bounds=bounds)
    atol, rtol = TOL[dtype]
    for n_splits in (None, 3):  # the default split-K partition, and 3 splits merged by the combine kernel
        out = tsd.sparse_decode_triton(q, k, v, *bounds, vl, mask, scale, S, budget, sink, cf, n_splits=n_splits)
        assert out.dtype == dtype and out.shape == q.shape
        assert_close_report(out.float(), want.float(), atol, rtol, f"triton (n_splits={n_splits}) vs reference {case}")


@pytest.mark.parametrize("n_splits", [1, 3, 64])
def test_split_counts_agree(n_splits):
    """Any split-K partition gives the same result (combine kernel, empty splits)."""
    q, k, v, vl, mask, bounds = _inputs(2, 2, 3, 240, 32, 16, torch.float32, "bool_L", "ragged", seed=5)
    want = ref.sparse_decode_reference(q, k, v, vl, mask, 32 ** -0.5, 16, 80, 0, 1, bounds=bounds)
    out = tsd.sparse_decode_triton(q, k, v, *bounds, vl, mask, 32 ** -0.5, 16, 80, 0, 1, n_splits=n_splits)
    assert_close_report(out, want, *TOL[torch.float32], f"n_splits={n_splits}")


@pytest.mark.parametrize("cf,extra,keep", [(1, 0, False), (2, 16, True)])
def test_fully_masked_rows_give_zeros(cf, extra, keep):
    """A head with no attendable token gives zeros (as SDPA), not NaN; a row of valid_len 0 too."""
    B, Hkv, G, L, D, S = 2, 1, 3, 100, 32, 16
    q, k, v, _, _, bounds = _inputs(B, Hkv, G, L, D, S, torch.float32, None, "full", seed=7)
    vl = torch.tensor([L, 0])
    mask = torch.ones(B, Hkv * G, 1, L, dtype=torch.bool)
    mask[0, 1] = False
    out = tsd.sparse_decode_triton(q, k, v, *bounds, vl, mask, D ** -0.5, S, 32, 0, cf, candidate_extra=extra,
                                   keep_tokens=keep)
    want = ref.sparse_decode_reference(q, k, v, vl, mask, D ** -0.5, S, 32, 0, cf, bounds=bounds,
                                       candidate_extra=extra, keep_tokens=keep)
    assert not torch.isnan(out).any()
    assert float(out[0, 1].abs().max()) == 0.0 and float(out[1].abs().max()) == 0.0
    assert_close_report(out, want, *TOL[torch.float32], "fully masked")


@pytest.mark.parametrize("dname,bname,extra,keep", [("fp32", "b32", 0, False), ("bf16", "b32", 0, False),
                                                    ("fp32", "b8", 32, True), ("bf16", "b16", 32, False)])
def test_op_dispatch_kernel_triton(dname, bname, extra, keep):
    """``sparse_decode(kernel="triton")`` on CPU under the interpreter runs these kernels (new arguments too)."""
    from tinyserve_compile.kernels import allocate_bounds, rebuild_bounds_

    dtype = DTYPES[dname]
    q, k, v, vl, mask, _ = _inputs(2, 2, 3, 200, 32, 16, dtype, "float_per_head", "ragged", seed=11)
    bounds = rebuild_bounds_(k, allocate_bounds(k, 16, BOUNDS[bname]), 16)
    sel = dict(page_size=16, token_budget=64, candidate_extra=extra, keep_tokens=keep)
    out = sparse_decode(q, k, v, bounds, vl, mask, kernel="triton", **sel)
    want = sparse_decode(q, k, v, bounds, vl, mask, kernel="torch", **sel)
    assert_close_report(out.float(), want.float(), *TOL[dtype], f"op kernel=triton vs torch ({dname})")


def test_triton_available():
    assert tsd.triton_available()


# ---------------------------------------------------------------------------------------------------------------------
# Issue 10 phase 3: int8 / bf16 bounds, additive candidates (candidate_extra), token-level keep (keep_tokens)
# ---------------------------------------------------------------------------------------------------------------------

BOUNDS = {"b32": torch.float32, "b16": torch.bfloat16, "b8": torch.int8}


def _ref_token_shares(q, k, bounds, vl, mask, scale, S, budget, sink, cf, extra):
    """``[B, Hkv, L]`` fp32: the reference's token ranking score over its candidates (-inf elsewhere)."""
    B, Hq, _, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    vl = vl.reshape(-1).expand(B)
    n1 = ref.candidate_pages(S, budget, cf, extra)
    scores = ref.page_scores(q, bounds, scale, ref.mask_page_max(mask, B, Hq, L, S))
    cand = ref.select_pages(scores, vl, S, budget, sink, n_select=n1)
    if cand is None:
        P = scores.shape[-1]
        idx = torch.arange(P).expand(B, Hkv, P).contiguous()
        cand = ref.Selection(idx, idx < ((vl + S - 1) // S).reshape(B, 1, 1))
    tok, tok_ok = ref._selected_tokens(cand, S, L, vl)
    kg = k.gather(2, tok[..., None].expand(-1, -1, -1, D)).float()
    logits = (q.float().reshape(B, Hkv, Hq // Hkv, D) @ kg.transpose(-1, -2)) * scale
    logits = (logits + ref._gathered_mask(mask, tok, B, Hq, L)).masked_fill(~tok_ok[:, :, None, :], float("-inf"))
    share = (logits - logits.logsumexp(-1, keepdim=True)).nan_to_num(nan=float("-inf")).amax(2)
    out = torch.full((B, Hkv, L), float("-inf"))
    return out.scatter_(2, tok, share.masked_fill(~tok_ok, float("-inf"))), scores


def _check_new_selection(q, k, bounds, vl, mask, scale, S, budget, sink, cf, extra, keep):
    """Attended tokens of the Triton path == the reference's ``choose``, up to near-ties (reported otherwise)."""
    B, Hq, _, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    sel_w, unit = ref.choose(q, k, bounds, vl, mask, scale, S, budget, sink, cf, extra, keep)
    got = tsd.select_pages_triton(q, k, *bounds, vl, mask, scale, S, budget, sink, cf, candidate_extra=extra,
                                  keep_tokens=keep)
    two_stage = ref.candidate_pages(S, budget, cf, extra) > budget // S
    unit_got = 1 if (keep and two_stage and got is not None) else S
    a_want = _attended(sel_w, B, Hkv, G, L, unit, vl, mask)
    a_got = _attended(got, B, Hkv, G, L, unit_got, vl, mask)
    if torch.equal(a_want, a_got):
        return 0
    share, scores = _ref_token_shares(q, k, bounds, vl, mask, scale, S, budget, sink, cf, extra)
    lines = []
    for b, h in sorted({(b, h) for b, h, _ in (a_want != a_got).nonzero().tolist()}):
        only_w = (a_want[b, h] & ~a_got[b, h]).nonzero().flatten()
        only_g = (a_got[b, h] & ~a_want[b, h]).nonzero().flatten()
        if unit == 1 and len(only_w) and len(only_g):  # token level: shares of the swapped tokens must tie
            sw, sg = share[b, h, only_w], share[b, h, only_g]
            gap = float(sw.max() - sg.min())
            if math.isfinite(gap) and abs(gap) <= 1e-4:
                continue
            lines.append(f"b={b} kvh={h}: ref-only tokens {only_w.tolist()[:6]} share {sw.tolist()[:6]}, "
                         f"triton-only {only_g.tolist()[:6]} share {sg.tolist()[:6]}")
        else:
            pw, pg = sorted({int(t) // S for t in only_w}), sorted({int(t) // S for t in only_g})
            lines.append(f"b={b} kvh={h}: ref-only pages {pw[:6]} score {[float(scores[b, h, p]) for p in pw[:6]]}, "
                         f"triton-only pages {pg[:6]} score {[float(scores[b, h, p]) for p in pg[:6]]}")
    if lines:
        raise AssertionError("selection differs beyond near-ties:\n" + "\n".join(lines[:8]))
    return 1


# (B, Hkv, G, L, D, S, budget, cache dtype, bounds dtype, mask, cf, extra, keep_tokens, sink, valid_len)
NEW_CASES = [
    (2, 2, 3, 200, 32, 16, 64, "fp32", "b8", None, 1, 0, False, 0, "ragged"),  # int8 bounds, one stage
    (2, 3, 1, 157, 32, 16, 48, "bf16", "b8", "bool_L", 1, 0, False, 1, "full"),
    (2, 2, 3, 200, 32, 16, 64, "fp32", "b16", "float_per_head", 1, 0, False, 0, "ragged"),  # bf16 bounds
    (2, 2, 3, 200, 32, 16, 64, "fp32", "b8", None, 1, 32, False, 0, "ragged"),  # extra alone -> two-stage pages
    (1, 2, 3, 256, 32, 16, 64, "bf16", "b16", "float_shared", 2, 32, False, 1, "full"),
    (2, 2, 3, 200, 32, 16, 64, "fp32", "b8", None, 1, 32, True, 0, "ragged"),  # token keep
    (2, 2, 3, 256, 32, 16, 64, "fp32", "b32", "float_per_head", 2, 0, True, 1, "ragged"),
    (2, 3, 1, 260, 32, 16, 48, "bf16", "b8", "bool_per_head", 2, 32, True, 0, "one"),
    (2, 1, 4, 180, 32, 8, 40, "bf16", "b16", "bool_padding", 1, 16, True, 1, "ragged"),
    (2, 2, 1, 130, 24, 6, 36, "fp32", "b8", "float_shared", 2, 12, True, 0, "ragged"),  # non-power-of-2 D, S
    (2, 1, 3, 180, 32, 16, 64, "fp32", "b8", "bool_L", 2, 32, True, 0, "ragged"),  # candidates cover every page
    (2, 2, 3, 200, 32, 16, 64, "fp16", "b8", None, 2, 32, True, 0, "ragged"),  # fp16: the native-dtype dots
    (2, 2, 3, 200, 32, 16, 64, "fp32", "b8", None, 1, 0, True, 0, "ragged"),  # one stage: keep_tokens ignored
    (2, 2, 3, 200, 32, 16, 256, "bf16", "b8", None, 2, 32, True, 0, "ragged"),  # dense from the shapes
]


@pytest.mark.parametrize("case", NEW_CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_new_selection_matches_reference(case):
    B, Hkv, G, L, D, S, budget, dname, bname, mask_kind, cf, extra, keep, sink, vl_kind = case
    dtype = DTYPES[dname]
    q, k, v, vl, mask, _ = _inputs(B, Hkv, G, L, D, S, dtype, mask_kind, vl_kind,
                                   seed=zlib.crc32(repr(case).encode()) % 1000)
    bounds = ref.page_bounds(k, S, dtype=BOUNDS[bname])
    scale = D ** -0.5
    tied = _check_new_selection(q, k, bounds, vl, mask, scale, S, budget, sink, cf, extra, keep)
    want = ref.sparse_decode_reference(q, k, v, vl, mask, scale, S, budget, sink, cf, bounds=bounds,
                                       candidate_extra=extra, keep_tokens=keep)
    dense = ref.sparse_decode_reference(q, k, v, vl, mask, scale, S, 10 ** 9, 0, 1)
    atol, rtol = TOL[dtype]
    for n_splits in (None, 3):
        out = tsd.sparse_decode_triton(q, k, v, *bounds, vl, mask, scale, S, budget, sink, cf, n_splits=n_splits,
                                       candidate_extra=extra, keep_tokens=keep)
        assert out.dtype == dtype and out.shape == q.shape
        err = (out.float() - want.float()).abs()
        print(f"{case} n_splits={n_splits}: max |triton - reference| {float(err.max()):.3e}, "
              f"max |triton - dense| {float((out.float() - dense.float()).abs().max()):.3e}, near-ties {tied}")
        if not tied:
            assert_close_report(out.float(), want.float(), atol, rtol, f"triton (n_splits={n_splits}) vs reference")


def test_int8_scores_match_reference_and_bound_logits():
    """The page-score kernel on int8 bounds: the reference's scores, and upper bounds on every exact logit."""
    B, Hkv, G, L, D, S = 2, 2, 3, 200, 32, 16
    q, k, v, vl, mask, _ = _inputs(B, Hkv, G, L, D, S, torch.float32, "float_per_head", "full", seed=3)
    bounds = ref.page_bounds(k, S, dtype=torch.int8)
    scale = D ** -0.5
    vlv, vls = tsd._valid_len_view(vl, B, q.device)
    m, mstr, mkind, mper = tsd._mask_view(mask, B, Hkv * G, L, q.device)
    got = tsd._page_scores(q, *bounds, vlv, vls, m, mstr, mkind, mper, scale, S, 0, L)
    want = ref.page_scores(q, bounds, scale, ref.mask_page_max(mask, B, Hkv * G, L, S))
    newest = (L - 1) // S
    want[:, :, newest] = float("inf")  # the kernel forces the newest page
    assert_close_report(got, want, 1e-5, 1e-5, "int8 page scores vs reference")
    logits = (q.float().reshape(B, Hkv, G, D) @ k.float().transpose(-1, -2)) * scale + mask.float().reshape(B, Hkv, G, L)
    page_max = ref._paged(logits.amax(2).unsqueeze(-1), S, float("-inf")).squeeze(-1).amax(-1)  # [B,Hkv,P]
    assert bool((got >= page_max).all()), f"score below a logit by {float((page_max - got).max()):.3e}"


def test_new_arguments_checked():
    q, k, v, vl, _, bounds = _inputs(1, 1, 1, 64, 16, 16, torch.float32, None, "full", seed=1)
    with pytest.raises(ValueError, match="candidate_extra"):
        tsd.sparse_decode_triton(q, k, v, *bounds, vl, None, 0.25, 16, 32, 0, 1, True, False)  # a bool
    with pytest.raises(ValueError, match="candidate_extra"):
        tsd.sparse_decode_triton(q, k, v, *bounds, vl, None, 0.25, 16, 32, candidate_extra=-16)
    with pytest.raises(ValueError, match="keep_tokens"):
        tsd.sparse_decode_triton(q, k, v, *bounds, vl, None, 0.25, 16, 32, candidate_extra=16, keep_tokens=1)
    with pytest.raises(ValueError, match="kmax"):
        tsd.sparse_decode_triton(q, k, v, bounds.kmax.half(), bounds.kmin.half(), bounds.kabs, vl, None, 0.25, 16, 32)


@pytest.mark.parametrize("keep", [False, True])
def test_valid_len_past_the_cache_counts_as_the_cache(keep):
    """``valid_len > L``: the result is that of ``valid_len = L`` (the newest page is the last one of the cache)."""
    B, Hkv, G, L, D, S = 2, 1, 2, 50, 16, 4
    q, k, v, _, mask, _ = _inputs(B, Hkv, G, L, D, S, torch.float32, "bool_L", "full", seed=23)
    bounds = ref.page_bounds(k, S, dtype=torch.int8)
    sel = (0.25, S, 16, 1, 2)
    out = tsd.sparse_decode_triton(q, k, v, *bounds, torch.tensor([60, 57]), mask, *sel, 8, keep)
    want = ref.sparse_decode_reference(q, k, v, torch.tensor([L, L]), mask, *sel, bounds=bounds, candidate_extra=8,
                                       keep_tokens=keep)
    assert_close_report(out, want, *TOL[torch.float32], f"valid_len past the cache, keep_tokens={keep}")
