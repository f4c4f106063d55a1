"""SmolLM2 finds a passkey hidden in 8K tokens: stock ``torch.compile`` vs ``backend="tinyserve"``.

The document is real English text (Python's ``pydoc_data.topics``) with one
sentence holding a 5-digit key (a "secret number") at a chosen depth, filling
SmolLM2's 8K context. The prompt is prefilled once, eagerly and in chunks (with a progress
bar), into a static cache; then each provider decodes greedily from its own
copy of that cache:

* ``stock``: ``torch.compile(model)`` (Inductor), dense attention;
* ``tinyserve``: ``torch.compile(model, backend="tinyserve")``, paged sparse attention
  (the default options unless ``--budget`` is given).

Each provider first decodes ``--warmup`` steps (compilation happens there),
then ``--steps`` timed steps. The Dynamo frame and graph counters are read
before and after the timed steps, and the demo fails if anything was compiled
inside them. It prints both answers, whether they hold the passkey, steady-state
decode tokens/s, their ratio, and the K/V bytes each reads per token
(``tinyserve_compile.cost``).

``--busy`` adds timed windows per provider with a busy neighbour: a separate
process that spins one core (at nice ``--busy-nice``, 0 by default: it competes
as an equal) for at most ``--busy-seconds``. The native kernel schedules its
work by the machine's load by default (``at::parallel_for`` idle, its own pool
while the machine is oversubscribed); for tinyserve the demo also times each of
the two forced (``pool`` / ``omp``, by ``set_scheduling``), idle and busy, side
by side in the same run.
OpenMP's wait policy (Inductor's kernels and ATen run on OpenMP) is read once
at start-up: set ``OMP_WAIT_POLICY=passive`` in the environment to compare.

Usage::

    python examples/passkey_demo.py                      # what `make demo` runs
    python examples/passkey_demo.py --busy --json results/demo/busy.json
    OMP_WAIT_POLICY=passive python examples/passkey_demo.py --busy --json results/demo/busy_passive.json
    python examples/passkey_demo.py --tokens 2000 --steps 4 --warmup 2   # a quick check
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import random
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's bars; the demo prints its own progress
# OpenMP's threads spin 30000 times, not libgomp's 300000, before they sleep, unless the environment chose: what
# keeps decode fast beside busy neighbours at no measured idle cost (bench/omp_env.py, which python -m bench uses)
if not any(v in os.environ for v in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")):
    os.environ["GOMP_SPINCOUNT"] = "30000"

import torch  # noqa: E402

#: the neighbour: spins until its deadline (argv[1], seconds) or until it is stopped
_BUSY_LOOP = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


class BusyNeighbour:
    """A separate process that spins one core at nice level ``nice``, for at most ``seconds``.

    Use as a context manager; the process (this one's child) is stopped by its pid on exit.
    """

    def __init__(self, seconds: float = 120.0, nice: int = 0):
        if seconds <= 0:
            raise ValueError(f"seconds: must be positive, got {seconds}")
        if nice < 0:
            raise ValueError(f"nice: must be >= 0 (raising priority needs privileges), got {nice}")
        self.seconds, self.nice, self.proc = seconds, nice, None

    def __enter__(self) -> "BusyNeighbour":
        nice = self.nice
        self.proc = subprocess.Popen([sys.executable, "-c", _BUSY_LOOP, str(self.seconds)],
                                     preexec_fn=(lambda: os.nice(nice)) if nice else None)
        time.sleep(0.2)  # let it start spinning
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


#: SmolLM2's trained context (max_position_embeddings)
CONTEXT = 8192


def filler_text() -> str:
    """Long English text every Python ships: the pydoc topics, in sorted order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


#: the start of the assistant's reply, part of the prompt: the model goes on with the number
ANSWER_PREFIX = "The secret number is"


def build_prompt(tok, n_tokens: int, depth: float, passkey: int) -> torch.Tensor:
    """Chat prompt of at most ``n_tokens`` tokens: a document with the passkey sentence at ``depth``.

    The key is called a "secret number": the document is Python's documentation, where "pass key" reads as
    Python's ``pass`` (SmolLM2-135M then answers with a string from the text at 4K-8K tokens). The user's
    message says that a secret number is hidden, gives the document, and asks for the number; the prompt
    ends with the start of the assistant's reply, :data:`ANSWER_PREFIX`.

    Parameters
    ----------
    tok : tokenizer
        Needs ``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`` and
        ``tok(text, return_tensors="pt").input_ids``.
    n_tokens : int
        Most tokens the prompt may have (the document is cut to fit, within a few percent).
    depth : float
        Where the passkey sentence sits in the document, 0 (start) .. 1 (end).
    passkey : int
        The number to hide.

    Returns
    -------
    torch.Tensor
        int64 ``[1, L]`` token ids, ``L <= n_tokens``.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth: must be in [0, 1], got {depth}")
    if n_tokens < 64:
        raise ValueError(f"n_tokens: need at least 64, got {n_tokens}")
    needle = f"\n\nThe secret number is {passkey}. Remember it: the secret number is {passkey}.\n\n"
    words = filler_text().split(" ")

    def prompt(n_chars: int) -> torch.Tensor:
        body, n = [], 0
        for w in words:
            if n + len(w) + 1 > n_chars:
                break
            body.append(w)
            n += len(w) + 1
        cut = int(len(body) * depth)
        doc = " ".join(body[:cut]) + needle + " ".join(body[cut:])
        messages = [{"role": "user", "content": "There is a secret number hidden in the document below. Find it "
                                                f"and remember it.\n\n{doc}\n\nWhat is the secret number? Answer "
                                                "with the number only."}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + ANSWER_PREFIX
        return tok(text, return_tensors="pt").input_ids

    n_chars = n_tokens * 4  # about 4 characters per token of English; corrected from the measured length
    for _ in range(8):
        ids = prompt(n_chars)
        if ids.shape[1] <= n_tokens and ids.shape[1] >= 0.97 * n_tokens:
            return ids
        n_chars = max(1, int(n_chars * (0.985 * n_tokens / ids.shape[1])))
    if ids.shape[1] > n_tokens:
        raise ValueError(f"n_tokens: cannot fit a prompt in {n_tokens} tokens")
    return ids


@torch.no_grad()
def prefill(model, ids: torch.Tensor, cache, chunk: int = 512, out=sys.stdout) -> torch.Tensor:
    """Eager prefill of ``ids`` (int64 ``[1, L]``) into the static ``cache``, in chunks, with a progress bar.

    The chunks go through a ``DynamicCache``, so that each attends only to the tokens before it (a static
    cache's attention spans its whole length, masked); the keys and values are then copied into ``cache``.

    Returns the logits of the last position, float ``[1, vocab]``.
    """
    from transformers import DynamicCache

    n = ids.shape[1]
    if n > cache.layers[0].max_cache_len:
        raise ValueError(f"ids: {n} tokens do not fit the cache's {cache.layers[0].max_cache_len}")
    dyn = DynamicCache(config=model.config)
    t0, logits = time.perf_counter(), None
    for s in range(0, n, chunk):
        logits = model(input_ids=ids[:, s: s + chunk], cache=dyn, use_cache=True, logits_to_keep=1).logits[:, -1]
        done = min(n, s + chunk)
        bar = "#" * (30 * done // n)
        print(f"\rprefill [{bar:<30}] {done}/{n} tokens  {time.perf_counter() - t0:5.1f} s", end="", file=out,
              flush=True)
    print(file=out, flush=True)
    for src, dst in zip(dyn.layers, cache.layers):  # [1, Hkv, n, D] into [1, Hkv, max_cache_len, D]
        if not dst.is_initialized:
            dst.lazy_initialization(src.keys, src.values)
        dst.keys[:, :, :n].copy_(src.keys)
        dst.values[:, :, :n].copy_(src.values)
        dst.cumulative_length.fill_(n)
    return logits


class CompileWatch:
    """Counts what Dynamo compiles: frames it converted (first compiles and recompiles) and graphs it produced.

    ``mark()`` takes a snapshot; ``since()`` returns how many frames and graphs were compiled after it.
    """

    def __init__(self):
        self._base = self._now()

    @staticmethod
    def _now() -> Dict[str, int]:
        from torch._dynamo.utils import counters

        return {"frames": int(sum(counters["frames"].values())),
                "graphs": int(counters["stats"]["unique_graphs"])}

    def mark(self) -> None:
        self._base = self._now()

    def since(self) -> Dict[str, int]:
        now = self._now()
        return {k: now[k] - self._base[k] for k in now}


@torch.no_grad()
def decode_steps(step: Callable, cache, cur: torch.Tensor, n: int) -> (List[int], List[float]):
    """``n`` greedy steps from token ``cur`` (int64 ``[1, 1]``); returns (tokens, seconds per step)."""
    toks, times = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        out = step(input_ids=cur, cache=cache, use_cache=True)
        cur = out.logits[:, -1:].argmax(-1)
        toks.append(int(cur))
        times.append(time.perf_counter() - t0)
    return toks, times


def _window(name: str, times: List[float], compiled: Dict[str, int]) -> dict:
    if compiled["frames"] or compiled["graphs"]:
        raise RuntimeError(f"{name}: Dynamo compiled {compiled['frames']} frame(s) and {compiled['graphs']} graph(s) "
                           f"inside the timed steps; raise --warmup")
    ts = sorted(times)
    return {"window": name, "steps": len(times), "tok_s": len(times) / sum(times),
            "median_ms": 1e3 * ts[len(ts) // 2], "max_ms": 1e3 * ts[-1]}


def _timed(step, cache, last: int, a, wname: str, sched: Optional[str], busy: bool, watch: CompileWatch):
    """One timed window from token ``last``: native scheduling ``sched`` (None: the default), a neighbour if ``busy``."""
    from tinyserve_compile.kernels.native import native_module

    native = native_module() if sched else None  # loaded by the warm-up's compiled steps
    old = native.set_scheduling(sched) if native is not None else None
    try:
        with BusyNeighbour(a.busy_seconds, a.busy_nice) if busy else contextlib.nullcontext():
            watch.mark()
            more, times = decode_steps(step, cache, torch.tensor([[last]]), a.steps)
            return more, _window(wname, times, watch.since())
    finally:
        if native is not None:
            native.set_scheduling(old)


def timed_windows(name: str, busy: bool) -> List[Tuple[str, Optional[str], bool]]:
    """The timed windows of provider ``name``, in order: ``(window name, native scheduling, busy neighbour)``.

    Parameters
    ----------
    name : str
        The provider's name; a ``tinyserve`` one also times its native kernel's two forced schedulings.
    busy : bool
        ``--busy``: add the busy-neighbour windows.

    Returns
    -------
    list of tuple
        One ``(window, sched, busy)`` per window; ``sched`` None is the kernel's default scheduling.
    """
    out = [("idle", None, False)]
    if busy:
        out.append(("busy", None, True))
        if name.startswith("tinyserve"):  # the native kernel's own pool against at::parallel_for, each forced
            out += [("idle, native kernel on its pool", "pool", False),
                    ("busy, native kernel on its pool", "pool", True),
                    ("idle, native kernel on at::parallel_for", "omp", False),
                    ("busy, native kernel on at::parallel_for", "omp", True)]
    return out


def decode_positions(names: List[str], a) -> int:
    """Cache slots the decode writes after the prompt: the warm-up and every timed window of the provider with
    the most windows (:func:`timed_windows`), each provider decoding from its own copy of the cache."""
    return a.warmup + a.steps * max(len(timed_windows(n, a.busy)) for n in names)


def run_provider(name: str, step: Callable, cache, first: torch.Tensor, a, eos: int, tok) -> dict:
    """Warm-up, timed idle window, and with ``a.busy`` the busy-neighbour windows of one compiled provider."""
    c = copy.deepcopy(cache)
    watch = CompileWatch()
    t0 = time.perf_counter()
    toks, _ = decode_steps(step, c, first.reshape(1, 1), a.warmup)  # compiles here
    compile_s = time.perf_counter() - t0
    windows = []
    for wname, sched, busy in timed_windows(name, a.busy):
        more, w = _timed(step, c, toks[-1], a, wname, sched, busy, watch)
        windows.append(w)
        toks += more
    if eos in toks:
        toks = toks[: toks.index(eos)]
    answer = (ANSWER_PREFIX + tok.decode([int(first)] + toks, skip_special_tokens=True)).strip()
    return {"provider": name, "answer": answer, "compile_s": compile_s, "windows": windows}


#: the stock provider's name; the sparse one's is :func:`provider_names`'s second
STOCK_NAME = "stock torch.compile (inductor)"


def provider_names(token_budget: int) -> List[str]:
    """The providers' names, in the order they run: stock, then tinyserve at ``token_budget``."""
    return [STOCK_NAME, f"tinyserve (budget {token_budget})"]


def cache_length(ctx: int, names: List[str], a) -> int:
    """Slots of the static cache: the prompt's ``ctx`` tokens, every position the decode of any provider in
    ``names`` writes (:func:`decode_positions`), and one spare."""
    return ctx + decode_positions(names, a) + 1


def parse_args(argv=None) -> Tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser (for its usage errors) and the parsed, checked arguments."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=None,
                    help=f"prompt length in tokens (default: fill the {CONTEXT}-token context)")
    ap.add_argument("--depth", type=float, default=0.5, help="where the passkey sits, 0..1")
    ap.add_argument("--budget", type=int, default=None,
                    help="tinyserve token budget per KV head (default: the backend's default)")
    ap.add_argument("--warmup", type=int, default=4, help="untimed decode steps first (compilation happens here)")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per window")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    ap.add_argument("--busy", action="store_true", help="also time decode with a busy neighbour process")
    ap.add_argument("--busy-nice", type=int, default=0, help="nice level of the busy neighbour (default 0)")
    ap.add_argument("--busy-seconds", type=float, default=300.0, help="the neighbour stops by itself after this")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads before compiling (Inductor's kernels keep the count they were "
                         "compiled with)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args(argv)
    if a.warmup < 2 or a.steps < 1:
        ap.error("--warmup needs >= 2 (the first steps compile), --steps >= 1")
    if a.threads is not None and a.threads < 1:
        ap.error(f"--threads: need >= 1, got {a.threads}")
    return ap, a


def main(argv=None) -> List[dict]:
    ap, a = parse_args(argv)
    import tinyserve_compile as tc
    from tinyserve_compile.config import TinyServeConfig
    from tinyserve_compile.cost import kv_bytes_per_token
    from tinyserve_compile.smollm2 import load_smollm2
    from transformers import StaticCache

    if a.threads is not None:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    passkey = random.Random(a.seed).randint(10000, 99999)
    t_start = time.perf_counter()
    print("loading SmolLM2-135M-Instruct (GGUF, dequantized to fp32) ...", flush=True)
    model, tok = load_smollm2()
    options = {} if a.budget is None else {"token_budget": a.budget}
    cfg = TinyServeConfig.from_options(options)
    names = provider_names(cfg.token_budget)
    n_steps = decode_positions(names, a)
    max_len = min(CONTEXT, model.config.max_position_embeddings)
    n_tokens = a.tokens or max_len - n_steps - 8
    if n_tokens + n_steps > max_len:
        ap.error(f"--tokens {n_tokens} + {n_steps} decode steps exceed SmolLM2's {max_len} positions")
    ids = build_prompt(tok, n_tokens, a.depth, passkey)
    ctx = ids.shape[1]
    print(f"SmolLM2-135M-Instruct, prompt of {ctx} tokens, passkey {passkey} at depth {a.depth:.0%}, "
          f"{torch.get_num_threads()} threads", flush=True)
    cache = StaticCache(config=model.config, max_cache_len=cache_length(ctx, names, a))
    logits = prefill(model, ids, cache, a.chunk)
    first = logits.argmax(-1)
    providers = {
        names[0]: (lambda: torch.compile(model), None),
        names[1]: (lambda: torch.compile(model, backend="tinyserve", options=options), cfg),
    }
    rows = []
    for name, (make, pcfg) in providers.items():
        tc.reset()
        torch._dynamo.reset()
        print(f"\n[{name}] compiling and warming up ({a.warmup} steps), then {a.steps} timed steps"
              + (" per window" if a.busy else ""), flush=True)
        r = run_provider(name, make(), cache, first, a, tok.eos_token_id, tok)
        r.update(correct=str(passkey) in r["answer"], kv_bytes=kv_bytes_per_token(model.config, ctx, pcfg),
                 context=ctx)
        print(f"[{name}] answer: {r['answer']!r}  (compile + warm-up {r['compile_s']:.0f} s)", flush=True)
        if pcfg is not None:
            print(tc.explain())
        rows.append(r)

    print(f"\ndecode at {ctx} tokens of context: {a.steps} timed steps per provider after {a.warmup} warm-up steps, "
          f"nothing compiled inside them")
    print(f"{'provider':<32} {'correct':>7} {'decode tok/s':>12} {'KV MB read/token':>17}  answer")
    for r in rows:
        print(f"{r['provider']:<32} {'yes' if r['correct'] else 'NO':>7} {r['windows'][0]['tok_s']:>12.2f} "
              f"{r['kv_bytes'] / 1e6:>17.1f}  {r['answer']}")
    ratio = rows[1]["windows"][0]["tok_s"] / rows[0]["windows"][0]["tok_s"]
    print(f"tinyserve / stock decode speed: {ratio:.2f}x; K/V bytes read: "
          f"{rows[1]['kv_bytes'] / rows[0]['kv_bytes']:.2f}x")
    if a.busy:
        print(f"\nwith a busy neighbour (one spinning process at nice {a.busy_nice}), {a.steps} timed steps each")
        print(f"{'provider':<32} {'window':<40} {'tok/s':>7} {'median ms':>9} {'max ms':>7} {'slowdown':>8}")
        for r in rows:
            idle = r["windows"][0]["tok_s"]
            for w in r["windows"]:
                print(f"{r['provider']:<32} {w['window']:<40} {w['tok_s']:>7.2f} {w['median_ms']:>9.1f} "
                      f"{w['max_ms']:>7.1f} {idle / w['tok_s']:>7.2f}x")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s after set-up", flush=True)
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        meta = {"threads": torch.get_num_threads(), "torch": torch.__version__, "steps": a.steps,
                "warmup": a.warmup, "busy_nice": a.busy_nice if a.busy else None, "passkey": passkey,
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                             time.gmtime())}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "providers": rows}, f, indent=1)
        print(f"# wrote {a.json}")
    return rows


if __name__ == "__main__":
    sys.exit(0 if all(r["correct"] for r in main()) else 1)
