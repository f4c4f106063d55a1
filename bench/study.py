"""Selection study: quality of page-selection variants against the bytes they read.

Every cell is measured on several *windows* (non-overlapping stretches of the tuning or held-out
text, see :func:`window_offsets`): per window, ``ctx - steps`` tokens are prefilled densely (the
prefill is cached on disk) and ``steps`` tokens are teacher-forced through the decode path
(:func:`bench.accuracy.perplexity`). Rows are written after every window, and ``--resume`` skips
the (window, configuration) pairs already in ``--out``. Aggregate with :func:`bench.report.study_summary`.

``python -m bench study --half tune --windows 4 --steps 64 --out results/study_frontier_tune.json``
``python -m bench study --half heldout --grid heldout --windows 4 --steps 64 --out results/study_frontier_heldout.json``
``python -m bench study --half heldout --grid defaults --windows 4 --steps 64 --out results/study_defaults_heldout.json``
(then ``python -m bench report``: a ``<prefix>_tune.json`` / ``<prefix>_heldout.json`` pair is one report).
"""
from __future__ import annotations

import json
import os
import time
from typing import Dict, List

from bench import cli
from bench.accuracy import load_model, perplexity, topic_text
from bench.harness import Sparse


def variant_name(cfg: Sparse) -> str:
    """Readable name of a configuration (the same for every budget)."""
    if cfg.policy == "oracle":
        return f"oracle (pages of {cfg.page_size})"
    if cfg.policy != "query_aware":
        return f"{cfg.policy} (pages of {cfg.page_size})"
    s = f"pages {cfg.page_size}, sink {cfg.sink_pages}, c={cfg.candidate_factor}"
    if cfg.candidate_extra:
        s += f" +{cfg.candidate_extra}"
    if cfg.keep_tokens:
        s += ", keep tokens"
    if cfg.dense_layers != 2:
        s += f", {cfg.dense_layers} dense layers"
    if cfg.bounds_dtype != "bfloat16":
        s += f", {'fp32' if cfg.bounds_dtype == 'float32' else cfg.bounds_dtype} bounds"
    return s


def grid(name: str, budget: int) -> List[Sparse]:
    """The configurations of one grid at one budget, most important first.

    ``frontier`` (tuning text): the one-stage bound (the only kind whose bytes can meet the byte
    targets of :data:`bench.report.TARGETS`) with pages of 8/12/16 and a sink, pages of 8/16 without one, fp32 bounds for pages of 8/16
    with a sink, two-stage c=2/4 with a sink, and the oracle (pages of 8, sink). ``tail``: the rest of
    pages 8/16 x sinks 0/1 x c 1/2/4 (two-stage without a sink). ``heldout``: the candidates for the
    defaults (one stage, pages of 8/12/16, a sink), two stages with c=4 (pages of 8, sink), the oracle,
    and the tuning text's best two-stage compromise (pages of 8, sink, c=2).
    ``defaults`` (the backend's own options, pages of 8, a sink): int8 bounds with ``candidate_extra``
    512/1024 keeping tokens (1024: the defaults), int8 with 1024 extra keeping pages, bf16 with 1024 extra
    keeping tokens, and int8 with c=2.
    """
    base = dict(cli.PRESETS["paper-bf16"], token_budget=budget, dense_layers=2)

    def cell(**changes) -> Sparse:  # the grids vary the paper's rule with bf16 bounds
        return Sparse(**{**base, **changes})

    one = [cell(page_size=S, sink_pages=1) for S in (8, 12, 16)]
    oracle = cell(policy="oracle", page_size=8, sink_pages=1)
    if name == "frontier":
        return one + [cell(page_size=S) for S in (8, 16)] + \
            [cell(page_size=S, sink_pages=1, bounds_dtype="float32") for S in (8, 16)] + \
            [cell(page_size=S, sink_pages=1, candidate_factor=c) for c in (4, 2) for S in (8, 16)] + [oracle]
    if name == "tail":
        return [cell(page_size=S, candidate_factor=c) for c in (2, 4) for S in (8, 16)]
    if name == "heldout":
        return one + [cell(page_size=8, sink_pages=1, candidate_factor=4), oracle,
                      cell(page_size=8, sink_pages=1, candidate_factor=2)]
    if name == "defaults":
        d = dict(page_size=8, sink_pages=1)
        return [cell(**d, bounds_dtype="int8", candidate_extra=1024, keep_tokens=True),
                cell(**d, bounds_dtype="int8", candidate_extra=512, keep_tokens=True),
                cell(**d, bounds_dtype="int8", candidate_extra=1024),
                cell(**d, candidate_extra=1024, keep_tokens=True),
                cell(**d, bounds_dtype="int8", candidate_factor=2)]
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
    ap = cli.parser("study", __doc__.split("\n\n")[0], out="results",
                    quick="one window of 16 steps at budget 512: checks the pipeline")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--half", default="tune", choices=("tune", "heldout"))
    ap.add_argument("--grid", default="frontier", choices=("frontier", "tail", "heldout", "defaults"))
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--budgets", default="512,2048")
    ap.add_argument("--only", default="", help="semicolon-separated variant names (default: the whole grid)")
    ap.add_argument("--resume", action="store_true", help="keep the rows in --out and skip what they cover")
    a = cli.parse(ap, argv)
    if a.quick:
        a.windows, a.steps, a.budgets = 1, 16, "512"
    a.out = cli.out_path(a.out, f"study_{a.grid}_{a.half}")
    cfgs: List[Sparse] = []
    names: Dict[str, str] = {}
    only = [s for s in a.only.split(";") if s]
    for budget in map(int, a.budgets.split(",")):
        pairs = [(variant_name(c), c) for c in grid(a.grid, budget)]
        if a.compare is not None:  # the options compared, over the backend's defaults, at this budget
            pairs.append((a.compare.name, Sparse(**{**a.compare, "token_budget": budget})))
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

        def keep(r, w=w, done=done, todo=todo):
            r["variant"] = names.get(r["label"], "full")
            r["window"] = w
            r["bounds_dtype"] = next((c.bounds_dtype for c in todo if c.label() == r["label"]), None)
            print(f"  w{w} {r['variant']:40s} B={r['budget']:5d} {100 * r['ppl_rel']:+7.2f}% "
                  f"top1={100 * r['top1']:.1f}% {time.time() - t0:.0f} s", flush=True)
            if r["label"] in done:  # full attention reruns as the reference of every call
                return
            rows.append(r)
            with open(a.out, "w") as f:
                json.dump(rows, f, indent=1)

        perplexity(a.ctx, todo, steps=a.steps, half=a.half, offset=off, quiet=True, on_row=keep)
        print(f"window {w} (offset {off}) done: {len(todo)} configurations, {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
