"""ONNX lowerings of the export-only ops (:mod:`tinyserve_compile.onnx.ops`), standard ops only.

Each function is handed to ``torch.onnx.export(..., custom_translation_table=...)``
and traced by onnxscript: Python runs at export time with static shapes, so every
size, ``K`` of ``TopK`` and reduction axis becomes a constant. The ops used are
among those TensorRT's ONNX parser supports (``TopK`` with a constant ``K``,
``Gather``/``GatherElements``, ``MatMul``, ``Softmax``, ``Where``, ``ScatterND``
without reduction, ``ReduceMax``/``ReduceMin``/``ReduceSum`` with constant axes,
elementwise arithmetic and comparisons, ``Ceil``/``Floor``, ``QuantizeLinear``/
``DequantizeLinear`` with a zero zero-point); no custom domain.

The selection is :func:`tinyserve_compile.kernels.reference.choose` written
for a static graph: ``N1 = candidate_factor * K + candidate_extra // page_size``
candidate pages, two stages iff ``N1 > K``, and with ``keep_tokens`` the ``K * S``
candidate tokens of highest softmax share (max over the GQA group) instead of
``K`` whole pages; dense when the cache has at most ``max(K, N1)`` pages
(``SelectionSpec.dense_cache``, decided from the shapes). Where the reference
branches on the data, the graph decides per row: a row whose valid pages fit in
``K`` has its pages past ``valid_len`` scored ``-inf`` and marked invalid, so
``TopK`` keeps every valid page; two-stage, a row whose valid pages are all
candidates keeps every candidate (the kept lists are as wide as the candidates,
the first ``K`` pages or ``K*S`` tokens by share kept in the other rows), so the
attended token set is the one the reference attends.

int8 bounds (``bounds_dtype="int8"``) are converted with ``QuantizeLinear`` /
``DequantizeLinear`` of scale 1 (exact on integer codes; TensorRT takes INT8 only
through Q/DQ, not ``Cast``): the writer computes the codes in fp32 exactly as
:func:`tinyserve_compile.kernels.reference.store_bounds`, the reader decodes
``code * max(kabs / 126, 2^-126)``.
"""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnxscript import opset18 as op

from ..kernels.reference import _INT8_STEP_FLOOR, score_slack_factor, score_underflow_slack
from ..kernels.spec import SelectionSpec, reads_every_key

__all__ = ["TRANSLATIONS", "translation_table"]

_INF = float("inf")
_FLOAT = onnx.TensorProto.FLOAT
_INT8 = onnx.TensorProto.INT8


# ---------------------------------------------------------------------------------------------- constants
def _ints(*v):
    return op.Constant(value_ints=[int(x) for x in v])


def _int(v):
    return op.Constant(value_int=int(v))


def _f(v):
    return op.Constant(value_float=float(v))


def _const(arr: np.ndarray):
    return op.Constant(value=onnx.numpy_helper.from_array(np.ascontiguousarray(arr)))


def _dims(x):
    shape = x.shape
    dims = [d if isinstance(d, int) else getattr(d, "value", d) for d in shape]
    if not all(isinstance(d, int) for d in dims):
        raise ValueError(f"tinyserve ONNX export needs static shapes, got {shape}")
    return dims


def _bh_index(B: int, H: int) -> np.ndarray:
    """int64 ``[B, H, 2]`` holding ``(b, h)``."""
    b, h = np.meshgrid(np.arange(B), np.arange(H), indexing="ij")
    return np.stack([b, h], -1).astype(np.int64)


def _row_base(B: int, H: int, P: int) -> np.ndarray:
    """int64 ``[B, H, 1]``: ``(b*H + h) * P``, the first page row of ``(b, h)`` in a ``[B*H*P, ...]`` view."""
    return (np.arange(B * H, dtype=np.int64) * P).reshape(B, H, 1)


