"""Selection study (issues 6 and 10): quality of page-selection variants against the bytes they read.

Every cell is measured on several *windows* (non-overlapping stretches of the tuning or held-out
text, see :func:`window_offsets`): per window, ``ctx - steps`` tokens are prefilled densely (the
prefill is cached on disk) and ``steps`` tokens are teacher-forced through the decode path
(:func:`bench.accuracy.perplexity`). Rows are written after every window, and ``--resume`` skips
the (window, configuration) pairs already in ``--out``. Aggregate with :func:`bench.report.study_summary`.

``python -m bench.study --half tune --windows 4 --steps 64 --out results/study10_tune.json``
``python -m bench.study --half heldout --grid heldout --windows 4 --steps 64 --out results/study10_heldout.json``
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Dict, List

try:
    from .accuracy import load_model, perplexity, topic_text
    from .harness import Sparse
except ImportError:
    from accuracy import load_model, perplexity, topic_text
    from harness import Sparse


def variant_name(cfg: Sparse) -> str:
    """Readable name of a configuration (the same for every budget)."""
    if cfg.policy == "oracle":
        return f"oracle (pages of {cfg.page_size})"
    if cfg.policy != "query_aware":
        return f"{cfg.policy} (pages of {cfg.page_size})"
    s = f"pages {cfg.page_size}, sink {cfg.sink_pages}, c={cfg.candidate_factor}"
    if cfg.dense_layers != 2:
        s += f", {cfg.dense_layers} dense layers"
    if cfg.bounds_dtype != "bfloat16":
        s += ", fp32 bounds"
    return s


def grid(name: str, budget: int) -> List[Sparse]:
    """The configurations of one grid at one budget.

    ``frontier`` (tuning text): pages 8/16 x sinks 0/1 x candidate factor 1/2/4 with bf16 bounds; the
    same with fp32 bounds for the one-stage pages-of-8 and pages-of-16 points with a sink; one-stage
    pages of 12 with a sink (between the two in bytes); the oracle with pages of 8.
    ``heldout``: the frontier's candidates for the defaults, and today's defaults, and the oracle.
    """
    b = dict(token_budget=budget, dense_layers=2)
    if name == "frontier":
        out = [Sparse(**b, page_size=S, sink_pages=s, candidate_factor=c)
               for S in (8, 16) for s in (0, 1) for c in (1, 2, 4)]
        out += [Sparse(**b, page_size=S, sink_pages=1, bounds_dtype="float32") for S in (8, 16)]
        out += [Sparse(**b, page_size=12, sink_pages=1)]
        out += [Sparse(**b, policy="oracle", page_size=8, sink_pages=1)]
        return out
    if name == "heldout":
        return [Sparse(**b, page_size=S, sink_pages=1) for S in (8, 12, 16)] + [
            Sparse(**b, page_size=8, sink_pages=1, candidate_factor=4),
            Sparse(**b, page_size=16, sink_pages=1, candidate_factor=4),
            Sparse(**b, policy="oracle", page_size=8, sink_pages=1)]
    raise ValueError(f"unknown grid {name!r}")


def window_offsets(half: str, ctx: int, n: int) -> List[int]:
    """``n`` token offsets spread evenly over the text of ``half`` (first at 0, last at its end);
    the windows of ``ctx + 1`` tokens do not overlap when the text holds ``n * (ctx + 1)`` tokens."""
    _, tok = load_model()
    total = len(tok(topic_text(half)).input_ids)
    room = total - (ctx + 1)
    if room < 0 or n < 1:
        raise ValueError(f"text {half!r} ({total} tokens) too short for ctx={ctx}")
    if n == 1:
        return [0]
    return [i * room // (n - 1) for i in range(n)]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--half", default="tune", choices=("tune", "heldout"))
    ap.add_argument("--grid", default="frontier", choices=("frontier", "heldout"))
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--budgets", default="512,2048")
    ap.add_argument("--only", default="", help="semicolon-separated variant names (default: the whole grid)")
    ap.add_argument("--extra", default="", help="module whose VARIANTS(budget) adds configurations (prototypes)")
    ap.add_argument("--resume", action="store_true", help="keep the rows in --out and skip what they cover")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    cfgs: List[Sparse] = []
    names: Dict[str, str] = {}
    only = [s for s in a.only.split(";") if s]
    extra = __import__(a.extra, fromlist=["VARIANTS"]).VARIANTS if a.extra else None
    for budget in map(int, a.budgets.split(",")):
        pairs = [(variant_name(c), c) for c in grid(a.grid, budget)]
        if extra is not None:
            pairs += list(extra(budget).items())
        for name, cfg in pairs:
            if only and name not in only:
                continue
            cfgs.append(cfg)
            names[cfg.label()] = name
    rows = json.load(open(a.out)) if a.resume and os.path.exists(a.out) else []
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    offsets = window_offsets(a.half, a.ctx, a.windows)
    t0 = time.time()
    for w, off in enumerate(offsets):
        done = {r["label"] for r in rows if r["offset"] == off and r["steps"] == a.steps}
        todo = [c for c in cfgs if c.label() not in done]
        if not todo:
            continue
        new = perplexity(a.ctx, todo, steps=a.steps, half=a.half, offset=off, quiet=True)
        for r in new:
            r["variant"] = names.get(r["label"], "full")
            r["window"] = w
            r["bounds_dtype"] = next((c.bounds_dtype for c in todo if c.label() == r["label"]), None)
            if r["label"] in done:  # full attention reruns as the reference of every call
                continue
            rows.append(r)
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"window {w} (offset {off}) done: {len(todo)} configurations, {time.time() - t0:.0f} s", flush=True)
        for r in new:
            print(f"  {r['variant']:44s} B={r['budget']:5d} {100 * r['ppl_rel']:+7.2f}% top1={100 * r['top1']:.1f}%",
                  flush=True)


if __name__ == "__main__":
    main()
