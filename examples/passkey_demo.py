"""SmolLM2 finds a passkey hidden in a long document: stock ``torch.compile`` vs ``backend="tinyserve"``.

The document is real English text (Python's ``pydoc_data.topics``) with one
sentence holding a 5-digit passkey at a chosen depth. The prompt is prefilled
once, eagerly, into a static cache; then each provider decodes greedily from a
copy of that cache:

* ``stock``: ``torch.compile(model)`` (Inductor), dense attention;
* ``tinyserve``: ``torch.compile(model, backend="tinyserve")``, paged sparse attention.

It prints both answers, decode tokens/s, and the K/V bytes read per token.

Usage::

    python examples/passkey_demo.py [--tokens 3000] [--depth 0.5] [--budget 2048]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def filler_text() -> str:
    """Long English text every Python ships: the pydoc topics, in sorted order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def build_prompt(tok, n_tokens: int, depth: float, passkey: int):
    """Chat prompt: a document of about ``n_tokens`` tokens with the passkey at ``depth``."""
    needle = f" IMPORTANT: the pass key is {passkey}. Remember it: the pass key is {passkey}. "
    words = filler_text().split(" ")
    body, n = [], 0
    for w in words:  # cut the text to about n_tokens tokens (4 chars per token is close for English)
        body.append(w)
        n += len(w) + 1
        if n > n_tokens * 4:
            break
    cut = int(len(body) * depth)
    doc = " ".join(body[:cut]) + needle + " ".join(body[cut:])
    messages = [{"role": "user", "content": f"Read this document.\n\n{doc}\n\nWhat is the pass key? "
                                            "Answer with the number only."}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt").input_ids
    return ids


@torch.no_grad()
def decode(model, step, cache, first_token: torch.Tensor, n_new: int, eos: int):
    """Greedy decode ``n_new`` tokens through ``step``; returns (tokens, seconds per token after warm-up)."""
    toks, times = [int(first_token)], []
    cur = first_token.reshape(1, 1)
    for i in range(n_new):
        t0 = time.perf_counter()
        out = step(input_ids=cur, cache=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
        cur = out.logits[:, -1:].argmax(-1)
        toks.append(int(cur))
        if toks[-1] == eos:
            break
    steady = times[2:] or times  # the first calls compile
    return toks, sum(steady) / len(steady)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=3000, help="document length in tokens (about)")
    ap.add_argument("--depth", type=float, default=0.5, help="where the passkey sits, 0..1")
    ap.add_argument("--budget", type=int, default=1024, help="tinyserve token budget per KV head")
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args(argv)

    import copy

    import tinyserve_compile as tc
    from tinyserve_compile.config import TinyServeConfig
    from tinyserve_compile.cost import kv_bytes_per_token
    from tinyserve_compile.smollm2 import load_smollm2
    from transformers import StaticCache

    torch.manual_seed(0)
    passkey = random.Random(a.seed).randint(10000, 99999)
    model, tok = load_smollm2()
    ids = build_prompt(tok, a.tokens, a.depth, passkey)
    ctx = ids.shape[1]
    print(f"SmolLM2-135M-Instruct, prompt of {ctx} tokens, passkey {passkey} at depth {a.depth:.0%}", flush=True)
    cache = StaticCache(config=model.config, max_cache_len=ctx + a.new_tokens + 16)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model(ids, cache=cache, use_cache=True)
    print(f"eager prefill: {time.perf_counter() - t0:.1f} s", flush=True)
    first = out.logits[:, -1].argmax(-1)
    eos = tok.eos_token_id
    options = {"token_budget": a.budget}
    cfg = TinyServeConfig.from_options(options)
    providers = {
        "stock torch.compile (inductor)": (torch.compile(model), False),
        f"tinyserve (budget {a.budget})": (torch.compile(model, backend="tinyserve", options=options), True),
    }
    rows = []
    for name, (step, sparse) in providers.items():
        tc.reset()
        torch._dynamo.reset()
        c = copy.deepcopy(cache)
        t0 = time.perf_counter()
        toks, spt = decode(model, step, c, first, a.new_tokens, eos)
        answer = tok.decode(toks, skip_special_tokens=True).strip()
        kvb = kv_bytes_per_token(model.config, ctx, cfg if sparse else None)
        rows.append((name, answer, 1.0 / spt, kvb, str(passkey) in answer))
        print(f"\n[{name}] answer: {answer!r}  (total {time.perf_counter() - t0:.0f} s incl. compile)", flush=True)
        if sparse:
            print(tc.explain())
    print(f"\n{'provider':<34} {'correct':>7} {'decode tok/s':>12} {'KV MB read/token':>17}  answer")
    for name, answer, tps, kvb, ok in rows:
        print(f"{name:<34} {str(ok):>7} {tps:>12.2f} {kvb / 1e6:>17.1f}  {answer}")
    return rows


if __name__ == "__main__":
    sys.exit(0 if all(r[4] for r in main()) else 1)