def _gather_pages(cache, idx, dims, S: int, K: int):
    """Whole pages of ``cache`` ``[B, H, L, D]`` at page indices ``idx`` int64 ``[B, H, K]`` -> ``[B, H, K*S, D]``.

    One ``Gather`` of rows of the ``[B*H*P, S*D]`` view (each row a page).
    """
    B, H, L, D = dims
    P = L // S
    rows = op.Add(idx, _const(_row_base(B, H, P)))  # [B,H,K]
    pages = op.Gather(op.Reshape(cache, _ints(B * H * P, S * D)), op.Reshape(rows, _ints(B * H * K)), axis=0)
    return op.Reshape(pages, _ints(B, H, K * S, D))  # [B,H,K*S,D]


def _kept_ranks(width: int, n: int, every):
    """bool ``[B, 1, width]``: the first ``n`` ranks of a sorted ``TopK`` are kept, every rank in the rows ``every``
    (``[B, 1, 1]`` bool: rows whose valid pages are all candidates, attended densely)."""
    return op.Or(op.Less(_const(np.arange(width, dtype=np.int64).reshape(1, 1, width)), _int(n)), every)


def _lse(x, axis: int):
    """``logsumexp`` over ``axis`` (dropped), ``-inf`` for a slice of ``-inf`` (as torch)."""
    m = op.ReduceMax(x, _ints(axis), keepdims=1)
    m = op.Where(op.Greater(m, _f(-_INF)), m, _f(0.0))
    s = op.ReduceSum(op.Exp(op.Sub(x, m)), _ints(axis), keepdims=1)
    return op.Squeeze(op.Add(op.Log(s), m), _ints(axis))


# ---------------------------------------------------------------------------------------------- bf16 rounding
def _trunc_ulp(y):
    """For fp32 ``y >= 0``: the bf16 value at or below ``y``, the bf16 step there, and ``y`` off the grid.

    The exponent comes from ``Floor(log2 y)`` corrected by one step either way
    (``Pow(2, e)`` is exact), so every division and product below is exact.
    """
    ys = op.Where(op.Greater(y, _f(0.0)), y, _f(1.0))
    e = op.Floor(op.Mul(op.Log(ys), _f(1.0 / math.log(2.0))))
    e = op.Max(e, _f(-126.0))  # subnormals share the grid of the lowest binade
    e = op.Where(op.Greater(op.Pow(_f(2.0), e), ys), op.Sub(e, _f(1.0)), e)
    e = op.Max(e, _f(-126.0))
    e = op.Where(op.LessOrEqual(op.Mul(op.Pow(_f(2.0), e), _f(2.0)), ys), op.Add(e, _f(1.0)), e)
    ulp = op.Pow(_f(2.0), op.Sub(e, _f(7.0)))  # bf16 keeps 8 significant bits
    q = op.Div(ys, ulp)
    fl = op.Floor(q)
    return op.Mul(fl, ulp), ulp, op.Greater(q, fl)


def _round_up_bf16(x):
    """The smallest bf16 value ``>= x`` (fp32 in, fp32 on the bf16 grid out), as ``reference.round_up_bf16``."""
    t, ulp, off = _trunc_ulp(op.Abs(x))
    up = op.Where(op.Greater(x, _f(0.0)), op.Where(off, op.Add(t, ulp), t), op.Neg(t))
    return op.Where(op.Equal(x, _f(0.0)), x, up)


def _round_outward_bf16(hi, lo, n: int):
    """``(round_up_bf16(hi), round_down_bf16(lo))`` for ``[n]``-element tensors, one pass over both.

    ``round_down(lo) = -round_up(-lo)``, so both halves are rounded up together.
    """
    both = _round_up_bf16(op.Concat(op.Reshape(hi, _ints(n)), op.Neg(op.Reshape(lo, _ints(n))), axis=0))
    up = op.Slice(both, _ints(0), _ints(n), _ints(0))
    neg_down = op.Slice(both, _ints(n), _ints(2 * n), _ints(0))
    return up, op.Neg(neg_down)


# ---------------------------------------------------------------------------------------------- int8 codes
def _is(x, tensor_type) -> bool:
    return x.dtype is not None and int(x.dtype) == tensor_type


