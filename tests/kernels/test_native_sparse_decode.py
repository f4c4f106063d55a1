"""The native CPU kernel (the CPU kernel of ``tinyserve::sparse_decode``) against the reference.

Every case compares the output with :func:`reference.sparse_decode_reference` and with
dense SDPA over the pages (tokens, with ``keep_tokens``) the reference keeps, and the pages the kernel keeps
(its ``kept_pages``) with the reference selection. The table of dtypes, groups, masks, rows, page sizes, bounds
dtypes and stages is the conformance suite's (tests/conformance); here are head dims, page sizes outside that
table, strided caches, the ctrl flags, empty rows, realistic shapes and properties. Skipped, with the build's
reason, only where the native kernel cannot be built.
"""
from __future__ import annotations

import math
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.kernel_checks import TOL, assert_close_report, dense_sdpa, make_gen, randn
from tinyserve_compile.kernels import reference as ref
from tinyserve_compile.kernels.native import load_native, native_module, native_unavailable_reason
from tinyserve_compile.kernels.spec import BOUNDS_CODES, SelectionSpec

pytestmark = pytest.mark.skipif(not load_native(), reason=f"native kernel unavailable: {native_unavailable_reason()}")

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BDT = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


def _spec(S, budget, sinks, cf, extra=0, keep_tokens=False, bdt=torch.float32):
    return SelectionSpec(S, budget, sinks, cf, extra, keep_tokens, bdt)


def _packed(kmax, S, budget, sinks, cf, extra, keep_tokens):
    """The C++ functions' ``spec`` (SelectionSpec.to_list()), left unchecked so that bad values reach C++."""
    code = BOUNDS_CODES.index(kmax.dtype) if kmax.dtype in BOUNDS_CODES else 0  # C++ reads kmax's own dtype
    return [S, budget, sinks, cf, extra, int(keep_tokens), code]


def _nat_decode(q, k, v, kmax, kmin, kabs, vl, mask, scale, S, budget, sinks, cf, ctrl, extra=0, keep_tokens=False):
    """The native kernel's entry point (the positional arguments of the C++ function)."""
    return native_module().sparse_decode(q, k, v, kmax, kmin, kabs, vl, mask, float(scale),
                                         _packed(kmax, S, budget, sinks, cf, extra, keep_tokens), ctrl)


def _nat_kept(q, k, kmax, kmin, kabs, vl, mask, scale, S, budget, sinks, cf, ctrl, extra=0, keep_tokens=False):
    """The pages the native kernel keeps, bool ``[B, Hkv, P]``."""
    return native_module().kept_pages(q, k, kmax, kmin, kabs, vl, mask, float(scale),
                                      _packed(kmax, S, budget, sinks, cf, extra, keep_tokens), ctrl)


def _mask(kind, B, Hq, L, gen):
    """A mask of the given kind, broadcastable to ``[B, Hq, 1, L]``."""
    if kind is None:
        return None
    if kind == "bool_shared":  # HF's layout: [B, 1, 1, L]
        return torch.rand(B, 1, 1, L, generator=gen) < 0.75
    if kind == "bool_L":
        return torch.rand(L, generator=gen) < 0.75
    if kind == "bool_per_head":
        return torch.rand(B, Hq, 1, L, generator=gen) < 0.7
    if kind == "float_shared":
        return randn((B, 1, 1, L), gen, torch.float32, 2.0)
    if kind == "float_per_head":  # additive, with -inf holes, in bf16 storage
        m = randn((B, Hq, 1, L), gen, torch.float32, 2.0)
        return m.masked_fill(torch.rand(B, Hq, 1, L, generator=gen) < 0.2, float("-inf")).to(torch.bfloat16)
    raise AssertionError(kind)


def _build(dtype, B, Hkv, G, L, D, S, bdt, valid_len, mask_kind, seed, transposed=False):
    gen = make_gen(seed)
    Hq = Hkv * G
    q = randn((B, Hq, 1, D), gen, dtype)
    if transposed:  # a [B, L, Hkv, D] buffer viewed as [B, Hkv, L, D]: strided, no copy
        k = randn((B, L, Hkv, D), gen, dtype).transpose(1, 2)
        v = randn((B, L, Hkv, D), gen, dtype).transpose(1, 2)
    else:
        k = randn((B, Hkv, L, D), gen, dtype)
        v = randn((B, Hkv, L, D), gen, dtype)
    mask = _mask(mask_kind, B, Hq, L, gen)
    vl = torch.tensor(valid_len, dtype=torch.int64)
    bounds = ref.page_bounds(k, S, dtype=bdt)
    return q, k, v, vl, mask, bounds


