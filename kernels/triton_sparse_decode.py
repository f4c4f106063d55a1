"""Triton kernels for query-aware paged sparse decode attention (GPU; CPU under ``TRITON_INTERPRET=1``).

Layout (Liger-Kernel style): private ``@triton.jit`` kernels ``_..._kernel``, the
launchers :func:`select_pages_triton` and :func:`sparse_decode_triton`, and the
registered op ``torch.ops.tinyserve.sparse_decode`` (in :mod:`.sparse_decode`),
whose CUDA kernel (or ``kernel="triton"``) calls :func:`sparse_decode_triton`.

Design: a tightly fused pair of passes rather than one kernel
----------------------------------------------------------------
The work per decode step is (1) a scan of the fp32 page bounds, (2) a top-K over
the ``P`` page scores of each KV head, (3) a gather of the selected pages and exact
attention. Step (2) is a global reduction over all pages of a head; doing it inside
the attention kernel would either serialize one head on one program (a single
sequence at 128K context then uses ``Hkv`` of the GPU's ~132 SMs) or need a
grid-wide barrier. So the work is split at that reduction:

1. :func:`_page_scores_kernel` (grid ``B*Hkv x P/BLOCK_P``): reads each page's
   ``kmax``/``kmin``/``kabs`` once for the whole GQA group, scores it for every
   query head of the group with exactly the formula of
   :func:`.reference.page_scores` (``relu(q).M + min(q,0).m`` plus the same rounding
   slack, times ``scale``, plus the page max of the mask), reduces with a max over
   the group, and writes ``+inf`` for the forced pages (newest page, sink pages: the rule
   of :func:`.reference.forced_pages`, fused) and ``-inf`` past ``valid_len``. Pages past
   ``valid_len`` are never loaded.
2. ``torch.topk`` over ``[B, Hkv, P]`` fp32 scores (a few KB per head; the one
   place where a hand-written radix select would save a launch or two, not bytes).
   No host synchronisation: when every valid page fits in the budget, the top-K
   holds every page with a finite score, and pages scored ``-inf`` contribute
   nothing, so the sparse path equals dense attention without a branch on data
   (the reference's "dense when it fits" rule). When the shapes alone make it dense
   (``P <= K``, or every page a candidate: ``SelectionSpec.dense_cache``) the scan is
   skipped and the attention kernel walks pages directly.
3. :func:`_sparse_attn_splitk_kernel` (grid ``B*Hkv x n_splits``): flash-decoding.
   Each program owns a slice of one KV head's selected pages, loads the group's
   ``G`` query heads once, gathers whole pages straight from the ``[B, Hkv, L, D]``
   cache (page ``j`` is ``S`` contiguous rows), and keeps an online softmax in
   fp32. Tokens past ``valid_len`` / ``L`` and the partial last page are masked at
   the load, so they cost no bandwidth. The number of splits is chosen so that
   ``B*Hkv*n_splits`` covers the SMs twice even at ``B=1``.
4. :func:`_splitk_combine_kernel` (grid ``B*Hq``): merges the split partials
   (max / rescaled sum) and writes ``[B, Hq, 1, D]`` in the dtype of ``q``.

Page bounds are fp32, bf16 (upcast exactly) or int8: step 1 then decodes each code as
``code * step`` with the page's ``step = max(kabs / 126, 2^-126)`` (``tl.div_rn``, the IEEE
division torch does), exactly as :func:`.reference.bounds_f32`.

Two-stage selection (``N1 = candidate_factor * K + candidate_extra // page_size > K``,
:func:`.reference.candidate_pages`) takes the top-``N1`` pages by bound and adds
:func:`_candidate_page_lse_kernel`, the attention-logit kernel without ``V``: it
computes each candidate page's log-sum-exp of exact logits per query head; the
reference's own share-of-mass ranking, :func:`.reference.rank_candidate_pages`, then runs
on the tiny ``[B, Hkv, G, N1]`` result in PyTorch, and step 3 attends over the K survivors.
With ``keep_tokens`` the same kernel stores the candidates' logits themselves
(``[B, Hkv, G, N1*S]`` fp32); :func:`.reference.rank_candidate_tokens` runs on them in
PyTorch (share against the log-sum-exp over all candidate tokens, max over the group,
forced newest/sink tokens, top ``K*S``), and :func:`_token_attn_splitk_kernel` attends
over the kept tokens reusing their logits: it reads only their ``V`` rows, then step 4
combines the splits.

Precision: scores and softmax are fp32. On a GPU, fp16/bf16 ``Q.K`` and ``P.V``
run as tensor-core dots with fp32 accumulation (``P`` rounded to the value dtype,
as in FlashAttention); fp32 inputs use ``input_precision="ieee"`` (no TF32). Under
the interpreter bf16 is upcast to fp32 right after ``tl.load`` (numpy has no bf16).

Triton is imported lazily: :func:`triton_available` is False (and no kernel is
defined) when it is missing, so the package imports without it.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from .reference import (Selection, rank_candidate_pages, rank_candidate_tokens, score_slack_factor,
                        score_underflow_slack)
from .spec import SelectionSpec

try:  # guarded: the package must import without triton
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    _HAS_TRITON = False

__all__ = ["triton_available", "select_pages_triton", "sparse_decode_triton"]

_MASK_NONE, _MASK_BOOL, _MASK_FLOAT = 0, 1, 2


def triton_available() -> bool:
    """True when triton imports (the kernels below are defined)."""
    return _HAS_TRITON


# The kernels below are interpreted iff TRITON_INTERPRET=1 when this module is imported (triton decides at
# decoration time), so that is when the bf16 upcast is decided too.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


if _HAS_TRITON:

    @triton.jit
    def _exact_f32(x):
        """Upcast to fp32, exactly: bf16 through its bits (the interpreter's bf16 -> fp32 conversion mishandles
        subnormals), other dtypes by conversion."""
        if x.dtype.is_bf16():
            return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        return x.to(tl.float32)

    @triton.jit
    def _page_mask_max(mrow_ptr, stride_ml, offs_p, page_ok, L, S: tl.constexpr, S_PAD: tl.constexpr,
                       MASK_KIND: tl.constexpr):
        """Max of one head's additive mask over each page of ``offs_p``: ``[BLOCK_P]`` fp32."""
        offs_s = tl.arange(0, S_PAD)
        pos = offs_p[:, None] * S + offs_s[None, :]
        ok = page_ok[:, None] & (offs_s < S)[None, :] & (pos < L)
        if MASK_KIND == 1:  # bool (stored as uint8): True = attend
            mv = tl.load(mrow_ptr + pos * stride_ml, mask=ok, other=0)
            add = tl.where(mv != 0, 0.0, float("-inf"))
        else:
            add = tl.load(mrow_ptr + pos * stride_ml, mask=ok, other=0.0).to(tl.float32)
        add = tl.where(ok, add, float("-inf"))
        return tl.max(add, axis=1)

    @triton.jit
    def _apply_mask(qk, mask_ptr, b, heads, pos, g_ok, tok_ok, stride_mb, stride_mh, stride_ml,
                    MASK_KIND: tl.constexpr, MASK_PER_HEAD: tl.constexpr):
        """Apply the attention mask to logits ``qk`` ``[G_PAD, T]``: 0 none, 1 boolean, 2 additive."""
        if MASK_KIND != 0:
            if MASK_PER_HEAD:
                m_off = b * stride_mb + heads[:, None] * stride_mh + pos[None, :] * stride_ml
                m_ld = g_ok[:, None] & tok_ok[None, :]
                if MASK_KIND == 1:
                    mv = tl.load(mask_ptr + m_off, mask=m_ld, other=1)
                    qk = tl.where(mv != 0, qk, float("-inf"))
                else:
                    qk = qk + tl.load(mask_ptr + m_off, mask=m_ld, other=0.0).to(tl.float32)
            else:
                m_off = b * stride_mb + pos * stride_ml
                if MASK_KIND == 1:
                    mv = tl.load(mask_ptr + m_off, mask=tok_ok, other=1)
                    qk = tl.where((mv != 0)[None, :], qk, float("-inf"))
                else:
                    qk = qk + tl.load(mask_ptr + m_off, mask=tok_ok, other=0.0).to(tl.float32)[None, :]
        return qk

    @triton.jit
    def _page_scores_kernel(
        q_ptr, kmax_ptr, kmin_ptr, kabs_ptr, vl_ptr, mask_ptr, score_ptr,
        stride_qb, stride_qh, stride_qd,
        stride_xb, stride_xh, stride_xp, stride_xd,
        stride_ab, stride_ah, stride_ap,
        stride_vb,
        stride_mb, stride_mh, stride_ml,
        Hkv, P, L, scale, slack_c, under_c, sink_pages,
        G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr,
        BLOCK_P: tl.constexpr, MASK_KIND: tl.constexpr, MASK_PER_HEAD: tl.constexpr, BOUNDS_KIND: tl.constexpr,
    ):
        """Group-max page scores with forced / invalid pages: ``score[b, kvh, p]`` fp32.

        ``BOUNDS_KIND``: 0 fp32, 1 bf16 (upcast exactly), 2 int8 (``code * step`` with the page's
        ``step = max(kabs / 126, 2^-126)``, as :func:`.reference.bounds_f32`).
        """
        pid_bh = tl.program_id(0)
        pid_p = tl.program_id(1)
        b = pid_bh // Hkv
        kvh = pid_bh % Hkv

        # -- stage 0: valid pages of row b (pages past valid_len are never loaded)
        vl = tl.minimum(tl.load(vl_ptr + b * stride_vb).to(tl.int64), L)  # valid_len past the cache counts as L
        n_valid = (vl + S - 1) // S
        newest = tl.where(vl > 0, (vl - 1) // S, -1)  # C division truncates: guard vl = 0
        offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_d = tl.arange(0, D_PAD)
        p_in = offs_p < P
        p_ok = p_in & (offs_p < n_valid)
        d_ok = offs_d < D

        # -- stage 1: the pages' bounds, read once for the whole GQA group
        x_off = b * stride_xb + kvh * stride_xh + offs_p[:, None] * stride_xp + offs_d[None, :] * stride_xd
        ld = p_ok[:, None] & d_ok[None, :]
        kabs = tl.load(kabs_ptr + b * stride_ab + kvh * stride_ah + offs_p * stride_ap, mask=p_ok, other=0.0)
        kmax = tl.load(kmax_ptr + x_off, mask=ld, other=0)
        kmin = tl.load(kmin_ptr + x_off, mask=ld, other=0)
        if BOUNDS_KIND == 2:  # int8 codes on the page's grid: one fp32 division, one max, one multiply
            step = tl.maximum(tl.div_rn(kabs, 126.0), 1.1754943508222875e-38)  # 2^-126
            kmax = kmax.to(tl.float32) * step[:, None]
            kmin = kmin.to(tl.float32) * step[:, None]
        else:
            kmax = _exact_f32(kmax)
            kmin = _exact_f32(kmin)
        mrow = mask_ptr + b * stride_mb
        if MASK_KIND != 0:
            if not MASK_PER_HEAD:
                mp_shared = _page_mask_max(mrow, stride_ml, offs_p, p_ok, L, S, S_PAD, MASK_KIND)

        # -- stage 2: score every query head of the group, reduce with max
        best = tl.full([BLOCK_P], float("-inf"), tl.float32)
        for g in tl.static_range(G):
            h = kvh * G + g
            qv = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_d * stride_qd, mask=d_ok, other=0.0)
            qv = qv.to(tl.float32)
            qp = tl.maximum(qv, 0.0)
            qn = tl.minimum(qv, 0.0)
            r = tl.sum(qp[None, :] * kmax + qn[None, :] * kmin, axis=1)
            slack = slack_c * tl.sum(tl.abs(qv), axis=0) * kabs + under_c
            s = (r + slack) * scale
            if MASK_KIND != 0:
                if MASK_PER_HEAD:
                    s = s + _page_mask_max(mrow + h * stride_mh, stride_ml, offs_p, p_ok, L, S, S_PAD, MASK_KIND)
                else:
                    s = s + mp_shared
            best = tl.maximum(best, s)

        # -- stage 3: forced pages (+inf), pages past valid_len (-inf)
        forced = (offs_p == newest) | (offs_p < sink_pages)
        best = tl.where(forced, float("inf"), best)
        best = tl.where(offs_p < n_valid, best, float("-inf"))
        tl.store(score_ptr + pid_bh * P + offs_p, best, mask=p_in)

    @triton.jit
    def _softmax_pv_block(qk, m_i, l_i, acc, v_base, pos, stride_vl_, offs_d, stride_vd, tok_ok, d_ok,
                          UPCAST: tl.constexpr):
        """One block of the split-K online softmax: logits ``qk`` [G_PAD, BLOCK] of the tokens at ``pos``
        (``tok_ok`` valid) fold into the running max ``m_i``, sum ``l_i`` and ``acc`` [G_PAD, D_PAD]."""
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + pos[:, None] * stride_vl_ + offs_d[None, :] * stride_vd,
                    mask=tok_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc * alpha[:, None] + pv

    @triton.jit
    def _store_partials(acc, m_i, l_i, acc_ptr, m_ptr, l_ptr, row, offs_d, D, g_ok, d_ok):
        """Unnormalised split partials of rows ``row`` [G_PAD] for :func:`_splitk_combine_kernel`."""
        tl.store(acc_ptr + row[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
        tl.store(m_ptr + row, m_i, mask=g_ok)
        tl.store(l_ptr + row, l_i, mask=g_ok)

    @triton.jit
    def _sparse_attn_splitk_kernel(
        q_ptr, k_ptr, v_ptr, idx_ptr, vl_ptr, mask_ptr, acc_ptr, m_ptr, l_ptr,
        stride_qb, stride_qh, stride_qd,
        stride_kb, stride_kh, stride_kl, stride_kd,
        stride_vb_, stride_vh, stride_vl_, stride_vd,
        stride_ib, stride_ih,
        stride_vlb,
        stride_mb, stride_mh, stride_ml,
        Hkv, L, n_pages, pages_per_split, n_splits, scale,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        S: tl.constexpr, S_PAD: tl.constexpr, PAGES_PER_BLOCK: tl.constexpr,
        MASK_KIND: tl.constexpr, MASK_PER_HEAD: tl.constexpr, DENSE: tl.constexpr, UPCAST: tl.constexpr,
    ):
        """One split of flash-decoding over the selected pages of one KV head, all G query heads.

        Writes the unnormalised partial ``acc[b, h, split, :]`` fp32 with its running
        max ``m`` and denominator ``l``.
        """
        pid_bh = tl.program_id(0)
        pid_s = tl.program_id(1)
        b = pid_bh // Hkv
        kvh = pid_bh % Hkv
        BLOCK_T: tl.constexpr = PAGES_PER_BLOCK * S_PAD

        # -- stage 0: the group's query heads, loaded once
        vl = tl.load(vl_ptr + b * stride_vlb).to(tl.int64)
        lim = tl.minimum(vl, L)  # tokens >= lim do not exist
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D_PAD)
        g_ok = offs_g < G
        d_ok = offs_d < D
        heads = kvh * G + offs_g
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)

        offs_t = tl.arange(0, BLOCK_T)
        t_page = offs_t // S_PAD
        t_slot = offs_t % S_PAD
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)

        start = pid_s * pages_per_split
        end = tl.minimum(start + pages_per_split, n_pages)
        if DENSE:  # pages are 0..n_pages-1 in order: stop at the last valid one
            end = tl.minimum(end, (lim + S - 1) // S)
        k_base = k_ptr + b * stride_kb + kvh * stride_kh
        v_base = v_ptr + b * stride_vb_ + kvh * stride_vh
        for j0 in range(start, end, PAGES_PER_BLOCK):
            # -- stage 1: token positions of PAGES_PER_BLOCK selected pages (gather)
            jp = j0 + t_page
            j_ok = jp < end
            if DENSE:
                page = jp.to(tl.int64)
            else:
                page = tl.load(idx_ptr + b * stride_ib + kvh * stride_ih + jp, mask=j_ok, other=0).to(tl.int64)
            pos = page * S + t_slot
            tok_ok = j_ok & (t_slot < S) & (pos < lim)

            # -- stage 2: logits of all G heads, masked
            k = tl.load(k_base + pos[:, None] * stride_kl + offs_d[None, :] * stride_kd,
                        mask=tok_ok[:, None] & d_ok[None, :], other=0.0)
            if UPCAST:
                qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k))
            qk = qk * scale
            qk = _apply_mask(qk, mask_ptr, b, heads, pos, g_ok, tok_ok, stride_mb, stride_mh, stride_ml,
                             MASK_KIND, MASK_PER_HEAD)
            qk = tl.where(tok_ok[None, :], qk, float("-inf"))

            # -- stages 3-4: online softmax (rows with no finite logit stay at zero), then P.V
            m_i, l_i, acc = _softmax_pv_block(qk, m_i, l_i, acc, v_base, pos, stride_vl_, offs_d, stride_vd, tok_ok,
                                              d_ok, UPCAST)

        # -- stage 5: unnormalised partials for the combine kernel
        _store_partials(acc, m_i, l_i, acc_ptr, m_ptr, l_ptr, (b * Hkv * G + heads) * n_splits + pid_s, offs_d, D,
                        g_ok, d_ok)

    @triton.jit
    def _token_attn_splitk_kernel(
        v_ptr, tok_ptr, logit_ptr, cnt_ptr, acc_ptr, m_ptr, l_ptr,
        stride_vb_, stride_vh, stride_vl_, stride_vd,
        stride_tb, stride_th,
        Hkv, n_tok, tok_per_split, n_splits,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """One split of flash-decoding over a list of kept tokens of one KV head, all G query heads.

        The logits come from the candidate stage (``logit[b, kvh, g, t]`` fp32, masked and scaled); only
        ``V`` rows are read here. ``tok[b, kvh, t]`` int64 is the token's position, -1 for an empty slot;
        slots from ``cnt[b]`` (int64) on are empty and not visited. Writes the unnormalised partial
        ``acc[b, h, split, :]`` fp32 with its running max ``m`` and denominator ``l``, as
        :func:`_sparse_attn_splitk_kernel`.
        """
        pid_bh = tl.program_id(0)
        pid_s = tl.program_id(1)
        b = pid_bh // Hkv
        kvh = pid_bh % Hkv

        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D_PAD)
        offs_t = tl.arange(0, BLOCK_T)
        g_ok = offs_g < G
        d_ok = offs_d < D
        heads = kvh * G + offs_g
        lrow = ((b * Hkv + kvh) * G + offs_g) * n_tok  # [G_PAD]
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)

        start = pid_s * tok_per_split
        end = tl.minimum(tl.minimum(start + tok_per_split, n_tok), tl.load(cnt_ptr + b))
        v_base = v_ptr + b * stride_vb_ + kvh * stride_vh
        for t0 in range(start, end, BLOCK_T):
            # -- stage 1: positions and logits of BLOCK_T kept tokens
            t = t0 + offs_t
            t_in = t < end
            pos = tl.load(tok_ptr + b * stride_tb + kvh * stride_th + t, mask=t_in, other=-1).to(tl.int64)
            tok_ok = t_in & (pos >= 0)
            qk = tl.load(logit_ptr + lrow[:, None] + t[None, :], mask=g_ok[:, None] & tok_ok[None, :],
                         other=float("-inf"))

            # -- stages 2-3: online softmax (rows with no finite logit stay at zero), P.V over the gathered values
            m_i, l_i, acc = _softmax_pv_block(qk, m_i, l_i, acc, v_base, pos, stride_vl_, offs_d, stride_vd, tok_ok,
                                              d_ok, UPCAST)

        # -- stage 4: unnormalised partials for the combine kernel
        _store_partials(acc, m_i, l_i, acc_ptr, m_ptr, l_ptr, (b * Hkv * G + heads) * n_splits + pid_s, offs_d, D,
                        g_ok, d_ok)

    @triton.jit
    def _splitk_combine_kernel(
        acc_ptr, m_ptr, l_ptr, out_ptr, n_splits,
        D: tl.constexpr, D_PAD: tl.constexpr, NS_PAD: tl.constexpr,
    ):
        """Merge the split partials of one query head: ``out[b, h, 0, :]`` in the dtype of ``out``."""
        row = tl.program_id(0)  # b * Hq + h
        offs_s = tl.arange(0, NS_PAD)
        offs_d = tl.arange(0, D_PAD)
        s_ok = offs_s < n_splits
        d_ok = offs_d < D

        # -- stage 1: global max and rescaled denominators
        m = tl.load(m_ptr + row * n_splits + offs_s, mask=s_ok, other=float("-inf"))
        l = tl.load(l_ptr + row * n_splits + offs_s, mask=s_ok, other=0.0)
        m_max = tl.max(m, axis=0)
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.exp(m - m_safe)
        den = tl.sum(w * l, axis=0)

        # -- stage 2: weighted sum of partial numerators; no finite logit -> zeros (as SDPA)
        acc = tl.load(acc_ptr + (row * n_splits + offs_s)[:, None] * D + offs_d[None, :],
                      mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        num = tl.sum(w[:, None] * acc, axis=0)
        out = num / tl.where(den > 0, den, 1.0)
        tl.store(out_ptr + row * D + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)

    @triton.jit
    def _candidate_page_lse_kernel(
        q_ptr, k_ptr, idx_ptr, vl_ptr, mask_ptr, lse_ptr,
        stride_qb, stride_qh, stride_qd,
        stride_kb, stride_kh, stride_kl, stride_kd,
        stride_ib, stride_ih,
        stride_vlb,
        stride_mb, stride_mh, stride_ml,
        Hkv, L, n_cand, scale,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        S: tl.constexpr, S_PAD: tl.constexpr,
        MASK_KIND: tl.constexpr, MASK_PER_HEAD: tl.constexpr, UPCAST: tl.constexpr, STORE_LOGITS: tl.constexpr,
    ):
        """Exact logits of one candidate page, no V read: their log-sum-exp ``lse[b, kvh, g, c]`` fp32 or, with
        ``STORE_LOGITS``, the logits themselves ``lse[b, kvh, g, c * S + s]`` fp32 (-inf past ``valid_len``)."""
        pid_bh = tl.program_id(0)
        c = tl.program_id(1)
        b = pid_bh // Hkv
        kvh = pid_bh % Hkv

        # -- stage 1: group queries and the page's keys
        vl = tl.load(vl_ptr + b * stride_vlb).to(tl.int64)
        lim = tl.minimum(vl, L)
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D_PAD)
        offs_s = tl.arange(0, S_PAD)
        g_ok = offs_g < G
        d_ok = offs_d < D
        heads = kvh * G + offs_g
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        page = tl.load(idx_ptr + b * stride_ib + kvh * stride_ih + c).to(tl.int64)
        pos = page * S + offs_s
        tok_ok = (offs_s < S) & (pos < lim)
        k = tl.load(k_ptr + b * stride_kb + kvh * stride_kh + pos[:, None] * stride_kl + offs_d[None, :] * stride_kd,
                    mask=tok_ok[:, None] & d_ok[None, :], other=0.0)

        # -- stage 2: masked logits
        if UPCAST:
            qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = qk * scale
        qk = _apply_mask(qk, mask_ptr, b, heads, pos, g_ok, tok_ok, stride_mb, stride_mh, stride_ml,
                         MASK_KIND, MASK_PER_HEAD)
        qk = tl.where(tok_ok[None, :], qk, float("-inf"))

        if STORE_LOGITS:
            # -- stage 3': the masked logits of the page's S slots (token-level ranking)
            row = ((b * Hkv + kvh) * G + offs_g) * (n_cand * S) + c * S  # [G_PAD]
            tl.store(lse_ptr + row[:, None] + offs_s[None, :], qk, mask=g_ok[:, None] & (offs_s < S)[None, :])
        else:
            # -- stage 3: per-head log-sum-exp over the page (-inf when nothing is attended)
            mx = tl.max(qk, axis=1)
            mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
            lse = mx_safe + tl.log(tl.sum(tl.exp(qk - mx_safe[:, None]), axis=1))
            tl.store(lse_ptr + ((b * Hkv + kvh) * G + offs_g) * n_cand + c, lse, mask=g_ok)