def _int8_step(kabs):
    """``reference.int8_bounds_step``: ``max(kabs / 126, 2^-126)`` in fp32, elementwise."""
    return op.Max(op.Div(kabs, _f(126.0)), _f(_INT8_STEP_FLOOR))


def _int8_codes(x, step, up: bool):
    """``reference._int8_codes`` in fp32: the nearest grid code at or above (``up``) / below ``x``, clamped to +-127.

    ``Ceil``/``Floor`` of the fp32 quotient is off by at most one either way; one check of each neighbour fixes it.
    """
    one = _f(1.0)
    if up:
        c = op.Ceil(op.Div(x, step))
        c = op.Where(op.GreaterOrEqual(op.Mul(op.Sub(c, one), step), x), op.Sub(c, one), c)
        c = op.Where(op.Less(op.Mul(c, step), x), op.Add(c, one), c)
    else:
        c = op.Floor(op.Div(x, step))
        c = op.Where(op.LessOrEqual(op.Mul(op.Add(c, one), step), x), op.Add(c, one), c)
        c = op.Where(op.Greater(op.Mul(c, step), x), op.Sub(c, one), c)
    return op.Max(op.Min(c, _f(127.0)), _f(-127.0))


def _to_int8(codes):
    """fp32 integer codes in [-127, 127] -> int8, exactly (``QuantizeLinear`` of scale 1)."""
    return op.QuantizeLinear(codes, _f(1.0), _const(np.zeros((), np.int8)))


def _from_int8(codes):
    """int8 codes -> fp32, exactly (``DequantizeLinear`` of scale 1)."""
    return op.DequantizeLinear(codes, _f(1.0), _const(np.zeros((), np.int8)))


# ---------------------------------------------------------------------------------------------- the ops
def kv_write(cache, position, src):
    """ScatterND of ``src`` ``[B, H, 1, D]`` into ``cache`` ``[B, H, L, D]`` at ``(b, h, position[b])``."""
    B, H, L, D = _dims(cache)
    idx = op.Concat(_const(_bh_index(B, H)), op.Expand(op.Reshape(position, _ints(B, 1, 1)), _ints(B, H, 1)),
                    axis=-1)  # [B,H,3]
    return op.ScatterND(cache, idx, op.Reshape(src, _ints(B, H, D)))


def bounds_write(k_cache, kmax, kmin, kabs, position, spec):
    """Recompute the page holding ``position[b]``: Gather it, ReduceMax/Min, ScatterND into the bounds.

    int8 bounds are written the way TensorRT can parse (INT8 only through Q/DQ): the whole state is dequantized,
    the page's codes scattered in fp32 and the result quantized again (see :func:`bounds_write_int8_inplace`).
    """
    return _bounds_write(k_cache, kmax, kmin, kabs, position, SelectionSpec.from_list(spec).page_size, False)


def bounds_write_int8_inplace(k_cache, kmax, kmin, kabs, position, spec):
    """:func:`bounds_write` with int8 codes scattered straight into the int8 state (``ScatterND`` on INT8).

    ONNX Runtime then updates the int8 bounds in place (no full dequantize/quantize pass per step), but TensorRT's
    parser takes no ``ScatterND`` on INT8 (:func:`tinyserve_compile.onnx.check.trt_problems` says so).
    """
    return _bounds_write(k_cache, kmax, kmin, kabs, position, SelectionSpec.from_list(spec).page_size, True)


