"""Decode ms/token: eager vs stock ``torch.compile`` (inductor) vs ``backend="tinyserve"``, side by side.

Providers are compiled and warmed up first, then timed in interleaved rounds
(every provider runs ``steps`` decode steps per round) so that machine noise hits
them alike; the table quotes medians and ratios from the same run.

The static cache is filled with random keys/values up to the context (decode cost
does not depend on what it holds; see ``bench/speed.py``). Up to 8K the model is
SmolLM2-135M-Instruct, beyond that a random-init Llama of the same shape.

Usage::

    python bench/bench_decode.py --quick --json results/decode.json
    python bench/bench_decode.py --contexts 2048 8192 --budgets 2048 --json results/decode.json
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.speed import _filled_cache, _model_for  # noqa: E402
from tinyserve_compile.cost import kv_bytes_per_token  # noqa: E402


#: selection settings a provider name may carry: "tinyserve B2048" (the backend defaults) or
#: "tinyserve-paper B2048" (the paper's rule: pages of 16, the bound alone, no sink page)
PAPER = {"page_size": 16, "candidate_factor": 1, "sink_pages": 0}


def _options(name: str):
    """``options=`` of tinyserve provider ``name`` (None for the dense providers)."""
    if not name.startswith("tinyserve"):
        return None
    opts = {"token_budget": int(name.split("B")[-1])}
    if name.startswith("tinyserve-paper"):
        opts.update(PAPER)
    return opts


def _config(name: str):
    """The tinyserve config of provider ``name`` (None for the dense providers)."""
    from tinyserve_compile.config import TinyServeConfig

    opts = _options(name)
    return None if opts is None else TinyServeConfig.from_options(opts)


def _provider_fn(model, name: str):
    if name == "eager":
        return model
    if name == "inductor":
        return torch.compile(model, backend="inductor")
    return torch.compile(model, backend="tinyserve", options=_options(name))


def run_context(ctx: int, providers, steps: int, rounds: int, warmup: int):
    model, which = _model_for(ctx)
    total = warmup + steps * rounds + 1
    caches = {p: _filled_cache(model, ctx, total) for p in providers}
    fns, compile_s, pos = {}, {}, {p: ctx for p in providers}

    def step(p, i):
        fns[p](input_ids=torch.tensor([[100 + i % 50]]), position_ids=torch.tensor([[pos[p]]]), cache=caches[p],
               use_cache=True)
        pos[p] += 1

    with torch.no_grad():
        for p in providers:  # compile + warm up
            fns[p] = _provider_fn(model, p)
            t0 = time.perf_counter()
            for i in range(warmup):
                step(p, i)
            compile_s[p] = time.perf_counter() - t0
        times = {p: [] for p in providers}
        for r in range(rounds):
            for p in providers:
                for i in range(steps):
                    t0 = time.perf_counter()
                    step(p, i)
                    times[p].append(time.perf_counter() - t0)
    torch._dynamo.reset()
    rows = []
    for p in providers:
        rows.append(dict(provider=p, context=ctx, model=which, ms_per_token=statistics.median(times[p]) * 1e3,
                         warmup_s=compile_s[p], steps=len(times[p]),
                         kv_bytes_per_token=kv_bytes_per_token(model.config, ctx, _config(p))))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--budgets", type=int, nargs="+", default=[2048])
    ap.add_argument("--no-eager", action="store_true", help="skip the eager provider")
    ap.add_argument("--paper", action="store_true", help="also time the paper's selection (page 16, bound only)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per provider per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1K and 2K contexts, fewer steps")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    ap.add_argument("--json", help="write records here (a .csv and .png go next to it)")
    a = ap.parse_args(argv)
    if a.quick:
        a.contexts, a.steps, a.rounds, a.warmup = [1024, 2048], 4, 2, 2
    if a.threads:
        torch.set_num_threads(a.threads)
    providers = ([] if a.no_eager else ["eager"]) + ["inductor"] + [f"tinyserve B{b}" for b in a.budgets]
    providers += [f"tinyserve-paper B{b}" for b in a.budgets] if a.paper else []
    rows = []
    for ctx in a.contexts:
        rows += run_context(ctx, providers, a.steps, a.rounds, a.warmup)
    base = {r["context"]: r["ms_per_token"] for r in rows if r["provider"] == "inductor"}
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} {platform.machine()} {os.cpu_count()} cores, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'context':>8} {'provider':>22} {'ms/token':>9} {'tok/s':>7} {'vs inductor':>11} {'KV MB/token':>11}")
    for r in rows:
        r["speedup_vs_inductor"] = base[r["context"]] / r["ms_per_token"]
        print(f"{r['context']:>8} {r['provider']:>22} {r['ms_per_token']:>9.2f} {1e3 / r['ms_per_token']:>7.1f} "
              f"{r['speedup_vs_inductor']:>10.2f}x {r['kv_bytes_per_token'] / 1e6:>11.1f}")
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.splitext(a.json)[0] + ".csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for p in providers:
            pts = [(r["context"], r["ms_per_token"]) for r in rows if r["provider"] == p]
            ax.plot(*zip(*pts), marker="o", label=p)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms / token")
        ax.set_title("decode latency (CPU)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.splitext(a.json)[0] + ".png", dpi=100)
    return rows


if __name__ == "__main__":
    main()
