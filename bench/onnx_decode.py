"""Decode ms/token: eager HF, inductor, tinyserve, and ONNX Runtime (CPU) on a dense and on a tinyserve export.

Five providers per context, timed side by side in interleaved rounds (every
provider runs ``steps`` decode steps per round), so machine noise hits them
alike; the table quotes medians and ratios from the same run:

* ``eager (HF SDPA)``, ``torch.compile (inductor)``, ``tinyserve B<budget>``: the
  model in PyTorch over a static cache;
* ``ONNX Runtime CPU, dense export``: ``export_onnx(..., options={"policy": "full"})``,
  the stock decode step (every layer SDPA);
* ``ONNX Runtime CPU, tinyserve export B<budget>``: ``export_onnx`` with the backend's
  options.

Both ONNX files run in ONNX Runtime's CPU provider with their caches and bounds
updated in place (``OrtDecoder``). These rows are ONNX Runtime on this CPU, not
TensorRT: ``bench/trt_build.sh`` builds TensorRT engines from the same two files
where TensorRT exists.

Up to 8K the model is SmolLM2-135M-Instruct, beyond that a random-init Llama of
the same shape. The caches hold random keys/values up to the context (decode cost
does not depend on what they hold); the ONNX state gets its page bounds from
``decode_state``. Bytes per step: the weights plus the K/V state the attention
reads (``tinyserve_compile.cost``), next to the read bandwidth measured in the run.

Exports are cached in ``--export-dir`` (one file per model, context and options). ``--profile DIR``
turns on ONNX Runtime's profiler for every ONNX session and writes its JSON traces under ``DIR`` (off by
default: a trace of one run takes tens of MB).

Usage::

    python -m bench onnx --out results/onnx/onnx.json              # 2K, 8K, 32K
    python -m bench onnx --quick --label contended --out results/onnx_quick/onnx.json
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from typing import Optional

import torch

from bench import cli
from bench.harness import set_cache_length
from bench.decode import model_for, read_bandwidth_gbs, weight_bytes
from bench.output import write_rows
from tinyserve_compile.config import TinyServeConfig
from tinyserve_compile.cost import kv_bytes_per_token

EAGER, INDUCTOR = "eager (HF SDPA)", "torch.compile (inductor)"
ORT_DENSE = "ONNX Runtime CPU, dense export"
STOCK = (EAGER, INDUCTOR, ORT_DENSE)


def _names(budget: int):
    return f"tinyserve B{budget}", f"ONNX Runtime CPU, tinyserve export B{budget}"


def _export(model, which: str, L: int, options, export_dir: str, batch: int = 1):
    """Export (or reuse) the decode step of ``model`` at cache length ``L``: (path, seconds or None if cached)."""
    from tinyserve_compile.onnx.export import export_onnx

    import tinyserve_compile.onnx.export as ex
    import tinyserve_compile.onnx.translate as tr

    code = "".join(open(m.__file__).read() for m in (ex, tr))  # a changed lowering invalidates the cache
    key = json.dumps([which, L, sorted(options.items()), batch, "inplace", hashlib.sha1(code.encode()).hexdigest()])
    path = os.path.join(export_dir, f"step_{hashlib.sha1(key.encode()).hexdigest()[:12]}.onnx")
    if os.path.exists(path) and os.path.exists(path + ".json"):
        return path, None
    # ONNX Runtime writes int8 bounds in place; the TensorRT-parsable form re-quantizes every page each step
    info = export_onnx(model, path, max_cache_len=L, options=options, batch_size=batch, int8_write="inplace")
    with open(path + ".json", "w") as f:
        f.write(info.to_json())
    return path, info.export_seconds


def _filled_cache(model, ctx: int, length: int, seed: int = 0):
    """A static cache of ``length`` slots whose first ``ctx`` hold seeded random keys/values."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=length)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1]]), cache=cache, use_cache=True)  # allocates the layers
    g = torch.Generator().manual_seed(seed)
    for layer in cache.layers:
        for buf in (layer.keys, layer.values):
            buf.zero_()
            buf[:, :, :ctx].copy_(torch.randn(buf[:, :, :ctx].shape, generator=g))
        set_cache_length(layer, ctx)  # the next write goes to slot ctx
    return cache


