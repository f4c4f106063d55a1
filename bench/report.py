"""Tables (markdown) and PNG plots from the JSON results of ``python -m bench accuracy`` and ``python -m bench study``.

``python -m bench report [--out results] [--img docs/img]`` reads ``accuracy_ppl.json``, ``passkey.json``,
``diagnostics.json`` and every ``study_*.json`` of the results folder, writes ``report.md`` there and the
plots to ``--img``. A study file of one window per cell gets :func:`study_table`; a study of several windows
per cell (rows with ``window``), with its tuning and held-out halves named ``<prefix>_tune.json`` and
``<prefix>_heldout.json``, gets :func:`window_report`. The decode, op, ONNX and GPU benchmarks print and
write their own tables.
"""
from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from typing import List

from tinyserve_compile.config import TinyServeConfig

#: the backend's defaults (the variant starred in the plots)
_DEFAULTS = TinyServeConfig()


def _load(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _plt():
    from bench.output import pyplot

    plt = pyplot()

    return plt


def ppl_table(rows: List[dict]) -> str:
    """+ppl% vs full and top-1 agreement per (series, budget), one block per context."""
    out = []
    for ctx in sorted({r["ctx"] for r in rows}):
        rs = [r for r in rows if r["ctx"] == ctx]
        full = next(r for r in rs if r["policy"] == "full" and r["dense_layers"] == 0)
        budgets = sorted({r["budget"] for r in rs if r["policy"] != "full"})
        series = []
        for r in rs:
            if r.get("series", r["label"]) not in series and r["policy"] != "full":
                series.append(r.get("series", r["label"]))
        out.append(f"\n**{ctx} tokens** (full attention ppl {full['ppl']:.3f}; cells: +ppl vs full / top-1 agreement)\n")
        out.append("| selection | " + " | ".join(f"budget {b}" for b in budgets) + " |")
        out.append("|---|" + "---|" * len(budgets))
        for s in series:
            cells = []
            for b in budgets:
                r = next((x for x in rs if x.get("series", x["label"]) == s and x["budget"] == b), None)
                cells.append("-" if r is None else f"{100 * r['ppl_rel']:+.2f}% / {100 * r['top1']:.1f}%")
            out.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def stats_table(rows: List[dict]) -> str:
    rs = [r for r in rows if "stat_kv_fraction" in r and r["policy"] != "full"]
    if not rs:
        return ""
    out = ["| ctx | selection | budget | KV read | bytes read | rho | dropped mass (mean / max) | certified bound (mean / max) | violations |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rs, key=lambda r: (r["ctx"], r.get("series", r["label"]), r["budget"])):
        out.append(f"| {r['ctx']} | {r.get('series', r['label'])} | {r['budget']} | {100 * r['stat_kv_fraction']:.1f}% | "
                   f"{100 * r['stat_bytes_fraction']:.1f}% | {r['stat_rho']:.3f} | "
                   f"{r['stat_dropped']:.4f} / {r['stat_dropped_max']:.3f} | {r['stat_bound']:.4f} / {r['stat_bound_max']:.3f} | "
                   f"{r['stat_bound_violations']} |")
    return "\n".join(out)


def _series(r: dict) -> str:
    """A passkey row's series: ``series`` where the row has one, else its policy."""
    return r.get("series") or r["policy"]


def passkey_table(rows: List[dict]) -> str:
    acc = defaultdict(list)
    for r in rows:
        acc[(_series(r), r["budget"], r["ctx"])].append(r["ok"])
    pols = sorted({_series(r) for r in rows if _series(r) != "full"})
    ctxs = sorted({r["ctx"] for r in rows})
    budgets = sorted({r["budget"] for r in rows if _series(r) != "full"})
    out = ["| series | budget | " + " | ".join(f"{c // 1024}K" for c in ctxs) + " |", "|---|---|" + "---|" * len(ctxs)]
    full = [acc[(p, b, c)] for p, b, c in acc if p == "full"]
    out.append("| full | - | " + " | ".join(
        f"{100 * sum(sum(acc[k]) for k in acc if k[0] == 'full' and k[2] == c) / max(1, sum(len(acc[k]) for k in acc if k[0] == 'full' and k[2] == c)):.0f}%"
        for c in ctxs) + " |")
    for p in pols:
        for b in budgets:
            cells = [f"{100 * sum(acc[(p, b, c)]) / len(acc[(p, b, c)]):.0f}%" if acc[(p, b, c)] else "-" for c in ctxs]
            out.append(f"| {p} | {b} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot_accuracy(rows, path):
    plt = _plt()
    ctxs = sorted({r["ctx"] for r in rows})
    fig, axes = plt.subplots(1, len(ctxs), figsize=(4.2 * len(ctxs), 3.4), squeeze=False)
    for ax, ctx in zip(axes[0], ctxs):
        rs = [r for r in rows if r["ctx"] == ctx and r["policy"] != "full"]
        for s in dict.fromkeys(r.get("series", r["label"]) for r in rs):
            pts = sorted((r["budget"], 100 * r["ppl_rel"]) for r in rs if r.get("series", r["label"]) == s)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
        ax.set_xscale("log", base=2)
        ax.set_yscale("symlog", linthresh=1.0)
        ax.axhline(0, color="k", lw=0.5)
        ax.set_title(f"{ctx} tokens")
        ax.set_xlabel("token budget")
        ax.set_ylabel("+perplexity vs full (%)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_passkey(rows, path):
    """Passkey success per series (the policy, or the compared options' ``series``), context, depth, budget."""
    plt = _plt()
    import numpy as np

    pols = sorted({_series(r) for r in rows if _series(r) != "full"}) + ["full"]
    ctxs = sorted({r["ctx"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    budgets = sorted({r["budget"] for r in rows if _series(r) != "full"})
    fig, axes = plt.subplots(1, len(pols), figsize=(3.3 * len(pols), 3.6), squeeze=False)
    for ax, p in zip(axes[0], pols):
        bs = budgets if p != "full" else [None]
        grid = np.full((len(ctxs) * len(depths), len(bs)), np.nan)
        for i, (c, d) in enumerate((c, d) for c in ctxs for d in depths):
            for j, b in enumerate(bs):
                v = [r["ok"] for r in rows if _series(r) == p and r["ctx"] == c and r["depth"] == d
                     and (b is None or r["budget"] == b)]
                if v:
                    grid[i, j] = sum(v) / len(v)
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(bs)), [str(b) if b else "-" for b in bs], fontsize=7)
        ax.set_yticks(range(len(ctxs) * len(depths)), [f"{c // 1024}K@{int(100 * d)}%" for c in ctxs for d in depths],
                      fontsize=6)
        ax.set_title(p, fontsize=9)
        ax.set_xlabel("budget", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


#: SmolLM2-135M attention shape (KV heads, head dim) and the fp32 cache of the study
SMOLLM2_KV_HEADS, SMOLLM2_HEAD_DIM, CACHE_ITEMSIZE = 3, 64, 4


def site_bytes_share(policy: str, ctx: int, budget: int, page_size: int, candidate_factor: int = 1,
                     bounds_dtype: str = "float32", n_kv_heads: int = SMOLLM2_KV_HEADS,
                     head_dim: int = SMOLLM2_HEAD_DIM, itemsize: int = CACHE_ITEMSIZE,
                     candidate_extra: int = 0) -> float:
    """Bytes one sparse layer reads per decode step, as a share of dense K+V at context ``ctx``.

    ``query_aware``: :func:`tinyserve_compile.cost.sparse_site_bytes` (the backend's cost model; bounds of
    ``bounds_dtype``). ``oracle`` and ``h2o``: every key (to score) and the kept values. Others: the kept K+V.
    """
    from tinyserve_compile.cost import sparse_site_bytes

    dense = 2 * n_kv_heads * ctx * head_dim * itemsize
    kept = min(budget, ctx) / ctx
    if policy == "query_aware":
        bi = {"bfloat16": 2, "int8": 1}.get(bounds_dtype, 4)
        return sparse_site_bytes(ctx, n_kv_heads, head_dim, itemsize, page_size, budget, candidate_factor, bi,
                                 candidate_extra) / dense
    if policy in ("oracle", "h2o"):
        return 0.5 + kept / 2
    if policy == "full":
        return 1.0
    return kept


def bytes_fraction(r) -> float:
    """:func:`site_bytes_share` of a result row (rows without ``bounds_dtype`` were measured with fp32 bounds)."""
    return site_bytes_share(r["policy"], r["ctx"], r["budget"], r["page_size"], r.get("candidate_factor", 1),
                            r.get("bounds_dtype") or "float32")


def plot_frontier(rows, path, budget_key="budget"):
    """+ppl vs fraction of KV bytes read per sparse layer, per variant (a study of one window per cell)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for b, mk in zip(sorted({r["budget"] for r in rows if r["policy"] != "full"}), "os^v"):
        for r in rows:
            if r["policy"] == "full" or r["budget"] != b or r["policy"] in ("streaming", "h2o"):
                continue
            x, y = 100 * bytes_fraction(r), 100 * r["ppl_rel"]
            ax.scatter(x, y, s=20, marker=mk)
            ax.annotate(f"{r.get('variant', r['label'])} B{b}", (x, y), fontsize=5)
    ax.set_yscale("symlog", linthresh=1.0)
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xlabel("bytes read per sparse layer and step (% of dense K+V)")
    ax.set_ylabel("+perplexity vs full (%)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def study_table(rows: List[dict]) -> str:
    budgets = sorted({r["budget"] for r in rows if r["policy"] != "full"})
    full = next(r for r in rows if r["policy"] == "full")
    orc = {r["budget"]: r for r in rows if r["policy"] == "oracle"}
    head = "| variant | " + " | ".join(f"+ppl @ {b} | top-1 @ {b}" for b in budgets) + " | gap to oracle @ " + \
           " / ".join(map(str, budgets)) + " | bytes read @ " + " / ".join(map(str, budgets)) + " |"
    out = [f"full attention ppl {full['ppl']:.3f} ({full['ctx']} tokens, {full['steps']} teacher-forced steps, "
           f"text: {full['half']})\n", head, "|---|" + "---|---|" * len(budgets) + "---|---|"]
    for v in dict.fromkeys(r.get("variant") for r in rows if r["policy"] != "full"):
        cells, gaps, byts = [], [], []
        for b in budgets:
            r = next((x for x in rows if x.get("variant") == v and x["budget"] == b), None)
            if r is None:
                cells += ["-", "-"]
                gaps.append("-")
                byts.append("-")
                continue
            byts.append(f"{100 * bytes_fraction(r):.0f}%")
            cells += [f"{100 * r['ppl_rel']:+.2f}%", f"{100 * r['top1']:.1f}%"]
            o = orc.get(b)
            gaps.append("-" if o is None else f"{100 * (r['ppl'] / o['ppl'] - 1):+.2f}%")
        out.append(f"| {v} | " + " | ".join(cells) + " | " + " / ".join(gaps) + " | " + " / ".join(byts) + " |")
    return "\n".join(out)


def report(results_dir="results", img_dir="docs/img") -> str:
    os.makedirs(img_dir, exist_ok=True)
    parts = []
    ppl = _load(os.path.join(results_dir, "accuracy_ppl.json"))
    if ppl:
        plot_accuracy(ppl, os.path.join(img_dir, "accuracy_vs_budget.png"))
        parts += ["### Perplexity and top-1 agreement", ppl_table(ppl), "", "### Per-step statistics", stats_table(ppl)]
    pk = _load(os.path.join(results_dir, "passkey.json"))
    if pk:
        plot_passkey(pk, os.path.join(img_dir, "passkey_heatmap.png"))
        parts += ["", "### Passkey retrieval", passkey_table(pk)]
    dg = _load(os.path.join(results_dir, "diagnostics.json"))
    if dg:
        acc = defaultdict(list)
        for r in dg:
            acc[(r["task"], r["label"])].append(r["score"])
        tasks = list(dict.fromkeys(r["task"] for r in dg))
        labels = list(dict.fromkeys(r["label"] for r in dg))
        parts += ["", "### Synthetic diagnostics", "| selection | " + " | ".join(tasks) + " |",
                  "|---|" + "---|" * len(tasks)]
        for lab in labels:
            parts.append(f"| {lab} | " + " | ".join(
                f"{100 * sum(acc[(t, lab)]) / len(acc[(t, lab)]):.1f}%" if acc[(t, lab)] else "-" for t in tasks) + " |")
    names = sorted(os.listdir(results_dir)) if os.path.isdir(results_dir) else []
    prefixes = []
    for name in names:
        if not (name.startswith("study_") and name.endswith(".json")):
            continue
        rows = _load(os.path.join(results_dir, name))
        prefix, half = name[:-5].rsplit("_", 1)
        if half in ("tune", "heldout") and any("window" in r for r in rows):  # several windows per cell
            if prefix not in prefixes:  # one report per tune/heldout pair
                prefixes.append(prefix)
            continue
        for r in rows:
            r.setdefault("series", r.get("variant", r["label"]))
        parts += ["", f"### Selection study `{name}`", study_table(rows), "", stats_table(rows)]
        if any("stat_bytes_fraction" in r for r in rows):
            plot_frontier(rows, os.path.join(img_dir, name.replace(".json", "_frontier.png")))
    for prefix in prefixes:
        parts += ["", f"### Selection study `{prefix}` (several windows per cell)",
                  window_report(results_dir, img_dir, prefix)]
    text = "\n".join(parts)
    with open(os.path.join(results_dir, "report.md"), "w") as f:
        f.write(text)
    return text


# ---------------------------------------------------------------------------------------------- several windows
#: the selection targets (held-out text, 8K, mean over windows; bytes per sparse layer and step, budget 2048)
TARGETS = dict(ppl_2048=0.005, ppl_512=0.03, top1_2048=0.98, bytes_8k=0.35, bytes_32k=0.12)


def _stats(xs: List[float]) -> dict:
    n = len(xs)
    mean = sum(xs) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else float("nan")
    return dict(mean=mean, std=std, min=min(xs), max=max(xs), n=n)


def _row_extra(r: dict) -> int:
    """``candidate_extra`` of a row (older rows carry it only in their label, as ``/e<tokens>``)."""
    if "candidate_extra" in r:
        return int(r["candidate_extra"])
    part = next((p for p in r["label"].split("/") if p[:1] == "e" and p[1:].isdigit()), None)
    return int(part[1:]) if part else 0


def means_table(rows: List[dict]) -> str:
    """Markdown: per variant, +ppl (mean (sd)) and top-1 at 512 and 2048, and bytes at 8K / 32K (budget 2048,
    :func:`site_bytes_share` with the row's ``candidate_extra`` and bounds dtype)."""
    groups = defaultdict(list)
    for r in rows:
        if r["policy"] != "full":
            groups[(r["variant"], r["budget"])].append(r)
    variants = list(dict.fromkeys(v for v, _ in groups))
    head = ["variant", "+ppl @512", "top-1 @512", "+ppl @2048", "top-1 @2048", "bytes 8K / 32K @2048", "windows"]
    out = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for v in variants:
        cells, n = [], set()
        for b in (512, 2048):
            rs = groups.get((v, b), [])
            n.add(len(rs))
            if not rs:
                cells += ["-", "-"]
                continue
            p, t = _stats([r["ppl_rel"] for r in rs]), _stats([r["top1"] for r in rs])
            cells += [f"{100 * p['mean']:+.2f}% ({100 * p['std']:.2f})", f"{100 * t['mean']:.1f}%"]
        r0 = (groups.get((v, 2048)) or groups.get((v, 512)))[0]
        bd = r0.get("bounds_dtype") or "float32"
        sh = [site_bytes_share(r0["policy"], c, 2048, r0["page_size"], r0.get("candidate_factor", 1), bd,
                               candidate_extra=_row_extra(r0)) for c in (8192, 32768)]
        out.append("| " + " | ".join([v] + cells + [f"{100 * sh[0]:.1f}% / {100 * sh[1]:.1f}%",
                                                      "/".join(map(str, sorted(n)))]) + " |")
    return "\n".join(out)


def plot_means_frontier(rows: List[dict], path: str, targets=((512, 0.03), (2048, 0.005)), byte_target=0.35):
    """Two panels (budget 512 and 2048): +ppl (mean, sd error bars over the windows) against bytes per sparse layer
    and step at 8K / budget 2048 (share of dense K+V), every ``query_aware`` variant of ``rows``; the oracle (which
    reads every key) as a dashed line; the targets as grey lines."""
    plt = _plt()
    if plt is None:
        return
    groups = defaultdict(list)
    for r in rows:
        if r["policy"] in ("query_aware", "oracle"):
            groups[(r["variant"], r["budget"])].append(r)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, (budget, ppl_target) in zip(axes, targets):
        for (v, b), rs in groups.items():
            if b != budget:
                continue
            st = _stats([100 * r["ppl_rel"] for r in rs])
            if rs[0]["policy"] == "oracle":
                ax.axhline(st["mean"], ls="--", color="tab:purple", lw=1, label=f"{v} (reads every key)")
                continue
            r0 = rs[0]
            x = 100 * site_bytes_share("query_aware", 8192, 2048, r0["page_size"], r0.get("candidate_factor", 1),
                                       r0.get("bounds_dtype") or "float32", candidate_extra=_row_extra(r0))
            shipped = (r0.get("bounds_dtype") == _DEFAULTS.bounds_dtype and _row_extra(r0) == _DEFAULTS.candidate_extra
                       and ("keep tokens" in v) == _DEFAULTS.keep_tokens and r0["page_size"] == _DEFAULTS.page_size)
            ax.errorbar([x], [st["mean"]], yerr=[st["std"]], fmt="*" if shipped else "o", ms=12 if shipped else 6,
                        capsize=3, label=v)
        ax.axhline(100 * ppl_target, color="grey", lw=0.8)
        ax.axvline(100 * byte_target, color="grey", lw=0.8)
        ax.set_title(f"budget {budget}: +ppl (mean ± sd over windows; star: the defaults)")
        ax.set_xlabel("bytes per sparse layer and step, % of dense K+V (8K, budget 2048)")
        ax.set_ylabel("+ppl vs full attention, %")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=6.5, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def study_summary(rows: List[dict]) -> List[dict]:
    """One entry per (variant, budget) over the windows of a multi-window study: ``ppl_rel``, ``top1`` and
    ``gap`` (perplexity over the oracle's, same window) as mean/std/min/max/n, and bytes at 8K and 32K."""
    oracle = {(r["offset"], r["budget"]): r["ppl"] for r in rows if r["policy"] == "oracle"}
    groups = defaultdict(list)
    for r in rows:
        if r["policy"] != "full":
            groups[(r["variant"], r["budget"])].append(r)
    out = []
    for (v, b), rs in groups.items():
        r0 = rs[0]
        gaps = [r["ppl"] / oracle[(r["offset"], b)] - 1 for r in rs if (r["offset"], b) in oracle]
        bd = r0.get("bounds_dtype") or "float32"
        e = dict(variant=v, budget=b, policy=r0["policy"], page_size=r0["page_size"], sink_pages=r0["sink_pages"],
                 candidate_factor=r0["candidate_factor"], bounds_dtype=bd, half=r0["half"], ctx=r0["ctx"],
                 steps=r0["steps"], ppl_rel=_stats([r["ppl_rel"] for r in rs]), top1=_stats([r["top1"] for r in rs]),
                 gap=_stats(gaps) if gaps else None)
        for ctx in (8192, 32768):
            e[f"bytes_{ctx // 1024}k"] = site_bytes_share(r0["policy"], ctx, b, r0["page_size"], r0["candidate_factor"], bd)
        out.append(e)
    return out


def _pm(s: dict, pct=True, signed=True) -> str:
    k = 100 if pct else 1
    f = "{:+.2f}" if signed else "{:.1f}"
    return (f.format(k * s["mean"]) + "% ± " + "{:.2f}".format(k * s["std"]) + " [" + f.format(k * s["min"]) + ", "
            + f.format(k * s["max"]) + "]")


def window_table(summary: List[dict], mark: str = "") -> str:
    """Markdown: per variant, +ppl and top-1 at each budget (mean ± std [min, max] over windows), the gap to
    the oracle, and bytes per sparse layer and step at budget 2048 (share of dense K+V) at 8K and 32K."""
    budgets = sorted({e["budget"] for e in summary})
    head = ["variant"] + [f"{x} @ {b}" for b in budgets for x in ("+ppl", "top-1")] + \
        ["gap to oracle @ " + " / ".join(map(str, budgets)), "bytes 8K / 32K @ 2048", "windows"]
    out = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for v in dict.fromkeys(e["variant"] for e in summary):
        cells, gaps, byts, n = [], [], "-", set()
        for b in budgets:
            e = next((x for x in summary if x["variant"] == v and x["budget"] == b), None)
            if e is None:
                cells += ["-", "-"]
                gaps.append("-")
                continue
            n.add(e["ppl_rel"]["n"])
            cells += [_pm(e["ppl_rel"]), _pm(e["top1"], signed=False).replace("% ±", "% ±")]
            gaps.append("-" if e["gap"] is None or e["policy"] == "oracle" else f"{100 * e['gap']['mean']:+.2f}%")
            if b == 2048 or (byts == "-" and b == budgets[-1]):
                byts = f"{100 * e['bytes_8k']:.1f}% / {100 * e['bytes_32k']:.1f}%"
        name = f"**{v}**" if v == mark else v
        out.append(f"| {name} | " + " | ".join(cells) + " | " + " / ".join(gaps) + f" | {byts} | "
                   + "/".join(map(str, sorted(n))) + " |")
    return "\n".join(out)


def targets_check(summary: List[dict]) -> List[dict]:
    """Per variant, each of :data:`TARGETS` met or missed (quality from ``summary``, bytes from the cost model)."""
    out = []
    for v in dict.fromkeys(e["variant"] for e in summary):
        e = {e["budget"]: e for e in summary if e["variant"] == v}
        if 512 not in e or 2048 not in e:
            continue
        b = e[2048]
        vals = dict(ppl_2048=b["ppl_rel"]["mean"], ppl_512=e[512]["ppl_rel"]["mean"], top1_2048=b["top1"]["mean"],
                    bytes_8k=b["bytes_8k"], bytes_32k=b["bytes_32k"])
        met = {k: (vals[k] >= TARGETS[k]) if k == "top1_2048" else (vals[k] <= TARGETS[k]) for k in TARGETS}
        out.append(dict(variant=v, values=vals, met=met, n=b["ppl_rel"]["n"]))
    return out


def targets_table(summary: List[dict]) -> str:
    rows = targets_check(summary)
    head = ["variant", "+ppl @ 2048 (<= 0.5%)", "+ppl @ 512 (<= 3%)", "top-1 @ 2048 (>= 98%)",
            "bytes 8K (<= 35%)", "bytes 32K (<= 12%)", "misses"]
    out = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        v, m = r["values"], r["met"]
        cell = lambda k, f: f.format(100 * v[k]) + ("" if m[k] else " ✗")  # noqa: E731
        miss = [k for k in TARGETS if not m[k]]
        out.append(f"| {r['variant']} | {cell('ppl_2048', '{:+.2f}%')} | {cell('ppl_512', '{:+.2f}%')} | "
                   f"{cell('top1_2048', '{:.1f}%')} | {cell('bytes_8k', '{:.1f}%')} | {cell('bytes_32k', '{:.1f}%')} | "
                   f"{', '.join(miss) if miss else 'none'} |")
    return "\n".join(out)


def _short(v: str) -> str:
    return (v.replace("pages ", "p").replace(", sink ", " s").replace(", c=", " c").replace(", fp32 bounds", " fp32")
            .replace("oracle (pages of 8)", "oracle").replace("hierarchical", "hier").replace(" from bounds", "")
            .replace("superpages of 8 pages, 4x, ", "").replace(",", ""))


def plot_window_frontier(summary: List[dict], path: str, title: str = ""):
    """Quality against bytes per sparse layer and step at 8K, one column per budget: +ppl (top row) and
    top-1 agreement (bottom row), mean with min..max over windows as error bars; the targets dashed."""
    plt = _plt()
    budgets = sorted({e["budget"] for e in summary})
    fig, axes = plt.subplots(2, len(budgets), figsize=(7.5 * len(budgets), 9), squeeze=False)
    lim = {512: TARGETS["ppl_512"], 2048: TARGETS["ppl_2048"]}
    for j, b in enumerate(budgets):
        for i, key in enumerate(("ppl_rel", "top1")):
            ax = axes[i][j]
            for e in (x for x in summary if x["budget"] == b):
                s = e[key]
                x, y = 100 * e["bytes_8k"], 100 * s["mean"]
                c = {1: "C0", 2: "C1", 4: "C2"}.get(e["candidate_factor"], "C4") if e["policy"] == "query_aware" \
                    else ("C3" if e["policy"] == "oracle" else "C5")
                mk = {16: "s", 12: "D"}.get(e["page_size"], "o")
                if e["bounds_dtype"] == "float32" and e["policy"] == "query_aware":
                    mk = "x"
                if e["policy"] not in ("query_aware", "oracle"):
                    mk = "*"
                ax.errorbar(x, y, yerr=[[y - 100 * s["min"]], [100 * s["max"] - y]], fmt=mk, color=c, ms=6, capsize=2,
                            mfc="none" if e["sink_pages"] == 0 else c, alpha=0.85)
                ax.annotate(_short(e["variant"]), (x, y), fontsize=6.5, xytext=(4, -3 if i else 2),
                            textcoords="offset points")
            if key == "ppl_rel":
                if b in lim:
                    ax.axhline(100 * lim[b], color="k", ls="--", lw=0.7)
                ax.set_yscale("symlog", linthresh=1.0)
                ax.axhline(0, color="k", lw=0.4)
                ax.set_ylabel("+perplexity vs full (%)")
            else:
                if b == 2048:
                    ax.axhline(100 * TARGETS["top1_2048"], color="k", ls="--", lw=0.7)
                ax.set_ylabel("top-1 agreement with full (%)")
            if b == 2048:
                ax.axvline(100 * TARGETS["bytes_8k"], color="k", ls=":", lw=0.7)
            ax.set_title(f"{title} budget {b}: mean, bars min..max over windows", fontsize=9)
            ax.set_xlabel("bytes read per sparse layer and step at 8K (% of dense K+V)", fontsize=8)
            ax.grid(alpha=0.3)
    fig.text(0.01, 0.005, "colour: c=1 blue, c=2 orange, c=4 green, oracle red; marker: pages "
             "8 o, 12 D, 16 s, fp32 bounds x; hollow: no sink; dashed: quality target, dotted: 8K bytes target "
             "(budget 2048)", fontsize=7.5)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, dpi=80)
    plt.close(fig)


def bytes_table(summary: List[dict]) -> str:
    """Markdown: bytes per sparse layer and step (share of dense K+V) of every variant of ``summary`` at
    8K and 32K, budgets 512 and 2048 (cost model; SmolLM2's 3 KV heads, D=64, fp32 cache)."""
    out = ["| variant | 8K @ 512 | 8K @ 2048 | 32K @ 512 | 32K @ 2048 |", "|---|---|---|---|---|"]
    for v in dict.fromkeys(e["variant"] for e in summary):
        e = next(x for x in summary if x["variant"] == v)
        cells = [f"{100 * site_bytes_share(e['policy'], c, b, e['page_size'], e['candidate_factor'], e['bounds_dtype']):.1f}%"
                 for c in (8192, 32768) for b in (512, 2048)]
        out.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def window_report(results_dir: str = "results", img_dir: str = "docs/img", prefix: str = "study_frontier") -> str:
    """Tables (markdown) and PNGs of a study of several windows per cell from
    ``results/<prefix>_{tune,heldout}.json``: bytes per variant, the per-window spread (:func:`window_table`),
    the targets (:func:`targets_table`) and the means (:func:`means_table`); plots
    ``<img_dir>/<prefix>_<half>_frontier.png`` (:func:`plot_window_frontier`) and
    ``<img_dir>/<prefix>_<half>_means.png`` (:func:`plot_means_frontier`). The summaries go to
    ``<img_dir>/<prefix>_summary.json`` and the per-window rows next to them."""
    os.makedirs(img_dir, exist_ok=True)
    parts, dump = [], {}
    for half in ("tune", "heldout"):
        rows = _load(os.path.join(results_dir, f"{prefix}_{half}.json"))
        if not rows:
            continue
        summ = study_summary(rows)
        dump[half] = summ
        with open(os.path.join(img_dir, f"{prefix}_{half}_rows.json"), "w") as f:
            json.dump(rows, f, indent=0)
        full = [r for r in rows if r["policy"] == "full"]
        offs = sorted({r["offset"] for r in full})
        fulls = ", ".join(f"{r['ppl']:.2f}" for r in sorted(full, key=lambda r: r["offset"]))
        if half == "tune" or "tune" not in dump:
            parts += ["### Bytes read per sparse layer and step (share of dense K+V, `tinyserve_compile.cost`)", "", bytes_table(summ), ""]
        parts += [f"### {'Tuning' if half == 'tune' else 'Held-out'} text: {len(offs)} windows at token offsets "
                  f"{', '.join(map(str, offs))} (full-attention ppl {fulls}; {full[0]['steps']} teacher-forced "
                  f"predictions each, context {full[0]['ctx']})", "",
                  "Cells: mean ± std [min, max] over windows.", "", window_table(summ), "",
                  "Targets, on the means:", "", targets_table(summ), "",
                  "Means (sd) and bytes with each variant's extra candidates:", "", means_table(rows), ""]
        label = "tuning text," if half == "tune" else "held-out text,"
        plot_window_frontier(summ, os.path.join(img_dir, f"{prefix}_{half}_frontier.png"), label)
        plot_means_frontier(rows, os.path.join(img_dir, f"{prefix}_{half}_means.png"))
    with open(os.path.join(img_dir, f"{prefix}_summary.json"), "w") as f:
        json.dump(dump, f, indent=1)
    return "\n".join(parts)


def main(argv=None) -> int:
    from bench import cli

    ap = cli.parser("report", __doc__.split("\n\n")[0], out="results", threads=False,
                    quick="no effect (the report only reads what the benchmarks stored)")
    ap.add_argument("--img", default="docs/img", help="where the PNGs go")
    ap.add_argument("--windows", default="", help="only the window report of this study prefix "
                    "(e.g. study_defaults: results/study_defaults_{tune,heldout}.json)")
    a = cli.parse(ap, argv, compare="report makes tables from stored results: run --compare on the benchmark")
    if a.out.endswith(".json"):
        ap.error("argument --out: the results folder the benchmarks wrote (report.md goes there too)")
    print(window_report(a.out, a.img, a.windows) if a.windows else report(a.out, a.img))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