# ---------------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------------


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << (max(int(n), 1) - 1).bit_length())


def _mask_view(attn_mask: Optional[torch.Tensor], B: int, Hq: int, L: int, device):
    """``(tensor, strides (b, h, l), kind, per_head)`` of the mask viewed as ``[B, Hm, L]`` without a copy."""
    if attn_mask is None:
        dummy = torch.zeros(1, dtype=torch.float32, device=device)
        return dummy, (0, 0, 0), _MASK_NONE, False
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    hm = m.shape[1]
    m = m.expand(B, hm, 1, L)[:, :, 0, :]  # stride 0 on broadcast dims, no copy
    kind = _MASK_FLOAT
    if m.dtype == torch.bool:
        m = m.view(torch.uint8)
        kind = _MASK_BOOL
    return m, tuple(m.stride()), kind, hm != 1 and Hq != 1


def _valid_len_view(valid_len, B: int, device):
    if not isinstance(valid_len, torch.Tensor):
        valid_len = torch.tensor([int(valid_len)], dtype=torch.int64, device=device)
    vl = valid_len.reshape(-1)
    return vl, (0 if vl.numel() == 1 else vl.stride(0))


def _upcast(dtype: torch.dtype) -> bool:
    """fp32 dots in ieee mode; bf16 under the interpreter (numpy has no bf16 arithmetic)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _INTERPRETED)


def _n_splits(bh: int, n_pages: int, pages_per_block: int, device, n_splits: Optional[int]):
    """Split count and pages per split.

    By default ``bh * n_splits`` covers the GPU's SMs twice, and each split loops
    over at least two blocks of pages (so loads overlap compute; this also bounds
    the partials' traffic). Not tuned on hardware yet. Under the interpreter a
    split may hold one block, so that small test shapes still use several splits.
    An explicit ``n_splits`` is only clamped to one page per split.
    """
    if n_splits is None:
        if device.type == "cuda":
            target, min_blocks = 2 * torch.cuda.get_device_properties(device).multi_processor_count, 2
        else:
            target, min_blocks = 2 * bh, 1
        n_splits = triton.cdiv(target, bh)
        n_splits = max(1, min(n_splits, triton.cdiv(n_pages, min_blocks * pages_per_block)))
        pps = triton.cdiv(triton.cdiv(n_pages, n_splits), pages_per_block) * pages_per_block
    else:
        n_splits = max(1, min(int(n_splits), n_pages))
        pps = triton.cdiv(n_pages, n_splits)
    return triton.cdiv(n_pages, pps), pps


#: ``BOUNDS_KIND`` of :func:`_page_scores_kernel` for each storage dtype of ``kmax``/``kmin``
_BOUNDS_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


def _page_scores(q, kmax, kmin, kabs, vl, vl_stride, mask, mstr, mkind, mper, scale, page_size, sink_pages, L):
    B, Hq, _, D = q.shape
    Hkv, P = kmax.shape[1], kmax.shape[2]
    if kmax.dtype not in _BOUNDS_KINDS or kmin.dtype != kmax.dtype:
        raise ValueError(f"sparse_decode_triton: arguments 'kmax'/'kmin' must both be float32, bfloat16 or int8, "
                         f"got {kmax.dtype}/{kmin.dtype}")
    if kabs.dtype != torch.float32:
        raise ValueError(f"sparse_decode_triton: argument 'kabs' must be float32, got {kabs.dtype}")
    if kmin.stride() != kmax.stride():
        kmin = kmin.contiguous()
        kmax = kmax.contiguous()
    scores = torch.empty(B, Hkv, P, dtype=torch.float32, device=q.device)
    BLOCK_P = min(max(1, 4096 // _pow2(D)), _pow2(P))  # two [BLOCK_P, D] fp32 tiles: ~64 registers a thread
    grid = (B * Hkv, triton.cdiv(P, BLOCK_P))
    _page_scores_kernel[grid](
        q, kmax, kmin, kabs, vl, mask, scores,
        q.stride(0), q.stride(1), q.stride(3),
        *kmax.stride(),
        *kabs.stride(),
        vl_stride,
        *mstr,
        Hkv, P, L, float(scale), score_slack_factor(D), score_underflow_slack(D) / float(scale), int(sink_pages),
        G=Hq // Hkv, D=D, D_PAD=_pow2(D), S=page_size, S_PAD=_pow2(page_size),
        BLOCK_P=BLOCK_P, MASK_KIND=mkind, MASK_PER_HEAD=mper, BOUNDS_KIND=_BOUNDS_KINDS[kmax.dtype],
    )
    return scores


def _candidate_page_lse(q, k_cache, cand, vl, vl_stride, mask, mstr, mkind, mper, scale, page_size,
                        store_logits=False):
    """Per candidate page and query head: log-sum-exp ``[B, Hkv, G, Kc]`` fp32 of the exact logits or, with
    ``store_logits``, the logits ``[B, Hkv, G, Kc * S]`` fp32 (token ``cand[c] * S + s`` at ``c * S + s``)."""
    B, Hq, _, D = q.shape
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    Kc = cand.shape[-1]
    out = torch.empty(B, Hkv, G, Kc * page_size if store_logits else Kc, dtype=torch.float32, device=q.device)
    _candidate_page_lse_kernel[(B * Hkv, Kc)](
        q, k_cache, cand, vl, mask, out,
        q.stride(0), q.stride(1), q.stride(3),
        *k_cache.stride(),
        cand.stride(0), cand.stride(1),
        vl_stride,
        *mstr,
        Hkv, L, Kc, float(scale),
        G=G, G_PAD=_pow2(G, 16), D=D, D_PAD=_pow2(D, 16), S=page_size, S_PAD=_pow2(page_size, 16),
        MASK_KIND=mkind, MASK_PER_HEAD=mper, UPCAST=_upcast(q.dtype), STORE_LOGITS=bool(store_logits),
    )
    return out


def _select(q, k_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, spec: SelectionSpec):
    """What the attention kernels read, ``(idx, ok, logits, count)``.

    Returns ``(idx, ok, logits, count)``:

    * ``(None, None, None, None)`` when dense from the shapes (:meth:`.spec.SelectionSpec.dense_cache`);
    * pages: ``idx`` ``[B, Hkv, K]`` (two-stage: ``[B, Hkv, N1]``) int64 page indices (unsorted; page ``P``, past
      every token, for an empty slot), ``ok`` bool, False where a page scored ``-inf`` or the slot is empty (it
      contributes nothing), ``logits`` and ``count`` None;
    * tokens (two-stage with ``keep_tokens``): ``idx`` ``[B, Hkv, N1*S]`` int64 token positions (unsorted, -1 for
      an empty slot), ``ok`` bool, False for an empty slot, ``logits`` ``[B, Hkv, G, N1*S]`` fp32 their masked
      logits from the candidate stage (-inf for an empty slot), ``count`` int64 ``[B]`` the slots to visit.

    Two-stage, a row whose valid pages are all candidates keeps every candidate (it attends densely,
    :attr:`.spec.SelectionSpec.n_dense_pages`); the other rows keep ``K`` pages (``K*S`` tokens) and empty slots.

    The page-score kernel applies the forced pages (:func:`.reference.forced_pages`); the two-stage ranking is
    the reference's own (:func:`.reference.rank_candidate_pages`, :func:`.reference.rank_candidate_tokens`).
    """
    B, Hq, _, D = q.shape
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    P = kmax.shape[2]
    S, sink_pages = spec.page_size, spec.sink_pages
    K = spec.n_pages
    if spec.dense_cache(P):  # every page fits, or every page is a candidate, whatever valid_len is: dense
        return None, None, None, None
    vl, vls = _valid_len_view(valid_len, B, q.device)
    mask, mstr, mkind, mper = _mask_view(attn_mask, B, Hq, L, q.device)
    scores = _page_scores(q, kmax, kmin, kabs, vl, vls, mask, mstr, mkind, mper, scale, S, sink_pages, L)
    n1 = spec.n_candidates
    if n1 <= K:  # one stage
        top, idx = scores.topk(K, dim=-1, sorted=False)
        return idx, top > float("-inf"), None, None
    # ---- two-stage: top-N1 candidates by bound (all valid pages when N1 covers them; the rest score -inf)
    ctop, cidx = scores.topk(min(n1, P), dim=-1, sorted=False)  # [B,Hkv,Kc]
    cand = Selection(cidx, ctop > float("-inf"))
    Kc = cidx.shape[-1]
    vlb = vl.expand(B).clamp(max=L)  # [B]: valid_len past the cache counts as L
    # rows whose valid pages are all candidates attend every candidate (dense: SelectionSpec.n_dense_pages); the
    # other rows' selections are padded to the candidates' width with empty slots
    every = ((vlb + S - 1) // S <= n1).reshape(B, 1, 1)  # [B,1,1]
    if not spec.keep_tokens:
        # ---- K of the candidate pages by share of exact softmax mass
        lse = _candidate_page_lse(q, k_cache, cidx, vl, vls, mask, mstr, mkind, mper, scale, S)  # [B,Hkv,G,Kc]
        sel, _ = rank_candidate_pages(lse, cand, vlb, S, K, sink_pages)  # [B,Hkv,K]
        pad = Kc - sel.idx.shape[-1]
        idx = torch.cat([sel.idx, sel.idx.new_full((B, Hkv, pad), P)], -1)  # page P: past every token, never read
        ok = torch.cat([sel.ok, sel.ok.new_zeros(B, Hkv, pad)], -1)
        return torch.where(every, cidx, idx), torch.where(every, cand.ok, ok), None, None
    # ---- K*S of the candidate tokens by share of exact softmax mass, with their logits
    logits = _candidate_page_lse(q, k_cache, cidx, vl, vls, mask, mstr, mkind, mper, scale, S,
                                 store_logits=True)  # [B,Hkv,G,Kc*S]
    sel, slot = rank_candidate_tokens(logits, cand, vlb, S, K * S, sink_pages)  # [B,Hkv,n]
    kept_logits = logits.gather(3, slot[:, :, None, :].expand(B, Hkv, G, slot.shape[-1]))  # [B,Hkv,G,n]
    kept_logits = kept_logits.masked_fill(~sel.ok[:, :, None, :], float("-inf"))
    n, W = slot.shape[-1], Kc * S
    tok_c = (cidx[..., None] * S + torch.arange(S, device=q.device)).reshape(B, Hkv, W)  # [B,Hkv,W]
    ok_c = cand.ok.repeat_interleave(S, dim=-1) & (tok_c < vlb.reshape(B, 1, 1))
    idx = torch.cat([sel.idx.masked_fill(~sel.ok, -1), sel.idx.new_full((B, Hkv, W - n), -1)], -1)
    lg = torch.cat([kept_logits, kept_logits.new_full((B, Hkv, G, W - n), float("-inf"))], -1)
    idx = torch.where(every, tok_c.masked_fill(~ok_c, -1), idx)  # [B,Hkv,W]
    lg = torch.where(every[..., None], logits.masked_fill(~ok_c[:, :, None, :], float("-inf")), lg)  # [B,Hkv,G,W]
    count = torch.where(every.reshape(B), W, n)  # [B]: the slots the attention visits
    return idx, idx >= 0, lg, count


def select_pages_triton(q, k_cache, kmax, kmin, kabs, valid_len, attn_mask, scale,
                        spec: SelectionSpec) -> Optional[Selection]:
    """What the Triton path attends, for checks against :func:`.reference.choose`.

    Parameters
    ----------
    q, k_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, spec
        As in :func:`sparse_decode_triton`.

    Returns
    -------
    Selection or None
        ``idx`` ``[B, Hkv, K]`` int64 ascending and ``ok`` (False for a slot whose page
        scored ``-inf``: past ``valid_len`` or fully masked, so it contributes nothing).
        Two-stage with ``keep_tokens`` (``spec.n_candidates > K``), the kept single tokens instead:
        ``idx`` ``[B, Hkv, n]`` token positions, ascending (pages of one token, as the reference's
        ``choose`` returns with ``unit = 1``). None when dense from the shapes alone
        (:meth:`.spec.SelectionSpec.dense_cache`).
    """
    idx, ok, _, _ = _select(q, k_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, spec)
    if idx is None:
        return None
    idx, order = idx.clamp(min=0).sort(-1)
    return Selection(idx, ok.gather(-1, order))


def sparse_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kmax: torch.Tensor,
    kmin: torch.Tensor,
    kabs: torch.Tensor,
    valid_len: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    scale: float,
    spec: SelectionSpec,
    n_splits: Optional[int] = None,
) -> torch.Tensor:
    """Query-aware paged sparse decode attention with Triton kernels.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, 1, D]``, float32/float16/bfloat16 (any strides).
    k_cache, v_cache : torch.Tensor
        ``[B, Hkv, L, D]``, dtype of ``q``, ``Hq % Hkv == 0``; read in place.
    kmax, kmin : torch.Tensor
        ``[B, Hkv, P, D]`` page bounds, ``P = ceil(L / page_size)``: float32, bfloat16 (rounded
        outward) or int8 (codes on the page's grid, :func:`.reference.int8_bounds_step`).
    kabs : torch.Tensor
        ``[B, Hkv, P]`` float32.
    valid_len : torch.Tensor
        int64/int32 ``[B]`` or ``[1]``; a length past ``L`` counts as ``L``.
    attn_mask : torch.Tensor or None
        Bool (True = attend) or additive float, broadcastable to ``[B, Hq, 1, L]``
        with a head dim of 1 or ``Hq``.
    scale : float
        Softmax scale.
    spec : SelectionSpec
        The selection (:class:`.spec.SelectionSpec`): two-stage iff ``spec.n_candidates > K``; with
        ``keep_tokens`` the ``K * page_size`` candidate tokens of highest softmax share are kept instead of
        ``K`` whole pages (:func:`.reference.rank_candidate_tokens`).
    n_splits : int, optional
        Split-K programs per KV head (default: enough to fill the device twice). Pass by keyword.

    Returns
    -------
    torch.Tensor
        ``[B, Hq, 1, D]`` in the dtype of ``q``.
    """
    B, Hq, _, D = q.shape
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    page_size = spec.page_size
    idx, _, tok_logits, count = _select(q, k_cache, kmax, kmin, kabs, valid_len, attn_mask, scale, spec)
    if tok_logits is not None:
        return _attend_tokens(q, v_cache, idx, tok_logits, count, n_splits)
    dense = idx is None
    n_pages = kmax.shape[2] if dense else idx.shape[-1]
    vl, vls = _valid_len_view(valid_len, B, q.device)
    mask, mstr, mkind, mper = _mask_view(attn_mask, B, Hq, L, q.device)
    S_PAD = _pow2(page_size)
    ppb = max(1, 64 // S_PAD) if D <= 128 else max(1, 32 // S_PAD)
    if ppb * S_PAD < 16:  # tl.dot needs N >= 16
        ppb = 16 // S_PAD
    ns, pps = _n_splits(B * Hkv, n_pages, ppb, q.device, n_splits)
    acc = torch.empty(B, Hq, ns, D, dtype=torch.float32, device=q.device)
    m = torch.empty(B, Hq, ns, dtype=torch.float32, device=q.device)
    l = torch.empty(B, Hq, ns, dtype=torch.float32, device=q.device)
    idx_t = vl if dense else idx  # dummy pointer when dense
    _sparse_attn_splitk_kernel[(B * Hkv, ns)](
        q, k_cache, v_cache, idx_t, vl, mask, acc, m, l,
        q.stride(0), q.stride(1), q.stride(3),
        *k_cache.stride(),
        *v_cache.stride(),
        0 if dense else idx.stride(0), 0 if dense else idx.stride(1),
        vls,
        *mstr,
        Hkv, L, n_pages, pps, ns, float(scale),
        G=G, G_PAD=_pow2(G, 16), D=D, D_PAD=_pow2(D, 16), S=page_size, S_PAD=S_PAD, PAGES_PER_BLOCK=ppb,
        MASK_KIND=mkind, MASK_PER_HEAD=mper, DENSE=dense, UPCAST=_upcast(q.dtype),
    )
    out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=q.device)
    _splitk_combine_kernel[(B * Hq,)](acc, m, l, out, ns, D=D, D_PAD=_pow2(D), NS_PAD=_pow2(ns))
    return out


def _attend_tokens(q, v_cache, tok, logits, count, n_splits):
    """Split-K attention over kept tokens with their candidate-stage logits, then the combine kernel.

    ``tok`` ``[B, Hkv, n]`` int64 positions (-1: empty), ``logits`` ``[B, Hkv, G, n]`` fp32 contiguous, ``count``
    int64 ``[B]``: row ``b``'s slots past ``count[b]`` are empty and skipped.
    """
    B, Hq, _, D = q.shape
    Hkv = v_cache.shape[1]
    G = Hq // Hkv
    n = tok.shape[-1]
    BLOCK_T = 64 if D <= 128 else 32
    ns, tps = _n_splits(B * Hkv, n, BLOCK_T, q.device, n_splits)
    acc = torch.empty(B, Hq, ns, D, dtype=torch.float32, device=q.device)
    m = torch.empty(B, Hq, ns, dtype=torch.float32, device=q.device)
    l = torch.empty(B, Hq, ns, dtype=torch.float32, device=q.device)
    logits = logits.contiguous()
    _token_attn_splitk_kernel[(B * Hkv, ns)](
        v_cache, tok, logits, count.contiguous(), acc, m, l,
        *v_cache.stride(),
        tok.stride(0), tok.stride(1),
        Hkv, n, tps, ns,
        G=G, G_PAD=_pow2(G, 16), D=D, D_PAD=_pow2(D, 16), BLOCK_T=BLOCK_T, UPCAST=_upcast(q.dtype),
    )
    out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=q.device)
    _splitk_combine_kernel[(B * Hq,)](acc, m, l, out, ns, D=D, D_PAD=_pow2(D), NS_PAD=_pow2(ns))
    return out
