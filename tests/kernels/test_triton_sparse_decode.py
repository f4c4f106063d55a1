"""The Triton sparse-decode kernels, run on CPU under the Triton interpreter.

The table of dtypes, groups, masks, rows, page sizes, bounds dtypes and stages runs through Triton in the
conformance suite (tests/conformance: same selection as ``reference.choose``, outputs within dtype tolerance).
Here: split-K partitions, fully masked rows, the op's ``kernel="triton"`` dispatch, the int8 score kernel
against the reference and the true logits, and valid lengths past the cache.
fp16 runs the GPU code path (native-dtype ``tl.dot`` with fp32 accumulation);
bf16 is upcast after ``tl.load`` (the interpreter has no bf16 arithmetic).
"""
from __future__ import annotations


import pytest
import torch


from tests.support.triton_interp import _import_interpreted  # noqa: E402


tsd = _import_interpreted("tinyserve_compile.kernels.triton_sparse_decode")

from tests.support.kernel_checks import DTYPES, TOL, assert_close_report, make_gen, randn  # noqa: E402
from tinyserve_compile.kernels import reference as ref  # noqa: E402
from tinyserve_compile.kernels import sparse_decode  # noqa: E402
from tinyserve_compile.kernels.spec import SelectionSpec  # noqa: E402


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


@pytest.mark.parametrize("n_splits", [1, 3, 64])
def test_split_counts_agree(n_splits):
    """Any split-K partition gives the same result (combine kernel, empty splits)."""
    q, k, v, vl, mask, bounds = _inputs(2, 2, 3, 240, 32, 16, torch.float32, "bool_L", "ragged", seed=5)
    want = ref.sparse_decode_reference(q, k, v, vl, mask, 32 ** -0.5, _spec(16, 80), bounds)
    out = tsd.sparse_decode_triton(q, k, v, *bounds, vl, mask, 32 ** -0.5, _spec(16, 80), n_splits=n_splits)
    assert_close_report(out, want, *TOL[torch.float32], f"n_splits={n_splits}")


@pytest.mark.parametrize("cf,extra,keep", [(1, 0, False), (2, 16, True)])
def test_fully_masked_rows_give_zeros(cf, extra, keep):
    """A head with no attendable token gives zeros (as SDPA), not NaN; a row of valid_len 0 too."""
    B, Hkv, G, L, D, S = 2, 1, 3, 100, 32, 16
    q, k, v, _, _, bounds = _inputs(B, Hkv, G, L, D, S, torch.float32, None, "full", seed=7)
    vl = torch.tensor([L, 0])
    mask = torch.ones(B, Hkv * G, 1, L, dtype=torch.bool)
    mask[0, 1] = False
    spec = _spec(S, 32, 0, cf, extra, keep)
    out = tsd.sparse_decode_triton(q, k, v, *bounds, vl, mask, D ** -0.5, spec)
    want = ref.sparse_decode_reference(q, k, v, vl, mask, D ** -0.5, spec, bounds)
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
    spec = _spec(16, 64, 0, 1, extra, keep, BOUNDS[bname])
    out = sparse_decode(q, k, v, bounds, vl, mask, spec=spec, kernel="triton")
    want = sparse_decode(q, k, v, bounds, vl, mask, spec=spec, kernel="torch")
    assert_close_report(out.float(), want.float(), *TOL[dtype], f"op kernel=triton vs torch ({dname})")


BOUNDS = {"b32": torch.float32, "b16": torch.bfloat16, "b8": torch.int8}


def _spec(S, budget, sink=0, cf=1, extra=0, keep=False, bdt=torch.float32):
    return SelectionSpec(S, budget, sink, cf, extra, keep, bdt)


def test_triton_available():
    assert tsd.triton_available()


BOUNDS = {"b32": torch.float32, "b16": torch.bfloat16, "b8": torch.int8}


def test_int8_scores_match_reference_and_bound_logits():
    """The page-score kernel on int8 bounds: the reference's scores, and upper bounds on every exact logit."""
    B, Hkv, G, L, D, S = 2, 2, 3, 200, 32, 16
    q, k, v, vl, mask, _ = _inputs(B, Hkv, G, L, D, S, torch.float32, "float_per_head", "full", seed=3)
    bounds = ref.page_bounds(k, S, dtype=torch.int8)
    scale = D ** -0.5
    got = tsd.page_scores_triton(q, *bounds, vl, mask, scale, _spec(S, 2 * S, bdt=torch.int8), L)
    want = ref.page_scores(q, bounds, scale, ref.mask_page_max(mask, B, Hkv * G, L, S))
    newest = (L - 1) // S
    want[:, :, newest] = float("inf")  # the kernel forces the newest page
    assert_close_report(got, want, 1e-5, 1e-5, "int8 page scores vs reference")
    logits = (q.float().reshape(B, Hkv, G, D) @ k.float().transpose(-1, -2)) * scale + mask.float().reshape(B, Hkv, G, L)
    page_max = ref._paged(logits.amax(2).unsqueeze(-1), S, float("-inf")).squeeze(-1).amax(-1)  # [B,Hkv,P]
    assert bool((got >= page_max).all()), f"score below a logit by {float((page_max - got).max()):.3e}"


def test_bounds_dtype_checked():
    q, k, v, vl, _, bounds = _inputs(1, 1, 1, 64, 16, 16, torch.float32, None, "full", seed=1)
    with pytest.raises(ValueError, match="kmax"):
        tsd.sparse_decode_triton(q, k, v, bounds.kmax.half(), bounds.kmin.half(), bounds.kabs, vl, None, 0.25,
                                 _spec(16, 32))


@pytest.mark.parametrize("keep", [False, True])
def test_valid_len_past_the_cache_counts_as_the_cache(keep):
    """``valid_len > L``: the result is that of ``valid_len = L`` (the newest page is the last one of the cache)."""
    B, Hkv, G, L, D, S = 2, 1, 2, 50, 16, 4
    q, k, v, _, mask, _ = _inputs(B, Hkv, G, L, D, S, torch.float32, "bool_L", "full", seed=23)
    bounds = ref.page_bounds(k, S, dtype=torch.int8)
    spec = _spec(S, 16, 1, 2, 8, keep, torch.int8)
    out = tsd.sparse_decode_triton(q, k, v, *bounds, torch.tensor([60, 57]), mask, 0.25, spec)
    want = ref.sparse_decode_reference(q, k, v, torch.tensor([L, L]), mask, 0.25, spec, bounds)
    assert_close_report(out, want, *TOL[torch.float32], f"valid_len past the cache, keep_tokens={keep}")