def _profiled(dec, prefix: str):
    """``dec`` (an ``OrtDecoder``) with its session rebuilt under ONNX Runtime's profiler, which writes
    ``<prefix>_<date>.json`` when :meth:`end_profiling` of the session is called."""
    import onnxruntime as ort

    old = dec.session
    so = ort.SessionOptions()
    so.intra_op_num_threads = old.get_session_options().intra_op_num_threads
    so.log_severity_level = 3
    so.enable_profiling = True
    so.profile_file_prefix = prefix
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    dec.session = ort.InferenceSession(dec.path, so, providers=old.get_providers())
    return dec


def run_context(ctx: int, budget: int, steps: int, rounds: int, warmup: int, export_dir: str, threads,
                kind: str = "auto", only=None, profile_dir: Optional[str] = None):
    from tinyserve_compile.onnx.export import decode_state
    from tinyserve_compile.onnx.runtime import OrtDecoder

    model, which = model_for(kind, ctx, torch.float32, torch.device("cpu"))
    S = TinyServeConfig().page_size
    total = warmup + steps * rounds + 1
    L = -(-(ctx + total) // S) * S  # room for every timed step, whole pages
    ts_name, ort_ts_name = _names(budget)
    # the defaults' extra candidates (1024 at budget 2048) scale with the budget, so that a small budget on a short
    # context stays two-stage (a row of at most max(K, N1) pages attends densely)
    d = TinyServeConfig()
    sparse_opts = {"token_budget": budget, "candidate_extra": d.candidate_extra * budget // d.token_budget}
    dense_opts = {"policy": "full"}
    paths, export_s = {}, {}
    for p, opts in ((ORT_DENSE, dense_opts), (ort_ts_name, sparse_opts)):
        if only is None or p in only:
            paths[p], export_s[p] = _export(model, which, L, opts, export_dir)
    providers = [p for p in (EAGER, INDUCTOR, ts_name, ORT_DENSE, ort_ts_name) if only is None or p in only]
    caches, fns, pos = {}, {}, {p: ctx for p in providers}
    source = _filled_cache(model, ctx, L)  # static cache of length L, random up to ctx
    for p in (EAGER, INDUCTOR, ts_name):
        if p in providers:
            caches[p] = source if not caches else _filled_cache(model, ctx, L)
    compiled = {EAGER: lambda: model, INDUCTOR: lambda: torch.compile(model, backend="inductor", dynamic=False),
                ts_name: lambda: torch.compile(model, backend="tinyserve", options=sparse_opts, dynamic=False)}
    for p in caches:
        fns[p] = compiled[p]()
    for p, opts in ((ORT_DENSE, dense_opts), (ort_ts_name, sparse_opts)):
        if p in providers:
            dec = OrtDecoder(paths[p], threads=threads)
            if profile_dir:
                tag = "ort_dense" if p == ORT_DENSE else "ort_tinyserve"
                dec = _profiled(dec, os.path.join(profile_dir, f"onnxruntime_profile_{tag}_{ctx}"))
            dec.load_state(decode_state(source, options=opts))  # a copy of the same random cache, before any step
            fns[p] = dec

    def step(p, i):
        tok = torch.tensor([[(100 + i % 50) % model.config.vocab_size]])
        if p in (ORT_DENSE, ort_ts_name):
            fns[p].step(tok, torch.tensor([pos[p]]))
        else:
            fns[p](input_ids=tok, position_ids=torch.tensor([[pos[p]]]), cache=caches[p], use_cache=True)
        pos[p] += 1

    warm_s, times = {}, {p: [] for p in providers}
    with torch.no_grad():
        for p in providers:  # compile / session warm-up
            t0 = time.perf_counter()
            for i in range(warmup):
                step(p, i)
            warm_s[p] = time.perf_counter() - t0
        for r in range(rounds):
            for p in providers:
                for i in range(steps):
                    t0 = time.perf_counter()
                    step(p, i)
                    times[p].append(time.perf_counter() - t0)
    torch._dynamo.reset()
    profiles = {p: fns[p].session.end_profiling() for p in (ORT_DENSE, ort_ts_name) if p in fns and profile_dir}
    cfg = TinyServeConfig.from_options(sparse_opts)
    weights = weight_bytes(model)
    rows = []
    for p in providers:
        kv = kv_bytes_per_token(model.config, ctx, cfg if p in (ts_name, ort_ts_name) else None)
        rows.append(dict(provider=p, context=ctx, model=which, budget=budget, ms_per_token=statistics.median(times[p]) * 1e3,
                         steps=len(times[p]), warmup_s=warm_s[p], export_s=export_s.get(p),
                         kv_bytes_per_token=kv, weight_bytes=weights, bytes_per_step=kv + weights))
        if p in profiles:
            rows[-1]["profile"] = profiles[p]
    return rows


def main(argv=None):
    ap = cli.parser("onnx", __doc__.split("\n")[0], quick="2K and 8K, 4 steps x 2 rounds")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per provider per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--label", default="", help="e.g. 'contended' when other jobs share the machine")
    ap.add_argument("--model", default="auto", help="auto (SmolLM2 to 8K, then random-init Llama of its shape), "
                    "smollm2, random, tiny")
    ap.add_argument("--providers", nargs="+", default=None,
                    help="a subset: eager inductor tinyserve ort-dense ort-tinyserve (default: all)")
    ap.add_argument("--export-dir", default="results/onnx_exports", help="exported files are cached here")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="ONNX Runtime's profiler on, traces written under DIR (e.g. results/onnx_profile)")
    a = cli.parse(ap, argv, compare="onnx exports the backend's defaults with --budget: a second tinyserve "
                  "export is not implemented")
    path = cli.out_path(a.out, "onnx")
    if a.quick:
        a.contexts, a.steps, a.rounds, a.warmup = [2048, 8192], 4, 2, 2
    os.makedirs(a.export_dir, exist_ok=True)
    load0 = os.getloadavg()
    bw = read_bandwidth_gbs(torch.device("cpu"))
    short = dict(zip(("eager", "inductor", "tinyserve", "ort-dense", "ort-tinyserve"),
                     (EAGER, INDUCTOR, *_names(a.budget)[:1], ORT_DENSE, _names(a.budget)[1])))
    only = None if a.providers is None else [short[p] for p in a.providers]
    rows = []
    for ctx in a.contexts:
        rows += run_context(ctx, a.budget, a.steps, a.rounds, a.warmup, a.export_dir, a.threads, a.model, only,
                            a.profile)
    load1 = os.getloadavg()
    ts_name, ort_ts_name = _names(a.budget)
    label = f" [{a.label}]" if a.label else ""
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}{label} {platform.machine()} {os.cpu_count()} cores, "
          f"{a.threads or torch.get_num_threads()} threads, torch {torch.__version__}, read bandwidth {bw:.1f} GB/s, "
          f"load average {load0[0]:.1f} -> {load1[0]:.1f}")
    print(f"{'context':>8} {'provider':>44} {'ms/token':>9} {'vs best stock':>13} {'vs ORT dense':>12} "
          f"{'KV MB':>8} {'MB/step':>8} {'GB/s':>6}")
    for ctx in a.contexts:
        rs = [r for r in rows if r["context"] == ctx]
        best = min((r["ms_per_token"] for r in rs if r["provider"] in STOCK), default=float("nan"))
        ort_dense = next((r["ms_per_token"] for r in rs if r["provider"] == ORT_DENSE), float("nan"))
        for r in rs:
            r.update(speedup_vs_best_stock=best / r["ms_per_token"], speedup_vs_ort_dense=ort_dense / r["ms_per_token"],
                     effective_gbs=r["bytes_per_step"] / r["ms_per_token"] / 1e6, read_bandwidth_gbs=bw,
                     label=a.label, load_average=[load0[0], load1[0]])
            print(f"{ctx:>8} {r['provider']:>44} {r['ms_per_token']:>9.2f} {r['speedup_vs_best_stock']:>12.2f}x "
                  f"{r['speedup_vs_ort_dense']:>11.2f}x {r['kv_bytes_per_token'] / 1e6:>8.1f} "
                  f"{r['bytes_per_step'] / 1e6:>8.1f} {r['effective_gbs']:>6.1f}")
    if path:
        write_rows(rows, path)
        from bench.output import pyplot

        plt = pyplot()

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for p in dict.fromkeys(r["provider"] for r in rows):
            pts = [(r["context"], r["ms_per_token"]) for r in rows if r["provider"] == p]
            ax.plot(*zip(*pts), marker="o", label=p)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms / token")
        ax.set_title(f"decode latency, batch 1 (CPU){label}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.splitext(path)[0] + ".png", dpi=100)
    return rows


if __name__ == "__main__":
    main()
