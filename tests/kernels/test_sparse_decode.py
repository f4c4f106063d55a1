"""The ``tinyserve::sparse_decode`` op: properties, opcheck, bad input, the PyTorch path's fast paths.

(c) With a budget at or above the length the op is dense attention: it equals
    ``F.scaled_dot_product_attention``, masks (bool, additive, per-head, padding) included.
(e) Otherwise it equals dense attention in which the tokens outside the pages the
    reference selects (``reference.choose_pages``) are masked with -inf.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.kernel_checks import DTYPES, TOL, assert_close_report, dense_sdpa, make_gen, randn
from tinyserve_compile.kernels import allocate_bounds, rebuild_bounds_, sparse_decode
from tinyserve_compile.kernels import reference as ref
from tinyserve_compile.kernels.spec import SelectionSpec

MASK_KINDS = [None, "bool_L", "bool_per_head", "bool_padding", "float_shared", "float_per_head", "float_padding"]


def _mask(kind, B, Hq, L, gen, dtype):
    """An attention mask of the given kind, broadcastable to ``[B, Hq, 1, L]``."""
    if kind is None:
        return None
    if kind == "bool_L":
        return torch.rand(L, generator=gen) < 0.7  # [L]
    if kind == "bool_per_head":
        return torch.rand(B, Hq, 1, L, generator=gen) < 0.6
    if kind == "bool_padding":  # left padding: row b starts at pad[b]
        pad = torch.randint(0, max(1, L // 2), (B,), generator=gen)
        return (torch.arange(L)[None, :] >= pad[:, None])[:, None, None, :]  # [B,1,1,L]
    if kind == "float_shared":
        return randn((1, 1, 1, L), gen, dtype, 2.0)
    if kind == "float_per_head":
        return randn((B, Hq, 1, L), gen, dtype, 2.0).masked_fill(torch.rand(B, Hq, 1, L, generator=gen) < 0.2,
                                                               float("-inf"))
    if kind == "float_padding":
        pad = torch.randint(0, max(1, L // 2), (B,), generator=gen)
        keep = (torch.arange(L)[None, :] >= pad[:, None])[:, None, None, :]
        return torch.zeros(B, 1, 1, L, dtype=dtype).masked_fill(~keep, float("-inf"))
    raise AssertionError(kind)


@st.composite
def decode_case(draw, dense: bool):
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    S = draw(st.sampled_from([1, 2, 4, 8, 16]))
    L = draw(st.integers(1, 96))
    B = draw(st.integers(1, 3))
    Hkv = draw(st.integers(1, 3))
    G = draw(st.sampled_from([1, 2, 3]))
    D = draw(st.sampled_from([4, 8, 16]))
    full_rows = draw(st.booleans())
    valid_len = [L if full_rows else draw(st.integers(1, L)) for _ in range(B)]
    P = ref.num_pages(max(valid_len), S)
    if dense:
        K = draw(st.integers(P, P + 3))
    else:
        K = draw(st.integers(1, max(1, P - 1)))
    sink = draw(st.integers(0, K - 1))
    cf = draw(st.sampled_from([1, 1, 2, 4]))
    mask_kind = draw(st.sampled_from(MASK_KINDS))
    scale = draw(st.sampled_from([None, 0.3, 2.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(dtype=DTYPES[dtype], S=S, L=L, B=B, Hkv=Hkv, G=G, D=D, valid_len=valid_len, budget=K * S,
                sink=sink, cf=cf, mask_kind=mask_kind, scale=scale, seed=seed)


def _spec(S, budget, sink=0, cf=1, extra=0, keep_tokens=False, bdt=torch.float32):
    return SelectionSpec(S, budget, sink, cf, extra, keep_tokens, bdt)


def _inputs(c):
    gen = make_gen(c["seed"])
    B, Hkv, G, L, D, dt = c["B"], c["Hkv"], c["G"], c["L"], c["D"], c["dtype"]
    q = randn((B, Hkv * G, 1, D), gen, dt)
    k = randn((B, Hkv, L, D), gen, dt)
    v = randn((B, Hkv, L, D), gen, dt)
    mask = _mask(c["mask_kind"], B, Hkv * G, L, gen, dt)
    vl = torch.tensor(c["valid_len"])
    bounds = rebuild_bounds_(k, allocate_bounds(k, c["S"]), c["S"])
    return q, k, v, vl, mask, bounds


@settings(max_examples=80, deadline=None)
@given(decode_case(dense=True))
def test_budget_covers_length_equals_sdpa(c):
    """(c) budget >= every row's valid length: the op is dense SDPA (enable_gqa and repeat_interleave)."""
    q, k, v, vl, mask, bounds = _inputs(c)
    out = sparse_decode(q, k, v, bounds, vl, mask, c["scale"], _spec(c["S"], c["budget"], c["sink"], c["cf"]), "torch")
    assert out.shape == q.shape and out.dtype == q.dtype
    atol, rtol = TOL[c["dtype"]]
    for use_flag in (True, False):
        want = dense_sdpa(q, k, v, vl, mask, c["scale"], use_gqa_flag=use_flag)
        assert_close_report(out, want, atol, rtol, f"op vs SDPA (enable_gqa={use_flag}), case {c}")


