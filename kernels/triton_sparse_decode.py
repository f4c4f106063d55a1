"""Triton kernels for query-aware paged sparse decode attention (GPU; CPU under ``TRITON_INTERPRET=1``).

One call of :func:`sparse_decode_triton` is at most three launches, decides everything on the device (no host
read, no allocation whose size depends on data, no ATen selection op), and can therefore be captured by CUDA
graphs and replayed for any valid lengths, masks and ``ctrl`` flags:

1. :func:`_score_pages_kernel` (grid ``B*Hkv x n_prog1``, about one wave): each program scores every
   ``n_prog1``-th block of ``BLOCK_P`` pages of its head, its loads software-pipelined, with exactly the bound
   of :func:`.reference.page_scores` (``relu(q).M + min(q,0).m`` plus the rounding slack, times ``scale``, plus
   the page max of the mask, max over the GQA group; forced pages ``+inf``, pages past ``valid_len``
   ``-inf``). The last program of each (batch row, KV head) to finish (a per-head arrival
   counter) selects the top ``N1`` pages by an exact radix select over the head's scores (ties at the
   threshold go to the lower page index) and writes them ascending: the candidates (two stages) or the kept
   pages (one stage).
2. :func:`_rank_candidates_kernel` (two stages only; grid ``B*Hkv x ceil(N1 / CAND_PER_PROG)``): exact logits of
   the candidates' keys (no values): the logits themselves (``keep_tokens``) or each candidate page's
   log-sum-exp, with per-program softmax statistics. The last program of each head combines the statistics
   into each query head's log-sum-exp over every candidate, scores each token (page) by its share of softmax
   mass (max over the group; forced newest/sink tokens ``+inf``), as :func:`.reference.rank_candidate_tokens`
   (:func:`.reference.rank_candidate_pages`) does, and radix-selects the ``K*S`` tokens (``K`` pages).
3. :func:`_attend_kernel` (grid ``B*Hkv x n_splits``): flash-decoding over the kept pages (keys and values),
   the kept tokens (values only, their logits reused from launch 2), or, for a dense row, every valid token;
   the last split of each head to finish merges the splits' partials and writes ``[B, Hq, 1, D]``.

A row attends densely, in launch 3 alone (launches 1 and 2 skip it), when its valid pages number at most
``SelectionSpec.n_dense_pages`` (every page fits in the budget, or every page is a candidate) or when ``ctrl``
(int32 ``[2]`` on the device of ``q``) has a nonzero flag: stale bounds or a dense layer. When the shapes alone
make every row dense (:meth:`.spec.SelectionSpec.dense_cache`), only launch 3 runs.

Workspace (scores, candidate lists, logits, partials, arrival counters) is sized from the shapes and allocated
once per shape and device (:func:`_workspace`); the arrival counters are reset by the program that reads them
last, so every call leaves them at zero. One workspace serves calls issued in order on one stream (calls of one
shape on concurrent streams would share it: not supported).

Page bounds are fp32, bf16 (upcast exactly) or int8 (``code * step`` with the page's
``step = max(kabs / 126, 2^-126)``, as :func:`.reference.bounds_f32`). Scores and softmax are fp32; on a GPU,
fp16/bf16 ``Q.K`` and ``P.V`` are tensor-core dots with fp32 accumulation (``P`` rounded to the value dtype,
as in FlashAttention); fp32 inputs use ``input_precision="ieee"``. Under the interpreter bf16 is upcast to fp32
right after ``tl.load`` (numpy has no bf16).

Triton is imported lazily: :func:`triton_available` is False (and no kernel is defined) when it is missing,
so the package imports without it.
"""
from __future__ import annotations

import copy
import functools
import os
from typing import Optional

import torch

from .reference import Selection, score_slack_factor, score_underflow_slack
from .spec import SelectionSpec

try:  # guarded: the package must import without triton
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    _HAS_TRITON = False

