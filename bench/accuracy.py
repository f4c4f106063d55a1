"""Accuracy benchmarks on SmolLM2 through the eager reference path (:mod:`bench.harness`).

* :func:`perplexity` - teacher-forced decode perplexity and top-1 agreement with full attention.
* :func:`passkey` - passkey retrieval grid.
* :func:`diagnostics` - the paper's synthetic suite (repetition/copy, rare-token recall, aliasing).

``python -m bench accuracy [--quick] [--parts ppl,passkey,diagnostics]`` runs them for the backend's defaults
(``Sparse()``, :class:`bench.harness.Sparse`), the paper's rule (``--compare`` adds a series), the oracle,
streaming and h2o, and writes
``accuracy_ppl``, ``passkey`` and ``diagnostics`` (JSON + CSV) under ``--out``; ``python -m bench report``
turns them into tables and plots.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import random
import time
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from bench import cli
from bench.harness import FULL, EvalModel, Sparse, summarize_stats
from bench.output import write_rows

_MODEL = {}
#: prefilled caches of the perplexity runs, reused across processes (results/ is git-ignored)
PREFILL_CACHE = os.environ.get("TINYSERVE_PREFILL_CACHE", "results/.prefill")


def load_model():
    """SmolLM2-135M-Instruct fp32 + tokenizer, loaded once per process."""
    if "m" not in _MODEL:
        from tinyserve_compile.smollm2 import load_smollm2

        _MODEL["m"] = load_smollm2()
    return _MODEL["m"]


def topic_text(half: str) -> str:
    """Python's ``pydoc_data.topics``, topics in sorted order; ``half`` = "tune" (first half of the sorted
    topic names, used to choose defaults) or "heldout" (second half, used to report them)."""
    import pydoc_data.topics as T

    keys = sorted(T.topics)
    mid = len(keys) // 2
    keys = keys[:mid] if half == "tune" else keys[mid:]
    return "\n\n".join(T.topics[k] for k in keys)


def _progress(it, desc, total=None, quiet=False):
    if quiet:
        return it
    from tqdm import tqdm

    return tqdm(it, desc=desc, total=total, leave=False)


# ---------------------------------------------------------------------------------------------- perplexity
def perplexity(ctx: int, cfgs: Sequence[Sparse], steps: int = 128, half: str = "tune", collect: Iterable = (),
               offset: int = 0, quiet: bool = False, on_row: Optional[Callable[[dict], None]] = None) -> List[dict]:
    """Teacher-forced decode perplexity at context ``ctx``.

    The first ``ctx - steps`` tokens of the text (from token ``offset``) are prefilled densely once;
    then, per configuration, the cache is rolled back and the next ``steps`` tokens are fed one
    at a time through the decode path (the policy is used at every step), each predicting its
    successor. Reports the perplexity of those ``steps`` predictions, the top-1 agreement of
    the argmax with full attention at the same positions, and (for configurations in
    ``collect``) the per-step statistics of :class:`bench.harness.StepStats`. ``on_row`` is called
    with each row as soon as it is measured (full attention first).
    """
    model, tok = load_model()
    ids = tok(topic_text(half), return_tensors="pt").input_ids[0, offset: offset + ctx + 1]
    assert ids.numel() == ctx + 1, f"text too short for ctx={ctx}"
    n = ctx - steps
    em = EvalModel(model, ctx)
    t0 = time.time()
    kv_path = os.path.join(PREFILL_CACHE, f"ppl_{half}_{offset}_{ctx}_{n}.pt")
    if os.path.exists(kv_path):
        em.load_prefill(kv_path)
    else:
        em.prefill(ids[None, :n])
        os.makedirs(PREFILL_CACHE, exist_ok=True)
        em.save_prefill(kv_path)
    prefill_s = time.time() - t0
    feed, target = ids[n: n + steps], ids[n + 1: n + steps + 1]
    rows, ref = [], None
    collect = set(collect)
    for cfg in _progress([FULL] + [c for c in cfgs if c != FULL], f"ppl@{ctx}", quiet=quiet):
        em.reset(cfg, collect=cfg in collect)
        t0 = time.time()
        logits = em.teacher_forced(feed)
        dt = time.time() - t0
        nll = F.cross_entropy(logits, target, reduction="none")
        if ref is None:
            ref = logits
        row = dict(ctx=ctx, half=half, steps=steps, offset=offset, label=cfg.label(), policy=cfg.policy,
                   budget=cfg.token_budget, page_size=cfg.page_size, dense_layers=cfg.dense_layers,
                   sink_pages=cfg.sink_pages, candidate_factor=cfg.candidate_factor, candidate_extra=cfg.candidate_extra, keep_tokens=cfg.keep_tokens,
                   per_layer=bool(cfg.layer_budgets), nll=float(nll.mean()), ppl=math.exp(float(nll.mean())),
                   top1=float((logits.argmax(-1) == ref.argmax(-1)).float().mean()),
                   s_per_step=dt / steps, prefill_s=prefill_s)
        row.update({f"stat_{k}": v for k, v in summarize_stats(em.stats).items()})
        row["ppl_rel"] = row["ppl"] / (rows[0]["ppl"] if rows else row["ppl"]) - 1.0
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


# ---------------------------------------------------------------------------------------------- passkey
_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
          "I will quiz you about the important information there.\n")
_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
_QUESTION = "\nWhat is the pass key? The pass key is"


def passkey_prompt(tok, ctx: int, depth: float, key: str) -> List[int]:
    """Token ids of a passkey prompt of exactly ``ctx`` tokens (filler repeated, needle at ``depth``)."""
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    unit = tok(_FILLER, add_special_tokens=False).input_ids
    head = tok(_INTRO, add_special_tokens=False).input_ids
    nd = tok(needle, add_special_tokens=False).input_ids
    q = tok(_QUESTION, add_special_tokens=False).input_ids
    room = ctx - len(head) - len(nd) - len(q)
    body = (unit * (room // len(unit) + 1))[:room]
    cut = int(round(depth * room / len(unit))) * len(unit)
    cut = min(cut, room)
    return head + body[:cut] + nd + body[cut:] + q


def passkey(contexts=(1024, 2048, 4096, 8192), depths=(0.0, 0.25, 0.5, 0.75, 1.0), budgets=(256, 512, 1024, 2048),
            policies=("query_aware", "streaming", "oracle"), base: Optional[Sparse] = None, decode_tail: int = 16,
            quiet: bool = False, compare: Optional[Tuple[str, Sparse]] = None) -> List[dict]:
    """Passkey retrieval. The prompt is prefilled except its last ``decode_tail`` tokens (the
    question), which go through the decode path, as does the 5-digit answer (greedy, 7 tokens).
    Success: the key's digits appear in the generated text. ``full`` is run once per prompt.
    ``compare``: ``(series name, options)`` also run at each budget on the same prompts; every row has its
    ``series`` (``policy`` for the others)."""
    model, tok = load_model()
    base = base or Sparse()
    rng = random.Random(1234)
    rows = []
    grid = [(c, d) for c in contexts for d in depths]
    for ctx, depth in _progress(grid, "passkey", quiet=quiet):
        key = str(rng.randint(10000, 99999))
        ids = torch.tensor(passkey_prompt(tok, ctx, depth, key))
        em = EvalModel(model, ctx + 8)
        n = ctx - decode_tail
        em.prefill(ids[None, :n])
        runs = [("full", FULL)] + [(p, Sparse(**{**base.__dict__, "policy": p, "token_budget": b}))
                                   for p in policies for b in budgets if b < ctx]
        if compare is not None:
            runs += [(compare[0], Sparse(**{**compare[1].__dict__, "token_budget": b})) for b in budgets if b < ctx]
        for series, cfg in runs:
            em.reset(cfg)
            lg = em.teacher_forced(ids[n:])[-1]
            out = tok.decode(em.generate(lg, 7))
            ok = key in out.replace(" ", "")
            rows.append(dict(ctx=ctx, depth=depth, policy=cfg.policy, series=series, budget=cfg.token_budget,
                             label=cfg.label(), ok=ok, answer=out))
            if cfg is FULL:  # budgets covering the whole context are dense: same answer
                for p in list(policies) + ([compare[0]] if compare is not None else []):
                    for b in budgets:
                        if b >= ctx:
                            rows.append(dict(ctx=ctx, depth=depth, policy=p.split(" ")[0], series=p, budget=b,
                                             label="dense", ok=ok, answer=out))
    return rows


# ---------------------------------------------------------------------------------------------- diagnostics
_WORDS = ("apple river stone cloud maple copper violet harbor lantern meadow falcon pepper canyon velvet "
          "orbit walnut ember glacier saddle cobalt thistle marble quartz willow tundra breeze anchor").split()


def _prose(tok, n: int, half: str = "heldout") -> List[int]:
    return tok(topic_text(half), add_special_tokens=False).input_ids[:n]


def _facts_in_prose(tok, ctx: int, fact_ids: List[List[int]], q: List[int]) -> List[int]:
    """Token ids of ``ctx`` tokens: prose with each fact at evenly spaced depths, then the question ``q``."""
    room = ctx - len(q) - sum(len(f) for f in fact_ids)
    filler = _prose(tok, room)
    out, step = [], room // len(fact_ids)
    for i, f in enumerate(fact_ids):
        out += filler[i * step:(i + 1) * step] + f
    return out + filler[len(fact_ids) * step:] + q


def diag_repetition(tok, ctx: int, rng: random.Random, seg: int = 64):
    """**Repetition/copy.** A segment of ``seg`` tokens of random words (from a 27-word list) is placed at
    the start of the context, followed by prose filling the context to ``ctx - seg`` tokens, then the same
    segment is repeated. The repeat is teacher-forced through the decode path; the score is the fraction of
    its positions (after the first token) where the greedy next token equals the segment's true next token.
    Only a copy from the distant first occurrence can make these predictions."""
    words = " " + " ".join(rng.choice(_WORDS) for _ in range(seg))
    s = tok(words, add_special_tokens=False).input_ids[:seg]
    filler = _prose(tok, ctx - 2 * seg)
    return s + filler, s  # context, then the repeat is teacher-forced


def diag_rare(tok, ctx: int, rng: random.Random, n_facts: int = 6):
    """**Rare-token recall.** ``n_facts`` facts "The secret code of <nonce> is <4 digits>." with made-up
    nonce names (rare token sequences) are inserted at evenly spaced depths in prose filling ``ctx``; the
    query "The secret code of <nonce> is" asks for one of them (chosen at random). Success: the 4 digits
    are generated (greedy) through the decode path."""
    syll = ["zor", "blax", "quen", "thra", "vip", "mok", "zu", "drel", "fyn", "gosh", "plim", "wex"]
    facts = []
    for _ in range(n_facts):
        name = "".join(rng.choice(syll) for _ in range(3)).capitalize()
        facts.append((name, str(rng.randint(1000, 9999))))
    asked = rng.choice(facts)
    q = tok(f"\nThe secret code of {asked[0]} is", add_special_tokens=False).input_ids
    fact_ids = [tok(f" The secret code of n is {c}. ".replace(" n ", f" {n} "), add_special_tokens=False).input_ids
                for n, c in facts]
    return _facts_in_prose(tok, ctx, fact_ids, q), asked[1]


def diag_aliasing(tok, ctx: int, rng: random.Random, n_dup: int = 8):
    """**Attention aliasing.** ``n_dup`` near-duplicate sentences "The locker number for room <X> is <4 digits>."
    that differ only in the room letter and the number are inserted at evenly spaced depths in prose
    filling ``ctx``; the query asks for one room. Near-identical pages have near-identical key bounds, so
    a page ranking that aliases them picks the wrong one. Success: the right 4 digits are generated."""
    rooms = rng.sample("ABCDEFGHJKLMNPQRSTUVWXYZ", n_dup)
    facts = [(r, str(rng.randint(1000, 9999))) for r in rooms]
    asked = rng.choice(facts)
    q = tok(f"\nThe locker number for room {asked[0]} is", add_special_tokens=False).input_ids
    fact_ids = [tok(f" The locker number for room {r} is {c}. ", add_special_tokens=False).input_ids for r, c in facts]
    return _facts_in_prose(tok, ctx, fact_ids, q), asked[1]


def diagnostics(ctx: int = 4096, cfgs: Sequence[Sparse] = (), trials: int = 4, quiet: bool = False) -> List[dict]:
    """Runs the three diagnostics ``trials`` times each; rows hold per-configuration scores."""
    model, tok = load_model()
    rng = random.Random(7)
    rows = []
    runs = [FULL] + [c for c in cfgs if c != FULL]
    tasks = [("repetition", t) for t in range(trials)] + [("rare_recall", t) for t in range(trials)] + \
            [("aliasing", t) for t in range(trials)]
    for task, t in _progress(tasks, f"diagnostics@{ctx}", quiet=quiet):
        if task == "repetition":
            prompt, seg = diag_repetition(tok, ctx, rng)
            ids = torch.tensor(prompt + seg)
            n = len(prompt)
            em = EvalModel(model, len(ids))
            em.prefill(ids[None, :n])
            for cfg in runs:
                em.reset(cfg)
                lg = em.teacher_forced(ids[n:-1])
                score = float((lg[:-0 or None].argmax(-1) == ids[n + 1:]).float().mean())
                rows.append(dict(task=task, trial=t, ctx=ctx, label=cfg.label(), policy=cfg.policy,
                                 budget=cfg.token_budget, score=score))
        else:
            prompt, ans = (diag_rare if task == "rare_recall" else diag_aliasing)(tok, ctx, rng)
            ids = torch.tensor(prompt)
            tail = 12
            n = len(ids) - tail
            em = EvalModel(model, len(ids) + 8)
            em.prefill(ids[None, :n])
            for cfg in runs:
                em.reset(cfg)
                lg = em.teacher_forced(ids[n:])[-1]
                out = tok.decode(em.generate(lg, 5))
                rows.append(dict(task=task, trial=t, ctx=ctx, label=cfg.label(), policy=cfg.policy,
                                 budget=cfg.token_budget, score=float(ans in out.replace(" ", "")), answer=out))
    return rows


def main(argv=None) -> int:
    ap = cli.parser("accuracy", __doc__.split("\n\n")[0], out="results", quick="small grid, a few minutes on 2 cores")
    ap.add_argument("--half", default="heldout", choices=("tune", "heldout"),
                    help="text for perplexity: tune = first half of the sorted topics, heldout = second")
    ap.add_argument("--parts", default="ppl,passkey,diagnostics")
    a = cli.parse(ap, argv)
    if a.out.endswith(".json"):
        ap.error("argument --out: accuracy writes three files (accuracy_ppl, passkey, diagnostics): give a folder")
    if a.quick:
        ctxs, budgets, steps = (1024, 2048), (256, 512), 32
        pk = dict(contexts=(1024, 2048), depths=(0.0, 0.5, 1.0), budgets=(256, 512))
        dg = dict(ctx=1024, trials=1)
        dg_budgets = (256,)
    else:
        ctxs, budgets, steps = (2048, 4096, 8192), (256, 512, 1024, 2048), 128
        pk = dict(contexts=(1024, 2048, 4096, 8192), depths=(0.0, 0.25, 0.5, 0.75, 1.0), budgets=(256, 512, 1024, 2048))
        dg = dict(ctx=4096, trials=4)
        dg_budgets = (512, 1024)
    d = Sparse()
    series = {
        "query_aware (defaults)": lambda b: dataclasses.replace(d, token_budget=b),
        "query_aware (paper: no sink, one stage)": lambda b: Sparse(**cli.PRESETS["paper-bf16"], token_budget=b),
        "oracle": lambda b: dataclasses.replace(d, policy="oracle", token_budget=b),
        "streaming": lambda b: dataclasses.replace(d, policy="streaming", token_budget=b),
        # one stage and whole pages: with more candidates than the budget the exact-mass refinement, not h2o,
        # would pick what is kept
        "h2o": lambda b: dataclasses.replace(d, policy="h2o", token_budget=b, candidate_factor=1, candidate_extra=0,
                                             keep_tokens=False),
    }
    if a.compare is not None:
        series[f"query_aware ({a.compare.name})"] = lambda b: Sparse(**{**a.compare, "token_budget": b})
    t0 = time.time()
    if "ppl" in a.parts:
        rows = []
        for ctx in ctxs:
            cfgs, names, collect = [], {}, []
            for s, mk in series.items():
                for b in budgets:
                    c = mk(b)
                    if c.label() in names:  # two series with one configuration: keep the first name
                        continue
                    cfgs.append(c)
                    names[c.label()] = s
                    if s.startswith("query_aware") or s == "oracle":
                        collect.append(c)
            for r in perplexity(ctx, cfgs, steps=steps, half=a.half, collect=collect):
                r["series"] = names.get(r["label"], "full")
                rows.append(r)
            write_rows(rows, os.path.join(a.out, "accuracy_ppl.json"))
    if "passkey" in a.parts:
        pol = ("query_aware", "streaming", "oracle") if not a.quick else ("query_aware", "streaming")
        compare = None if a.compare is None else (f"query_aware ({a.compare.name})", Sparse(**a.compare))
        write_rows(passkey(policies=pol, base=d, compare=compare, **pk), os.path.join(a.out, "passkey.json"))
    if "diagnostics" in a.parts:
        cfgs = [dataclasses.replace(d, policy=p, token_budget=b) for b in dg_budgets
                for p in ("query_aware", "streaming", "oracle")]
        write_rows(diagnostics(cfgs=cfgs, **dg), os.path.join(a.out, "diagnostics.json"))
    print(f"accuracy done in {time.time() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