def _bounds_write(k_cache, kmax, kmin, kabs, position, page_size, int8_inplace: bool):
    B, H, L, D = _dims(k_cache)
    S, P = int(page_size), _dims(kmax)[2]
    page = op.Div(position, _int(S))  # [B] int64
    row = op.Reshape(page, _ints(B, 1, 1))
    keys = _gather_pages(k_cache, row, [B, H, L, D], S, 1)  # [B,H,S,D]
    hi = op.ReduceMax(keys, _ints(2), keepdims=0)  # [B,H,D]
    lo = op.ReduceMin(keys, _ints(2), keepdims=0)
    bdtype = kmax.dtype
    if bdtype is not None and int(bdtype) == onnx.TensorProto.BFLOAT16:  # exact on the bf16 grid: the Cast is exact
        hi, lo = _round_outward_bf16(hi, lo, B * H * D)
        hi, lo = op.Reshape(hi, _ints(B, H, D)), op.Reshape(lo, _ints(B, H, D))
    new_abs = op.ReduceMax(op.Max(op.Abs(hi), op.Abs(lo)), _ints(-1), keepdims=0)  # [B,H]: exact max |k| for int8
    idx = op.Concat(_const(_bh_index(B, H)), op.Expand(row, _ints(B, H, 1)), axis=-1)  # [B,H,3]
    if _is(kmax, _INT8):  # codes on the page's grid, max rounded up and min down
        step = _int8_step(op.Unsqueeze(new_abs, _ints(-1)))  # [B,H,1]
        hi, lo = _int8_codes(hi, step, True), _int8_codes(lo, step, False)  # [B,H,D] fp32 codes
        if int8_inplace:
            hi, lo = _to_int8(hi), _to_int8(lo)
        else:  # INT8 only through Q/DQ: scatter into the dequantized codes, quantize the whole state
            new_max = _to_int8(op.ScatterND(_from_int8(kmax), idx, hi))
            new_min = _to_int8(op.ScatterND(_from_int8(kmin), idx, lo))
            return new_max, new_min, op.ScatterND(kabs, idx, new_abs)
    elif bdtype is not None and int(bdtype) != _FLOAT:
        hi, lo = op.Cast(hi, to=int(bdtype)), op.Cast(lo, to=int(bdtype))
    return op.ScatterND(kmax, idx, hi), op.ScatterND(kmin, idx, lo), op.ScatterND(kabs, idx, new_abs)


def _as_float(x):
    if x.dtype is not None and int(x.dtype) != _FLOAT:
        return op.Cast(x, to=_FLOAT)
    return x


def _bounds_f32(kmax, kmin, kabs):
    """``reference.bounds_f32``: int8 codes times their page's step, other dtypes upcast; ``[B, Hkv, P, D]`` fp32."""
    if _is(kmax, _INT8):
        step = op.Unsqueeze(_int8_step(kabs), _ints(-1))  # [B,Hkv,P,1]
        return op.Mul(_from_int8(kmax), step), op.Mul(_from_int8(kmin), step)
    return _as_float(kmax), _as_float(kmin)


def _page_scores(qg, kmax, kmin, kabs, scale: float, D: int):
    """``reference.page_scores`` without a mask: ``[B, Hkv, G, P]`` per query head (fp32)."""
    factor = score_slack_factor(D)
    kmax, kmin = _bounds_f32(kmax, kmin, kabs)
    base = score_underflow_slack(D) / (scale * factor)
    qp, qn = op.Relu(qg), op.Min(qg, _f(0.0))  # [B,Hkv,G,D]
    q1 = op.ReduceSum(op.Abs(qg), _ints(-1), keepdims=1)  # [B,Hkv,G,1]
    slack = op.Add(op.Mul(q1, op.Unsqueeze(kabs, _ints(2))), _f(base))  # [B,Hkv,G,P]
    kmin_t = op.Transpose(kmin, perm=[0, 1, 3, 2])  # [B,Hkv,D,P]
    kmax_t = op.Transpose(kmax, perm=[0, 1, 3, 2])
    r = op.Add(op.Mul(slack, _f(factor)), op.MatMul(qn, kmin_t))
    r = op.Add(r, op.MatMul(qp, kmax_t))
    return op.Mul(r, _f(scale))


def _softmax_attend(logits, v):
    """``softmax(logits) @ v``: ``[B, Hkv, G, T]`` x ``[B, Hkv, T, D]`` -> ``[B, Hkv, G, D]``."""
    return op.MatMul(op.Softmax(logits, axis=-1), v)


