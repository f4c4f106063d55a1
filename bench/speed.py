"""The attention op alone vs SDPA (``python -m bench speed --parts op``).

Decode ms/token lives in ``bench/bench_decode.py`` (``python -m bench speed --parts decode`` calls
:func:`bench.bench_decode.run`): one interleaved runner for eager, inductor and tinyserve.
"""
from __future__ import annotations

import time
from typing import List, Sequence

import torch


def op_speed(contexts: Sequence[int] = (16384, 65536), reps: int = 30, configs=None) -> List[dict]:
    """The op alone vs SDPA through ``bench/bench_op.py``'s ``bench_one`` (default selection knobs),
    plus the selection variants timed the same way here."""
    import statistics as st

    import torch.nn.functional as F

    from tinyserve_compile.kernels import allocate_bounds, rebuild_bounds_
    from tinyserve_compile.kernels.spec import SelectionSpec

    configs = configs or [dict(page_size=16, sink_pages=0, candidate_factor=1)]
    rows = []
    for L in contexts:
        for c in configs:
            g = torch.Generator().manual_seed(0)
            q = torch.randn(1, 9, 1, 64, generator=g)
            k = torch.randn(1, 3, L, 64, generator=g)
            v = torch.randn(1, 3, L, 64, generator=g)
            S = c["page_size"]
            bounds = rebuild_bounds_(k, allocate_bounds(k, S), S)
            vl = torch.tensor([L])
            op = torch.ops.tinyserve.sparse_decode

            def dense():
                return F.scaled_dot_product_attention(q, k, v, scale=0.125, enable_gqa=True)

            def sparse():
                spec = SelectionSpec(S, 2048, c["sink_pages"], c["candidate_factor"], 0, False, torch.float32)
                return op(q, k, v, *bounds, vl, None, 0.125, spec.to_list(), "torch", None)

            for _ in range(3):
                dense(), sparse()
            td, ts = [], []
            for i in range(reps):
                for f, acc in ((dense, td), (sparse, ts)) if i % 2 == 0 else ((sparse, ts), (dense, td)):
                    t0 = time.perf_counter()
                    f()
                    acc.append(time.perf_counter() - t0)
            rows.append(dict(context=L, **c, budget=2048, dense_ms=st.median(td) * 1e3, sparse_ms=st.median(ts) * 1e3,
                             ratio=st.median(td) / st.median(ts)))
    return rows
