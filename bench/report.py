"""Tables (markdown) and PNG plots from the JSON results of ``python -m bench accuracy/speed``."""
from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from typing import List


def _load(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def passkey_table(rows: List[dict]) -> str:
    acc = defaultdict(list)
    for r in rows:
        acc[(r["policy"], r["budget"], r["ctx"])].append(r["ok"])
    pols = sorted({r["policy"] for r in rows if r["policy"] != "full"})
    ctxs = sorted({r["ctx"] for r in rows})
    budgets = sorted({r["budget"] for r in rows if r["policy"] != "full"})
    out = ["| policy | budget | " + " | ".join(f"{c // 1024}K" for c in ctxs) + " |", "|---|---|" + "---|" * len(ctxs)]
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
    plt = _plt()
    import numpy as np

    pols = sorted({r["policy"] for r in rows if r["policy"] != "full"}) + ["full"]
    ctxs = sorted({r["ctx"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    budgets = sorted({r["budget"] for r in rows if r["policy"] != "full"})
    fig, axes = plt.subplots(1, len(pols), figsize=(3.3 * len(pols), 3.6), squeeze=False)
    for ax, p in zip(axes[0], pols):
        bs = budgets if p != "full" else [None]
        grid = np.full((len(ctxs) * len(depths), len(bs)), np.nan)
        for i, (c, d) in enumerate((c, d) for c in ctxs for d in depths):
            for j, b in enumerate(bs):
                v = [r["ok"] for r in rows if r["policy"] == p and r["ctx"] == c and r["depth"] == d
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


def plot_speed(rows, path):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for p in dict.fromkeys(r["provider"] for r in rows):
        pts = sorted((r["ctx"], r["ms_per_token"]) for r in rows if r["provider"] == p and "ms_per_token" in r)
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode ms/token")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def bytes_fraction(r) -> float:
    """Bytes one sparse layer reads per step, as a fraction of dense K+V (fp32 cache, D=64), from the
    configuration: selected K+V, plus for the bound the page bounds (2 fp32 vectors per page) and for
    two-stage the candidates' keys; oracle and h2o read every key to score."""
    L, B, S, c = r["ctx"], r["budget"], r["page_size"], r.get("candidate_factor", 1)
    kv = min(B, L) / L
    if r["policy"] == "query_aware":
        return kv + 1.0 / S + (min(c * B, L) / (2 * L) if c > 1 else 0.0)
    if r["policy"] in ("oracle", "h2o"):
        return kv + 0.5
    return kv


def plot_frontier(rows, path, budget_key="budget"):
    """+ppl vs fraction of KV bytes read per sparse layer, per variant (issue 6 frontier)."""
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
    for name in sorted(os.listdir(results_dir)) if os.path.isdir(results_dir) else []:
        if name.startswith("study_") and name.endswith(".json"):
            rows = _load(os.path.join(results_dir, name))
            for r in rows:
                r.setdefault("series", r.get("variant", r["label"]))
            parts += ["", f"### Selection study `{name}`", study_table(rows), "", stats_table(rows)]
            if any("stat_bytes_fraction" in r for r in rows):
                plot_frontier(rows, os.path.join(img_dir, name.replace(".json", "_frontier.png")))
    # decode rows at batch 1 (batch 8 is in decode.json) and the op rows
    sp = [r for r in _load(os.path.join(results_dir, "speed.json")) or [] if r.get("batch", 1) == 1]
    if sp:
        plot_speed([r for r in sp if "provider" in r], os.path.join(img_dir, "speed_ms_per_token.png"))
        parts += ["", "### Decode speed", "| provider | ctx | ms/token | compile s |", "|---|---|---|---|"]
        for r in sp:
            if "provider" in r:
                parts.append(f"| {r['provider']} | {r['ctx']} | {r.get('ms_per_token', float('nan')):.1f} | "
                             f"{r.get('compile_s', float('nan')):.1f} |" if "error" not in r else
                             f"| {r['provider']} | {r['ctx']} | error: {r['error'][:80]} | |")
    ops = [r for r in (sp or []) if r.get("kind") == "op"]
    if ops:
        parts += ["", "### Attention op vs SDPA (fp32, 9/3 heads, D=64, budget 2048)",
                  "| context | page | sinks | candidate factor | SDPA ms | op ms | speed-up |", "|---|---|---|---|---|---|---|"]
        for r in ops:
            parts.append(f"| {r['context']} | {r['page_size']} | {r['sink_pages']} | {r['candidate_factor']} | "
                         f"{r['dense_ms']:.2f} | {r['sparse_ms']:.2f} | {r['ratio']:.1f}x |")
    text = "\n".join(parts)
    with open(os.path.join(results_dir, "report.md"), "w") as f:
        f.write(text)
    return text
