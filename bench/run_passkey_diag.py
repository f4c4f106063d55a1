"""The passkey grid and the diagnostics as run for the README (one process, reduced depths at 8K)."""
from __future__ import annotations

import dataclasses
import os

from bench.accuracy import diagnostics, passkey
from bench.harness import default_sparse
from bench.output import write_rows

if __name__ == "__main__":
    d = default_sparse()
    rows = passkey(contexts=(1024, 2048, 4096), depths=(0.0, 0.25, 0.5, 0.75, 1.0), budgets=(256, 512, 1024, 2048),
                   policies=("query_aware", "streaming"), base=d)
    write_rows(rows, os.path.join("results", "passkey.json"))
    rows += passkey(contexts=(8192,), depths=(0.0, 0.5, 1.0), budgets=(256, 512, 1024, 2048),
                    policies=("query_aware", "streaming"), base=d)
    write_rows(rows, os.path.join("results", "passkey.json"))
    cfgs = [dataclasses.replace(d, policy=p, token_budget=512) for p in ("query_aware", "streaming", "oracle")]
    cfgs.append(dataclasses.replace(d, policy="query_aware", token_budget=512, page_size=16, sink_pages=0,
                                    candidate_factor=1))
    write_rows(diagnostics(ctx=4096, cfgs=cfgs, trials=2), os.path.join("results", "diagnostics.json"))