def _attend_kept(q, k, v, vl, mask, scale, keep_tok):
    """Exact attention over the kept valid tokens, fp32, with the reference's conventions (no finite logit: zeros).

    ``keep_tok``: bool ``[B, Hkv, L]``.
    """
    B, Hq, _, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    keep = keep_tok & (torch.arange(L)[None, None, :] < vl.reshape(-1).expand(B)[:, None, None])
    keep = keep.repeat_interleave(G, dim=1)[:, :, None, :]  # [B,Hq,1,L]
    logits = (q.float() @ k.float().repeat_interleave(G, dim=1).transpose(-1, -2)) * scale
    if mask is not None:
        logits = logits + (torch.zeros(mask.shape).masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool
                           else mask.float())
    logits = logits.masked_fill(~keep, float("-inf"))
    return ref.softmax_attend(logits, v.float().repeat_interleave(G, dim=1))


def _ref_kept(q, k, bounds, vl, mask, scale, S, budget, sinks, cf, extra=0, keep_tokens=False):
    """Reference kept pages as bool ``[B, Hkv, P]`` (every valid page for a dense result; with token-level keep,
    the pages holding a kept token) and kept tokens as bool ``[B, Hkv, L]`` (every token of the kept pages)."""
    B, Hkv, L = k.shape[0], k.shape[1], k.shape[2]
    P = ref.num_pages(L, S)
    sel, unit = ref.choose(q, k, bounds, vl, mask, scale, _spec(S, budget, sinks, cf, extra, keep_tokens,
                                                                bounds.kmax.dtype))
    vlb = vl.reshape(-1).expand(B)
    n_valid = ((vlb + S - 1) // S).clamp(max=P)
    if sel is None:
        pages = (torch.arange(P)[None, :] < n_valid[:, None])[:, None, :].expand(B, Hkv, P).clone()
        return pages, pages.repeat_interleave(S, dim=-1)[..., :L]
    tok = ref.selected_token_mask(sel, unit, L, vlb)  # [B,Hkv,L]
    pad = P * S - L
    pages = torch.nn.functional.pad(tok, (0, pad)).reshape(B, Hkv, P, S).any(-1)
    return pages, tok


def _comparable_pages(q, bounds, vl, mask, scale, S, L):
    """Pages whose group score is finite: where keeping or not changes the result (bool ``[B, Hkv, P]``)."""
    B, Hq = q.shape[0], q.shape[1]
    scores = ref.page_scores(q, bounds, scale, ref.mask_page_max(mask, B, Hq, L, S))
    P = scores.shape[-1]
    n_valid = ((vl.reshape(-1).expand(B) + S - 1) // S).clamp(max=P)
    return torch.isfinite(scores) & (torch.arange(P)[None, None, :] < n_valid[:, None, None])


def _check_case(dtype, B, Hkv, G, L, D, S, budget, sinks, cf, bdt, valid_len, mask_kind, seed, transposed=False,
                compare_selection=True, extra=0, keep_tokens=False):
    q, k, v, vl, mask, b = _build(dtype, B, Hkv, G, L, D, S, bdt, valid_len, mask_kind, seed, transposed)
    scale = 1.0 / math.sqrt(D)
    out = _nat_decode(q, k, v, b.kmax, b.kmin, b.kabs, vl, mask, scale, S, budget, sinks, cf, None, extra, keep_tokens)
    what = (f"{dtype} B={B} Hkv={Hkv} G={G} L={L} D={D} S={S} budget={budget} sinks={sinks} c={cf} bounds={bdt} "
            f"extra={extra} keep_tokens={keep_tokens} valid_len={valid_len} mask={mask_kind} transposed={transposed}")
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    atol, rtol = TOL[dtype]
    want = ref.sparse_decode_reference(q, k, v, vl, mask, scale, _spec(S, budget, sinks, cf, extra, keep_tokens, bdt), b)
    assert_close_report(out, want, atol, rtol, f"native vs reference: {what}")
    print(f"worst |native - reference| {float((out.float() - want.float()).abs().max()):.3e}: {what}")
    kept = _nat_kept(q, k, b.kmax, b.kmin, b.kabs, vl, mask, scale, S, budget, sinks, cf, None, extra, keep_tokens)
    rk, rtok = _ref_kept(q, k, b, vl, mask, scale, S, budget, sinks, cf, extra, keep_tokens)
    cmp = _comparable_pages(q, b, vl, mask, scale, S, L)
    if compare_selection:
        diff = (kept != rk) & cmp
        assert not bool(diff.any()), (f"kept pages differ from the reference at {diff.nonzero().tolist()[:8]} "
                                      f"({int(diff.sum())} pages): {what}")
    if keep_tokens:
        # token-level keep: kept_pages marks the pages of the kept tokens, so the oracle is dense SDPA over the
        # reference's kept tokens (and those of comparable pages lie in the kernel's kept pages)
        outside = rtok & ~kept.repeat_interleave(S, dim=-1)[..., :L] & cmp.repeat_interleave(S, dim=-1)[..., :L]
        assert not bool(outside.any()), f"a reference token outside the kept pages: {what}"
        dense = dense_sdpa(q, k, v, vl, mask, scale, keep_kv=rtok)
        assert_close_report(out, dense, atol, rtol, f"native vs dense SDPA over the reference's kept tokens: {what}")
        return kept
    # the output is exact attention over the kernel's own kept pages
    keep_tok = kept.repeat_interleave(S, dim=-1)[..., :L]
    dense = dense_sdpa(q, k, v, vl, mask, scale, keep_kv=keep_tok)
    assert_close_report(out, dense, atol, rtol, f"native vs dense SDPA over its kept pages: {what}")
    assert_close_report(out, _attend_kept(q, k, v, vl, mask, scale, keep_tok), atol, rtol,
                        f"native vs exact attention over its kept pages: {what}")
    return kept


@pytest.mark.parametrize("cf", [1, 4])
@pytest.mark.parametrize("dt", ["fp32", "bf16"])
def test_candidates_cover_every_page(dt, cf):
    """Between K and c*K valid pages: every valid page is a candidate (no bound scan); and the dense fit."""
    S, budget = 8, 64  # K = 8 pages, c*K = 32
    for vl in ([200, 100], [60, 64]):  # 25 / 13 pages (candidates = all), 8 / 8 pages (dense)
        _check_case(DT[dt], 2, 3, 3, 256, 32, S, budget, 1, cf, torch.bfloat16, vl, "bool_shared", seed=vl[0])


@pytest.mark.parametrize("D", [4, 16, 20, 64, 128])
def test_head_dims(D):
    """Head dims that do and do not fill whole vectors (padded rows)."""
    _check_case(torch.float32, 1, 2, 3, 150, D, 8, 32, 1, 2, torch.float32, [150], None, seed=D)
    _check_case(torch.bfloat16, 1, 2, 3, 150, D, 8, 32, 1, 1, torch.bfloat16, [149], "float_shared", seed=D + 1)


@pytest.mark.parametrize("G", [1, 2, 3, 5, 6, 7, 9])
@pytest.mark.parametrize("dt", ["fp32", "bf16", "fp16"])
def test_group_sizes(dt, G):
    """Query heads per KV head that fill the value sums' head blocks (up to 4 heads) fully, partly and over several
    blocks, on a dense fit (every page attended) and a sparse selection, at D=64 and D=32; G = 1-6 are also the
    group-fused fp32 value sums (``v_accum_rows_g``, fp16 rows go through it once widened), 7 and 9 the per-head
    loop."""
    for D in (64, 32):
        _check_case(DT[dt], 1, 2, G, 300, D, 8, 512, 1, 1, torch.int8, [300], None, seed=G * D)
        _check_case(DT[dt], 1, 2, G, 300, D, 8, 64, 1, 2, torch.int8, [290], "bool_per_head", seed=G * D + 1)


@pytest.mark.parametrize("scale", [0.125, 0.1])
@pytest.mark.parametrize("G", [1, 3, 5])
@pytest.mark.parametrize("qmul", [1, 8])
def test_bf16_logits_round_like_fp64_attention(scale, G, qmul):
    """bf16 keys at D = 64: with a power-of-two scale q * scale is exact in bf16 and the logits are AVX512-BF16 dot
    products of channel pairs (where the CPU has them); with 0.1 they go through the widened pairs. Either way the
    logits are fp32 dot products, so the bf16 output is fp64 attention rounded to bf16 but for the odd element on a
    rounding boundary (a logit error of 0.3% already changes a quarter to a half of the elements)."""
    q, k, v, vl, _, b = _build(torch.bfloat16, 2, 2, G, 200, 64, 8, torch.int8, [200, 131], None, seed=40 + G)
    q = q * qmul  # exact in bf16 (a power of two); 8: logits of tens, a sharp softmax
    out = _nat_decode(q, k, v, b.kmax, b.kmin, b.kabs, vl, None, scale, 8, 256, 1, 1, None)  # a dense fit
    want = dense_sdpa(q.double(), k.double(), v.double(), vl, None, scale).to(torch.bfloat16)
    differ = float((out != want).float().mean())
    assert differ <= 0.02, differ
    assert_close_report(out, want, 2 ** -9, 2 ** -7, "native bf16 vs fp64 attention rounded to bf16")


@pytest.mark.parametrize("page", [1, 2, 4, 5, 16, 32])
def test_page_sizes(page):
    """Pages smaller and larger than a vector, and not a power of two."""
    _check_case(torch.float32, 2, 1, 2, 97, 16, page, 4 * page, 1, 2, torch.float32, [97, 60], "bool_L", seed=page)
    _check_case(torch.float16, 2, 1, 2, 97, 16, page, 4 * page, 0, 1, torch.bfloat16, [96, 3 * page], None, seed=page)


@pytest.mark.parametrize("cf", [1, 4])
@pytest.mark.parametrize("dt", ["fp32", "bf16", "fp16"])
def test_transposed_cache_view(dt, cf):
    """A ``[B, L, Hkv, D]`` buffer read through ``.transpose(1, 2)`` (no copy) gives the reference result."""
    _check_case(DT[dt], 2, 3, 3, 400, 64, 8, 64, 1, cf, torch.bfloat16, [400, 250], "bool_shared", seed=7,
                transposed=True)


def test_transposed_cache_is_not_copied():
    """The kernel reads a strided cache in place: no copy/clone/contiguous op runs inside the call."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v, vl, mask, b = _build(torch.float32, 1, 3, 3, 512, 64, 8, torch.bfloat16, [512], "bool_shared", 3,
                                  transposed=True)
    assert not k.is_contiguous()
    op = _nat_decode
    op(q, k, v, b.kmax, b.kmin, b.kabs, vl, mask, 0.125, 8, 64, 1, 4, None)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        op(q, k, v, b.kmax, b.kmin, b.kabs, vl, mask, 0.125, 8, 64, 1, 4, None)
    names = {e.key for e in prof.key_averages()}
    copies = sorted(n for n in names if n in ("aten::copy_", "aten::clone", "aten::contiguous", "aten::to",
                                              "aten::_to_copy", "aten::index_select", "aten::gather"))
    assert not copies, f"the native op copied data: {copies}"


def test_ctrl_dense_flag():
    """``ctrl[1] != 0`` (a dense layer) or ``ctrl[0] != 0`` (stale bounds, never read): dense attention over every
    valid token, whatever the budget; ``ctrl = [0, 0]`` applies the budget."""
    q, k, v, vl, mask, b = _build(torch.float32, 2, 2, 3, 300, 32, 8, torch.bfloat16, [300, 170], "bool_shared", 5)
    scale = 0.2
    n_valid = (vl + 7) // 8
    for flags in ([0, 1], [1, 0]):
        ctrl = torch.tensor(flags, dtype=torch.int32)
        out = _nat_decode(q, k, v, b.kmax, b.kmin, b.kabs, vl, mask, scale, 8, 16, 1, 4, ctrl)
        assert_close_report(out, dense_sdpa(q, k, v, vl, mask, scale), *TOL[torch.float32], f"ctrl {flags} vs SDPA")
        kept = _nat_kept(q, k, b.kmax, b.kmin, b.kabs, vl, mask, scale, 8, 16, 1, 4, ctrl)
        assert torch.equal(kept, (torch.arange(kept.shape[-1])[None, :] < n_valid[:, None])[:, None, :].expand_as(kept))
    sparse = _nat_decode(q, k, v, b.kmax, b.kmin, b.kabs, vl, mask, scale, 8, 16, 1, 4,
                         torch.tensor([0, 0], dtype=torch.int32))
    assert float((sparse - out).abs().max()) > 1e-4, "with ctrl = [0, 0] the budget must apply"


def test_rows_without_tokens_give_zeros():
    """A row with no valid token, or every token masked, gives zeros (as SDPA's convention in the reference)."""
    q, k, v, vl, _, b = _build(torch.float32, 3, 1, 2, 64, 16, 8, torch.float32, [0, 64, 40], None, 9)
    mask = torch.ones(3, 1, 1, 64, dtype=torch.bool)
    mask[1] = False
    out = _nat_decode(q, k, v, b.kmax, b.kmin, b.kabs, vl, mask, 0.25, 8, 16, 0, 2, None)
    want = ref.sparse_decode_reference(q, k, v, vl, mask, 0.25, _spec(8, 16, 0, 2), b)
    assert_close_report(out, want, *TOL[torch.float32], "empty rows")
    assert float(out[:2].abs().max()) == 0.0


def test_sparse_drops_tokens_and_matches_reference_at_scale():
    """A realistic shape (9/3 heads, D=64, 4K tokens, the defaults): budget applies and the result is the reference's."""
    kept = _check_case(torch.float32, 1, 3, 3, 4096, 64, 8, 512, 1, 4, torch.bfloat16, [4001], None, seed=11)
    assert int(kept.sum()) == 3 * 64  # K = 64 pages per KV head


# ---------------------------------------------------------------------------------------------------------------
# int8 bounds, candidate_extra, keep_tokens
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bdt", ["int8", "bf16"])
def test_keep_tokens_at_scale(bdt):
    """A realistic shape (9/3 heads, D=64, 4K tokens, 64 pages + 256 extra candidate tokens), token-level keep."""
    kept = _check_case(torch.float32, 1, 3, 3, 4096, 64, 8, 512, 1, 1, BDT[bdt], [4001], "bool_shared", seed=12,
                       extra=256, keep_tokens=True)
    assert int(kept.sum(-1).min()) > 64, "token keep over 96 candidate pages should touch more than K pages"


@pytest.mark.parametrize("dt", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("mask_kind", [None, "bool_shared", "float_per_head"])
@pytest.mark.parametrize("valid_len", [[70, 128], [65, 97], [128, 200], [200, 71]])
def test_every_page_a_candidate_with_few_tokens_left_out(dt, mask_kind, valid_len):
    """Two-stage with every valid page a candidate and at most 64 valid tokens left out (the shape of the 2K
    decode point of the defaults, 2056 token slots and 2048 kept, in small: below 512 slots the ranking takes the
    heap of the few left out): kept tokens and output against the reference, rows of the batch on that path and
    beside it (200 tokens: 25 pages, past the 16 candidates)."""
    # S=8, budget 64 (K = 8 pages, 64 kept tokens), extra 64 (16 candidate pages)
    _check_case(DT[dt], 2, 2, 3, 200, 32, 8, 64, 1, 1, torch.int8, valid_len, mask_kind, seed=sum(valid_len),
                extra=64, keep_tokens=True)


def test_keep_tokens_one_stage_is_ignored():
    """With ``N1 <= K`` (c = 1, extra < S) keep_tokens has no effect: the one-stage result."""
    q, k, v, vl, mask, b = _build(torch.float32, 2, 2, 3, 300, 32, 8, torch.int8, [300, 250], "bool_shared", 21)
    args = (b.kmax, b.kmin, b.kabs, vl, mask, 0.2, 8, 48, 1, 1, None)
    assert torch.equal(_nat_decode(q, k, v, *args, 7, True), _nat_decode(q, k, v, *args))
    assert torch.equal(_nat_kept(q, k, *args, 7, True), _nat_kept(q, k, *args))


@pytest.mark.parametrize("keep_tokens", [False, True])
def test_valid_len_past_the_cache_counts_as_the_cache(keep_tokens):
    """``valid_len > L``: the tokens past the cache do not exist, so the result is that of ``valid_len = L``
    (with token keep the newest page's missing slots are not forced and take no keep slot)."""
    q, k, v, _, mask, b = _build(torch.float32, 2, 1, 2, 50, 16, 4, torch.int8, [50, 50], "bool_shared", 23)
    args = (b.kmax, b.kmin, b.kabs)
    sel = (0.25, 4, 16, 1, 2)
    out = _nat_decode(q, k, v, *args, torch.tensor([52, 51]), mask, *sel, None, 8, keep_tokens)
    want = ref.sparse_decode_reference(q, k, v, torch.tensor([50, 50]), mask, 0.25,
                                       _spec(4, 16, 1, 2, 8, keep_tokens, torch.int8), b)
    assert_close_report(out, want, *TOL[torch.float32], f"valid_len past the cache, keep_tokens={keep_tokens}")


def test_candidate_extra_rejects_negative():
    q, k, v, vl, mask, b = _build(torch.float32, 1, 1, 1, 64, 16, 8, torch.float32, [64], None, 22)
    with pytest.raises(ValueError, match="candidate_extra"):
        _nat_decode(q, k, v, b.kmax, b.kmin, b.kabs, vl, None, 0.25, 8, 16, 0, 1, None, -8, False)


# ---------------------------------------------------------------------------------------------------------------
# properties (hypothesis): robust to ties, any shape
# ---------------------------------------------------------------------------------------------------------------


@st.composite
def native_case(draw):
    dt = draw(st.sampled_from(sorted(DT)))
    S = draw(st.sampled_from([1, 2, 4, 8, 16]))
    L = draw(st.integers(1, 120))
    B = draw(st.integers(1, 3))
    Hkv = draw(st.integers(1, 3))
    G = draw(st.sampled_from([1, 2, 3, 4]))
    D = draw(st.sampled_from([4, 8, 16, 24]))
    vl = [draw(st.integers(0, L)) for _ in range(B)]
    P = ref.num_pages(L, S)
    K = draw(st.integers(1, max(1, P + 1)))
    sinks = draw(st.integers(0, K - 1))
    cf = draw(st.sampled_from([1, 2, 4]))
    extra = draw(st.sampled_from([0, 0, 1, S, 3 * S + 1]))  # tokens; floored to pages
    keep_tokens = draw(st.booleans())
    mask = draw(st.sampled_from([None, "bool_shared", "bool_per_head", "float_shared", "float_per_head"]))
    bdt = draw(st.sampled_from(sorted(BDT)))
    ties = draw(st.booleans())  # repeated keys: equal page scores
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(dt=dt, S=S, L=L, B=B, Hkv=Hkv, G=G, D=D, vl=vl, budget=K * S, sinks=sinks, cf=cf, extra=extra,
                keep_tokens=keep_tokens, mask=mask, bdt=bdt, ties=ties, seed=seed)


@settings(max_examples=120, deadline=None)
@given(native_case())
def test_property_exact_attention_over_valid_selection(c):
    """For any input: (1) the output is exact attention over the pages the kernel keeps (whole pages: one stage,
    or two-stage without token keep); (2) those pages are valid, at most K per KV head (N1 = the candidates with
    token keep), and include the newest page and the sinks of every sparse row; (3) with one stage, every kept
    page's bound score is at least every dropped valid page's (ties broken either way)."""
    dtype = DT[c["dt"]]
    q, k, v, vl, mask, b = _build(dtype, c["B"], c["Hkv"], c["G"], c["L"], c["D"], c["S"], BDT[c["bdt"]], c["vl"],
                                  c["mask"], c["seed"])
    if c["ties"]:
        k = k[:, :, :1].expand_as(k).contiguous()
        b = ref.page_bounds(k, c["S"], dtype=BDT[c["bdt"]])
    S, L, K = c["S"], c["L"], c["budget"] // c["S"]
    spec = _spec(S, c["budget"], c["sinks"], c["cf"], c["extra"])
    n1 = spec.n_candidates
    tokens = c["keep_tokens"] and n1 > K  # token-level keep applies (two-stage)
    scale = 1.0 / math.sqrt(c["D"])
    args = (b.kmax, b.kmin, b.kabs, vl, mask, scale, S, c["budget"], c["sinks"], c["cf"], None, c["extra"],
            c["keep_tokens"])
    out = _nat_decode(q, k, v, *args)
    kept = _nat_kept(q, k, *args)
    P = ref.num_pages(L, S)
    n_valid = ((vl + S - 1) // S).clamp(max=P)  # [B]
    page = torch.arange(P)
    valid = page[None, :] < n_valid[:, None]  # [B,P]
    # (1) exact attention over the kept pages (with token keep, a subset of their tokens: finite or zero rows)
    if not tokens:
        dense = _attend_kept(q, k, v, vl, mask, scale, kept.repeat_interleave(S, dim=-1)[..., :L])
        assert_close_report(out, dense, *TOL[dtype], f"native vs attention over its kept pages, case {c}")
    else:
        assert bool(torch.isfinite(out).all()), f"non-finite output with token keep, case {c}"
    # (2) kept pages are valid; sparse rows keep at most K, the newest page and the sinks
    assert not bool((kept & ~valid[:, None, :]).any()), f"kept an invalid page, case {c}"
    sparse_row = n_valid > spec.n_dense_pages  # a row of at most max(K, N1) valid pages is dense
    if bool(sparse_row.any()):
        ks = kept[sparse_row]  # [r,Hkv,P]
        n_max = n1 if tokens else K
        assert int(ks.sum(-1).max()) <= n_max, f"kept more than {n_max} pages, case {c}"
        newest = (vl[sparse_row] - 1) // S
        assert bool(ks.gather(2, newest.reshape(-1, 1, 1).expand(-1, ks.shape[1], 1)).all()), f"newest dropped {c}"
        assert bool(ks[:, :, :c["sinks"]].all()), f"a sink page dropped, case {c}"
    else:
        assert torch.equal(kept, valid[:, None, :].expand_as(kept)), f"dense rows must keep every valid page {c}"
    # (3) one stage: the kept pages are the top scores
    if n1 <= K and bool(sparse_row.any()):
        sc = ref.page_scores(q, b, scale, ref.mask_page_max(mask, c["B"], q.shape[1], L, S))  # [B,Hkv,P]
        forced = (page[None, :] == ((vl - 1) // S)[:, None]) | (page[None, :] < c["sinks"])
        sc = sc.masked_fill(forced[:, None, :], float("inf"))[sparse_row]
        kk, vv = kept[sparse_row], valid[sparse_row][:, None, :].expand_as(kept[sparse_row])
        lo = sc.masked_fill(~kk, float("inf")).amin(-1)  # weakest kept
        hi = sc.masked_fill(kk | ~vv, float("-inf")).amax(-1)  # strongest dropped
        tol = 1e-5 * (hi.abs().nan_to_num(0, 0, 0) + 1)
        assert bool(((lo >= hi - tol) | (hi == float("-inf"))).all()), f"a dropped page outscores a kept one {c}"


# ---------------------------------------------------------------------------------------------------------------
# opcheck
# ---------------------------------------------------------------------------------------------------------------


def _opcheck_decode_args(dtype, mask_kind, cf, bdt, ctrl):
    q, k, v, vl, mask, b = _build(dtype, 2, 2, 2, 61, 8, 4, bdt, [61, 40], mask_kind, 13)
    c = None if ctrl is None else torch.tensor(ctrl, dtype=torch.int32)
    return q, k, v, b, vl, mask, c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask_kind, cf, bdt, ctrl, extra, keep_tokens", [
    (None, 1, torch.float32, None, 0, False),
    ("bool_shared", 4, torch.bfloat16, [0, 0], 0, False),
    ("float_per_head", 2, torch.float32, [0, 1], 4, True),
    ("bool_per_head", 1, torch.int8, None, 8, True),
    (None, 1, torch.int8, [0, 0], 12, False),
])
def test_opcheck_native_decode(dtype, mask_kind, cf, bdt, ctrl, extra, keep_tokens):
    """``tinyserve::sparse_decode`` with ``kernel="native"`` (its CPU kernel) passes opcheck."""
    q, k, v, b, vl, mask, c = _opcheck_decode_args(dtype, mask_kind, cf, bdt, ctrl)
    spec = _spec(4, 12, 1, cf, extra, keep_tokens, bdt).to_list()
    torch.library.opcheck(torch.ops.tinyserve.sparse_decode.default,
                          (q, k, v, b.kmax, b.kmin, b.kabs, vl, mask, 0.35, spec, "native", c))