@settings(max_examples=100, deadline=None)
@given(decode_case(dense=False))
def test_sparse_equals_dense_with_unselected_masked(c):
    """(e) the op equals dense attention with every token outside the reference selection at -inf."""
    q, k, v, vl, mask, bounds = _inputs(c)
    scale = c["scale"] if c["scale"] is not None else 1.0 / math.sqrt(c["D"])
    spec = _spec(c["S"], c["budget"], c["sink"], c["cf"])
    out = sparse_decode(q, k, v, bounds, vl, mask, c["scale"], spec, "torch")
    sel = ref.choose_pages(q, k, bounds, vl, mask, scale, spec)
    keep = None if sel is None else ref.selected_token_mask(sel, c["S"], c["L"], vl)  # [B,Hkv,L]
    want = dense_sdpa(q, k, v, vl, mask, scale, keep_kv=keep)
    atol, rtol = TOL[c["dtype"]]
    assert_close_report(out, want, atol, rtol, f"op vs masked dense SDPA, case {c}")
    want_ref = ref.sparse_decode_reference(q, k, v, vl, mask, scale, spec, bounds)
    assert_close_report(out, want_ref, atol, rtol, f"op vs sparse_decode_reference, case {c}")


def test_sparse_actually_drops_tokens():
    """A case where the budget matters: the sparse output differs from dense, and matches the masked oracle."""
    gen = make_gen(7)
    B, Hkv, G, L, D, S = 1, 3, 3, 512, 64, 16
    q = randn((B, Hkv * G, 1, D), gen)
    k = randn((B, Hkv, L, D), gen)
    v = randn((B, Hkv, L, D), gen)
    vl = torch.tensor([L])
    bounds = rebuild_bounds_(k, allocate_bounds(k, S), S)
    out = sparse_decode(q, k, v, bounds, vl, spec=_spec(S, 64))
    dense = dense_sdpa(q, k, v, vl)
    assert float((out - dense).abs().max()) > 1e-3
    sel = ref.choose_pages(q, k, bounds, vl, None, 1 / 8, _spec(S, 64))
    want = dense_sdpa(q, k, v, vl, keep_kv=ref.selected_token_mask(sel, S, L, vl))
    assert_close_report(out, want, *TOL[torch.float32], "op vs masked oracle")


def _opcheck_args(dtype, L, budget, mask, cf, kernel="torch", ctrl=None, B=2):
    gen = make_gen(11)
    S, D, Hkv, G = 4, 8, 2, 2
    q = randn((B, Hkv * G, 1, D), gen, dtype)
    k = randn((B, Hkv, L, D), gen, dtype)
    v = randn((B, Hkv, L, D), gen, dtype)
    b = rebuild_bounds_(k, allocate_bounds(k, S), S)
    m = None
    if mask == "bool":
        m = torch.rand(B, 1, 1, L, generator=gen) < 0.8
    elif mask == "float":
        m = randn((B, Hkv * G, 1, L), gen, dtype)
    vl = torch.tensor([L, max(1, L - 5)][:B])
    spec = _spec(S, budget, 1, cf, S if cf > 1 else 0, cf > 1).to_list()
    return (q, k, v, *b, vl, m, 0.35, spec, kernel, ctrl)


@pytest.mark.parametrize("kernel", ["torch", "auto"])  # auto: the native kernel on CPU where it builds
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("L, budget, mask, cf", [(30, 8, None, 1), (30, 8, "bool", 2), (29, 12, "float", 1),
                                                (10, 64, "bool", 1)])
def test_opcheck_sparse_decode(dtype, L, budget, mask, cf, kernel):
    torch.library.opcheck(torch.ops.tinyserve.sparse_decode.default, _opcheck_args(dtype, L, budget, mask, cf, kernel))


