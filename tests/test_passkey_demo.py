"""The helpers of examples/passkey_demo.py: prompt building, chunked prefill, the compile watch, the neighbour."""
from __future__ import annotations

import contextlib
import importlib.util
import os

import pytest
import torch

from tests.support.backend_models import hf_model

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "passkey_demo.py")
_spec = importlib.util.spec_from_file_location("passkey_demo", _PATH)
demo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo)


class WordTokenizer:
    """One token per whitespace-separated word; keeps the last text it tokenized."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "<user> " + messages[0]["content"] + " <assistant>"

    def __call__(self, text, return_tensors="pt"):
        self.text = text
        return type("Enc", (), {"input_ids": torch.zeros(1, len(text.split()), dtype=torch.long)})()


@pytest.mark.parametrize("n_tokens", [200, 1000, 4000])
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_prompt_fits_and_holds_the_passkey_at_depth(n_tokens, depth):
    tok = WordTokenizer()
    ids = demo.build_prompt(tok, n_tokens, depth, 12345)
    assert 0.9 * n_tokens <= ids.shape[1] <= n_tokens
    words = tok.text.split()
    head = 16  # "<user> There is a secret number hidden in the document below. Find it and remember it."
    tail = 14  # "What is the secret number? Answer with the number only. <assistant>The secret number is"
    needle = 12  # "The secret number is 12345. Remember it: the secret number is 12345."
    start = words.index("12345.") - 4
    assert words[start: start + needle] == "The secret number is 12345. Remember it: the secret number is 12345.".split()
    assert tok.text.endswith(demo.ANSWER_PREFIX)
    where = (start - head) / (len(words) - head - tail - needle)
    assert abs(where - depth) < 0.05, where  # depth counts " "-separated pieces, some hold a newline


@pytest.mark.parametrize("bad", [{"depth": 1.5}, {"depth": -0.1}, {"n_tokens": 10}])
def test_prompt_rejects_bad_arguments(bad):
    kw = {"n_tokens": 500, "depth": 0.5, **bad}
    with pytest.raises(ValueError, match=next(iter(bad))):
        demo.build_prompt(WordTokenizer(), passkey=1, **kw)


def test_chunked_prefill_equals_one_pass():
    from transformers import StaticCache

    model = hf_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 45), generator=torch.Generator().manual_seed(0))
    caches = [StaticCache(config=model.config, max_cache_len=64) for _ in range(2)]
    with torch.no_grad():
        whole = model(input_ids=ids, cache=caches[0], use_cache=True).logits[:, -1]
    chunked = demo.prefill(model, ids, caches[1], chunk=8, out=open(os.devnull, "w"))
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)
    for a, b in zip(caches[0].layers, caches[1].layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)
        assert int(a.cumulative_length) == int(b.cumulative_length) == 45
    with torch.no_grad():  # the next decode step reads the same cache
        nxt = torch.tensor([[5]])
        torch.testing.assert_close(model(input_ids=nxt, cache=caches[1], use_cache=True).logits,
                                   model(input_ids=nxt, cache=caches[0], use_cache=True).logits, atol=1e-5, rtol=1e-5)


def test_prefill_rejects_a_prompt_longer_than_the_cache():
    from transformers import StaticCache

    model = hf_model("llama")
    with pytest.raises(ValueError, match="ids"):
        demo.prefill(model, torch.zeros(1, 20, dtype=torch.long), StaticCache(config=model.config, max_cache_len=16))


def test_compile_watch_sees_compiles_and_recompiles():
    torch._dynamo.reset()
    f = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    watch = demo.CompileWatch()
    f(torch.ones(3))
    assert watch.since()["frames"] >= 1 and watch.since()["graphs"] == 1
    watch.mark()
    f(torch.ones(3))
    assert watch.since() == {"frames": 0, "graphs": 0}
    f(torch.ones(3, dtype=torch.float64))  # a guard fails: recompile
    assert watch.since()["graphs"] == 1


def test_timed_window_refuses_compiles():
    assert demo._window("idle", [0.5, 0.25], {"frames": 0, "graphs": 0})["tok_s"] == pytest.approx(2 / 0.75)
    with pytest.raises(RuntimeError, match="compiled"):
        demo._window("idle", [0.5], {"frames": 1, "graphs": 0})


class _PositionCache:
    """Stands in for the static cache: ``slots`` positions, the next one written at ``pos``."""

    def __init__(self, slots: int, pos: int):
        self.slots, self.pos = slots, pos


def _stepper(written: list):
    """A decode step that writes the next position of the cache it is given (logged in ``written``) and refuses one
    outside the cache, as tinyserve's op does."""

    def step(input_ids, cache, use_cache):
        if cache.pos >= cache.slots:
            raise ValueError(f"position {cache.pos} outside the cache's {cache.slots} slots")
        written.append(cache.pos)
        cache.pos += 1
        return type("Out", (), {"logits": torch.zeros(1, 1, 8)})()

    return step


class _DecodeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.mark.parametrize("argv", [["--busy"], ["--busy", "--steps", "5", "--warmup", "3"], []])
def test_the_cache_covers_every_position_each_provider_writes(argv, monkeypatch):
    """The cache main() sizes (the demo's own plan, no model) holds every position each provider's warm-up and
    timed windows write, --busy's six windows of tinyserve included."""
    monkeypatch.setattr(demo, "BusyNeighbour", lambda *a, **kw: contextlib.nullcontext())  # no spinning process
    _, a = demo.parse_args(argv)
    names = demo.provider_names(2048)
    ctx = 100
    slots = demo.cache_length(ctx, names, a)
    for name in names:
        written = []
        cache = _PositionCache(slots, ctx)
        r = demo.run_provider(name, _stepper(written), cache, torch.tensor([0]), a, eos=-1, tok=_DecodeTokenizer())
        assert cache.pos == ctx  # each provider decodes on its own copy
        assert len(r["windows"]) == len(demo.timed_windows(name, a.busy))
        assert written == list(range(ctx, ctx + a.warmup + a.steps * len(r["windows"])))
        assert written[-1] < slots
    assert len(demo.timed_windows(names[1], True)) == 6 and len(demo.timed_windows(names[0], True)) == 2


def test_the_demo_starts_with_the_default_waits_before_torch():
    import subprocess
    import sys

    code = ("import importlib.util, os, sys; s = importlib.util.spec_from_file_location('d', sys.argv[1]); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); print(os.environ.get('GOMP_SPINCOUNT'))")
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    for env, want in (({}, "30000"), ({"OMP_WAIT_POLICY": "passive"}, "None"), ({"GOMP_SPINCOUNT": "5"}, "5")):
        res = subprocess.run([sys.executable, "-c", code, _PATH], capture_output=True, text=True, timeout=300,
                             env={**base, **env})
        assert res.returncode == 0, res.stderr[-2000:]
        assert res.stdout.strip().splitlines()[-1] == want, (env, res.stdout)
