"""Multi-user load on transformers' continuous batching (CB): stock CB (eager, compiled) against CB + tinyserve.

``python -m bench serve`` (or ``python bench/serve.py``) runs :func:`main`.

Workload (one seeded workload, replayed identically for every provider, in one run)
----------------------------------------------------------------------------------
* ``--requests`` requests arrive as a Poisson process of mean interval ``--interval`` seconds (the seed paper's
  workload uses 50 ms).
* Prompt lengths are drawn from ``--prompt-lens`` (default a mix up to SmolLM2's 8K context); every request asks
  for ``--new-tokens`` greedy tokens. SmolLM2 prompts are slices of the held-out Python documentation text, other
  models get seeded random ids.
* At most ``--users`` requests are in flight (N concurrent users): a request that arrives while N are running waits
  for a slot, and that wait counts in its time to first token.

Providers
---------
* ``stock-eager``: CB as shipped, attention ``sdpa`` (every decode step gathers every request's whole history);
* ``stock-compiled``: the same with ``ContinuousBatchingConfig(varlen_compile_config=CompileConfig(backend=
  "inductor", dynamic=True))``: the compile config transformers itself picks for the varlen path at
  ``default_compile_level=1`` (dynamic shapes, so that the growing KV length does not recompile; CB on CPU runs its
  varlen path, the block-table decode path is CUDA-only);
* ``tinyserve``: ``tinyserve_compile.enable_continuous_batching(model, options)``: each decode row attends to the
  tokens its own pages' bounds select (see :mod:`tinyserve_compile.continuous_batching`);
* ``tinyserve-compiled``: the same with the compiled varlen path (the rest of the model through Inductor; the paged
  attention and the cache write run eagerly between graphs, as CB's own cache update does).

Figures (per provider)
----------------------
requests/s and generated tokens/s over the run (first arrival to last token); time to first token (from arrival)
and inter-token latency (between consecutive tokens of a request, from CB's own token timestamps) at P50 and P99;
KV bytes per decode step. For the tinyserve providers the bytes are counted by the paged attention (keys, values
and page bounds it reads, per layer call, summed over a step); ``dense_kv_bytes_per_step`` is what a dense read of
the same rows would be, which is what stock CB's ``index_select`` gather reads each step (it also writes a copy of
it). ``stream_gbps`` is the read bandwidth measured in the same run; ``kv_floor_ms`` = bytes per step over it.

Differences from the seed paper's table: CPU (2 cores) instead of a GPU, one small model (SmolLM2-135M), tens of
requests rather than 512-2048, and the baselines are transformers' CB, not vLLM, TGI or TensorRT-LLM.

A provider still running after ``--timeout`` seconds of the timed run is stopped and keeps a row marked
``timed_out``: its ``requests`` are those finished, its ``requests_per_s`` and ``tokens_per_s`` are upper bounds
(every request, or every token, over the time it ran: the real figures are lower), and its latencies come from the
tokens generated before the stop (requests are streamed, so unfinished ones count too). A ratio against such a row is a lower bound.

``--compare '{"option": value}'`` adds, after each tinyserve provider, the same provider with those options over
``--options`` (named ``<provider> <preset>``, or ``<provider> compare``).

Outputs: a table on stdout, ``<out>/serve.json`` and ``.csv``, ``<out>/serve.png``; a progress bar on stderr.

Usage::

    python -m bench serve --quick                        # tiny random model, a few requests, a minute or two
    python -m bench serve --providers stock-eager,stock-compiled,tinyserve --prompt-lens 2048 --users 8 \
        --requests 8 --new-tokens 32                   # about 10 minutes on 2 cores (docs/serving.md)
    python -m bench serve --providers stock-eager,stock-compiled,tinyserve --prompt-lens 8000 --users 8 \
        --requests 8 --new-tokens 16 --warmup 1        # about 25-30 minutes on 2 cores
"""
from __future__ import annotations

import csv
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from bench import cli

