"""Prototypes of cheaper selections, measured in the study's harness only.

They are page-selection policies registered under their own names on import, so the harness
(:class:`bench.harness.EvalModel`) runs them like any other policy; they are **not** backend options:
neither the kernels nor :mod:`tinyserve_compile.cost` know them. Their bytes per step come from
:func:`proto_site_bytes`, written in the same terms as :func:`tinyserve_compile.cost.sparse_site_bytes`.

* ``hier{R}x{F}`` - *hierarchical bounds*: superpages of ``R`` pages carry bounds of their own (the max/min
  over their pages: still an upper bound). The bound first ranks superpages, keeps ``F * K / R`` of them
  (plus the newest superpage and those holding sink pages), then ranks pages by their own bounds inside
  those superpages only, and keeps ``K``. Reads: all superpage bounds, the page bounds of the kept
  superpages, the kept K/V.
* ``sketch{b}`` - *two-stage with a b-bit key sketch*: the bound keeps ``candidate_factor * K`` candidate
  pages as today, but the second stage computes logits over keys quantised to ``b`` bits per channel on the
  grid of their own page's bounds (``kmin + i * (kmax - kmin) / (2^b - 1)``: no scale bytes beyond the bounds
  already there), and keeps the ``K`` pages of largest (approximate) mass. Reads: the page bounds (needed to
  decode the sketch even when the candidates cover every page), the candidates' sketch, the kept K/V (the
  attention needs exact logits: unlike today's two-stage, the sketch's logits cannot be reused).

* ``hier8x4sketch4`` - both: candidates from the hierarchical first stage, ranked by the 4-bit sketch.

``python -m bench.study --extra bench.prototypes ...`` adds :func:`VARIANTS` to a grid.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from tinyserve_compile.kernels.reference import (PageBounds, Selection, page_scores, rank_candidates,
                                                 refine_candidates, select_pages)
from tinyserve_compile.policies import DecodeContext, PagePolicy, register_policy

try:
    from .harness import Sparse
except ImportError:
    from harness import Sparse


# ---------------------------------------------------------------------------------------------- hierarchical
def superpage_bounds(bounds: PageBounds, pages_per_super: int) -> PageBounds:
    """Bounds of superpages of ``R = pages_per_super`` pages: max of ``kmax``, min of ``kmin``, max of ``kabs``.

    Parameters
    ----------
    bounds : PageBounds
        ``kmax``/``kmin`` ``[B, Hkv, P, D]`` (fp32 or bf16), ``kabs`` fp32 ``[B, Hkv, P]``.

    Returns
    -------
    PageBounds
        ``[B, Hkv, ceil(P / R), D]`` in the dtype of ``bounds`` (max/min of outward-rounded values are exact).
    """
    R = pages_per_super
    B, H, P, D = bounds.kmax.shape
    pad = -P % R
    kmax, kmin, kabs = bounds
    if pad:  # repeat the last page: it does not widen the box
        kmax = torch.cat([kmax, kmax[:, :, -1:].expand(B, H, pad, D)], 2)
        kmin = torch.cat([kmin, kmin[:, :, -1:].expand(B, H, pad, D)], 2)
        kabs = torch.cat([kabs, kabs[:, :, -1:].expand(B, H, pad)], 2)
    return PageBounds(kmax.unflatten(2, (-1, R)).amax(3), kmin.unflatten(2, (-1, R)).amin(3),
                      kabs.unflatten(2, (-1, R)).amax(3))


def scores_inside_superpages(ctx: DecodeContext, pages_per_super: int, factor: int) -> torch.Tensor:
    """Page-bound scores ``[B, Hkv, P]`` with every page outside the ``factor * K / R`` superpages of highest
    superpage bound (plus the forced ones) set to -inf; all scores when those cover every superpage."""
    B, S, R = ctx.q.shape[0], ctx.page_size, pages_per_super
    K = ctx.token_budget // S
    vl = ctx.valid_len.reshape(-1).expand(B)
    scores = page_scores(ctx.q, ctx.bounds, ctx.scale, ctx.mask_pages())  # [B,Hkv,P]
    n_super = max(1, factor * K // R)
    sup = select_pages(page_scores(ctx.q, superpage_bounds(ctx.bounds, R), ctx.scale, None), vl, S * R,
                       ctx.token_budget, -(-ctx.sink_pages // R), n_select=n_super)
    if sup is None:
        return scores
    P = scores.shape[-1]
    inside = torch.zeros(B, scores.shape[1], -(-P // R), dtype=torch.bool, device=scores.device)
    inside.scatter_(2, sup.idx, sup.ok)
    inside = inside.repeat_interleave(R, dim=2)[..., :P]
    return scores.masked_fill(~inside, float("-inf"))


class HierarchicalPolicy(PagePolicy):
    """Superpage bounds first, then page bounds inside the kept superpages (see the module docstring)."""

    pages_per_super = 8
    factor = 4

    def choose(self, ctx: DecodeContext) -> Tuple[Optional[Selection], int]:
        vl = ctx.valid_len.reshape(-1).expand(ctx.q.shape[0])
        scores = scores_inside_superpages(ctx, self.pages_per_super, self.factor)
        return select_pages(scores, vl, ctx.page_size, ctx.token_budget, ctx.sink_pages), ctx.page_size


# ---------------------------------------------------------------------------------------------- key sketch
def sketch_keys(k_cache: torch.Tensor, bounds: PageBounds, page_size: int, bits: int) -> torch.Tensor:
    """Keys rounded to ``bits`` bits per channel on their page's ``[kmin, kmax]`` grid, decoded to fp32.

    Parameters
    ----------
    k_cache : torch.Tensor
        ``[B, Hkv, L, D]``.
    bounds : PageBounds
        ``[B, Hkv, P, D]`` bounds of ``k_cache`` with ``P = ceil(L / page_size)``.

    Returns
    -------
    torch.Tensor
        fp32 ``[B, Hkv, L, D]``.
    """
    L = k_cache.shape[2]
    lo = bounds.kmin.float().repeat_interleave(page_size, dim=2)[:, :, :L]
    hi = bounds.kmax.float().repeat_interleave(page_size, dim=2)[:, :, :L]
    levels = 2 ** bits - 1
    step = (hi - lo).clamp(min=1e-30) / levels
    code = ((k_cache.float() - lo) / step).round().clamp(0, levels)
    return lo + code * step


class SketchPolicy(PagePolicy):
    """Two-stage selection whose second stage reads a ``bits``-bit key sketch (see the module docstring).
    With ``pages_per_super`` set, the first stage is the hierarchical one (candidates inside the kept
    superpages only)."""

    bits = 4
    pages_per_super = 0
    factor = 4

    def choose(self, ctx: DecodeContext) -> Tuple[Optional[Selection], int]:
        B, Hq, _, D = ctx.q.shape
        S = ctx.page_size
        K = ctx.token_budget // S
        vl = ctx.valid_len.reshape(-1).expand(B)
        if int(((vl + S - 1) // S).max()) <= K:
            return None, S
        if self.pages_per_super:
            scores = scores_inside_superpages(ctx, self.pages_per_super, self.factor)
        else:
            scores = page_scores(ctx.q, ctx.bounds, ctx.scale, ctx.mask_pages())
        cand = select_pages(scores, vl, S, ctx.token_budget, ctx.sink_pages, n_select=K * max(1, ctx.candidate_factor))
        Hkv, L = ctx.k_cache.shape[1], ctx.k_cache.shape[2]
        if cand is None:
            P = scores.shape[-1]
            idx = torch.arange(P, device=scores.device).expand(B, Hkv, P).contiguous()
            cand = Selection(idx, idx < ((vl + S - 1) // S).reshape(B, 1, 1))
        ks = sketch_keys(ctx.k_cache, ctx.bounds, S, self.bits)  # [B,Hkv,L,D]
        Kc = cand.idx.shape[-1]
        tok = (cand.idx[..., None] * S + torch.arange(S, device=ks.device)).reshape(B, Hkv, Kc * S)
        ok = cand.ok.repeat_interleave(S, dim=-1) & (tok < vl.reshape(B, 1, 1))
        kg = ks.gather(2, tok.clamp(max=L - 1)[..., None].expand(-1, -1, -1, D))
        G = Hq // Hkv
        logits = (ctx.q.float().reshape(B, Hkv, G, D) @ kg.transpose(-1, -2)) * ctx.scale
        logits = logits.masked_fill(~ok[:, :, None, :], float("-inf"))
        return rank_candidates(logits, cand, vl, S, K, ctx.sink_pages)[0], S


# ---------------------------------------------------------------------------------------------- registry
def _register(name, base, **attrs):
    cls = type(f"{base.__name__}_{name}", (base,), dict(name=name, **attrs))
    register_policy(cls)
    return name


HIER = {_register(f"hier{R}x{F}", HierarchicalPolicy, pages_per_super=R, factor=F): (R, F)
        for R, F in ((8, 4), (8, 2), (4, 4))}
SKETCH = {_register(f"sketch{b}", SketchPolicy, bits=b): b for b in (4, 8)}
#: hierarchical first stage (superpages of 8 pages, 4x) + 4-bit sketch second stage
HIER_SKETCH = {_register("hier8x4sketch4", SketchPolicy, bits=4, pages_per_super=8, factor=4): (8, 4, 4)}


# ---------------------------------------------------------------------------------------------- two-level
def quantize_bounds(bounds: PageBounds, kind: str) -> PageBounds:
    """Bounds rounded outward to one byte per channel, decoded to fp32: ``"int8"`` on a per-page grid of
    ``kabs / 127`` (``kabs`` = the page's max ``|k|``, already stored), ``"fp8"`` to float8 e4m3 values."""
    kmax, kmin, kabs = bounds.kmax.float(), bounds.kmin.float(), bounds.kabs.float()
    if kind == "int8":
        step = (kabs / 127).clamp(min=1e-30)[..., None]
        hi = torch.ceil(kmax / step).clamp(-127, 127) * step
        lo = torch.floor(kmin / step).clamp(-127, 127) * step
        hi = torch.where(hi < kmax, hi + step, hi)
        lo = torch.where(lo > kmin, lo - step, lo)
    elif kind == "fp8":
        vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        vals = vals[vals.isfinite()].unique()  # sorted
        hi = vals[torch.searchsorted(vals, kmax.contiguous()).clamp(max=len(vals) - 1)]
        lo = vals[(torch.searchsorted(vals, kmin.contiguous(), right=True) - 1).clamp(min=0)]
        assert bool((hi >= kmax).all()) and bool((lo <= kmin).all()), "keys outside the fp8 range"
    else:
        raise ValueError(kind)
    return PageBounds(hi, lo, kabs)


def two_level_candidates(ctx: DecodeContext, coarse: int, extra: int, bq: str = "") -> Optional[Selection]:
    """First stage on *coarse pages* of ``coarse`` pages: the bounds of ``coarse * S`` tokens (what storing
    the bounds at that page size gives: the max/min of outward-rounded bounds are those of the union) rank
    them, and the ``(token_budget + extra) // (coarse * S)`` best (plus the forced ones) are kept. Returns
    their pages of ``S``, ``[B, Hkv, Kc * coarse]``, or None when every page fits in the budget."""
    B = ctx.q.shape[0]
    S, R = ctx.page_size, coarse
    K = ctx.token_budget // S
    vl = ctx.valid_len.reshape(-1).expand(B)
    n_valid = (vl + S - 1) // S
    if int(n_valid.max()) <= K:
        return None
    cb = superpage_bounds(quantize_bounds(ctx.bounds, bq) if bq else ctx.bounds, R)
    scores = page_scores(ctx.q, cb, ctx.scale, None)  # [B,Hkv,P/R]
    n_cand = max(1, (ctx.token_budget + extra) // (S * R))
    cand = select_pages(scores, vl, S * R, ctx.token_budget, -(-ctx.sink_pages // R), n_select=n_cand)
    Hkv = scores.shape[1]
    if cand is None:  # every coarse page is a candidate
        Pc = scores.shape[-1]
        idx = torch.arange(Pc, device=scores.device).expand(B, Hkv, Pc).contiguous()
        cand = Selection(idx, idx < ((vl + S * R - 1) // (S * R)).reshape(B, 1, 1))
    fine = (cand.idx[..., None] * R + torch.arange(R, device=cand.idx.device)).flatten(2)
    ok = cand.ok.repeat_interleave(R, dim=-1) & (fine < n_valid.reshape(B, 1, 1))
    return Selection(fine, ok)


class TwoLevelPolicy(PagePolicy):
    """Bounds on coarse pages of ``coarse * S`` tokens pick ``token_budget + extra`` candidate tokens; exact
    logits over them rank the pages of ``S`` (``token=False``) or the single tokens (``token=True``) by
    their share of softmax mass (max over the GQA group), and the best ``token_budget`` tokens' worth are
    attended. The candidates' logits are reused, so the reads are: the coarse bounds, the candidates' keys,
    the kept values."""

    coarse = 2
    extra = 1024
    token = False
    bq = ""

    def choose(self, ctx: DecodeContext) -> Tuple[Optional[Selection], int]:
        cand = two_level_candidates(ctx, self.coarse, self.extra, self.bq)
        if cand is None:
            return None, ctx.page_size
        vl = ctx.valid_len.reshape(-1).expand(ctx.q.shape[0])
        # with self.token, the token_budget single tokens (pages of one token)
        n_keep = ctx.token_budget if self.token else ctx.token_budget // ctx.page_size
        sel = refine_candidates(ctx.q, ctx.k_cache, cand, vl, None, ctx.scale, ctx.page_size, n_keep,
                                ctx.sink_pages, keep_tokens=self.token)
        return sel, 1 if self.token else ctx.page_size


TWO_LEVEL = {_register(f"tl{R}e{E}{'tok' if t else ''}", TwoLevelPolicy, coarse=R, extra=E, token=t): (R, E, t)
             for R in (1, 2, 4) for E in (512, 1024, 1536) for t in (False, True)}
TWO_LEVEL_Q = {_register(f"tl1e{E}tok{q}", TwoLevelPolicy, coarse=1, extra=E, token=True, bq=q): (1, E, q)
               for E in (512, 1024, 1536) for q in ("int8", "fp8")}


def proto_site_bytes(policy: str, ctx: int, n_kv_heads: int, head_dim: int, itemsize: int, page_size: int,
                     token_budget: int, candidate_factor: int = 1, bounds_itemsize: int = 2) -> int:
    """Bytes a prototype reads per decode step and attention site, all KV heads (cf.
    :func:`tinyserve_compile.cost.sparse_site_bytes`; one page's bounds: ``2 * D`` values + fp32 ``kabs``)."""
    h, d, S, B = n_kv_heads, head_dim, page_size, token_budget
    if ctx <= B:
        return h * ctx * d * 2 * itemsize
    page_b = d * 2 * bounds_itemsize + 4
    pages = -(-ctx // S)
    kept = h * B * d * 2 * itemsize  # kept keys and values
    if policy in HIER or policy in HIER_SKETCH:
        R, F = HIER[policy] if policy in HIER else HIER_SKETCH[policy][:2]
        n_super = -(-pages // R)
        kept_super = min(n_super, max(1, F * (B // S) // R))
        if kept_super >= n_super:  # every superpage is kept: the superpage stage is skipped
            bounds = h * pages * page_b
        else:
            bounds = h * (n_super * page_b + kept_super * R * page_b)
        if policy in HIER:
            return bounds + kept
        sketch = h * min(ctx, candidate_factor * B) * d * HIER_SKETCH[policy][2] // 8
        return bounds + sketch + kept
    if policy in SKETCH:
        bits = SKETCH[policy]
        cand = min(ctx, candidate_factor * B)
        # bounds, the candidates' sketch, then the kept keys (their exact logits) and values
        return h * pages * page_b + h * cand * d * bits // 8 + kept
    if policy in TWO_LEVEL or policy in TWO_LEVEL_Q:
        R, E, q = TWO_LEVEL[policy] if policy in TWO_LEVEL else TWO_LEVEL_Q[policy]
        if policy in TWO_LEVEL_Q:  # one byte per channel and the fp32 kabs (int8: the scale)
            page_b = d * 2 + 4
        n_coarse = -(-ctx // (S * R))
        cand = min(ctx, (B + E) // (S * R) * S * R)
        # coarse bounds, the candidates' keys (their logits are reused), the kept values
        return h * n_coarse * page_b + h * cand * d * itemsize + h * B * d * itemsize
    raise ValueError(f"not a prototype policy: {policy!r}")


def VARIANTS(budget: int) -> Dict[str, Sparse]:  # noqa: N802 (the study's --extra hook)
    b = dict(token_budget=budget, dense_layers=2, sink_pages=1)
    tl = {f"two-level: bounds on pages of {8 * R}, +{E} candidates, keep {'tokens' if t else 'pages of 8'}, sink 1":
          Sparse(**b, policy=name, page_size=8) for name, (R, E, t) in TWO_LEVEL.items()}
    tl.update({f"two-level: {q} bounds on pages of 8, +{E} candidates, keep tokens, sink 1":
               Sparse(**b, policy=name, page_size=8) for name, (_, E, q) in TWO_LEVEL_Q.items()})
    return {**tl,
        "hierarchical: superpages of 8 pages, 4x, pages 8, sink 1": Sparse(**b, policy="hier8x4", page_size=8),
        "sketch int4 from bounds, pages 16, sink 1, c=4": Sparse(**b, policy="sketch4", page_size=16,
                                                                 candidate_factor=4),
        "sketch int8 from bounds, pages 16, sink 1, c=2": Sparse(**b, policy="sketch8", page_size=16,
                                                                 candidate_factor=2),
        "hierarchical + sketch int4, pages 8, sink 1, c=2": Sparse(**b, policy="hier8x4sketch4", page_size=8,
                                                                   candidate_factor=2),
    }


__all__ = ["superpage_bounds", "scores_inside_superpages", "sketch_keys", "HierarchicalPolicy", "SketchPolicy",
           "proto_site_bytes", "VARIANTS", "HIER", "SKETCH", "HIER_SKETCH"]
