"""Exported decode steps of tiny random-init HF models in ONNX Runtime vs the compiled tinyserve backend."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import EXPORTS, L
from tests.support.export_helpers import greedy, hf_step, prefill, worst
from tests.support.backend_helpers import prompt
from tests.support.backend_models import hf_model
from tinyserve_compile.onnx.export import decode_state, export_onnx, main
from tinyserve_compile.kernels.reference import page_bounds
from tinyserve_compile.onnx.runtime import OrtDecoder

PROMPT, STEPS = 90, 8


def _ort(info, cache, options, **kw):
    dec = OrtDecoder(info.path, **kw)
    dec.load_state(decode_state(cache, options=options))
    return dec


@pytest.mark.parametrize("name,lower", [("llama_sparse", "eager"), ("gpt2_sparse", "eager"),
                                        ("llama_one_stage", "inductor")])
def test_onnx_runtime_equals_compiled_backend_and_differs_from_dense(exports, name, lower):
    info = exports[name]
    family, options, _ = EXPORTS[name]
    model = hf_model(family)
    ids = prompt(PROMPT, seed=1)
    tok, cache = prefill(model, ids, L)
    dec = _ort(info, cache, options)
    _, dense_cache = prefill(model, ids, L)
    compiled = torch.compile(model, backend="tinyserve", options={**options, "lower": lower})
    want_toks, want = greedy(hf_step(compiled, cache), tok, PROMPT, STEPS)
    got_toks, got = greedy(dec.step, tok, PROMPT, STEPS)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), worst(got, want)
    assert torch.equal(got_toks, want_toks)
    # the same steps attending densely: the selection dropped pages, so the logits differ
    _, dense = greedy(hf_step(model, dense_cache), tok, PROMPT, STEPS)
    assert (got - dense).abs().max() > 1e-3, worst(got, dense)
    # the state ONNX Runtime kept: the caches the compiled model wrote, bounds equal to a rebuild
    S, bdt = options["page_size"], getattr(torch, options["bounds_dtype"])
    for i in range(info.n_layers):
        assert torch.allclose(dec.state[f"key.{i}"], cache.layers[i].keys, atol=1e-5), i
        assert torch.allclose(dec.state[f"value.{i}"], cache.layers[i].values, atol=1e-5), i
    for i in info.sparse_layers:
        fresh = page_bounds(dec.state[f"key.{i}"], S, dtype=bdt)
        assert torch.equal(dec.state[f"kmax.{i}"], fresh.kmax) and torch.equal(dec.state[f"kmin.{i}"], fresh.kmin)
        assert torch.equal(dec.state[f"kabs.{i}"], fresh.kabs)


def reference_step(model, options, state):
    """A ``step`` for :func:`greedy`: the exported module run eagerly in PyTorch, whose export-only ops are the
    reference (``sparse_decode_reference`` with every option, ``store_bounds``); it advances ``state`` (a dict)."""
    from tinyserve_compile.onnx import ops as onnx_ops  # noqa: F401  (registers the ops)
    from tinyserve_compile.config import TinyServeConfig
    from tinyserve_compile.onnx.export import _DecodeStep, _register_attention

    config = TinyServeConfig.from_options(options)
    n_layers = sum(1 for n in state if n.startswith("key."))
    sparse = [i for i in range(n_layers) if f"kmax.{i}" in state]
    _register_attention()
    module = _DecodeStep(model, config, n_layers, sparse).eval()
    names = list(state)

    @torch.no_grad()
    def step(tok, pos):
        out = module(tok, pos, *[state[n] for n in names])
        assert module.last_sparse_calls == len(sparse)
        state.update(zip(names, out[1:]))
        return out[0]

    return step


@pytest.mark.parametrize("name,lower", [("llama_int8_tokens", "eager"), ("gpt2_int8_tokens", "inductor")])
def test_int8_bounds_extra_candidates_keep_tokens_equal_reference_and_backend(exports, name, lower):
    """int8 bounds, ``candidate_extra = 2 * page_size``, ``keep_tokens``: ONNX Runtime gives the reference's logits
    and state, and the compiled backend's logits."""
    info = exports[name]
    family, options, _ = EXPORTS[name]
    assert info.bounds_dtype == "int8"
    model = hf_model(family)
    ids = prompt(PROMPT, seed=5)
    tok, cache = prefill(model, ids, L)
    dec = _ort(info, cache, options)
    assert info.sparse_layers and dec.state[f"kmax.{info.sparse_layers[0]}"].dtype == torch.int8
    assert set(dec.shared) == set(info.input_names[2:])  # the int8 bounds (DQ -> ScatterND -> Q) share buffers too
    ref_state = decode_state(cache, options=options)
    ref_state = {n: t.clone() for n, t in ref_state.items()}
    page_state = {n: t.clone() for n, t in ref_state.items()}
    want_toks, want = greedy(reference_step(model, options, ref_state), tok, PROMPT, STEPS)
    got_toks, got = greedy(dec.step, tok, PROMPT, STEPS)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), worst(got, want)
    assert torch.equal(got_toks, want_toks)
    _, backend_cache = prefill(model, ids, L)
    compiled = torch.compile(model, backend="tinyserve", options={**options, "lower": lower})
    backend_toks, backend = greedy(hf_step(compiled, backend_cache), tok, PROMPT, STEPS)
    assert torch.allclose(got, backend, atol=1e-4, rtol=1e-4), worst(got, backend)
    assert torch.equal(got_toks, backend_toks)
    for n, t in ref_state.items():  # the new keys differ in fp32 noise, so the pages written may differ by a code
        assert dec.state[n].dtype == t.dtype, n
        if n.startswith(("kmax", "kmin")):
            assert (dec.state[n].int() - t.int()).abs().max() <= 1, n
        else:
            assert torch.allclose(dec.state[n], t, atol=1e-5), n
    for i in info.sparse_layers:  # the bounds ONNX Runtime kept equal a rebuild of its cache (the writer is exact)
        fresh = page_bounds(dec.state[f"key.{i}"], options["page_size"], dtype=torch.int8)
        assert torch.equal(dec.state[f"kmax.{i}"], fresh.kmax) and torch.equal(dec.state[f"kmin.{i}"], fresh.kmin)
        assert torch.equal(dec.state[f"kabs.{i}"], fresh.kabs)
    # binding the int8 state in place equals double-buffering it
    double = greedy(_ort(info, cache, options, share_buffers=False).step, tok, PROMPT, 2)[1]
    assert torch.equal(got[:2], double)
    # the options take effect: keeping whole pages, or attending densely, gives other logits
    pages = {**options, "keep_tokens": False}
    _, by_pages = greedy(reference_step(model, pages, page_state), tok, PROMPT, STEPS)
    assert (got - by_pages).abs().max() > 1e-4, worst(got, by_pages)
    _, dense_cache = prefill(model, ids, L)
    _, dense = greedy(hf_step(model, dense_cache), tok, PROMPT, STEPS)
    assert (got - dense).abs().max() > 1e-3, worst(got, dense)