PROVIDERS = ("stock-eager", "stock-compiled", "tinyserve", "tinyserve-compiled")
#: CB page size: a multiple of tinyserve's default page size (8)
CB_PAGE = 64
#: seconds a provider's generation thread may take to finish its step in flight once stopped (a recompile takes minutes)
STOP_WAIT_S = 600
TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)


@dataclass
class Request:
    index: int
    arrival: float  # seconds after the start of the run
    prompt: List[int]


def load_model(kind: str):
    """``(model, name)``: SmolLM2-135M-Instruct (offline wheel) or a tiny random-init Llama."""
    if kind == "smollm2":
        from tinyserve_compile.smollm2 import load_smollm2

        return load_smollm2()[0], "SmolLM2-135M-Instruct"
    if kind == "tiny":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(**TINY_SHAPE)
        return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval(), "tiny random llama"
    raise ValueError(f"argument '--model' must be smollm2 or tiny, got {kind!r}")


def _text_ids(kind: str, vocab: int, n: int) -> torch.Tensor:
    if kind == "smollm2":
        from bench.accuracy import topic_text
        from tinyserve_compile.smollm2 import load_smollm2

        ids = load_smollm2()[1](topic_text("heldout"), return_tensors="pt").input_ids[0]
        while ids.numel() < n:
            ids = torch.cat([ids, ids])
        return ids
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1))


def workload(kind: str, vocab: int, n_requests: int, prompt_lens: Sequence[int], interval: float,
             seed: int = 0) -> List[Request]:
    """Seeded Poisson arrivals and prompts of the given lengths (each a slice of one long token stream)."""
    g = torch.Generator().manual_seed(seed)
    text = _text_ids(kind, vocab, max(prompt_lens) * 2)
    gaps = torch.empty(n_requests).exponential_(1.0 / interval, generator=g) if interval > 0 else \
        torch.zeros(n_requests)
    arrivals = torch.cumsum(gaps, 0) - gaps[0]
    out = []
    for i in range(n_requests):
        L = int(prompt_lens[int(torch.randint(len(prompt_lens), (1,), generator=g))])
        start = int(torch.randint(0, text.numel() - L + 1, (1,), generator=g))
        out.append(Request(i, float(arrivals[i]), text[start:start + L].tolist()))
    return out


def _pct(xs: List[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))
    return xs[k]