@pytest.mark.parametrize("kernel", ["torch", "auto"])
@pytest.mark.parametrize("flags", [(0, 0), (0, 1), (1, 0)])
def test_ctrl_attends_densely_when_flagged(kernel, flags):
    """``ctrl[1]`` (a dense layer) or ``ctrl[0]`` (stale bounds) attend densely; ``(0, 0)`` is the sparse op."""
    ctrl = torch.tensor(flags, dtype=torch.int32)
    args = _opcheck_args(torch.float32, 30, 8, None, 1, kernel, ctrl, B=1)
    torch.library.opcheck(torch.ops.tinyserve.sparse_decode.default, args)
    out = torch.ops.tinyserve.sparse_decode(*args)
    q, k, v, vl = args[0], args[1], args[2], args[6]
    dense = dense_sdpa(q, k, v, vl, scale=0.35)
    if any(flags):
        assert_close_report(out, dense, *TOL[torch.float32], f"ctrl={flags}: dense")
    else:
        assert float((out - dense).abs().max()) > 1e-4, "the unflagged op dropped nothing"


def _good():
    gen = make_gen(5)
    q = randn((1, 4, 1, 8), gen)
    k = randn((1, 2, 32, 8), gen)
    v = randn((1, 2, 32, 8), gen)
    b = rebuild_bounds_(k, allocate_bounds(k, 4), 4)
    return dict(q=q, k_cache=k, v_cache=v, bounds=b, valid_len=torch.tensor([32]), attn_mask=None, scale=None,
                page_size=4, token_budget=16, sink_pages=0, candidate_factor=1, candidate_extra=0, keep_tokens=False,
                bounds_dtype=torch.float32, kernel="torch")


def _call(page_size, token_budget, sink_pages, candidate_factor, candidate_extra, keep_tokens, bounds_dtype, **kw):
    """:func:`sparse_decode` with the spec built from its fields (a bad field raises when the spec is built)."""
    spec = SelectionSpec(page_size, token_budget, sink_pages, candidate_factor, candidate_extra, keep_tokens,
                         bounds_dtype)
    return sparse_decode(spec=spec, **kw)


def _bad(case):
    a = _good()
    q, k, b = a["q"], a["k_cache"], a["bounds"]
    edits = {
        "q_3d": dict(q=q[0]),
        "q_len2": dict(q=q.expand(1, 4, 2, 8)),
        "q_int": dict(q=q.to(torch.int32)),
        "q_meta": dict(q=q.to("meta")),
        "k_meta": dict(k_cache=k.to("meta")),
        "v_meta": dict(v_cache=a["v_cache"].to("meta")),
        "k_dtype": dict(k_cache=k.half()),
        "v_shape": dict(v_cache=a["v_cache"][:, :, :16]),
        "k_heads": dict(k_cache=torch.zeros(1, 3, 32, 8), v_cache=torch.zeros(1, 3, 32, 8)),
        "k_headdim": dict(k_cache=torch.zeros(1, 2, 32, 4), v_cache=torch.zeros(1, 2, 32, 4)),
        "kmax_shape": dict(bounds=ref.PageBounds(b.kmax[:, :, :3], b.kmin, b.kabs)),
        "kmin_dtype": dict(bounds=ref.PageBounds(b.kmax, b.kmin.half(), b.kabs)),
        "kabs_meta": dict(bounds=ref.PageBounds(b.kmax, b.kmin, b.kabs.to("meta"))),
        "bounds_type": dict(bounds=(b.kmax, b.kmin)),
        "valid_len_float": dict(valid_len=torch.tensor([32.0])),
        "valid_len_count": dict(valid_len=torch.tensor([32, 32, 32])),
        "mask_shape": dict(attn_mask=torch.ones(1, 1, 1, 31, dtype=torch.bool)),
        "mask_heads": dict(attn_mask=torch.ones(1, 2, 1, 32, dtype=torch.bool)),
        "mask_dtype": dict(attn_mask=torch.ones(1, 1, 1, 32, dtype=torch.int64)),
        "page_size_zero": dict(page_size=0),
        "page_size_neg": dict(page_size=-4),
        "budget_small": dict(token_budget=3),
        "sink_too_many": dict(sink_pages=4),
        "sink_neg": dict(sink_pages=-1),
        "scale_zero": dict(scale=0.0),
        "scale_nan": dict(scale=float("nan")),
        "cf_zero": dict(candidate_factor=0),
        "extra_neg": dict(candidate_extra=-1),
        "extra_bool": dict(candidate_extra=True),
        "keep_int": dict(keep_tokens=1),
        "bounds_dtype_half": dict(bounds_dtype=torch.float16),
        "spec_bounds_other": dict(bounds_dtype=torch.int8),
        "kernel_name": dict(kernel="cuda"),
    }
    a.update(edits[case])
    return a


