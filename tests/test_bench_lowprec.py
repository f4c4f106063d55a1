"""The decode benchmark's lower-precision rows and llama.cpp provider, without llama.cpp: ``--weights`` through
bench_decode on a tiny Llama, and the pure-Python parts of bench/llamacpp.py (GGUF conversion commands,
llama-bench output parsing, the shape and bytes of the real SmolLM2 GGUF, records, interleaving, tables)."""
from __future__ import annotations

import argparse
import json
import os
import sys

import pytest
import torch

pytest.importorskip("transformers")

from bench import decode as bd  # noqa: E402
from bench import llamacpp as lc  # noqa: E402

OPTS = {"token_budget": 16, "page_size": 8, "lower": "eager"}
#: keys every bench_decode record carries (tests/test_bench_decode.py checks their types)
RECORD_KEYS = {"provider", "context", "batch", "ms_per_token", "tokens_per_s", "compile_s", "first_call_s",
               "kv_bytes_per_step", "weight_bytes", "stream_gbps", "floor_ms", "pct_of_floor", "row_lengths", "steps",
               "sparse_sites", "timed_bounds_rebuilds", "options", "model", "dtype", "weights", "ms_min", "ms_p90",
               "fill", "device", "rounds", "warmup", "date", "threads", "native_kernel", "dense_sites", "cold_compile"}


def test_weights_int8_through_bench_decode(tmp_path):
    out = tmp_path / "int8.json"
    bd.main(["--model", "tiny", "--contexts", "64", "--batches", "1", "--providers", "eager,tinyserve",
             "--weights", "int8", "--options", json.dumps(OPTS), "--steps", "2", "--rounds", "1", "--warmup", "1",
             "--warm-compile", "--prefill-cache", str(tmp_path / "snap"), "--out", str(out)])
    rows = json.loads(out.read_text())
    assert [r["provider"] for r in rows] == ["eager", "tinyserve"]
    assert RECORD_KEYS <= set(rows[0]) and RECORD_KEYS <= set(rows[1])
    assert all(r["weights"] == "int8" and r["dtype"] == "bfloat16" for r in rows)  # bf16 activations by default
    assert rows[1]["sparse_sites"] >= 2, rows[1]
    # int8 codes plus one scale per output row: about a quarter of the fp32 bytes (half of bf16's)
    model, _ = bd.model_for("tiny", 64, torch.float32, torch.device("cpu"))
    assert rows[0]["weight_bytes"] < bd.weight_bytes(model) * 0.3


def test_int4_plain_weights_count_their_buffers_in_the_floor():
    pytest.importorskip("torchao")
    from bench.weights import prepare_weights

    model, _ = bd.model_for("tiny", 64, torch.bfloat16, torch.device("cpu"))
    # the same codes, scales and zero points: as parameters of torchao's weights, as buffers of Int4Linear modules
    plain, sub = bd.weight_bytes(prepare_weights(model, "int4-plain")), bd.weight_bytes(prepare_weights(model, "int4"))
    assert plain == sub and plain < bd.weight_bytes(model) * 0.5, (plain, sub)


def test_weights_and_dtype_must_agree():
    with pytest.raises(SystemExit):
        bd.main(["--model", "tiny", "--weights", "bf16", "--dtype", "fp32"])
    assert bd.weights_dtype("bf16", None) == "bf16" and bd.weights_dtype("int4", None) == "bf16"
    assert bd.weights_dtype("int8", "fp32") == "fp32"
    assert bd.weights_dtype(None, None) == "fp32"


def test_rotation_lets_every_provider_lead_once():
    order = ["eager", "inductor", "tinyserve", "llama.cpp F32/F32", "llama.cpp Q4_1/F16"]
    rounds = [bd.rotation(order, r) for r in range(len(order))]
    assert all(sorted(r) == sorted(order) for r in rounds)
    assert [r[0] for r in rounds] == order
    assert bd.rotation(order, len(order)) == order