def _configs(provider: str, args, max_len: int):
    from transformers import CompileConfig, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = dict(page_size=CB_PAGE, max_batch_tokens=args.max_batch_tokens, max_requests_per_batch=args.users,
              num_blocks=args.users * (-(-max_len // CB_PAGE) + 1) + 4, use_async_batching=False,
              allow_block_sharing=False)
    if provider.split(" ")[0].endswith("compiled"):
        # transformers' own default for the varlen path (default_compile_level=1): dynamic shapes, no fullgraph
        cb.update(varlen_compile_config=CompileConfig(backend="inductor", mode=None, fullgraph=False, dynamic=True),
                  q_padding_interval_size=args.q_pad, kv_padding_interval_size=args.kv_pad)
    return gen, ContinuousBatchingConfig(**cb)


def run_provider(model, provider: str, requests: List[Request], args, progress=None,
                 options: Optional[dict] = None) -> dict:
    """Replay ``requests`` through one CB manager; returns the provider's figures. ``options``: the tinyserve
    providers' (default ``args.options``)."""
    import tinyserve_compile as tc

    max_len = max(len(r.prompt) for r in requests) + args.new_tokens
    gen, cb = _configs(provider, args, max_len)
    sparse = provider.startswith("tinyserve")
    if sparse:
        tc.enable_continuous_batching(model, dict(args.options if options is None else options))
    torch._dynamo.reset()
    tc.reset()
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    try:
        # ---- warm-up: `--warmup` requests of every prompt length (compiles the shapes the run meets)
        t0 = time.perf_counter()
        lens = sorted({len(r.prompt) for r in requests})
        warm = [manager.add_request(r.prompt, request_id=f"warm{i}", max_new_tokens=4)
                for i, r in enumerate(next(r for r in requests if len(r.prompt) == n) for n in lens
                                      for _ in range(args.warmup))]
        _drain(manager, set(warm), time.perf_counter() + args.timeout)
        warmup_s = time.perf_counter() - t0
        tc.reset()
        # ---- the timed run: arrivals on schedule, at most `users` in flight
        start = time.perf_counter()
        pending = list(requests)
        inflight: Dict[str, tuple] = {}
        done: Dict[int, dict] = {}
        latest: Dict[str, object] = {}  # request id -> its latest streamed output
        deadline = start + args.timeout
        timed_out = False
        while pending or inflight:
            now = time.perf_counter() - start
            while pending and len(inflight) < args.users and pending[0].arrival <= now:
                r = pending.pop(0)
                # streamed, so that a request still running at a timeout has its tokens' timestamps so far
                rid = manager.add_request(r.prompt, request_id=f"r{r.index}", max_new_tokens=args.new_tokens,
                                          record_timestamps=True, streaming=True)
                inflight[rid] = (r, start + r.arrival)
            res = manager.get_result(timeout=0.01)
            if res is not None and res.request_id in inflight:
                if res.error is not None:
                    raise RuntimeError(f"{provider}: request {res.request_id} failed: {res.error}")
                latest[res.request_id] = res
                if res.is_finished():
                    r, arrived = inflight.pop(res.request_id)
                    done[r.index] = _figures(res, arrived)
                    if progress is not None:
                        progress.update(1)
            if time.perf_counter() > deadline:
                timed_out = True
                break
        # latencies of the requests a timeout stopped: from the tokens they had streamed
        running = [_figures(latest[rid], arrived) for rid, (r, arrived) in inflight.items() if rid in latest]
        # a timed-out run: every request (token) over the time it ran bounds its throughput from above
        wall = time.perf_counter() - start if timed_out else max(d["end"] for d in done.values()) - start
    finally:
        # a hard stop (a flushing stop would finish a timed-out run's requests first), waiting for the step in flight:
        # the next provider must not share the model with a running generation thread
        manager.stop(block=True, timeout=STOP_WAIT_S, hard_stop=True)
        if manager.is_running():
            raise RuntimeError(f"{provider}: the generation thread did not stop within {STOP_WAIT_S} s")
        model.destroy_cached_continuous_batching_manager()
        if sparse:
            tc.disable_continuous_batching(model)
    c = dict(tc.counters)
    n_tok = sum(len(d["tokens"]) for d in done.values())
    itl = [x for d in list(done.values()) + (running if timed_out else []) for x in d["itl"]]
    ttft = [d["ttft"] for d in list(done.values()) + (running if timed_out else [])]
    steps = c.get("cb_steps", 0)
    if timed_out:
        print(f"{provider}: {len(done)} of {len(requests)} requests done after {args.timeout} s; its throughput "
              f"is given as an upper bound", file=sys.stderr)
    n_req = len(requests) if timed_out else len(done)
    n_tok = len(requests) * args.new_tokens if timed_out else n_tok
    row = dict(provider=provider, requests=len(done), timed_out=timed_out, wall_s=wall, warmup_s=warmup_s,
               requests_per_s=n_req / wall, tokens_per_s=n_tok / wall,
               ttft_p50_s=_pct(ttft, 50), ttft_p99_s=_pct(ttft, 99), itl_p50_ms=_pct(itl, 50) * 1e3,
               itl_p99_ms=_pct(itl, 99) * 1e3,
               kv_bytes_per_step=c["cb_kv_bytes"] / steps if sparse and steps else float("nan"),
               dense_kv_bytes_per_step=c["cb_dense_kv_bytes"] / steps if sparse and steps else float("nan"),
               sparse_rows=c.get("cb_sparse_rows", 0), steps=steps)
    row["_tokens"] = {i: d["tokens"] for i, d in done.items()}
    return row


def _figures(res, arrived: float) -> dict:
    """Time to first token, inter-token latencies (s), last token time and tokens of one (streamed) output."""
    ts = list(res.timestamps or [])
    return dict(ttft=ts[0] - arrived if ts else float("nan"), itl=[b - a for a, b in zip(ts, ts[1:])],
                end=ts[-1] if ts else arrived, tokens=list(res.generated_tokens))


def _drain(manager, ids, deadline):
    left = set(ids)
    while left:
        r = manager.get_result(timeout=0.1)
        if r is not None and r.is_finished():
            if r.error is not None:
                raise RuntimeError(f"warm-up request {r.request_id} failed: {r.error}")
            left.discard(r.request_id)
        if time.perf_counter() > deadline:
            raise TimeoutError(f"warm-up: {len(left)} requests left")


def table(rows: List[dict], stream_gbps: float) -> str:
    stock = [r for r in rows if r["provider"].startswith("stock")]
    best = max(stock, key=lambda r: r["tokens_per_s"]) if stock else None
    head = ("| provider | req/s | tok/s | x best stock | TTFT P50 s | TTFT P99 s | ITL P50 ms | ITL P99 ms | "
            "KV MB/step | dense KV MB/step | KV floor ms | same tokens as stock |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ratio = r["tokens_per_s"] / best["tokens_per_s"] if best else float("nan")
        kv = r["kv_bytes_per_step"]
        le = "<=" if r.get("timed_out") else ""  # a timed-out row's throughput is an upper bound
        ge = ">=" if best is not None and best.get("timed_out") and r is not best else ""
        lines.append(f"| {r['provider']}{' (timed out)' if le else ''} | {le}{r['requests_per_s']:.3f} | "
                     f"{le}{r['tokens_per_s']:.1f} | {ge}{ratio:.2f} | "
                     f"{r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['itl_p50_ms']:.0f} | {r['itl_p99_ms']:.0f} | "
                     f"{kv / 1e6:.1f} | {r['dense_kv_bytes_per_step'] / 1e6:.1f} | "
                     f"{kv / (stream_gbps * 1e9) * 1e3:.2f} | {r.get('same_tokens_as_stock')}/{r['requests']} |")
    lines.append(f"\nread bandwidth measured in this run: {stream_gbps:.1f} GB/s. KV bytes per step: counted by the "
                 f"paged attention of the tinyserve providers; the stock rows show a dense read of the tinyserve "
                 f"run's steps, which is what stock CB's gather reads (it also writes a copy)")
    return "\n".join(lines)


def plot(rows: List[dict], path: str) -> None:
    from bench.output import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    names = [r["provider"] for r in rows]
    ax[0].bar(names, [r["tokens_per_s"] for r in rows])
    ax[0].set_title("generated tokens/s")
    for k, (p50, p99, unit) in enumerate((("ttft_p50_s", "ttft_p99_s", "s"), ("itl_p50_ms", "itl_p99_ms", "ms"))):
        a = ax[k + 1]
        x = range(len(rows))
        a.bar([i - 0.2 for i in x], [r[p50] for r in rows], width=0.4, label="P50")
        a.bar([i + 0.2 for i in x], [r[p99] for r in rows], width=0.4, label="P99")
        a.set_xticks(list(x), names)
        a.set_title(("time to first token" if k == 0 else "inter-token latency") + f" ({unit})")
        a.legend()
    for a in ax:
        a.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(rows: List[dict], meta: dict, out: str) -> List[str]:
    path = cli.out_path(out, "serve")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    clean = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=clean), f, indent=1)
    with open(path[:-5] + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(clean[0]))
        w.writeheader()
        w.writerows(clean)
    plot(rows, path[:-5] + ".png")
    return [path, path[:-5] + ".csv", path[:-5] + ".png"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = cli.parser("serve", __doc__.split("\n")[0], out="results/serve", options=True,
                    quick="tiny model, 6 short requests: checks the pipeline")
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "tiny"))
    ap.add_argument("--providers", default=",".join(PROVIDERS), help=f"subset of {','.join(PROVIDERS)}")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--users", type=int, default=8, help="requests in flight at most (concurrent users)")
    ap.add_argument("--interval", type=float, default=0.05, help="mean Poisson arrival interval, seconds")
    ap.add_argument("--prompt-lens", default="1024,2048,4096,8000", help="prompt lengths drawn per request")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-batch-tokens", type=int, default=512, help="CB tokens per step (chunked prefill)")
    ap.add_argument("--q-pad", type=int, default=64, help="compiled providers: query padding interval")
    ap.add_argument("--kv-pad", type=int, default=4096, help="compiled providers: KV padding interval")
    ap.add_argument("--timeout", type=float, default=7200,
                    help="seconds per provider (warm-up, then the timed run) before it is stopped; a timed run that "
                         "overruns keeps a row with upper bounds on its throughput")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up requests per prompt length, per provider")
    a = cli.parse(ap, argv)
    if a.quick:
        a.model, a.requests, a.users, a.new_tokens = "tiny", 6, 3, 6
        a.prompt_lens, a.max_batch_tokens, a.q_pad, a.kv_pad = "40,120,300", 128, 32, 256
        if not a.options:
            a.options = {"token_budget": 64, "candidate_extra": 64}
    providers = [p for p in a.providers.split(",") if p]
    bad = [p for p in providers if p not in PROVIDERS]
    if bad:
        raise SystemExit(f"argument '--providers': unknown {bad}; choose from {PROVIDERS}")
    from tqdm import tqdm

    torch.set_grad_enabled(False)
    runs = [(p, None) for p in providers]  # (provider, its options: None for --options)
    if a.compare is not None:
        runs = [r for p in providers for r in [(p, None)] + ([(f"{p} {a.compare.name}", {**a.options, **a.compare})]
                                                            if p.startswith("tinyserve") else [])]
    model, name = load_model(a.model)
    prompt_lens = [int(x) for x in a.prompt_lens.split(",")]
    reqs = workload(a.model, model.config.vocab_size, a.requests, prompt_lens, a.interval)
    from bench.timing import read_bandwidth_gbs

    stream = read_bandwidth_gbs()
    rows = []
    with tqdm(total=len(reqs) * len(runs), desc="serve", unit="req", file=sys.stderr) as bar:
        for p, options in runs:
            bar.set_postfix_str(p)
            rows.append(run_provider(model, p, reqs, a, bar, options))
    dense = next((r["dense_kv_bytes_per_step"] for r in rows if r["provider"].startswith("tinyserve")), float("nan"))
    for r in rows:
        r["stream_gbps"] = stream
        if r["provider"].startswith("stock"):  # stock CB's gather reads every row densely
            r["kv_bytes_per_step"] = r["dense_kv_bytes_per_step"] = dense
        r["kv_floor_ms"] = r["kv_bytes_per_step"] / (stream * 1e9) * 1e3
    # tokens of the tinyserve providers against stock, request by request (equal when the budget covers them)
    ref = next((r["_tokens"] for r in rows if r["provider"].startswith("stock")), None)
    for r in rows:
        r["same_tokens_as_stock"] = None if ref is None else sum(r["_tokens"].get(i) == ref[i] for i in ref)
    print(f"# {name}, {a.requests} requests, {a.users} users, Poisson interval {a.interval} s, prompts "
          f"{prompt_lens}, {a.new_tokens} new tokens, options {json.dumps(a.options)}"
          + (f", compared with {json.dumps(a.compare)}" if a.compare is not None else ""))
    print(table(rows, stream))
    from tinyserve_compile.kernels.native import load_native

    meta = dict(model=name, native_paged_kernel=load_native(), warmup=a.warmup, requests=a.requests, users=a.users,
                interval=a.interval, prompt_lens=prompt_lens,
                new_tokens=a.new_tokens, options=dict(a.options), compare=a.compare, max_batch_tokens=a.max_batch_tokens,
                torch=torch.__version__, threads=torch.get_num_threads())
    for p in write_outputs(rows, meta, a.out):
        print(f"wrote {p}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