__all__ = ["triton_available", "select_pages_triton", "page_scores_triton", "sparse_decode_triton", "LAUNCHES"]

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
    def _group_queries(q_ptr, b, heads, g_ok, offs_d, d_ok, stride_qb, stride_qh, stride_qd, UPCAST: tl.constexpr):
        """The query heads ``heads`` of row ``b``: ``[G_PAD, D_PAD]``, fp32 when ``UPCAST``."""
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            q = _exact_f32(q)
        return q

    @triton.jit
    def _masked_logits(q, k_base, pos, tok_ok, offs_d, d_ok, stride_kl, stride_kd, scale, mask_ptr, b, heads, g_ok,
                       stride_mb, stride_mh, stride_ml, MASK_KIND: tl.constexpr, MASK_PER_HEAD: tl.constexpr,
                       UPCAST: tl.constexpr):
        """Scaled, masked logits ``[G_PAD, T]`` fp32 of the group's queries ``q`` against the keys at ``pos``
        (``-inf`` where ``tok_ok`` is False)."""
        k = tl.load(k_base + pos[:, None] * stride_kl + offs_d[None, :] * stride_kd,
                    mask=tok_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            qk = tl.dot(q, tl.trans(_exact_f32(k)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = qk * scale
        qk = _apply_mask(qk, mask_ptr, b, heads, pos, g_ok, tok_ok, stride_mb, stride_mh, stride_ml,
                         MASK_KIND, MASK_PER_HEAD)
        return tl.where(tok_ok[None, :], qk, float("-inf"))

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


    # ---- device-side decisions and the exact top-n select ---------------------------------------------------------

    @triton.jit
    def _row_state(vl_ptr, stride_vb, ctrl_ptr, b, L, n_dense, S: tl.constexpr, HAS_CTRL: tl.constexpr):
        """``(lim, n_valid, sparse)`` of batch row ``b``: its valid tokens (``valid_len`` past the cache counts as
        ``L``), valid pages, and whether it goes through the selection (more than ``n_dense`` valid pages and,
        with ``ctrl``, neither flag set)."""
        lim = tl.minimum(tl.load(vl_ptr + b * stride_vb).to(tl.int64), L)
        n_valid = (lim + S - 1) // S
        sparse = n_valid > n_dense
        if HAS_CTRL:
            sparse = sparse & (tl.load(ctrl_ptr) == 0) & (tl.load(ctrl_ptr + 1) == 0)
        return lim, n_valid, sparse

    #: the sortable key of -inf (bits 0xFF800000): a key above it is a value above -inf (a NaN of sign 0 too)
    _NEG_INF_KEY = tl.constexpr(0x007FFFFF)

    @triton.jit
    def _sort_key(x):
        """uint32 keys in the order of the fp32 values ``x`` (``-inf`` lowest, ``+inf`` highest)."""
        bits = x.to(tl.uint32, bitcast=True)
        return tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)  # ^: not ~ (Triton 3.5 interpreter)

    @triton.jit
    def _arrive(sem_ptr, n_prog):
        """Count this program in: True for the last of ``n_prog`` programs, which also resets the counter.

        Every thread's stores are ordered before the count by the barrier; the counter's acquire-release atomic
        makes them visible to the last program, which reads them with ``.cg`` loads (L2, not a stale L1 line)."""
        tl.debug_barrier()
        done = tl.atomic_add(sem_ptr, 1, sem="acq_rel", scope="gpu")
        last = done == n_prog - 1
        if last:
            tl.atomic_xchg(sem_ptr, 0, sem="relaxed", scope="gpu")
        return last

    @triton.jit
    def _select_keys(key, ok, n_sel, out_ptr, count_ptr, BLOCK: tl.constexpr):
        """Write the positions of the ``n_sel`` largest of ``key`` (uint32 sortable keys ``[BLOCK]`` in registers,
        ``ok`` marks the real ones; padding keys are 0) ascending to ``out`` and their count to ``count``: never
        one whose value is ``-inf``; ties at the threshold go to the lower position. The threshold is found one
        bit a pass (32 reductions, no memory traffic between them)."""
        offs = tl.arange(0, BLOCK)
        # -- stage 1: the n_sel-th largest key, from the top bit down
        prefix = tl.zeros([], dtype=tl.uint32)
        for i in tl.static_range(32):
            cand = prefix | (1 << (31 - i))
            above = tl.sum((key >= cand).to(tl.int32), axis=0)
            prefix = tl.where(above >= n_sel, cand, prefix)
        # -- stage 2: the keys above it, the first ties in index order, written ascending
        need = n_sel - tl.sum((key > prefix).to(tl.int32), axis=0)
        eq = ok & (key == prefix)
        tie_rank = tl.cumsum(eq.to(tl.int32), axis=0) - 1
        sel = ((key > prefix) | (eq & (tie_rank < need))) & ok & (key > _NEG_INF_KEY)
        pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(out_ptr + pos, offs, mask=sel)
        tl.store(count_ptr, tl.sum(sel.to(tl.int32), axis=0))

    @triton.jit
    def _select_top_resident(val_ptr, n, n_sel, out_ptr, count_ptr, BLOCK: tl.constexpr):
        """:func:`_select_top` for ``n <= BLOCK``: the keys are loaded once and stay in registers
        (:func:`_select_keys`); the values themselves are not kept (their registers would double the tail's)."""
        offs = tl.arange(0, BLOCK)
        ok = offs < n
        x = tl.load(val_ptr + offs, mask=ok, other=float("-inf"), cache_modifier=".cg")
        _select_keys(tl.where(ok, _sort_key(x), 0), ok, n_sel, out_ptr, count_ptr, BLOCK)

    @triton.jit
    def _select_any(val_ptr, n, n_sel, out_ptr, count_ptr, BLOCK: tl.constexpr, BLOCK_ALL: tl.constexpr):
        """:func:`_select_top_resident` when ``n`` fits in ``BLOCK_ALL`` keys, else :func:`_select_top`."""
        if n <= BLOCK_ALL:
            _select_top_resident(val_ptr, n, n_sel, out_ptr, count_ptr, BLOCK_ALL)
        else:
            _select_top(val_ptr, n, n_sel, out_ptr, count_ptr, BLOCK)

    @triton.jit
    def _select_top(val_ptr, n, n_sel, out_ptr, count_ptr, BLOCK: tl.constexpr):
        """Write the indices of the ``n_sel`` largest of ``val[0:n]`` (fp32), ascending, to ``out``, and their count
        to ``count``: never an index whose value is ``-inf``; ties at the threshold go to the lower index.

        An exact radix select on the values' sortable keys, four bits a pass (eight passes of counts against 16
        thresholds), then one pass counting the keys above the threshold and one writing the selection."""
        # -- stage 1: the n_sel-th largest key, four bits at a time
        digits = tl.arange(0, 16).to(tl.uint32)
        prefix = tl.zeros([], dtype=tl.uint32)
        for i in tl.static_range(8):
            shift = 28 - 4 * i
            thr = prefix | (digits << shift)  # [16]: the candidates for this digit
            cnt = tl.zeros([16], dtype=tl.int32)
            for s in range(0, n, BLOCK):
                offs = s + tl.arange(0, BLOCK)
                ok = offs < n
                key = _sort_key(tl.load(val_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg"))
                cnt += tl.sum(((key[None, :] >= thr[:, None]) & ok[None, :]).to(tl.int32), axis=1)
            d = tl.sum((cnt >= n_sel).to(tl.int32), axis=0) - 1  # counts fall with the digit; digit 0 always holds
            prefix = prefix | (tl.maximum(d, 0).to(tl.uint32) << shift)
        # -- stage 2: keys above the threshold, then the ties it leaves room for
        n_gt = tl.zeros([], dtype=tl.int32)
        for s in range(0, n, BLOCK):
            offs = s + tl.arange(0, BLOCK)
            ok = offs < n
            key = _sort_key(tl.load(val_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg"))
            n_gt += tl.sum((ok & (key > prefix)).to(tl.int32), axis=0)
        need = n_sel - n_gt
        # -- stage 3: write the selected indices in ascending order
        emitted = tl.zeros([], dtype=tl.int32)
        ties = tl.zeros([], dtype=tl.int32)
        for s in range(0, n, BLOCK):
            offs = s + tl.arange(0, BLOCK)
            ok = offs < n
            key = _sort_key(tl.load(val_ptr + offs, mask=ok, other=float("-inf"), cache_modifier=".cg"))
            eq = ok & (key == prefix)
            tie_rank = ties + tl.cumsum(eq.to(tl.int32), axis=0) - 1
            sel = (ok & (key > prefix)) | (eq & (tie_rank < need))
            sel = sel & (key > _NEG_INF_KEY)
            pos = emitted + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            tl.store(out_ptr + pos, offs, mask=sel)
            emitted += tl.sum(sel.to(tl.int32), axis=0)
            ties += tl.sum(eq.to(tl.int32), axis=0)
        tl.store(count_ptr, emitted)

    # ---- launch 1: page scores, then the top pages --------------------------------------------------------------

    @triton.jit
    def _score_pages_kernel(
        q_ptr, kmax_ptr, kmin_ptr, kabs_ptr, vl_ptr, mask_ptr, ctrl_ptr,
        score_ptr, cand_ptr, ncand_ptr, sem_ptr,
        stride_qb, stride_qh, stride_qd,
        stride_xb, stride_xh, stride_xp, stride_xd,
        stride_ab, stride_ah, stride_ap,
        stride_vb,
        stride_mb, stride_mh, stride_ml,
        Hkv, P, L, scale, slack_c, under_c, sink_pages, n_dense, n_sel, n_prog,
        G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr,
        BLOCK_P: tl.constexpr, MASK_KIND: tl.constexpr, MASK_PER_HEAD: tl.constexpr, BOUNDS_KIND: tl.constexpr,
        HAS_CTRL: tl.constexpr, SELECT: tl.constexpr, BLOCK_SEL: tl.constexpr, BLOCK_ALL: tl.constexpr,
        NUM_STAGES: tl.constexpr,
    ):
        """Group-max page scores ``score[b*Hkv + kvh, p]`` fp32 of the blocks ``pid_p, pid_p + n_prog, ...`` of
        ``BLOCK_P`` pages (``NUM_STAGES`` software-pipeline stages); with ``SELECT``, the last program of the
        head writes the top ``n_sel`` pages ``cand[b*Hkv + kvh, :]`` int32 ascending and their count
        ``ncand[b*Hkv + kvh]`` (pages of ``-inf`` score left out).

        ``BOUNDS_KIND``: 0 fp32, 1 bf16 (upcast exactly), 2 int8 (``code * step`` with the page's
        ``step = max(kabs / 126, 2^-126)``, as :func:`.reference.bounds_f32`). Rows attended densely
        (:func:`_row_state`) are skipped whole.
        """
        pid_bh = tl.program_id(0)
        pid_p = tl.program_id(1)
        b = pid_bh // Hkv
        kvh = pid_bh % Hkv

        # -- stage 0: the row's state (a dense row is skipped by every program of its heads)
        lim, n_valid, sparse = _row_state(vl_ptr, stride_vb, ctrl_ptr, b, L, n_dense, S, HAS_CTRL)
        if sparse:
            newest = tl.where(lim > 0, (lim - 1) // S, -1)  # C division truncates: guard lim = 0
            offs_d = tl.arange(0, D_PAD)
            d_ok = offs_d < D
            mrow = mask_ptr + b * stride_mb
            # the program's blocks of pages: pid_p, pid_p + n_prog, ... (few programs, each looping over many
            # blocks: the select tail's registers then cost occupancy once a program, not once a block)
            for p0 in tl.range(pid_p * BLOCK_P, P, n_prog * BLOCK_P, num_stages=NUM_STAGES):
                offs_p = p0 + tl.arange(0, BLOCK_P)
                p_in = offs_p < P
                p_ok = p_in & (offs_p < n_valid)

                # -- stage 1: the pages' bounds, read once for the whole GQA group (pages past valid_len are not)
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
                            s = s + _page_mask_max(mrow + h * stride_mh, stride_ml, offs_p, p_ok, L, S, S_PAD,
                                                   MASK_KIND)
                        else:
                            s = s + mp_shared
                    best = tl.maximum(best, s)

                # -- stage 3: forced pages (+inf), pages past valid_len (-inf)
                forced = (offs_p == newest) | (offs_p < sink_pages)
                best = tl.where(forced, float("inf"), best)
                best = tl.where(offs_p < n_valid, best, float("-inf"))
                tl.store(score_ptr + pid_bh * P + offs_p, best, mask=p_in)

            # -- stage 4: the head's last program selects its top pages
            if SELECT:
                if _arrive(sem_ptr + pid_bh, n_prog):
                    _select_any(score_ptr + pid_bh * P, P, n_sel, cand_ptr + pid_bh * n_sel, ncand_ptr + pid_bh,
                                BLOCK_SEL, BLOCK_ALL)

    # ---- launch 2 (two stages): exact logits of the candidates, then the kept tokens or pages --------------------

    @triton.jit
    def _unit_shares(u, n_units, ncand, cand_row, logit_ptr, lrow0, lse, offs_g, lim, newest, sink_pages,
                     S: tl.constexpr, TOKENS: tl.constexpr, G: tl.constexpr):
        """``(share, in_range)`` of the candidate units ``u`` (slots ``c*S + s`` with ``TOKENS``, else candidate
        positions ``c``): the largest over the group's query heads of the unit's log share of the head's softmax
        mass (``logit - lse``; ``-inf`` for a masked one), ``+inf`` for a forced unit (the newest page, the sink
        pages), ``-inf`` for a unit past ``ncand`` or ``valid_len``. ``lse`` ``[G_PAD]`` fp32, the logits of head
        ``g`` at ``logit[(lrow0 + g) * n_units + u]``."""
        u_in = u < n_units
        if TOKENS:
            c = u // S
        else:
            c = u
        ok = u_in & (c < ncand)
        page = tl.load(cand_row + c, mask=ok, other=0, cache_modifier=".cg")
        if TOKENS:
            ok = ok & (page.to(tl.int64) * S + u % S < lim)
        sh = tl.where(u_in, float("-inf"), float("-inf"))
        for g in tl.static_range(G):  # one row of logits a head: G independent loads, no [G_PAD, N] tile
            lse_g = tl.sum(tl.where(offs_g == g, lse, 0.0), axis=0)
            lg = tl.load(logit_ptr + (lrow0 + g) * n_units + u, mask=ok, other=float("-inf"), cache_modifier=".cg")
            sh = tl.maximum(sh, tl.where(lg == float("-inf"), float("-inf"), lg - lse_g))  # nan -> -inf (reference)
        forced = (page == newest) | (page < sink_pages)
        return tl.where(ok & forced, float("inf"), tl.where(ok, sh, float("-inf"))), u_in

    @triton.jit
    def _rank_candidates_kernel(
        q_ptr, k_ptr, vl_ptr, mask_ptr, ctrl_ptr,
        cand_ptr, ncand_ptr, logit_ptr, stat_m_ptr, stat_l_ptr, share_ptr, kept_ptr, count_ptr, sem_ptr,
        stride_qb, stride_qh, stride_qd,
        stride_kb, stride_kh, stride_kl, stride_kd,
        stride_vb,
        stride_mb, stride_mh, stride_ml,
        Hkv, L, scale, sink_pages, n_dense, n_cand, n_keep, n_prog, cand_per_prog,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        S: tl.constexpr, S_PAD: tl.constexpr, PAGES_PER_BLOCK: tl.constexpr, NP_PAD: tl.constexpr,
        MASK_KIND: tl.constexpr, MASK_PER_HEAD: tl.constexpr, UPCAST: tl.constexpr, TOKENS: tl.constexpr,
        HAS_CTRL: tl.constexpr, BLOCK_SEL: tl.constexpr, BLOCK_ALL: tl.constexpr,
    ):
        """Exact logits of a slice of one KV head's candidate pages (no V read), then, in the head's last
        program, the kept tokens (``TOKENS``) or pages by share of softmax mass.

        Writes ``logit[bh, g, c*S + s]`` fp32 (``TOKENS``; the masked, scaled logit of slot ``s`` of candidate
        ``c``, ``-inf`` where invalid) or the candidate page's log-sum-exp ``logit[bh, g, c]``; per-program
        softmax statistics ``stat_m``/``stat_l`` ``[bh, prog, g]``; the last program ranks the units by
        :func:`_unit_shares` (in registers up to ``BLOCK_ALL`` units, else through ``share[bh, :]``) and writes
        the kept units ``kept[bh, :]`` int32 ascending (candidate slots ``c*S + s``, or candidate positions
        ``c``) and their number ``count[bh]``.
        """
        pid_bh = tl.program_id(0)
        pid = tl.program_id(1)
        b = pid_bh // Hkv
        kvh = pid_bh % Hkv
        BLOCK_T: tl.constexpr = PAGES_PER_BLOCK * S_PAD

        lim, n_valid, sparse = _row_state(vl_ptr, stride_vb, ctrl_ptr, b, L, n_dense, S, HAS_CTRL)
        if sparse:
            # -- stage 0: the group's query heads and this program's candidates
            ncand = tl.load(ncand_ptr + pid_bh)
            offs_g = tl.arange(0, G_PAD)
            offs_d = tl.arange(0, D_PAD)
            g_ok = offs_g < G
            d_ok = offs_d < D
            heads = kvh * G + offs_g
            q = _group_queries(q_ptr, b, heads, g_ok, offs_d, d_ok, stride_qb, stride_qh, stride_qd, UPCAST)
            offs_t = tl.arange(0, BLOCK_T)
            t_page = offs_t // S_PAD
            t_slot = offs_t % S_PAD
            n_slots = n_cand * S
            if TOKENS:
                n_units = n_slots  # candidate slots c*S + s
            else:
                n_units = n_cand  # candidate pages
            lrow = (pid_bh * G + offs_g) * n_units  # [G_PAD]
            m_i = tl.full([G_PAD], float("-inf"), tl.float32)
            l_i = tl.zeros([G_PAD], tl.float32)
            start = pid * cand_per_prog
            end = tl.minimum(start + cand_per_prog, ncand)
            k_base = k_ptr + b * stride_kb + kvh * stride_kh
            for j0 in range(start, end, PAGES_PER_BLOCK):
                # -- stage 1: the keys of PAGES_PER_BLOCK candidate pages, masked logits of all G heads
                jp = j0 + t_page
                j_ok = jp < end
                page = tl.load(cand_ptr + pid_bh * n_cand + jp, mask=j_ok, other=0).to(tl.int64)
                pos = page * S + t_slot
                tok_ok = j_ok & (t_slot < S) & (pos < lim)
                qk = _masked_logits(q, k_base, pos, tok_ok, offs_d, d_ok, stride_kl, stride_kd, scale, mask_ptr, b,
                                    heads, g_ok, stride_mb, stride_mh, stride_ml, MASK_KIND, MASK_PER_HEAD, UPCAST)
                # -- stage 2: running softmax statistics of the program's candidates
                m_new = tl.maximum(m_i, tl.max(qk, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(qk - m_safe[:, None]), axis=1)
                m_i = m_new
                # -- stage 3: the logits (tokens) or each page's log-sum-exp (pages)
                if TOKENS:
                    tl.store(logit_ptr + lrow[:, None] + (jp * S + t_slot)[None, :], qk,
                             mask=g_ok[:, None] & (j_ok & (t_slot < S))[None, :])
                else:
                    qk3 = tl.reshape(qk, [G_PAD, PAGES_PER_BLOCK, S_PAD])
                    mx = tl.max(qk3, axis=2)
                    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
                    lse = mx_safe + tl.log(tl.sum(tl.exp(qk3 - mx_safe[:, :, None]), axis=2))  # -inf: nothing
                    jj = j0 + tl.arange(0, PAGES_PER_BLOCK)
                    tl.store(logit_ptr + lrow[:, None] + jj[None, :], lse, mask=g_ok[:, None] & (jj < end)[None, :])
            st = (pid_bh * n_prog + pid) * G_PAD + offs_g
            tl.store(stat_m_ptr + st, m_i)
            tl.store(stat_l_ptr + st, l_i)

            # -- stage 4: the head's last program ranks every candidate by its share of softmax mass
            if _arrive(sem_ptr + pid_bh, n_prog):
                offs_np = tl.arange(0, NP_PAD)
                np_ok = offs_np < n_prog
                so = (pid_bh * n_prog + offs_np)[:, None] * G_PAD + offs_g[None, :]
                sm = tl.load(stat_m_ptr + so, mask=np_ok[:, None], other=float("-inf"), cache_modifier=".cg")
                sl = tl.load(stat_l_ptr + so, mask=np_ok[:, None], other=0.0, cache_modifier=".cg")
                mx = tl.max(sm, axis=0)
                mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
                lse = mx_safe + tl.log(tl.sum(sl * tl.exp(sm - mx_safe[None, :]), axis=0))  # [G_PAD]: -inf if none
                newest = tl.where(lim > 0, (lim - 1) // S, -1)
                cand_row = cand_ptr + pid_bh * n_cand
                if n_units <= BLOCK_ALL:  # the shares computed in registers and selected there (no store, no reload)
                    u = tl.arange(0, BLOCK_ALL)
                    sh, u_in = _unit_shares(u, n_units, ncand, cand_row, logit_ptr, pid_bh * G, lse, offs_g, lim,
                                            newest, sink_pages, S, TOKENS, G)
                    _select_keys(tl.where(u_in, _sort_key(sh), 0), u_in, n_keep, kept_ptr + pid_bh * n_keep,
                                 count_ptr + pid_bh, BLOCK_ALL)
                else:  # more units than registers hold: shares stored in chunks, then the chunked select
                    for u0 in range(0, n_units, BLOCK_SEL):
                        u = u0 + tl.arange(0, BLOCK_SEL)
                        sh, u_in = _unit_shares(u, n_units, ncand, cand_row, logit_ptr, pid_bh * G, lse, offs_g, lim,
                                                newest, sink_pages, S, TOKENS, G)
                        tl.store(share_ptr + pid_bh * n_units + u, sh, mask=u_in)
                    tl.debug_barrier()  # the shares written by every thread, before the select reads them
                    _select_top(share_ptr + pid_bh * n_units, n_units, n_keep, kept_ptr + pid_bh * n_keep,
                                count_ptr + pid_bh, BLOCK_SEL)

    # ---- launch 3: split-K attention over what was kept, then the combine ------------------------------------------

    @triton.jit
    def _attend_pages(q_ptr, m_i, l_i, acc, k_base, v_base, cand_ptr, kept_ptr, start, end, lim, sparse, scale,
                      mask_ptr, b, heads, g_ok, offs_d, d_ok, stride_qb, stride_qh, stride_qd, stride_kl, stride_kd,
                      stride_vl_, stride_vd, stride_mb, stride_mh, stride_ml,
                      S: tl.constexpr, S_PAD: tl.constexpr, PAGES_PER_BLOCK: tl.constexpr, INDIRECT: tl.constexpr,
                      MASK_KIND: tl.constexpr, MASK_PER_HEAD: tl.constexpr, UPCAST: tl.constexpr):
        """Online softmax over list entries ``[start, end)`` of whole pages: page ``j`` itself for a dense row,
        else ``cand[j]`` (or ``cand[kept[j]]`` with ``INDIRECT``); returns ``(m_i, l_i, acc)``."""
        BLOCK_T: tl.constexpr = PAGES_PER_BLOCK * S_PAD
        q = _group_queries(q_ptr, b, heads, g_ok, offs_d, d_ok, stride_qb, stride_qh, stride_qd, UPCAST)
        offs_t = tl.arange(0, BLOCK_T)
        t_page = offs_t // S_PAD
        t_slot = offs_t % S_PAD
        for j0 in range(start, end, PAGES_PER_BLOCK):
            # -- stage 1: token positions of PAGES_PER_BLOCK pages (gathered for a sparse row)
            jp = j0 + t_page
            j_ok = jp < end
            ld = j_ok & ((jp * 0 + sparse.to(tl.int32)) != 0)  # the flag spread over the block (interpreter-safe)
            jj = jp
            if INDIRECT:
                jj = tl.load(kept_ptr + jp, mask=ld, other=0)
            page = tl.where(sparse, tl.load(cand_ptr + jj, mask=ld, other=0).to(tl.int64), jp.to(tl.int64))
            pos = page * S + t_slot
            tok_ok = j_ok & (t_slot < S) & (pos < lim)
            # -- stage 2: logits of all G heads, masked
            qk = _masked_logits(q, k_base, pos, tok_ok, offs_d, d_ok, stride_kl, stride_kd, scale, mask_ptr, b, heads,
                                g_ok, stride_mb, stride_mh, stride_ml, MASK_KIND, MASK_PER_HEAD, UPCAST)
            # -- stage 3: online softmax (rows with no finite logit stay at zero), then P.V
            m_i, l_i, acc = _softmax_pv_block(qk, m_i, l_i, acc, v_base, pos, stride_vl_, offs_d, stride_vd, tok_ok,
                                              d_ok, UPCAST)
        return m_i, l_i, acc

    @triton.jit
    def _attend_tokens(m_i, l_i, acc, v_base, cand_ptr, kept_ptr, logit_ptr, lrow, start, end, lim, g_ok, offs_d,
                       d_ok, stride_vl_, stride_vd, S: tl.constexpr, BLOCK_T: tl.constexpr, UPCAST: tl.constexpr):
        """Online softmax over kept candidate slots ``kept[start:end]``: logits from launch 2, values gathered."""
        offs_t = tl.arange(0, BLOCK_T)
        for t0 in range(start, end, BLOCK_T):
            # -- stage 1: the kept slots' positions and logits
            t = t0 + offs_t
            t_ok = t < end
            slot = tl.load(kept_ptr + t, mask=t_ok, other=0)
            page = tl.load(cand_ptr + slot // S, mask=t_ok, other=0).to(tl.int64)
            pos = page * S + slot % S
            tok_ok = t_ok & (pos < lim)
            qk = tl.load(logit_ptr + lrow[:, None] + slot[None, :], mask=g_ok[:, None] & tok_ok[None, :],
                         other=float("-inf"))
            # -- stage 2: online softmax, P.V over the gathered values
            m_i, l_i, acc = _softmax_pv_block(qk, m_i, l_i, acc, v_base, pos, stride_vl_, offs_d, stride_vd, tok_ok,
                                              d_ok, UPCAST)
        return m_i, l_i, acc

    @triton.jit
    def _attend_kernel(
        q_ptr, k_ptr, v_ptr, vl_ptr, mask_ptr, ctrl_ptr,
        cand_ptr, kept_ptr, count_ptr, logit_ptr, acc_ptr, m_ptr, l_ptr, out_ptr, sem_ptr,
        stride_qb, stride_qh, stride_qd,
        stride_kb, stride_kh, stride_kl, stride_kd,
        stride_vb_, stride_vh, stride_vl_, stride_vd,
        stride_vb,
        stride_mb, stride_mh, stride_ml,
        Hkv, L, scale, n_dense, n_cand, n_keep, n_splits, min_per_split,
        G: tl.constexpr, G_PAD: tl.constexpr, G_POW: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        S: tl.constexpr, S_PAD: tl.constexpr, PAGES_PER_BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
        MODE: tl.constexpr, MASK_KIND: tl.constexpr, MASK_PER_HEAD: tl.constexpr, UPCAST: tl.constexpr,
        HAS_CTRL: tl.constexpr,
    ):
        """One split of flash-decoding for one KV head and its G query heads; the head's last split merges.

        ``MODE``: 0 every row dense (from the shapes), 1 kept pages ``cand[:count]`` (one stage), 2 kept pages
        ``cand[kept[:count]]`` (two stages), 3 kept tokens (candidate slots ``kept[:count]``, logits from launch
        2). A dense row attends every valid token in any mode. Partials ``acc``/``m``/``l`` ``[bh, split, g]``;
        output ``out[b, kvh*G + g, 0, :]`` in the dtype of ``out``.
        """
        pid_bh = tl.program_id(0)
        pid_s = tl.program_id(1)
        b = pid_bh // Hkv
        kvh = pid_bh % Hkv

        # -- stage 0: the row's state, the group's queries, this split's share of the list
        lim, n_valid, sparse = _row_state(vl_ptr, stride_vb, ctrl_ptr, b, L, n_dense, S, HAS_CTRL)
        if MODE == 0:
            sparse = lim < 0  # every row dense: no list was written
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D_PAD)
        g_ok = offs_g < G
        d_ok = offs_d < D
        heads = kvh * G + offs_g
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        if sparse:
            n_units = tl.load(count_ptr + pid_bh).to(tl.int64)
        else:
            n_units = n_valid
        n_tok = n_units * S  # tokens to visit: whole pages
        if MODE == 3:
            if sparse:
                n_tok = n_units  # kept single tokens
        n_eff = tl.minimum(tl.maximum((n_tok + min_per_split - 1) // min_per_split, 1), n_splits)
        per = (n_units + n_eff - 1) // n_eff
        start = pid_s * per
        end = tl.minimum(start + per, n_units)
        k_base = k_ptr + b * stride_kb + kvh * stride_kh
        v_base = v_ptr + b * stride_vb_ + kvh * stride_vh
        if MODE == 3:
            if sparse:
                lrow = (pid_bh * G + offs_g) * (n_cand * S)
                m_i, l_i, acc = _attend_tokens(m_i, l_i, acc, v_base, cand_ptr + pid_bh * n_cand,
                                               kept_ptr + pid_bh * n_keep, logit_ptr, lrow, start, end, lim, g_ok,
                                               offs_d, d_ok, stride_vl_, stride_vd, S, SPLIT_BLOCK, UPCAST)
            else:
                m_i, l_i, acc = _attend_pages(q_ptr, m_i, l_i, acc, k_base, v_base, cand_ptr, kept_ptr, start, end,
                                              lim, sparse, scale, mask_ptr, b, heads, g_ok, offs_d, d_ok,
                                              stride_qb, stride_qh, stride_qd, stride_kl, stride_kd, stride_vl_,
                                              stride_vd, stride_mb, stride_mh, stride_ml, S, S_PAD, PAGES_PER_BLOCK,
                                              False, MASK_KIND, MASK_PER_HEAD, UPCAST)
        else:
            m_i, l_i, acc = _attend_pages(q_ptr, m_i, l_i, acc, k_base, v_base, cand_ptr + pid_bh * n_cand,
                                          kept_ptr + pid_bh * n_keep, start, end, lim, sparse, scale, mask_ptr, b,
                                          heads, g_ok, offs_d, d_ok, stride_qb, stride_qh, stride_qd, stride_kl,
                                          stride_kd, stride_vl_, stride_vd, stride_mb, stride_mh, stride_ml, S, S_PAD,
                                          PAGES_PER_BLOCK, MODE == 2, MASK_KIND, MASK_PER_HEAD, UPCAST)

        # -- stage 1: this split's unnormalised partials
        row = (pid_bh * n_splits + pid_s) * G + offs_g  # [G_PAD]
        tl.store(acc_ptr + row[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
        tl.store(m_ptr + row, m_i, mask=g_ok)
        tl.store(l_ptr + row, l_i, mask=g_ok)

        # -- stage 2: the head's last split merges the n_eff used splits in one pass (running max, rescaled sums:
        # one round trip to L2 for every SB splits)
        if _arrive(sem_ptr + pid_bh, n_splits):
            offs_gp = tl.arange(0, G_POW)
            gp_ok = offs_gp < G
            SB: tl.constexpr = 8
            offs_sb = tl.arange(0, SB)
            mx = tl.full([G_POW], float("-inf"), tl.float32)
            num = tl.zeros([G_POW, D_PAD], tl.float32)
            den = tl.zeros([G_POW], tl.float32)
            for s0 in range(0, n_eff, SB):
                sr = s0 + offs_sb
                s_ok = (sr < n_eff)[:, None] & gp_ok[None, :]
                mr = (pid_bh * n_splits + sr)[:, None] * G + offs_gp[None, :]  # [SB, G_POW]
                ms = tl.load(m_ptr + mr, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
                ls = tl.load(l_ptr + mr, mask=s_ok, other=0.0, cache_modifier=".cg")
                a = tl.load(acc_ptr + mr[:, :, None] * D + offs_d[None, None, :],
                            mask=s_ok[:, :, None] & d_ok[None, None, :], other=0.0, cache_modifier=".cg")
                m_new = tl.maximum(mx, tl.max(ms, axis=0))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(mx - m_safe)  # 0 while nothing was finite
                w = tl.exp(ms - m_safe[None, :])  # [SB, G_POW]
                den = den * alpha + tl.sum(w * ls, axis=0)
                num = num * alpha[:, None] + tl.sum(w[:, :, None] * a, axis=0)
                mx = m_new
            o = num / tl.where(den > 0, den, 1.0)[:, None]  # no finite logit: zeros, as SDPA
            orow = b * Hkv * G + kvh * G + offs_gp
            tl.store(out_ptr + orow[:, None] * D + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=gp_ok[:, None] & d_ok[None, :])


# ---------------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------------

#: the kernels one call may launch, in order (the CPU-side checks count launches of these)
LAUNCHES = ("_score_pages_kernel", "_rank_candidates_kernel", "_attend_kernel")

#: ``BOUNDS_KIND`` of :func:`_score_pages_kernel` for each storage dtype of ``kmax``/``kmin``
_BOUNDS_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
#: elements of one select chunk when the keys do not fit in registers (16 thresholds against BLOCK_SEL keys a step)
_BLOCK_SEL = 256
#: most keys a select keeps in registers (the page scores of 128K tokens in pages of 8): loaded once, then 32
#: one-bit passes, instead of each pass re-reading the scores from L2 in BLOCK_SEL-key steps (docs/gpu: what the
#: looping select cost on an H200, README)
_BLOCK_ALL = 16384
#: warps of the launches whose last program selects (a [BLOCK_ALL] key vector: 32 keys a thread at 16 warps)
_SELECT_WARPS = 16
#: warps of launch 1 resident on an SM, which sizes its grid (one wave of programs), and the registers a thread
#: that allows (an SM's 64K), passed to ptxas as ``maxnreg`` (the select tail alone would take 168 at 8 warps);
#: tools/sm90_compile.py --occupancy checks the compiled kernel against it
_LAUNCH1_WARPS_PER_SM = 16
_LAUNCH1_MAX_REGISTERS = 65536 // (32 * _LAUNCH1_WARPS_PER_SM)
#: programs an SM that size the grids of launches 2 and 3 (one wave): Triton 3.6's attention kernel takes 217
#: registers a thread (two programs an SM), Triton 3.9's 145 (three); sm90_compile.py --occupancy checks it
_PROGRAMS_PER_SM = 2
#: software-pipeline stages of launch 1's loop over page blocks: the next block's bounds load (cp.async) while
#: one is scored
_LAUNCH1_STAGES = 2
#: fewest tokens a split of launch 3 visits before another split is used (CUDA; the interpreter uses 8, so that
#: small test shapes still run several splits)
_MIN_TOKENS_PER_SPLIT = 128


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << (max(int(n), 1) - 1).bit_length())


def _mask_view(attn_mask: Optional[torch.Tensor], B: int, Hq: int, L: int, dummy: torch.Tensor):
    """``(tensor, strides (b, h, l), kind, per_head)`` of the mask viewed as ``[B, Hm, L]`` without a copy
    (``dummy``, never read, when there is no mask)."""
    if attn_mask is None:
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


def _select_warps(n: int) -> int:
    """Warps for a launch whose last program selects among ``n`` keys (at most 32 resident keys a thread)."""
    return max(4, min(_SELECT_WARPS, _pow2(min(n, _BLOCK_ALL)) // (32 * 32)))


def _upcast(dtype: torch.dtype) -> bool:
    """fp32 dots in ieee mode; bf16 under the interpreter (numpy has no bf16 arithmetic)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _INTERPRETED)


class _Plan:
    """Grid and workspace sizes of one call, from the shapes alone.

    Attributes are plain ints and flags: ``mode`` (0 dense from the shapes, 1 one stage, 2 two stages keeping
    pages, 3 two stages keeping tokens), ``n_cand`` (pages selected by launch 1), ``n_keep`` (units kept by
    launch 2), ``n_units2`` (units launch 2 ranks), ``block_p``/``n_prog1``/``warps1`` (launch 1), ``cand_per_prog``/
    ``n_prog2`` (launch 2), ``ppb`` (pages per block), ``n_splits`` (launch 3).
    """

    def __init__(self, B, Hkv, G, L, D, P, spec: SelectionSpec, device, n_splits: Optional[int]):
        S = spec.page_size
        K, N1 = spec.n_pages, spec.n_candidates
        BH = B * Hkv
        self.S_PAD = _pow2(S)
        self.ppb = max(1, 64 // self.S_PAD) if D <= 128 else max(1, 32 // self.S_PAD)
        if self.ppb * self.S_PAD < 16:  # tl.dot needs N >= 16
            self.ppb = 16 // self.S_PAD
        cuda = device.type == "cuda"
        sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 1
        if spec.dense_cache(P):
            self.mode = 0
        elif N1 <= K:
            self.mode = 1
        else:
            self.mode = 3 if spec.keep_tokens else 2
        self.n_dense = spec.n_dense_pages
        self.n_cand = min(N1, P)
        self.n_keep = K * S if self.mode == 3 else K
        self.n_units2 = self.n_cand * S if self.mode == 3 else self.n_cand
        # launch 1: its warps are the select tail's (resident keys); a block of pages is two [BLOCK_P, D] fp32
        # tiles of 16 elements a thread at any warp count (at 32, the group's hoisted queries take the registers
        # of a fourth program an SM); each program loops over every n_prog1-th block, one wave of programs at
        # _LAUNCH1_WARPS_PER_SM. The interpreter: blocks of a quarter of the pages, two programs a head, so that
        # small test shapes loop and arrive as the GPU's do.
        self.warps1 = _select_warps(P)
        if cuda:
            self.block_p = min(_pow2(P), max(1, 16 * 32 * self.warps1 // _pow2(D)))
            programs1 = sms * max(1, _LAUNCH1_WARPS_PER_SM // self.warps1) // BH
        else:
            self.block_p = min(_pow2(P), max(4, _pow2(P) // 4))
            programs1 = 2
        self.n_prog1 = max(1, min(-(-P // self.block_p), programs1))
        # launches 2 and 3: _PROGRAMS_PER_SM programs an SM, one wave (rounded down: rounded up, a grid one
        # program past the wave runs a second; the interpreter: two programs, four splits)
        per_head = max(1, _PROGRAMS_PER_SM * sms // BH)
        target = per_head if cuda else 2
        cpp = max(self.ppb, -(-self.n_cand // target))
        self.cand_per_prog = -(-cpp // self.ppb) * self.ppb
        self.n_prog2 = -(-self.n_cand // self.cand_per_prog)
        self.min_per_split = _MIN_TOKENS_PER_SPLIT if cuda else 8
        if n_splits is None:
            n_splits = per_head if cuda else 4
            n_splits = max(1, min(n_splits, -(-L // self.min_per_split)))
        self.n_splits = max(1, min(int(n_splits), 1024))


@functools.lru_cache(maxsize=64)
def _plan(B, Hkv, G, L, D, P, spec: SelectionSpec, device: torch.device, n_splits: Optional[int]) -> _Plan:
    """The :class:`_Plan` of a shape, made once (a call's only per-shape work besides its workspace)."""
    return _Plan(B, Hkv, G, L, D, P, spec, device, n_splits)


class _Workspace:
    """Every buffer one call writes besides its output, sized by a :class:`_Plan` (see :func:`_workspace`)."""

    def __init__(self, plan: _Plan, B, Hkv, G, P, D, device):
        BH = B * Hkv
        f32, i32 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int32, device=device)
        self.scores = torch.empty(BH, P, **f32)
        self.cand = torch.empty(BH, plan.n_cand, **i32)
        self.ncand = torch.empty(BH, **i32)
        two = plan.mode in (2, 3)
        self.logits = torch.empty(BH, G, plan.n_units2 if two else 1, **f32)
        self.stat_m = torch.empty(BH, plan.n_prog2, _pow2(G, 16), **f32)
        self.stat_l = torch.empty_like(self.stat_m)
        self.share = torch.empty(BH, plan.n_units2 if two else 1, **f32)
        self.kept = torch.empty(BH, plan.n_keep if two else 1, **i32)
        self.count = torch.empty(BH, **i32) if two else self.ncand
        self.acc = torch.empty(BH, plan.n_splits, G, D, **f32)
        self.m = torch.empty(BH, plan.n_splits, G, **f32)
        self.l = torch.empty_like(self.m)
        self.sems = torch.zeros(3, BH, **i32)  # arrival counters: each launch leaves its row at zero


_WORKSPACES: "dict" = {}
#: workspaces kept before the oldest one no captured graph holds is dropped
_MAX_WORKSPACES = 32
#: keys of the workspaces handed out while a CUDA graph was being captured: the graph holds their pointers for as
#: long as it may be replayed, so they are never dropped (freed memory would be reused under a live graph)
_CAPTURED: "set" = set()
_SIDE_STREAMS: "dict" = {}  #: device -> the stream workspaces are allocated on


def _workspace(plan: _Plan, B, Hkv, G, P, D, spec: SelectionSpec, device) -> _Workspace:
    """The workspace of a shape, allocated once per shape and device (past 32, the oldest one that no captured
    graph holds is dropped; one handed out during a capture is kept for good).

    On CUDA it is allocated on a side stream of its own, so that it never comes from a CUDA graph's memory pool:
    Inductor's CUDA graph trees route the allocations of the stream they warm up on to the graph's pool and
    refuse a tensor there that outlives the call. A shape first seen while a graph is being captured gets a
    workspace of its own instead, not kept (its arrival counters zeroed by a memset the graph replays)."""
    key = (str(device), B, Hkv, G, P, D, plan.n_splits, tuple(spec.to_list()))
    ws = _WORKSPACES.get(key)
    if ws is not None:
        if _capturing(device):
            _CAPTURED.add(key)
        return ws
    if device.type != "cuda":
        ws = _Workspace(plan, B, Hkv, G, P, D, device)
    elif torch.cuda.is_current_stream_capturing():
        return _Workspace(plan, B, Hkv, G, P, D, device)
    else:
        main = torch.cuda.current_stream(device)
        side = _SIDE_STREAMS.get(device)
        if side is None:
            side = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            ws = _Workspace(plan, B, Hkv, G, P, D, device)
        main.wait_stream(side)  # the counters' zeros are written before any launch reads them
        for t in vars(ws).values():
            t.record_stream(main)  # used on the main stream: freed (evicted) only after its work there
    droppable = [k for k in _WORKSPACES if k not in _CAPTURED]
    if len(_WORKSPACES) >= _MAX_WORKSPACES and droppable:
        _WORKSPACES.pop(droppable[0])
    _WORKSPACES[key] = ws
    return ws


def _capturing(device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_bounds(kmax, kmin, kabs):
    if kmax.dtype not in _BOUNDS_KINDS or kmin.dtype != kmax.dtype:
        raise ValueError(f"sparse_decode_triton: arguments 'kmax'/'kmin' must both be float32, bfloat16 or int8, "
                         f"got {kmax.dtype}/{kmin.dtype}")
    if kabs.dtype != torch.float32:
        raise ValueError(f"sparse_decode_triton: argument 'kabs' must be float32, got {kabs.dtype}")


def _ctrl_view(ctrl: Optional[torch.Tensor], device, dummy: torch.Tensor):
    """``(tensor, has_ctrl, host_dense)``: a ``ctrl`` on the device of ``q`` is read by the kernels; one in host
    memory (a CUDA ``q``) is read here, a read of host memory that does not wait for the device."""
    if ctrl is None:
        return dummy, False, False
    if ctrl.dtype != torch.int32 or ctrl.numel() < 2:
        raise ValueError(f"sparse_decode_triton: argument 'ctrl' must be int32 with 2 elements, got {ctrl.dtype} "
                         f"{tuple(ctrl.shape)}")
    if ctrl.device == device:
        return ctrl.reshape(-1), True, False
    if ctrl.device.type != "cpu":
        raise ValueError(f"sparse_decode_triton: argument 'ctrl' must be on the device of q ({device}) or the CPU, "
                         f"got {ctrl.device}")
    return dummy, False, bool(ctrl[:2].any())


def _launch_select(q, k_cache, kmax, kmin, kabs, vl, vls, mask, mstr, mkind, mper, ctrl, has_ctrl, scale,
                   spec: SelectionSpec, plan: _Plan, ws: _Workspace, select: bool = True) -> None:
    """Launches 1 and (two stages) 2: the kept pages or tokens of every sparse row, in ``ws``."""
    B, Hq, _, D = q.shape
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    P = kmax.shape[2]
    S = spec.page_size
    if kmin.stride() != kmax.stride():
        kmin, kmax = kmin.contiguous(), kmax.contiguous()
    _score_pages_kernel[(B * Hkv, plan.n_prog1)](
        q, kmax, kmin, kabs, vl, mask, ctrl,
        ws.scores, ws.cand, ws.ncand, ws.sems[0],
        q.stride(0), q.stride(1), q.stride(3),
        *kmax.stride(),
        *kabs.stride(),
        vls,
        *mstr,
        Hkv, P, L, float(scale), score_slack_factor(D), score_underflow_slack(D) / float(scale), int(spec.sink_pages),
        plan.n_dense, plan.n_cand, plan.n_prog1,
        G=G, D=D, D_PAD=_pow2(D), S=S, S_PAD=plan.S_PAD, BLOCK_P=plan.block_p, MASK_KIND=mkind,
        MASK_PER_HEAD=mper, BOUNDS_KIND=_BOUNDS_KINDS[kmax.dtype], HAS_CTRL=has_ctrl, SELECT=select,
        BLOCK_SEL=_BLOCK_SEL, BLOCK_ALL=min(_BLOCK_ALL, _pow2(P)), NUM_STAGES=_LAUNCH1_STAGES,
        num_warps=plan.warps1, maxnreg=_LAUNCH1_MAX_REGISTERS,
    )
    if not select or plan.mode not in (2, 3):
        return
    _rank_candidates_kernel[(B * Hkv, plan.n_prog2)](
        q, k_cache, vl, mask, ctrl,
        ws.cand, ws.ncand, ws.logits, ws.stat_m, ws.stat_l, ws.share, ws.kept, ws.count, ws.sems[1],
        q.stride(0), q.stride(1), q.stride(3),
        *k_cache.stride(),
        vls,
        *mstr,
        Hkv, L, float(scale), int(spec.sink_pages), plan.n_dense, plan.n_cand, plan.n_keep, plan.n_prog2,
        plan.cand_per_prog,
        G=G, G_PAD=_pow2(G, 16), D=D, D_PAD=_pow2(D, 16), S=S, S_PAD=plan.S_PAD, PAGES_PER_BLOCK=plan.ppb,
        NP_PAD=_pow2(plan.n_prog2), MASK_KIND=mkind, MASK_PER_HEAD=mper, UPCAST=_upcast(q.dtype),
        TOKENS=plan.mode == 3, HAS_CTRL=has_ctrl, BLOCK_SEL=_BLOCK_SEL,
        BLOCK_ALL=min(_BLOCK_ALL, _pow2(plan.n_units2)), num_warps=_select_warps(plan.n_units2),
    )


def _prepare(q, k_cache, kmax, kmin, kabs, valid_len, attn_mask, spec, ctrl, n_splits):
    """Checks, views and the plan and workspace of a call."""
    _check_bounds(kmax, kmin, kabs)
    B, Hq, _, D = q.shape
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    P = kmax.shape[2]
    plan = _plan(B, Hkv, Hq // Hkv, L, D, P, spec, q.device, n_splits)
    ws = _workspace(plan, B, Hkv, Hq // Hkv, P, D, spec, q.device)
    vl, vls = _valid_len_view(valid_len, B, q.device)
    mask, mstr, mkind, mper = _mask_view(attn_mask, B, Hq, L, ws.scores)
    ctrl_t, has_ctrl, host_dense = _ctrl_view(ctrl, q.device, ws.ncand)
    return plan, ws, vl, vls, mask, mstr, mkind, mper, ctrl_t, has_ctrl, host_dense


def page_scores_triton(q, kmax, kmin, kabs, valid_len, attn_mask, scale, spec: SelectionSpec,
                       length: int) -> torch.Tensor:
    """Launch 1's page scores alone (no select), for checks against :func:`.reference.page_scores`.

    ``length`` is the key cache's ``L``; the other arguments as in :func:`sparse_decode_triton`. Every row is
    scored (the dense-row rule is lifted). Returns fp32 ``[B, Hkv, P]``: the group-max bound, ``+inf`` for the
    forced pages, ``-inf`` past ``valid_len``.
    """
    B, Hq, _, D = q.shape
    Hkv, P = kmax.shape[1], kmax.shape[2]
    spec = spec.for_cache(length)  # sizes bounded by the cache
    keys = torch.empty(B, Hkv, length, D, dtype=q.dtype, device="meta")  # only its shape is read
    plan, ws, vl, vls, mask, mstr, mkind, mper, ctrl_t, _, _ = _prepare(
        q, keys, kmax, kmin, kabs, valid_len, attn_mask, spec, None, None)
    plan = copy.copy(plan)  # the cached plan stays as it is
    plan.n_dense = -1
    _launch_select(q, keys, kmax, kmin, kabs, vl, vls, mask, mstr, mkind, mper, ctrl_t, False, scale, spec, plan, ws,
                   select=False)
    return ws.scores.reshape(B, Hkv, P).clone()


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
        ``idx`` ``[B, Hkv, n]`` int64 ascending and ``ok`` (False for an empty slot): the kept pages or, two-stage
        with ``keep_tokens``, the kept token positions (pages of one token, as the reference's ``choose`` returns
        with ``unit = 1``). A row attended densely lists every valid page (token). None when every row is dense
        from the shapes alone (:meth:`.spec.SelectionSpec.dense_cache`).
    """
    B, Hq, _, D = q.shape
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    spec = spec.for_cache(L)  # sizes bounded by the cache
    S = spec.page_size
    plan, ws, vl, vls, mask, mstr, mkind, mper, ctrl_t, has_ctrl, _ = _prepare(
        q, k_cache, kmax, kmin, kabs, valid_len, attn_mask, spec, None, None)
    if plan.mode == 0:
        return None
    _launch_select(q, k_cache, kmax, kmin, kabs, vl, vls, mask, mstr, mkind, mper, ctrl_t, False, scale, spec, plan,
                   ws)
    vlb = vl.expand(B).clamp(max=L).long()
    n_valid = (vlb + S - 1) // S
    dense = (n_valid <= plan.n_dense).reshape(B, 1, 1)
    # a dense row's lists were not written (launches 1 and 2 skip it): read them as empty
    cand = ws.cand.reshape(B, Hkv, -1).long().clamp(0, kmax.shape[2] - 1).masked_fill(dense, 0)
    count = (ws.ncand if plan.mode == 1 else ws.count).reshape(B, Hkv, 1).long().masked_fill(dense, 0)
    kept = ws.kept.reshape(B, Hkv, -1).long().masked_fill(dense, 0)
    if plan.mode == 1:
        idx, n = cand, count
    elif plan.mode == 2:
        idx, n = cand.gather(2, kept.clamp(0, cand.shape[-1] - 1)), count
    else:
        slot = kept.clamp(0, cand.shape[-1] * S - 1)
        idx = cand.gather(2, slot // S) * S + slot % S
        n = count
    width = idx.shape[-1]
    ok = torch.arange(width, device=q.device).reshape(1, 1, -1) < n
    unit = 1 if plan.mode == 3 else S
    every = torch.arange(-(-L // unit), device=q.device).reshape(1, 1, -1)  # a dense row: every valid unit
    w = max(width, every.shape[-1])
    idx = torch.nn.functional.pad(torch.where(ok, idx, 0), (0, w - width))
    ok = torch.nn.functional.pad(ok, (0, w - width))
    every_idx = torch.nn.functional.pad(every, (0, w - every.shape[-1])).expand(B, Hkv, w)
    every_ok = every_idx * unit < vlb.reshape(B, 1, 1)
    every_ok &= torch.arange(w, device=q.device).reshape(1, 1, -1) < every.shape[-1]
    idx = torch.where(dense, every_idx, idx)
    ok = torch.where(dense, every_ok, ok)
    idx, order = torch.where(ok, idx, torch.iinfo(torch.int64).max).sort(-1)
    return Selection(torch.where(ok.gather(-1, order), idx, 0), ok.gather(-1, order))


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
    ctrl: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Query-aware paged sparse decode attention in at most three Triton launches, with no host read.

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
        Split-K programs per KV head of launch 3 (default: one wave at two programs an SM). Pass by keyword.
    ctrl : torch.Tensor, optional
        int32 ``[2]``: a nonzero ``ctrl[0]`` (stale bounds) or ``ctrl[1]`` (a dense layer) attends every valid
        token. On the device of ``q`` the kernels read it; in host memory it is read here.

    Returns
    -------
    torch.Tensor
        ``[B, Hq, 1, D]`` in the dtype of ``q``.
    """
    B, Hq, _, D = q.shape
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    spec = spec.for_cache(L)  # sizes bounded by the cache
    S = spec.page_size
    plan, ws, vl, vls, mask, mstr, mkind, mper, ctrl_t, has_ctrl, host_dense = _prepare(
        q, k_cache, kmax, kmin, kabs, valid_len, attn_mask, spec, ctrl, n_splits)
    mode = 0 if host_dense else plan.mode
    if mode != 0:
        _launch_select(q, k_cache, kmax, kmin, kabs, vl, vls, mask, mstr, mkind, mper, ctrl_t, has_ctrl, scale, spec,
                       plan, ws)
    out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=q.device)
    _attend_kernel[(B * Hkv, plan.n_splits)](
        q, k_cache, v_cache, vl, mask, ctrl_t,
        ws.cand, ws.kept, ws.count, ws.logits, ws.acc, ws.m, ws.l, out, ws.sems[2],
        q.stride(0), q.stride(1), q.stride(3),
        *k_cache.stride(),
        *v_cache.stride(),
        vls,
        *mstr,
        Hkv, L, float(scale), plan.n_dense, plan.n_cand, ws.kept.shape[-1], plan.n_splits, plan.min_per_split,
        G=G, G_PAD=_pow2(G, 16), G_POW=_pow2(G), D=D, D_PAD=_pow2(D, 16), S=S, S_PAD=plan.S_PAD,
        PAGES_PER_BLOCK=plan.ppb, SPLIT_BLOCK=64 if D <= 128 else 32, MODE=mode, MASK_KIND=mkind,
        MASK_PER_HEAD=mper, UPCAST=_upcast(q.dtype), HAS_CTRL=has_ctrl and mode != 0,
    )
    return out