BAD_CASES = [
    ("q_3d", "q"), ("q_len2", "q"), ("q_int", "q"), ("q_meta", "q"), ("k_meta", "k_cache"), ("v_meta", "v_cache"),
    ("k_dtype", "k_cache"), ("v_shape", "v_cache"), ("k_heads", "k_cache"), ("k_headdim", "k_cache"),
    ("kmax_shape", "kmax"), ("kmin_dtype", "kmin"), ("kabs_meta", "kabs"), ("bounds_type", "bounds"),
    ("valid_len_float", "valid_len"), ("valid_len_count", "valid_len"), ("mask_shape", "attn_mask"),
    ("mask_heads", "attn_mask"), ("mask_dtype", "attn_mask"), ("page_size_zero", "page_size"),
    ("page_size_neg", "page_size"), ("budget_small", "token_budget"), ("sink_too_many", "sink_pages"),
    ("sink_neg", "sink_pages"), ("scale_zero", "scale"), ("scale_nan", "scale"), ("cf_zero", "candidate_factor"),
    ("extra_neg", "candidate_extra"), ("extra_bool", "candidate_extra"), ("keep_int", "keep_tokens"),
    ("bounds_dtype_half", "bounds_dtype"), ("spec_bounds_other", "kmax"), ("kernel_name", "kernel"),
]


@pytest.mark.parametrize("case, name", BAD_CASES)
def test_bad_input_raises_value_error_naming_argument(case, name):
    with pytest.raises(ValueError, match=f"'{name}'"):
        _call(**_bad(case))


def test_good_input_runs():
    """The baseline used by the bad-input cases is itself accepted."""
    out = _call(**_good())
    assert out.shape == (1, 4, 1, 8) and bool(torch.isfinite(out).all())


def test_fast_path_covers_cache_lengths_off_the_page_grid(monkeypatch):
    """``L % page_size != 0`` (any HF ``max_cache_len``): the whole-page gather still serves
    while the newest page is a full page of the cache, and the result equals the reference."""
    import importlib

    sd = importlib.import_module("tinyserve_compile.kernels.torch_sparse_decode")

    calls = []
    real = sd._gather_pages_raw
    monkeypatch.setattr(sd, "_gather_pages_raw", lambda *a: calls.append(1) or real(*a))
    gen = make_gen(7)
    S, B, Hkv, G, L, D, n, budget = 8, 1, 2, 3, 203, 16, 170, 48
    q, k, v = randn((B, Hkv * G, 1, D), gen), randn((B, Hkv, L, D), gen), randn((B, Hkv, L, D), gen)
    vl = torch.tensor([n])
    bounds = rebuild_bounds_(k, allocate_bounds(k, S), S)
    spec = _spec(S, budget)
    out = sparse_decode(q, k, v, bounds, vl, None, None, spec, "torch")
    assert len(calls) == 2, "the whole-page gather was not used for K and V"
    want = ref.sparse_decode_reference(q, k, v, vl, None, 1.0 / math.sqrt(D), spec, bounds)
    assert_close_report(out, want, *TOL[torch.float32], "off-grid fast path vs reference")


@pytest.mark.parametrize("L, n, cf, sink", [(256, 199, 4, 1), (400, 250, 4, 1)])
def test_two_stage_fast_path_matches_reference(monkeypatch, L, n, cf, sink):
    """No mask, one valid length, ``candidate_factor > 1``: the fast two-stage path is taken and keeps the
    reference's pages (a row of at most ``N1`` valid pages is dense instead: 32 valid pages against 24
    candidates here; the conformance suite covers the other dtypes and selections)."""
    dtype = torch.float32
    import importlib

    sd = importlib.import_module("tinyserve_compile.kernels.torch_sparse_decode")
    calls = []
    real = sd._fast_two_stage
    monkeypatch.setattr(sd, "_fast_two_stage", lambda *a: calls.append(1) or real(*a))
    gen = make_gen(L * 7 + n + cf)
    S, B, Hkv, G, D, budget = 8, 2, 2, 3, 16, 48
    q, k, v = randn((B, Hkv * G, 1, D), gen, dtype), randn((B, Hkv, L, D), gen, dtype), randn((B, Hkv, L, D), gen, dtype)
    vl = torch.full((B,), n)
    bounds = rebuild_bounds_(k, allocate_bounds(k, S), S)
    spec = _spec(S, budget, sink, cf)
    out = sparse_decode(q, k, v, bounds, vl, None, None, spec, "torch")
    assert calls, "the fast two-stage path was not taken"
    scale = 1.0 / math.sqrt(D)
    sel = ref.choose_pages(q, k, bounds, vl, None, scale, spec)
    want = dense_sdpa(q, k, v, vl, None, scale, keep_kv=ref.selected_token_mask(sel, S, L, vl))
    assert_close_report(out, want, *TOL[dtype], f"two-stage fast path vs masked dense oracle ({dtype}, n={n}, c={cf})")