def test_conversion_commands():
    assert lc.quantize_command("/opt/llama-quantize", "in.gguf", "out.gguf", "F32", 2) == [
        "/opt/llama-quantize", "--allow-requantize", "--token-embedding-type", "f32", "--output-tensor-type", "f32",
        "in.gguf", "out.gguf", "F32", "2"]
    assert lc.quantize_command("q", "a", "b", "F16", 1)[-2:] == ["F16", "1"]
    # 4-bit targets (the Llama-3 shapes' bf16 files) keep llama-quantize's own embedding and output types
    assert lc.quantize_command("q", "a.BF16.gguf", "b", "Q4_0", 1) == ["q", "--allow-requantize", "a.BF16.gguf", "b",
                                                                         "Q4_0", "1"]
    with pytest.raises(ValueError, match="weights"):
        lc.quantize_command("q", "a", "b", "Q8_0", 1)
    assert lc.gguf_name("/x/SmolLM2-135M-Instruct.Q4_1.gguf", "F16") == "SmolLM2-135M-Instruct.F16.gguf"
    # the shipped type needs no conversion: the source itself, nothing written
    assert lc.convert_gguf("/x/m.Q4_1.gguf", "/nonexistent", "Q4_1") == "/x/m.Q4_1.gguf"
    assert lc.convert_gguf("/x/m.BF16.gguf", "/nonexistent", "BF16", source_type="BF16") == "/x/m.BF16.gguf"
    # SmolLM2's shape converts the shipped file; the Llama-3 shapes write their bf16 weights once (not here: a file
    # of that name exists)
    assert lc.source_gguf("smollm2", None, "/nonexistent")[1] == "Q4_1"
    assert lc.llama_bench_command("lb", "m.gguf", 2048, 16, 2, "f16") == [
        "lb", "-m", "m.gguf", "-p", "0", "-n", "16", "-d", "2048", "-t", "2", "-fa", "1", "-ctk", "f16", "-ctv", "f16",
        "-r", "1", "-o", "json"]


def test_configs():
    assert lc.parse_configs("all") == ["F32/F32", "F16/F16", "Q4_1/F16"]
    assert lc.parse_configs("Q4_1/F16, F32/F32") == ["Q4_1/F16", "F32/F32"]
    with pytest.raises(ValueError, match="llamacpp"):
        lc.parse_configs("Q8_0/F16")


#: what llama-bench -o json writes for one generation test of 2 samples (fields trimmed)
LLAMA_BENCH_JSON = """[
  {
    "build_commit": "abc", "n_threads": 2, "type_k": "f16", "type_v": "f16", "flash_attn": true,
    "n_prompt": 0, "n_gen": 16, "n_depth": 2048, "avg_ns": 190000000, "stddev_ns": 10000000,
    "samples_ns": [ 180000000, 200000000 ],
    "samples_ts": [ 88.9, 80.0 ]
  }
]
"""


def test_parse_llama_bench_json():
    assert lc.parse_llama_bench_json(LLAMA_BENCH_JSON) == pytest.approx([0.18 / 16, 0.2 / 16])
    prompt_only = LLAMA_BENCH_JSON.replace('"n_prompt": 0, "n_gen": 16', '"n_prompt": 512, "n_gen": 0')
    with pytest.raises(ValueError, match="no generation test"):
        lc.parse_llama_bench_json(prompt_only)
    with pytest.raises(ValueError, match="not JSON"):
        lc.parse_llama_bench_json("error: unknown argument -fa")


def test_gguf_shape_and_record_of_the_smollm2_file():
    pytest.importorskip("gguf")
    from tinyserve_compile.smollm2 import smollm2_gguf_path

    path = str(smollm2_gguf_path())
    s = lc.gguf_shape(path)
    assert (s["n_layers"], s["n_kv_heads"], s["head_dim"]) == (30, 3, 64)  # SmolLM2-135M
    assert s["tensor_types"] == "F32:61,Q4_1:210,Q8_0:1"
    # tied embeddings: the Q8_0 token embedding is the output head and is read in full; under the file size
    assert 90e6 < s["weight_bytes"] < os.path.getsize(path)
    assert lc.kv_bytes(30, 3, 64, 2048, "f16") == 2 * 30 * 3 * 64 * 2048 * 2
    p = lc.LlamaBenchProvider("Q4_1/F16", path, 2, "llama-bench")
    assert p.name == "llama.cpp Q4_1/F16" and p.supports(1) and not p.supports(8)
    point = dict(context=2048, batch=1, stream_gbps=40.0, rounds=3, warmup=2, date="d", threads=2)
    r = p.record([0.012, 0.010, 0.011], point)
    assert RECORD_KEYS <= set(r)
    assert r["ms_per_token"] == pytest.approx(11.0) and r["ms_min"] == pytest.approx(10.0) and r["steps"] == 3
    assert r["kv_bytes_per_step"] == lc.kv_bytes(30, 3, 64, 2048, "f16")
    assert r["floor_ms"] == pytest.approx((s["weight_bytes"] + r["kv_bytes_per_step"]) / 40e9 * 1e3)
    assert json.loads(r["options"])["type_k"] == "f16" and r["weights"] == "Q4_1"
    assert r["native_isa"] == "unknown" and r["aten_isa"] == ""  # llama-bench does not say what it was built for