def test_dense_export_equals_eager_hf(exports):
    info = exports["llama_dense"]
    assert info.sparse_layers == [] and not any(n.startswith("kmax") for n in info.input_names)
    model = hf_model("llama")
    ids = prompt(PROMPT, seed=2)
    tok, cache = prefill(model, ids, L)
    dec = _ort(info, cache, {"policy": "full"})
    got_toks, got = greedy(dec.step, tok, PROMPT, STEPS)
    want_toks, want = greedy(hf_step(model, cache), tok, PROMPT, STEPS)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), worst(got, want)
    assert torch.equal(got_toks, want_toks)


def test_ragged_batch_rows_decode_as_alone(exports):
    """Rows at different positions in one batch give each row's batch-1 result (per-row selection)."""
    one, two = exports["llama_sparse"], exports["llama_batch2"]
    model = hf_model("llama")
    rows = [prompt(n, seed=3 + n) for n in (90, 41)]  # row 1: 3 pages <= its 2x2 candidates: dense inside a sparse batch
    prefs = [prefill(model, ids, L) for ids in rows]
    alone = []
    for (tok, cache), ids in zip(prefs, rows):
        dec = _ort(one, cache, EXPORTS["llama_sparse"][1])
        alone.append(greedy(dec.step, tok, ids.shape[1], 1)[1][0, 0])
    state = [decode_state(c, options=EXPORTS["llama_batch2"][1]) for _, c in prefs]
    dec = OrtDecoder(two.path)
    dec.load_state({n: torch.cat([state[0][n], state[1][n]]) for n in state[0]})
    tok = torch.cat([t for t, _ in prefs])
    got = dec.step(tok, torch.tensor([90, 41]))
    for r in range(2):
        assert torch.allclose(got[r], alone[r], atol=1e-5), (r, worst(got[r], alone[r]))


