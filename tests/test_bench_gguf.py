"""The GGUF writer of the benchmarks (``bench/gguf_writer.py``, issue 50): the file holds ``build_llama``'s weights
under llama.cpp's names and layout, and llama.cpp (where llama-cpp-python is installed) gives the HF model's
logits from it, in f32 exactly and in Q4_0 within the quantization's error."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from bench.gguf_writer import _permute_rope, gguf_tensor_name, write_llama_gguf  # noqa: E402
from bench.models import TINY_SHAPE, build_llama  # noqa: E402

#: token ids of the logits check (the placeholder vocabulary has no text)
IDS = [1, 5, 17, 42, 99, 3, 64, 7]


def _tensors(path):
    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        a = np.array(t.data)
        if t.tensor_type == gguf.GGMLQuantizationType.BF16:
            a = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
        out[t.name] = a.astype(np.float32).reshape([int(d) for d in reversed(t.shape)])
    return r, out


def _field(reader, key):
    f = reader.fields[key]
    return f.parts[f.data[0]].tolist()[0]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_the_file_holds_build_llamas_weights_under_llama_cpps_names(tmp_path, dtype):
    path = write_llama_gguf("tiny", str(tmp_path / f"tiny.{dtype}.gguf"), dtype=dtype, seed=3)
    model = build_llama("tiny", weights="fp32" if dtype == "f32" else "bf16", seed=3)
    reader, got = _tensors(path)
    want = {gguf_tensor_name(n): p.detach().float() for n, p in model.named_parameters()}
    assert set(got) == set(want)  # tiny's head is its own (a tied one is not written: the test below)
    heads, kv = TINY_SHAPE["num_attention_heads"], TINY_SHAPE["num_key_value_heads"]
    for name, g in got.items():
        w = want[name]
        if name.endswith("attn_q.weight"):
            w = _permute_rope(w, heads)
        elif name.endswith("attn_k.weight"):
            w = _permute_rope(w, kv)
        assert g.shape == tuple(w.shape), name
        assert np.array_equal(g, w.numpy()), name
    assert _field(reader, "llama.block_count") == TINY_SHAPE["num_hidden_layers"]
    assert _field(reader, "llama.attention.head_count_kv") == kv
    assert _field(reader, "llama.vocab_size") == TINY_SHAPE["vocab_size"]


def test_the_rope_permutation_pairs_each_heads_halves():
    # HF rotates channel i with i + d/2 of a head; llama.cpp rotates 2i with 2i + 1: row i goes to 2i, i + d/2 to
    # 2i + 1
    d, heads = 8, 2
    w = torch.arange(heads * d, dtype=torch.float32)[:, None]
    got = _permute_rope(w, heads)[:, 0].tolist()
    assert got == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]


def test_bad_arguments_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        write_llama_gguf("tiny", str(tmp_path / "x.gguf"), dtype="q4_0")
    with pytest.raises(ValueError, match="hf_name"):
        gguf_tensor_name("model.layers.0.self_attn.rotary.weight")


def _need_llama_cpp():
    """Skip unless llama-cpp-python imports with its library (an install built without llama.cpp raises
    FileNotFoundError until LLAMA_CPP_LIB_PATH names a build)."""
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError) as e:
        pytest.skip(f"llama-cpp-python is not usable here: {type(e).__name__}: {e}")


def _check(path):
    """``bench.gguf_writer.check_logits`` of a tiny file (seed 3) on IDS: llama.cpp's logits against HF's."""
    from bench.gguf_writer import check_logits

    return check_logits(str(path), "tiny", seed=3, ids=tuple(IDS))


def test_llama_cpp_gives_the_hf_models_logits(tmp_path, monkeypatch):
    _need_llama_cpp()
    path = write_llama_gguf("tiny", str(tmp_path / "tiny.f32.gguf"), dtype="f32", seed=3)
    r = _check(path)  # what python -m bench.gguf_writer --check prints
    assert r["argmax_equal"] == r["positions"] == len(IDS) and r["rel"] < 1e-3 and r["min_cos"] > 0.9999, r
    # a control: the q/k rows left in HF's order give other logits (the permutation is what makes them equal)
    import bench.gguf_writer as gw

    monkeypatch.setattr(gw, "_permute_rope", lambda w, n: w)
    wrong = _check(write_llama_gguf("tiny", str(tmp_path / "tiny.hf-order.gguf"), dtype="f32", seed=3))
    assert wrong["rel"] > 10 * r["rel"], (wrong, r)


def test_llama_cpp_q4_0_of_the_file_stays_within_the_quantization_error(tmp_path):
    _need_llama_cpp()
    from bench.llamacpp import convert_gguf

    src = write_llama_gguf("tiny", str(tmp_path / "tiny.f32.gguf"), dtype="f32", seed=3)
    binary = shutil.which("llama-quantize") or os.environ.get("LLAMA_QUANTIZE")
    r = _check(convert_gguf(str(src), str(tmp_path), "Q4_0", quantize_binary=binary))
    # 4-bit weights move the logits (cosine 0.9-0.99 on this random model)
    assert r["min_cos"] > 0.9, r
    assert 0.01 < r["rel"] < 0.5, r


def test_a_tied_head_is_not_written(tmp_path, monkeypatch):
    # llama.cpp reads the token embedding as the head when output.weight is absent (Llama-3.2-1B is tied)
    import bench.models as bm

    monkeypatch.setitem(bm.SHAPES, "tiny-tied", dict(TINY_SHAPE, tie_word_embeddings=True))
    _, got = _tensors(write_llama_gguf("tiny-tied", str(tmp_path / "tied.gguf"), dtype="f32", seed=3))
    _, untied = _tensors(write_llama_gguf("tiny", str(tmp_path / "untied.gguf"), dtype="f32", seed=3))
    assert "output.weight" not in got and set(untied) - set(got) == {"output.weight"}


def test_bench_decode_writes_a_llama_shapes_gguf_once(tmp_path, monkeypatch):
    # python -m bench decode --model llama3-1b --llamacpp converts llama.cpp's files from the random-init weights
    # (bench.llamacpp.source_gguf): written once per shape and layer count, then reused
    import bench.llamacpp as lc

    monkeypatch.setattr(lc, "WRITTEN_SHAPES", ("tiny",))
    said = []
    path, kind = lc.source_gguf("tiny", 2, str(tmp_path), said.append)
    assert kind == "BF16" and path.endswith("tiny-L2.BF16.gguf") and len(said) == 1
    reader = gguf.GGUFReader(path)
    assert _field(reader, "llama.block_count") == 2
    assert lc.source_gguf("tiny", 2, str(tmp_path), said.append) == (path, "BF16") and len(said) == 1