def sparse_decode(q, k_cache, v_cache, kmax, kmin, kabs, position, scale, spec):
    """Static-graph ``reference.choose`` + exact attention over the kept pages (or tokens)."""
    B, Hq, _, D = _dims(q)
    _, Hkv, L, _ = _dims(k_cache)
    sp = SelectionSpec.from_list(spec).for_cache(L)  # sizes bounded by the cache
    G, S = Hq // Hkv, sp.page_size
    P, K = L // S, sp.n_pages
    scale, sinks = float(scale), sp.sink_pages
    n1, keep_tokens = sp.n_candidates, sp.keep_tokens
    qg = op.Reshape(q, _ints(B, Hkv, G, D))  # [B,Hkv,G,D]: query head h reads KV head h // G
    vl = op.Add(position, _int(1))  # [B] valid length
    vl3 = op.Reshape(vl, _ints(B, 1, 1))
    neg_inf, pos_inf = _f(-_INF), _f(_INF)

    def out(o):  # [B,Hkv,G,D] -> [B,Hq,1,D]
        return op.Reshape(o, _ints(B, Hq, 1, D))

    def all_logits():  # exact logits over every slot, invalid ones -inf: [B,Hkv,G,L]
        logits = op.Mul(op.MatMul(qg, op.Transpose(k_cache, perm=[0, 1, 3, 2])), _f(scale))
        ok = op.Less(_const(np.arange(L, dtype=np.int64).reshape(1, 1, 1, L)), op.Reshape(vl, _ints(B, 1, 1, 1)))
        return op.Where(ok, logits, neg_inf)

    if sp.dense_cache(P):  # every page fits the budget, or every page is a candidate: dense over the valid tokens
        return out(_softmax_attend(all_logits(), v_cache))

    # ---- page bookkeeping: valid pages, forced pages (newest, sinks)
    page = _const(np.arange(P, dtype=np.int64).reshape(1, 1, P))
    n_valid = op.Div(op.Add(vl3, _int(S - 1)), _int(S))  # [B,1,1]
    newest = op.Div(op.Reshape(position, _ints(B, 1, 1)), _int(S))
    valid = op.Less(page, n_valid)  # [B,1,P]
    forced = op.Or(op.Equal(page, newest), op.Less(page, _int(sinks)))  # [B,1,P]

    def bound_topk(n):  # stage 1: the n pages of highest bound, per KV head
        s = op.ReduceMax(_page_scores(qg, kmax, kmin, kabs, scale, D), _ints(2), keepdims=0)  # [B,Hkv,P]
        s = op.Where(valid, op.Where(forced, pos_inf, s), neg_inf)
        top, idx = op.TopK(s, _ints(n), axis=-1, largest=1, sorted=1)  # [B,Hkv,n]
        ok = op.And(op.Greater(top, neg_inf), op.Less(idx, n_valid))
        return idx, ok

    def tokens_ok(idx, ok, n):  # [B,Hkv,1,n*S]: slot validity of the gathered pages
        tok = op.Add(op.Mul(op.Unsqueeze(idx, _ints(-1)), _int(S)), _const(np.arange(S, dtype=np.int64)))
        tok_ok = op.And(op.Unsqueeze(ok, _ints(-1)), op.Less(tok, op.Unsqueeze(vl3, _ints(-1))))  # [B,Hkv,n,S]
        return op.Reshape(tok_ok, _ints(B, Hkv, 1, n * S))

    if n1 <= K:  # ---- one stage: the bound alone keeps K pages
        idx, ok = bound_topk(K)
        kg, vg = _gather_pages(k_cache, idx, [B, Hkv, L, D], S, K), _gather_pages(v_cache, idx, [B, Hkv, L, D], S, K)
        logits = op.Mul(op.MatMul(qg, op.Transpose(kg, perm=[0, 1, 3, 2])), _f(scale))  # [B,Hkv,G,K*S]
        logits = op.Where(tokens_ok(idx, ok, K), logits, neg_inf)
        return out(_softmax_attend(logits, vg))

    # ---- two stages: N1 < P candidates by the bound (P <= N1 is dense above), then their exact logits keep K pages
    # or K*S tokens
    Kc = n1
    cand, cand_ok = bound_topk(Kc)  # [B,Hkv,Kc]
    if reads_every_key(Kc, P):  # most pages are candidates: one pass over every key
        full = op.Reshape(all_logits(), _ints(B, Hkv, G, P, S))
        sel_c = op.Expand(op.Reshape(cand, _ints(B, Hkv, 1, Kc, 1)), _ints(B, Hkv, G, Kc, S))
        logits = op.Reshape(op.GatherElements(full, sel_c, axis=3), _ints(B, Hkv, G, Kc * S))
    else:
        kc = _gather_pages(k_cache, cand, [B, Hkv, L, D], S, Kc)  # [B,Hkv,Kc*S,D]
        logits = op.Mul(op.MatMul(qg, op.Transpose(kc, perm=[0, 1, 3, 2])), _f(scale))  # [B,Hkv,G,Kc*S]
    tok_ok = tokens_ok(cand, cand_ok, Kc)  # [B,Hkv,1,Kc*S]
    logits = op.Where(tok_ok, logits, neg_inf)
    tok_ok = op.Reshape(tok_ok, _ints(B, Hkv, Kc * S))
    forced_c = op.Or(op.Equal(cand, newest), op.Less(cand, _int(sinks)))
    # a row whose valid pages are all candidates keeps every candidate (dense, SelectionSpec.n_dense_pages): the
    # kept lists are as wide as the candidates, the other rows' slots past K pages (K*S tokens) empty
    every = op.LessOrEqual(n_valid, _int(Kc))  # [B,1,1]
    if keep_tokens:
        return out(_keep_tokens(logits, cand, tok_ok, forced_c, every, v_cache, [B, Hkv, G, L, D], S, Kc, K * S))
    logits5 = op.Reshape(logits, _ints(B, Hkv, G, Kc, S))
    page_lse = _lse(logits5, 4)  # [B,Hkv,G,Kc]
    total = op.Unsqueeze(_lse(page_lse, 3), _ints(3))  # [B,Hkv,G,1]
    share = op.Where(op.Greater(page_lse, neg_inf), op.Sub(page_lse, total), neg_inf)
    share = op.ReduceMax(share, _ints(2), keepdims=0)  # [B,Hkv,Kc]: max over the GQA group
    share = op.Where(cand_ok, op.Where(forced_c, pos_inf, share), neg_inf)
    top, pos = op.TopK(share, _ints(Kc), axis=-1, largest=1, sorted=1)  # [B,Hkv,Kc] candidate slots by share
    ok = op.And(op.And(op.GatherElements(cand_ok, pos, axis=2), op.Greater(top, neg_inf)), _kept_ranks(Kc, K, every))
    chosen = op.Where(ok, op.GatherElements(cand, pos, axis=2), _int(0))  # [B,Hkv,Kc] pages (empty: page 0, cached)
    # ---- attend: the kept pages' logits are taken from the candidates' (no second key read)
    sel = op.Expand(op.Reshape(pos, _ints(B, Hkv, 1, Kc, 1)), _ints(B, Hkv, G, Kc, S))
    sel_logits = op.GatherElements(logits5, sel, axis=3)  # [B,Hkv,G,Kc,S]
    sel_logits = op.Where(op.Reshape(ok, _ints(B, Hkv, 1, Kc, 1)), sel_logits, neg_inf)
    vg = _gather_pages(v_cache, chosen, [B, Hkv, L, D], S, Kc)  # [B,Hkv,Kc*S,D]
    return out(_softmax_attend(op.Reshape(sel_logits, _ints(B, Hkv, G, Kc * S)), vg))


