"""Held-out perplexity at 4K and 8K as run for the README (a reduced grid of the full ``accuracy`` run:
budgets 512/1024/2048 for the bound series, 512/2048 for oracle and streaming)."""
from __future__ import annotations

import dataclasses
import json
import os

from bench.accuracy import perplexity
from bench.harness import Sparse, default_sparse
from bench.output import write_rows

if __name__ == "__main__":
    d = default_sparse()
    path = os.path.join("results", "accuracy_ppl.json")
    rows = [r for r in json.load(open(path)) if r["ctx"] == 2048 and r["series"] != "h2o"] if os.path.exists(path) else []
    for ctx in (8192, 4096):
        series = {}
        for b in (512, 1024, 2048):
            series[dataclasses.replace(d, token_budget=b)] = "query_aware (defaults)"
            series[Sparse(token_budget=b, page_size=16, dense_layers=2)] = "query_aware (paper: no sink, one stage)"
        for b in (512, 2048):
            series[dataclasses.replace(d, policy="oracle", token_budget=b)] = "oracle"
            series[dataclasses.replace(d, policy="streaming", token_budget=b)] = "streaming"
        collect = [c for c, s in series.items() if s.startswith("query_aware")]
        for r in perplexity(ctx, list(series), steps=128, half="heldout", collect=collect):
            r["series"] = next((s for c, s in series.items() if c.label() == r["label"]), "full")
            rows.append(r)
        write_rows(rows, path)
