"""``python -m bench {accuracy,speed,report} [--quick]`` - see bench/README in the project README section."""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time


def _write(rows, path):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path[:-5] + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path} (+ .csv)", file=sys.stderr)


def default_sparse(**kw):
    """The configuration the backend uses by default (tinyserve_compile.config DEFAULT_*)."""
    from tinyserve_compile import config as C

    from .harness import Sparse

    base = dict(policy=C.DEFAULT_POLICY, token_budget=C.DEFAULT_TOKEN_BUDGET, page_size=C.DEFAULT_PAGE_SIZE,
                dense_layers=C.DEFAULT_DENSE_LAYERS, sink_pages=C.DEFAULT_SINK_PAGES,
                candidate_factor=C.DEFAULT_CANDIDATE_FACTOR)
    base.update(kw)
    return Sparse(**base)


def cmd_accuracy(a):
    import dataclasses

    from .accuracy import diagnostics, passkey, perplexity
    from .harness import Sparse

    if a.quick:
        ctxs, budgets, steps = (1024, 2048), (256, 512), 32
        pk = dict(contexts=(1024, 2048), depths=(0.0, 0.5, 1.0), budgets=(256, 512))
        dg = dict(ctx=1024, trials=1)
        dg_budgets = (256,)
    else:
        ctxs, budgets, steps = (2048, 4096, 8192), (256, 512, 1024, 2048), 128
        pk = dict(contexts=(1024, 2048, 4096, 8192), depths=(0.0, 0.25, 0.5, 0.75, 1.0), budgets=(256, 512, 1024, 2048))
        dg = dict(ctx=4096, trials=4)
        dg_budgets = (512, 1024)
    d = default_sparse()
    series = {
        "query_aware (defaults)": lambda b: dataclasses.replace(d, token_budget=b),
        "query_aware (paper: no sink, one stage)": lambda b: Sparse(token_budget=b, page_size=16, dense_layers=2),
        "oracle": lambda b: dataclasses.replace(d, policy="oracle", token_budget=b),
        "streaming": lambda b: dataclasses.replace(d, policy="streaming", token_budget=b),
        # one stage: with candidate_factor > 1 the exact-mass refinement, not h2o, would pick the pages
        "h2o": lambda b: dataclasses.replace(d, policy="h2o", token_budget=b, candidate_factor=1),
    }
    t0 = time.time()
    if "ppl" in a.parts:
        rows = []
        for ctx in ctxs:
            cfgs, names, collect = [], {}, []
            for s, mk in series.items():
                for b in budgets:
                    c = mk(b)
                    if c.label() in names:  # defaults == paper: keep one series name per config
                        continue
                    cfgs.append(c)
                    names[c.label()] = s
                    if s.startswith("query_aware") or s == "oracle":
                        collect.append(c)
            for r in perplexity(ctx, cfgs, steps=steps, half=a.half, collect=collect):
                r["series"] = names.get(r["label"], "full")
                rows.append(r)
            _write(rows, os.path.join(a.out, "accuracy_ppl.json"))
    if "passkey" in a.parts:
        pol = ("query_aware", "streaming", "oracle") if not a.quick else ("query_aware", "streaming")
        _write(passkey(policies=pol, base=d, **pk), os.path.join(a.out, "passkey.json"))
    if "diagnostics" in a.parts:
        cfgs = [dataclasses.replace(d, policy=p, token_budget=b) for b in dg_budgets
                for p in ("query_aware", "streaming", "oracle")]
        _write(diagnostics(cfgs=cfgs, **dg), os.path.join(a.out, "diagnostics.json"))
    print(f"accuracy done in {time.time() - t0:.0f} s", file=sys.stderr)


def cmd_speed(a):
    """Decode (``bench/bench_decode.py``: eager, inductor and tinyserve in interleaved rounds, batch 1 and
    8, results/decode.{json,csv,png}) and the op alone (``bench.speed.op_speed``); both go to speed.json."""
    from .speed import op_speed

    rows = []
    if "decode" in a.parts:
        from . import bench_decode as bd

        ctxs = (2048,) if a.quick else (2048, 4096, 8192, 16384, 32768)
        if a.contexts:
            ctxs = tuple(int(x) for x in a.contexts.split(","))
        batches = tuple(int(x) for x in a.batches.split(","))
        budgets = tuple(int(x) for x in a.budgets.split(",")) if a.budgets else None
        providers = tuple(a.providers.split(",")) if a.providers else ("eager", "inductor", "tinyserve")
        steps, rounds, warmup = (4, 2, 2) if a.quick else (a.steps, a.rounds, 3)
        dec = bd.run(ctxs, batches, providers, json.loads(a.options), a.paper, budgets, steps, rounds, warmup,
                     log=lambda m: print(m, file=sys.stderr))
        print(bd.table(dec))
        for t in bd.targets(dec):
            print(f"# target {t['target']}: {t['value']:.2f} -> {'met' if t['met'] else 'MISSED'}")
        bd.write_outputs(dec, os.path.join(a.out, "decode.json"))
        # speed.json: report.py reads ``ctx``
        rows += [dict(kind="decode", ctx=r["context"], **r) for r in dec]
    if "op" in a.parts:
        from tinyserve_compile import config as C

        cfgs = [dict(page_size=C.DEFAULT_PAGE_SIZE, sink_pages=C.DEFAULT_SINK_PAGES,
                     candidate_factor=C.DEFAULT_CANDIDATE_FACTOR), dict(page_size=16, sink_pages=0, candidate_factor=1)]
        if not a.quick:
            cfgs += [dict(page_size=16, sink_pages=1, candidate_factor=c) for c in (2, 4)] + \
                [dict(page_size=8, sink_pages=1, candidate_factor=c) for c in (1, 2)]
        rows += [dict(kind="op", **r) for r in op_speed((16384,) if a.quick else (16384, 65536), configs=cfgs)]
    _write(rows, os.path.join(a.out, "speed.json"))


def cmd_report(a):
    from .report import report

    print(report(a.out, a.img))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("accuracy", "speed", "report"):
        p = sub.add_parser(name)
        p.add_argument("--out", default="results", help="results folder (JSON/CSV)")
        p.add_argument("--quick", action="store_true", help="small grid, a few minutes on 2 cores")
        if name == "accuracy":
            p.add_argument("--half", default="heldout", choices=("tune", "heldout"),
                           help="text for perplexity: tune = first half of the sorted topics, heldout = second")
            p.add_argument("--parts", default="ppl,passkey,diagnostics")
        if name == "speed":
            # decode: the runner of bench/bench_decode.py (python bench/bench_decode.py --help has every knob)
            p.add_argument("--parts", default="decode,op")
            p.add_argument("--contexts", default="", help="e.g. 2048,8192 (default: 2K..32K, quick: 2K)")
            p.add_argument("--batches", default="1,8", help="decode batch sizes (rows of different lengths)")
            p.add_argument("--budgets", default="", help="one tinyserve provider per budget, e.g. 512,2048")
            p.add_argument("--providers", default="", help="subset of eager,inductor,tinyserve")
            p.add_argument("--options", default="{}", help="tinyserve options as JSON")
            p.add_argument("--paper", action="store_true", help="also tinyserve with the paper's selection")
            p.add_argument("--steps", type=int, default=16, help="timed decode steps per provider and round")
            p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per point")
        if name == "report":
            p.add_argument("--img", default="docs/img", help="where the PNGs go")
    a = ap.parse_args(argv)
    {"accuracy": cmd_accuracy, "speed": cmd_speed, "report": cmd_report}[a.cmd](a)


if __name__ == "__main__":
    main()
