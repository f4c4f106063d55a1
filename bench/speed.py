"""Decode speed: ms/token vs context for eager, stock ``torch.compile`` (inductor) and the tinyserve
backend at several budgets; compile time; the attention op alone vs SDPA (via ``bench/bench_op.py``).

Up to 8K the model is SmolLM2-135M-Instruct; beyond, a random-init Llama with the same shape and
``max_position_embeddings`` raised (SmolLM2 is trained to 8K). Decode time does not depend on what the
cache holds, so the static cache is filled with random keys/values to the context length instead of
running a prefill (a foreign write for the backend: it rebuilds its page bounds once, untimed).
"""
from __future__ import annotations

import copy
import functools
import statistics
import time
from typing import List, Sequence

import torch

try:
    from .accuracy import _progress, load_model
except ImportError:
    from accuracy import _progress, load_model


def _model_for(ctx: int):
    model, _ = load_model()
    if ctx <= model.config.max_position_embeddings:
        return model, "smollm2"
    return _long_model(model)


@functools.lru_cache(maxsize=1)
def _long_model(model):
    from transformers import LlamaForCausalLM

    cfg = copy.deepcopy(model.config)
    cfg.max_position_embeddings = 65536
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).eval()
    return m, "random-init llama (SmolLM2 shape)"


def _filled_cache(model, ctx: int, extra: int):
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=ctx + extra)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1]]), cache=cache, use_cache=True)  # allocates the layers
    g = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        layer.keys[:, :, :ctx].copy_(torch.randn(layer.keys[:, :, :ctx].shape, generator=g))
        layer.values[:, :, :ctx].copy_(torch.randn(layer.values[:, :, :ctx].shape, generator=g))
        layer.cumulative_length.fill_(ctx)
    return cache


def _decode_timing(fn, model, ctx: int, steps: int, warmup: int):
    cache = _filled_cache(model, ctx, steps + warmup + 1)
    times, pos, first_s = [], ctx, None
    with torch.no_grad():
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            fn(input_ids=torch.tensor([[100 + i]]), position_ids=torch.tensor([[pos]]), cache=cache, use_cache=True)
            dt = time.perf_counter() - t0
            pos += 1
            if i == 0:
                first_s = dt
            if i >= warmup:
                times.append(dt)
    return statistics.median(times) * 1e3, first_s


def decode_speed(contexts: Sequence[int] = (1024, 2048, 4096, 8192, 16384, 32768),
                 budgets: Sequence[int] = (512, 1024, 2048), steps: int = 8, warmup: int = 2,
                 providers: Sequence[str] = ("eager", "inductor", "tinyserve"), quiet: bool = False) -> List[dict]:
    """Median ms per decode token. One ``torch.compile(dynamic=False)`` per provider and model: every
    context gets its own static-shape graph, compiled on its first call (``compile_s`` = first call
    minus a steady-state step). Reusing one graph with dynamic shapes across contexts measured
    5x slower compiled decode at 32K, for stock inductor and tinyserve alike."""
    runs = [(p, None) for p in ("eager", "inductor") if p in providers]
    runs += [("tinyserve", b) for b in budgets] if "tinyserve" in providers else []
    rows = []
    for prov, b in _progress(runs, "decode speed", quiet=quiet):
        name = prov if b is None else f"tinyserve B{b}"
        compiled = {}
        for ctx in contexts:
            model, which = _model_for(ctx)
            key = id(model)
            if key not in compiled:
                torch._dynamo.reset()
                if prov == "eager":
                    compiled[key] = model
                elif prov == "inductor":
                    compiled[key] = torch.compile(model, backend="inductor", dynamic=False)
                else:
                    compiled[key] = torch.compile(model, backend="tinyserve", options={"token_budget": b},
                                                  dynamic=False)
            try:
                ms, first_s = _decode_timing(compiled[key], model, ctx, steps, warmup)
                rows.append(dict(provider=name, ctx=ctx, model=which, ms_per_token=ms, first_call_s=first_s,
                                 compile_s=max(first_s - ms / 1e3, 0.0) if prov != "eager" else 0.0,
                                 steps=steps))
            except Exception as e:  # report, don't hide: the row says what failed
                rows.append(dict(provider=name, ctx=ctx, error=f"{type(e).__name__}: {str(e)[:300]}"))
    torch._dynamo.reset()
    return rows


def op_speed(contexts: Sequence[int] = (16384, 65536), reps: int = 30, configs=None) -> List[dict]:
    """The op alone vs SDPA through ``bench/bench_op.py``'s ``bench_one`` (default selection knobs),
    plus the selection variants timed the same way here."""
    import statistics as st

    import torch.nn.functional as F

    from tinyserve_compile.kernels import allocate_bounds, rebuild_bounds_

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
                return op(q, k, v, *bounds, vl, None, 0.125, S, 2048, c["sink_pages"], c["candidate_factor"], "torch")

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