def test_shared_buffers_equal_double_buffering(exports):
    info = exports["llama_sparse"]
    options = EXPORTS["llama_sparse"][1]
    assert set(OrtDecoder(info.path).shared) == set(info.input_names[2:])  # every state tensor updated in place
    model = hf_model("llama")
    tok, cache = prefill(model, prompt(PROMPT, seed=4), L)
    a = greedy(_ort(info, cache, options).step, tok, PROMPT, 4)[1]
    b = greedy(_ort(info, cache, options, share_buffers=False).step, tok, PROMPT, 4)[1]
    assert torch.equal(a, b)


def test_decode_state_builds_bounds_of_every_sparse_layer():
    model = hf_model("llama")
    _, cache = prefill(model, prompt(40), 64)
    st = decode_state(cache, options={"page_size": 8, "dense_layers": 1, "bounds_dtype": "bfloat16"})
    assert [n for n in st if n.startswith("kmax")] == ["kmax.1", "kmax.2", "kmax.3"]
    assert st["kmax.1"].dtype == torch.bfloat16 and st["kabs.1"].dtype == torch.float32
    assert st["key.0"] is cache.layers[0].keys
    fresh = page_bounds(cache.layers[2].keys, 8, dtype=torch.bfloat16)
    assert torch.equal(st["kmax.2"], fresh.kmax) and torch.equal(st["kmin.2"], fresh.kmin)
    with pytest.raises(ValueError, match="cache"):
        decode_state([(None, None)])


def test_decode_state_writes_int8_bounds_of_the_reference():
    model = hf_model("llama")
    _, cache = prefill(model, prompt(40), 64)
    st = decode_state(cache, options={"page_size": 8, "dense_layers": 1, "bounds_dtype": "int8"})
    for i in (1, 2, 3):
        want = page_bounds(cache.layers[i].keys, 8, dtype=torch.int8)
        assert st[f"kmax.{i}"].dtype == torch.int8 and st[f"kabs.{i}"].dtype == torch.float32
        assert torch.equal(st[f"kmax.{i}"], want.kmax) and torch.equal(st[f"kmin.{i}"], want.kmin)
        assert torch.equal(st[f"kabs.{i}"], want.kabs)
    assert st["kabs.1"][0, 0, 0] == cache.layers[1].keys[0, 0, :8].abs().max()  # the exact max |k| of the page


@pytest.mark.parametrize("kw,match", [
    ({"max_cache_len": 100}, "max_cache_len"),
    ({"options": {"policy": "streaming"}}, "policy"),
    ({"options": {"token_budget": 3}}, "token_budget"),
    ({"batch_size": 0}, "batch_size"),
])
def test_bad_arguments_raise_naming_them(tmp_path, kw, match):
    args = {"max_cache_len": 128, **kw}
    with pytest.raises(ValueError, match=match):
        export_onnx(hf_model("llama"), tmp_path / "x.onnx", **args)


def test_models_that_cannot_be_exported_raise(tmp_path):
    m = hf_model("llama")
    m.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="sdpa"):
        export_onnx(m, tmp_path / "x.onnx", max_cache_len=128)
    with pytest.raises(ValueError, match="training"):
        export_onnx(hf_model("llama").train(), tmp_path / "x.onnx", max_cache_len=128)
    import transformers as tf
    from transformers import AutoModelForCausalLM

    cfg = tf.MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=32)
    sw = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with pytest.raises(ValueError, match="sliding_attention"):
        export_onnx(sw, tmp_path / "x.onnx", max_cache_len=128)


def test_command_line_exports_a_local_model(tmp_path, capsys):
    folder = tmp_path / "tiny"
    hf_model("gpt2").save_pretrained(folder)
    out = tmp_path / "step.onnx"
    assert main(["--out", str(out), "--max-cache-len", "64", "--model", str(folder),
                 "--options", json.dumps({"token_budget": 16, "page_size": 8})]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["sparse_layers"] == 2 and out.exists()