def test_system_isa_reads_what_llama_cpp_was_built_for():
    """A llama.cpp row records the ISA of its build, not the CPU's: an AVX2 build on an AVX-512 CPU says AVX2."""
    avx512 = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | "
              "AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | ")
    assert lc.system_isa(avx512) == "AVX-512 (VNNI, BF16)"
    assert lc.system_isa(avx512.replace("AVX512_BF16 = 1", "AVX512_BF16 = 0")) == "AVX-512 (VNNI)"
    avx2 = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | OPENMP = 1 |"
    assert lc.system_isa(avx2) == "AVX2"
    assert lc.system_isa(avx2 + " AVX512 = 0 | AVX512_VNNI = 0 |") == "AVX2"
    assert lc.system_isa("CPU : SSE3 = 1 | SSSE3 = 1 | OPENMP = 1 |") == "baseline"
    assert lc.system_isa("") == "unknown"


class _FixedLlamaBench(lc.LlamaBenchProvider):
    """A llama-bench provider that runs no binary: every step takes 10 ms."""

    def _run(self, steps):
        return [0.010] * steps


def test_bench_decode_keeps_a_llama_cpp_rows_own_isa(tmp_path, monkeypatch):
    # bench decode adds the machine's fields to every row; a llama.cpp row keeps the ISA of its build
    pytest.importorskip("gguf")
    from tinyserve_compile.kernels.native import native_isa
    from tinyserve_compile.smollm2 import smollm2_gguf_path

    fake = _FixedLlamaBench("Q4_1/F16", str(smollm2_gguf_path()), 2, "unused")
    fake.isa = "AVX2"  # as a build for AVX2 on this CPU would say
    monkeypatch.setattr(bd.llamacpp, "providers_from_args", lambda a, prompt, threads: [fake])
    out = tmp_path / "ll.json"
    bd.main(["--model", "tiny", "--contexts", "64", "--batches", "1", "--providers", "eager", "--llamacpp", "Q4_1/F16",
             "--options", json.dumps(OPTS), "--steps", "2", "--rounds", "1", "--warmup", "1",
             "--prefill-cache", str(tmp_path / "snap"), "--out", str(out)])
    rows = {r["provider"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"eager", "llama.cpp Q4_1/F16"}
    assert rows["llama.cpp Q4_1/F16"]["native_isa"] == "AVX2" and rows["llama.cpp Q4_1/F16"]["aten_isa"] == ""
    assert rows["eager"]["native_isa"] == native_isa() and rows["eager"]["aten_isa"]
    assert rows["llama.cpp Q4_1/F16"]["isa"] == rows["eager"]["isa"]  # the CPU's, on every row


def _ns(**kw):
    return argparse.Namespace(**dict(dict(llamacpp=None, llamacpp_bench=None, llamacpp_dir="unused"), **kw))


def test_providers_from_args_skip_and_errors(monkeypatch, tmp_path):
    said = []
    assert lc.providers_from_args(_ns(), lambda n: [], 2, said.append) == [] and said == []
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # what a machine without llama-cpp-python sees
    assert lc.providers_from_args(_ns(llamacpp="all"), lambda n: [], 2, said.append) == []
    assert len(said) == 1 and "llama-cpp-python is not importable" in said[0] and "--llamacpp-bench" in said[0]
    not_exe = tmp_path / "llama-bench"
    not_exe.write_text("")
    with pytest.raises(ValueError, match="--llamacpp-bench"):
        lc.providers_from_args(_ns(llamacpp="all", llamacpp_bench=str(not_exe)), lambda n: [], 2, said.append)
    with pytest.raises(ValueError, match="llamacpp"):
        lc.providers_from_args(_ns(llamacpp="F8/F8"), lambda n: [], 2, said.append)


def _rec(provider, ctx, ms, weights="fp32", dtype="float32"):
    return dict(provider=provider, context=ctx, batch=1, ms_per_token=ms, weights=weights, dtype=dtype)


def test_markdown_tables_ratios_within_a_run():
    run1 = [_rec("tinyserve", 2048, 40.0), _rec("llama.cpp F32/F32", 2048, 30.0, "F32", "F32/f32"),
            _rec("tinyserve", 8192, 50.0), _rec("llama.cpp F32/F32", 8192, 75.0, "F32", "F32/f32")]
    run2 = [_rec("tinyserve", 2048, 10.0, "int4"), _rec("llama.cpp F32/F32", 2048, 32.0, "F32", "F32/f32"),
            _rec("tinyserve", 8192, 20.0, "int4"), _rec("llama.cpp F32/F32", 8192, 77.0, "F32", "F32/f32")]
    text = lc.markdown_tables([run1, run2])
    lines = text.splitlines()
    assert lines[0] == "| provider | 2K | 8K |"
    assert "| tinyserve (float32) | 40.0 | 50.0 |" in lines
    assert "| tinyserve (int4 weights, float32 activations) | 10.0 | 20.0 |" in lines
    assert "| llama.cpp F32/F32 | 30.0-32.0 | 75.0-77.0 |" in lines  # timed in both runs: the spread
    # ratios pair records of one run only: fp32 tinyserve with run 1's llama.cpp, int4 with run 2's
    assert "| tinyserve (float32) | llama.cpp F32/F32 | 0.75x | 1.50x |" in lines
    assert "| tinyserve (int4 weights, float32 activations) | llama.cpp F32/F32 | 3.20x | 3.85x |" in lines
    ratio_rows = [x for x in lines if x.startswith("| tinyserve (") and "| llama.cpp" in x]
    assert len(ratio_rows) == 2  # no cross-run pair


def test_llamacpp_saved_fill_is_keyed_by_everything_the_cache_holds():
    # a saved llama.cpp context is reused only for the same GGUF, KV type, context, slot count and prompt
    from tinyserve_compile.smollm2 import smollm2_gguf_path

    src = str(smollm2_gguf_path())
    stem = os.path.basename(src).replace(".gguf", "")
    p = lc.LlamaCppProvider("Q4_1/F16", src, 2, lambda n: list(range(n)), "/s")
    base = p.state_path(2048, 2066, list(range(2048)))
    assert base.startswith(f"/s/{stem}-Q4_1-f16-c2048-n2066-")
    assert p.state_path(2048, 2067, list(range(2048))) != base
    assert p.state_path(2048, 2066, list(range(1, 2049))) != base
    assert lc.LlamaCppProvider("F16/F16", src, 2, None, "/s").state_path(2048, 2066, list(range(2048))) != base
    assert lc.LlamaCppProvider("Q4_1/F16", src, 2, None).state_path(2048, 2066, [1]) is None
    assert "saved to and reloaded" in p.fill_desc(2048)


def test_a_llama_cpp_python_without_its_library_skips_its_providers(monkeypatch, tmp_path):
    # pip builds llama-cpp-python without llama.cpp under CMAKE_ARGS=-DLLAMA_BUILD=OFF: its import raises
    # FileNotFoundError until LLAMA_CPP_LIB_PATH names a build; the providers skip with the message, as without it
    (tmp_path / "llama_cpp").mkdir()
    (tmp_path / "llama_cpp" / "__init__.py").write_text(
        "raise FileNotFoundError(\"Shared library with base name 'llama' not found\")\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    said = []
    assert lc.providers_from_args(_ns(llamacpp="all"), lambda n: [], 2, said.append) == []
    assert len(said) == 1 and "llama-cpp-python is not importable" in said[0] and "'llama' not found" in said[0]