def _keep_tokens(logits, cand, tok_ok, forced_c, every, v_cache, dims, S: int, Kc: int, n: int):
    """``reference.rank_candidate_tokens`` + attend: the ``n`` candidate tokens of highest softmax share, or every
    candidate token in the rows ``every``.

    Parameters (onnxscript values)
    ------------------------------
    logits : ``[B, Hkv, G, Kc*S]`` fp32, -inf at invalid slots; cand : ``[B, Hkv, Kc]`` int64 page indices;
    tok_ok : ``[B, Hkv, Kc*S]`` bool; forced_c : ``[B, Hkv, Kc]``
    bool (newest page, sinks); every : ``[B, 1, 1]`` bool, rows whose valid pages are all candidates (dense).
    Returns ``[B, Hkv, G, D]``.
    """
    B, Hkv, G, L, D = dims
    T = Kc * S
    neg_inf = _f(-_INF)
    # ---- share of every candidate token: logit - lse over the candidates, max over the GQA group
    lse = op.Unsqueeze(_lse(logits, 3), _ints(3))  # [B,Hkv,G,1]
    share = op.Where(op.Greater(logits, neg_inf), op.Sub(logits, lse), neg_inf)  # no -inf - -inf NaN
    share = op.ReduceMax(share, _ints(2), keepdims=0)  # [B,Hkv,T]
    forced_t = op.Reshape(op.Expand(op.Unsqueeze(forced_c, _ints(-1)), _ints(B, Hkv, Kc, S)), _ints(B, Hkv, T))
    share = op.Where(tok_ok, op.Where(forced_t, _f(_INF), share), neg_inf)
    top, pos = op.TopK(share, _ints(T), axis=-1, largest=1, sorted=1)  # [B,Hkv,T] candidate token slots by share
    ok = op.And(op.Greater(top, neg_inf), _kept_ranks(T, n, every))  # valid (invalid slots score -inf), kept
    # ---- attend: the kept tokens' logits from the candidates', their values gathered row by row
    sel_logits = op.GatherElements(logits, op.Expand(op.Unsqueeze(pos, _ints(2)), _ints(B, Hkv, G, T)), axis=3)
    sel_logits = op.Where(op.Unsqueeze(ok, _ints(2)), sel_logits, neg_inf)  # [B,Hkv,G,T]
    tok_list = op.Add(op.Mul(op.Unsqueeze(cand, _ints(-1)), _int(S)), _const(np.arange(S, dtype=np.int64)))
    tok = op.GatherElements(op.Reshape(tok_list, _ints(B, Hkv, T)), pos, axis=2)  # [B,Hkv,T] positions
    tok = op.Where(ok, tok, _int(0))  # an empty slot reads row 0 (cached), at weight 0
    rows = op.Reshape(op.Add(tok, _const(_row_base(B, Hkv, L))), _ints(B * Hkv * T))
    vg = op.Reshape(op.Gather(op.Reshape(v_cache, _ints(B * Hkv * L, D)), rows, axis=0), _ints(B, Hkv, T, D))
    return _softmax_attend(sel_logits, vg)


#: how int8 bounds are written: "tensorrt" (Q/DQ only, :func:`bounds_write`) or "inplace"
#: (:func:`bounds_write_int8_inplace`)
INT8_WRITES = ("tensorrt", "inplace")


def translation_table(int8_write: str = "tensorrt") -> dict:
    """``{torch op overload: onnxscript function}`` for ``torch.onnx.export(custom_translation_table=...)``.

    Parameters
    ----------
    int8_write : {"tensorrt", "inplace"}
        The lowering of int8 bounds writes (other bounds dtypes are written the same either way).
    """
    import torch

    from . import ops  # noqa: F401  (registers the ops)

    if int8_write not in INT8_WRITES:
        raise ValueError(f"translation_table: argument 'int8_write' must be one of {INT8_WRITES}, got {int8_write!r}")
    ns = torch.ops.tinyserve
    return {
        ns.export_kv_write.default: kv_write,
        ns.export_bounds_write.default: bounds_write if int8_write == "tensorrt" else bounds_write_int8_inplace,
        ns.export_sparse_decode.default: sparse_decode,
    }


TRANSLATIONS = ("kv_write", "bounds_write", "sparse_decode")
