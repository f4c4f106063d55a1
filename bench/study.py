"""Issue 6: selection-quality variants at one context (teacher-forced perplexity, top-1 agreement, stats).

``python -m bench.study --ctx 8192 --half tune --out results/study_tune_8k.json``
"""
from __future__ import annotations

import argparse
import json
import os

try:
    from .accuracy import perplexity
    from .harness import Sparse
except ImportError:
    from accuracy import perplexity
    from harness import Sparse


def variants(budget: int):
    b = dict(token_budget=budget)
    return {
        "bound (paper)": Sparse(**b),
        "bound + sink 1": Sparse(**b, sink_pages=1),
        "bound + sink 2": Sparse(**b, sink_pages=2),
        "bound, pages of 8": Sparse(**b, page_size=8),
        "bound, pages of 8 + sink 1": Sparse(**b, page_size=8, sink_pages=1),
        "bound + sink 1 + 4 dense layers": Sparse(**b, sink_pages=1, dense_layers=4),
        "two-stage c=2 + sink 1": Sparse(**b, sink_pages=1, candidate_factor=2),
        "two-stage c=4 + sink 1": Sparse(**b, sink_pages=1, candidate_factor=4),
        "two-stage c=4 + sink 1, pages of 8": Sparse(**b, sink_pages=1, candidate_factor=4, page_size=8),
        "two-stage c=4 + sink 1 + 4 dense layers": Sparse(**b, sink_pages=1, candidate_factor=4, dense_layers=4),
        "oracle": Sparse(**b, policy="oracle"),
        "streaming": Sparse(**b, policy="streaming"),
        "h2o": Sparse(**b, policy="h2o"),
    }


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--half", default="tune")
    ap.add_argument("--budgets", default="512,2048")
    ap.add_argument("--only", default="", help="semicolon-separated variant names (default: all)")
    ap.add_argument("--collect", default="bound (paper);two-stage c=4 + sink 1;oracle")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    cfgs, names, collect = [], {}, []
    only = [s for s in a.only.split(";") if s]
    for budget in map(int, a.budgets.split(",")):
        for name, cfg in variants(budget).items():
            if only and name not in only:
                continue
            cfgs.append(cfg)
            names[cfg.label()] = name
            if name in a.collect.split(";"):
                collect.append(cfg)
    rows = perplexity(a.ctx, cfgs, steps=a.steps, half=a.half, collect=collect)
    for r in rows:
        r["variant"] = names.get(r["label"], "full")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
    for r in rows:
        print(f"{r['variant']:42s} B={r['budget']:5d} ppl={r['ppl']:.3f} ({100 * r['ppl_rel']:+.2f}%) "
              f"top1={100 * r['top1']:.1f}% s/step={r['s_per_step']:.3f}")


if __name__ == "__main__":
    main()
