"""llama.cpp timed with flash attention on and off (bench/llamacpp.py): ``python -m bench decode --llamacpp``
through a fake llama-bench, which is faster with flash attention off for one config and on for another; the
anchor of the ratios is the faster setting, both are recorded, and a quantized V cache runs "on" only."""
from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import sys
import types

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from bench import decode as bd  # noqa: E402
from bench import llamacpp as lc  # noqa: E402

OPTS = {"token_budget": 16, "page_size": 8, "lower": "eager"}
#: the fake's ms per token by (weights, -ctv, -fa, -t): Q4_1 weights with an f16 cache are faster with flash
#: attention off, F16 weights with it on, and at F16 one thread beats two; a q8_0 V cache has no "off" (llama.cpp
#: refuses it), and llama-bench takes no f32 cache at all
MS = {"Q4_1,f16,1,2": 40.0, "Q4_1,f16,0,2": 26.0, "Q4_1,f16,1,1": 45.0, "Q4_1,f16,0,1": 30.0,
      "F16,f16,1,2": 14.0, "F16,f16,0,2": 20.0, "F16,f16,1,1": 13.0, "F16,f16,0,1": 25.0,
      "Q4_1,q8_0,1,2": 12.0, "Q4_1,q8_0,1,1": 18.0}

#: a llama-bench that times nothing: it logs its arguments and prints -o json for one generation test at MS's speed
FAKE_BENCH = """#!{python}
import json, sys
args = sys.argv[1:]
opt = dict(zip(args[::2], args[1::2]))
with open({log!r}, "a") as f:
    f.write(json.dumps(opt) + "\\n")
if opt["-ctk"] not in ("f16", "q8_0"):
    sys.exit("error: invalid parameter for argument: -ctk")
if opt["-fa"] == "0" and opt["-ctv"] != "f16":
    sys.exit("V cache quantization requires flash_attn")
weights = opt["-m"].rsplit(".", 2)[-2]  # SmolLM2-135M-Instruct.<weights>.gguf
ms = {ms}[",".join((weights, opt["-ctv"], opt["-fa"], opt["-t"]))]
n = int(opt["-n"])
print(json.dumps([dict(n_prompt=0, n_gen=n, n_depth=int(opt["-d"]), flash_attn=opt["-fa"] == "1",
                       samples_ns=[int(ms * 1e6 * n)])]))
"""
#: llama-quantize that links the source instead of converting it (bench/llamacpp.quantize_command's arguments)
FAKE_QUANTIZE = """#!{python}
import os, sys
os.symlink(sys.argv[-4], sys.argv[-3])
"""


def _script(path, text, **kw):
    path.write_text(text.format(python=sys.executable, **kw))
    path.chmod(0o755)
    return str(path)


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    """One python -m bench decode run, tinyserve and llama.cpp through the fake llama-bench:
    (records, stdout, the fake's calls, the run's folder)."""
    tmp = tmp_path_factory.mktemp("fa")
    log = tmp / "calls.jsonl"
    bench = _script(tmp / "llama-bench", FAKE_BENCH, log=str(log), ms=repr(MS))
    _script(tmp / "llama-quantize", FAKE_QUANTIZE)
    out = tmp / "decode.json"
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        bd.main(["--model", "tiny", "--contexts", "64", "--batches", "1", "--providers", "tinyserve",
                 "--options", json.dumps(OPTS), "--steps", "2", "--rounds", "2", "--warmup", "1", "--warm-compile",
                 "--no-profile", "--prefill-cache", str(tmp / "snap"), "--out", str(out),
                 "--llamacpp", "Q4_1/F16,F16/F16,Q4_1/Q8_0", "--llamacpp-bench", bench, "--llamacpp-threads", "2", "1",
                 "--llamacpp-dir", str(tmp / "gguf")])
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    return json.loads(out.read_text()), text.getvalue(), calls, tmp


def _by_name(rows):
    return {r["provider"]: r for r in rows}


@pytest.mark.parametrize("config, won, on_ms, off_ms", [("Q4_1/F16", "fa=off t=2", 40.0, 26.0),
                                                        ("F16/F16", "fa=on t=1", 13.0, 20.0)])
def test_the_anchor_is_the_faster_setting_and_both_are_recorded(fake_run, config, won, on_ms, off_ms):
    rows = _by_name(fake_run[0])
    anchor = rows[f"llama.cpp {config}"]
    assert anchor["anchor"] is True and anchor["llamacpp_won"] == won
    assert anchor["ms_per_token"] == pytest.approx(min(on_ms, off_ms))
    assert anchor["flash_attn"] == won.split()[0][3:] and anchor["threads"] == int(won[-1])
    assert json.loads(anchor["options"])["flash_attn"] is (won.startswith("fa=on"))
    assert (anchor["fa_on_ms"], anchor["fa_off_ms"]) == pytest.approx((on_ms, off_ms))
    for fa in ("on", "off"):
        for t in (1, 2):
            row = rows[f"llama.cpp {config} fa={fa} t={t}"]
            assert row["anchor"] is False and row["flash_attn"] == fa and row["threads"] == t
            key = f"{config.split('/')[0]},{anchor['dtype'].split('/')[1]},{int(fa == 'on')},{t}"
            assert row["ms_per_token"] == pytest.approx(MS[key]) and row["steps"] == 2  # 2 rounds of one call
    assert json.loads(anchor["llamacpp_variants_ms"]) == pytest.approx(
        {f"fa={fa} t={t}": rows[f"llama.cpp {config} fa={fa} t={t}"]["ms_per_token"] for fa in ("on", "off")
         for t in (1, 2)})


def test_a_quantized_v_cache_runs_flash_attention_on_only(fake_run):
    rows, _, calls, _ = fake_run
    q8 = [r for r in rows if r.get("llamacpp_config") == "Q4_1/Q8_0"]
    assert sorted(r["provider"] for r in q8) == ["llama.cpp Q4_1/Q8_0", "llama.cpp Q4_1/Q8_0 fa=on t=1",
                                                 "llama.cpp Q4_1/Q8_0 fa=on t=2"]
    assert all("quantized V cache" in r["flash_attn_reason"] and r["flash_attn"] == "on" for r in q8)
    anchor = _by_name(q8)["llama.cpp Q4_1/Q8_0"]
    assert anchor["fa_off_ms"] is None and anchor["ms_per_token"] == pytest.approx(12.0)
    assert not [c for c in calls if c["-ctv"] == "q8_0" and c["-fa"] == "0"]
    assert all(r["flash_attn_reason"] == "" for r in rows if r.get("llamacpp_config") == "Q4_1/F16")


def test_both_settings_run_in_the_same_rounds(fake_run):
    """Every setting's warm-up call, then rounds of one call per setting: both settings of a config in each round."""
    calls = fake_run[2]
    n = len(MS)
    assert len(calls) == n * (1 + 2)  # --warmup's call and --rounds 2
    for k in range(3):
        assert sorted(",".join((c["-m"].rsplit(".", 2)[-2], c["-ctv"], c["-fa"], c["-t"]))
                      for c in calls[k * n: (k + 1) * n]) == sorted(MS)


def test_the_ratio_uses_the_faster_setting(fake_run):
    rows, stdout, _, tmp = fake_run
    by = _by_name(rows)
    ts = by["tinyserve"]["ms_per_token"]
    lines = lc.markdown_tables([rows]).splitlines()
    label = "tinyserve (float32)"
    assert f"| {label} | llama.cpp Q4_1/F16 | {26.0 / ts:.2f}x |" in lines
    assert f"| {label} | llama.cpp F16/F16 | {13.0 / ts:.2f}x |" in lines
    ratio_rows = [x for x in lines if x.startswith(f"| {label} | llama.cpp")]
    assert len(ratio_rows) == 3  # the anchors only, not each setting
    assert f"| {label} | llama.cpp Q4_1/F16 | {26.0 / ts:.2f}x |" in stdout.splitlines()  # what bench decode prints
    assert "| llama.cpp Q4_1/F16 fa=on t=2 | 40.0 |" in lines  # every setting's ms is in the first table
    with open(tmp / "decode.csv") as f:
        csv_rows = {r["provider"]: r for r in csv.DictReader(f)}
    assert float(csv_rows["llama.cpp Q4_1/F16"]["fa_off_ms"]) == pytest.approx(26.0)
    assert csv_rows["llama.cpp Q4_1/F16"]["llamacpp_won"] == "fa=off t=2"


def test_records_from_before_both_settings_are_marked_on_only():
    old = [dict(provider="tinyserve", context=2048, batch=1, ms_per_token=29.0, weights="fp32", dtype="float32"),
           dict(provider="llama.cpp F32/F32", context=2048, batch=1, ms_per_token=39.9, weights="F32",
                dtype="F32/f32")]
    text = lc.markdown_tables([old])
    assert "| tinyserve (float32) | llama.cpp F32/F32 | 1.38x |" in text.splitlines()
    assert "llama.cpp F32/F32: records from before flash attention off was timed" in text


class _FakeLlama:
    """What LlamaCppProvider uses of llama_cpp.Llama: it records its keywords and evaluates nothing."""

    made = []

    def __init__(self, **kw):
        self.kw, self.n_tokens = kw, 0
        _FakeLlama.made.append(kw)

    def eval(self, ids):
        self.n_tokens += len(ids)

    def close(self):
        pass


def test_llama_cpp_python_makes_one_model_per_setting(monkeypatch):
    fake = types.SimpleNamespace(__version__="0", Llama=_FakeLlama,
                                 llama_print_system_info=lambda: b"CPU : AVX2 = 1 | FMA = 1 |")
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    a = argparse.Namespace(llamacpp="Q4_1/F16,Q4_1/Q8_0", llamacpp_bench=None, llamacpp_dir="unused",
                           llamacpp_state="none", llamacpp_threads=None)
    ps = lc.providers_from_args(a, lambda n: list(range(n)), 2, lambda _: None)
    assert [p.name for p in ps] == ["llama.cpp Q4_1/F16 fa=on", "llama.cpp Q4_1/F16 fa=off",
                                    "llama.cpp Q4_1/Q8_0 fa=on"]
    _FakeLlama.made.clear()
    for p in ps:
        p.prepare(8, 3, 1)
    assert [kw["flash_attn"] for kw in _FakeLlama.made] == [True, False, True]
    assert [kw["type_v"] for kw in _FakeLlama.made] == [1, 1, 8]
    with pytest.raises(ValueError, match="quantized V cache"):
        lc.LlamaBenchProvider("Q4_1/Q8_0", ps[0].gguf_path, 2, "llama-bench", flash_attn=False)


def test_saved_fills_of_the_two_settings_differ():
    from tinyserve_compile.smollm2 import smollm2_gguf_path

    src = str(smollm2_gguf_path())
    on, off = (lc.LlamaCppProvider("Q4_1/F16", src, 2, None, "/s", flash_attn=fa) for fa in (True, False))
    assert on.state_path(64, 70, [1, 2]) != off.state_path(64, 70, [1, 2])
    assert lc.llama_bench_command("lb", "m", 64, 2, 1, "f16", False)[11:13] == ["-fa", "0"]
    assert lc.kv_bytes(30, 3, 64, 2048, "q8_0") == 2 * 30 * 3 * 64 * 2048 * 34 // 32


def test_llama_bench_refuses_a_cache_type_it_has_not():
    """llama-bench's -ctk/-ctv take no f32: an F32/F32 config through --llamacpp-bench is refused by name before
    anything runs (llama-cpp-python's contexts take it)."""
    from tinyserve_compile.smollm2 import smollm2_gguf_path

    pytest.importorskip("gguf")
    with pytest.raises(ValueError, match="--llamacpp-bench: llama-bench takes no f32 KV cache"):
        lc.LlamaBenchProvider("F32/F32", smollm2_gguf_path(), 2, "llama-bench")


def test_one_flash_attention_setting_can_be_asked_for_and_the_records_say_so(monkeypatch):
    """--llamacpp-flash-attn on|off (a fill too long for the other setting) times that one only; the providers'
    records say which was left out; a quantized V cache cannot run "off"; an unknown choice is refused by name."""
    assert [(c, fa) for c, fa, _, _ in lc.provider_settings(["Q4_0/F16", "F32/F32"], [2], "off")] == \
        [("Q4_0/F16", False), ("F32/F32", False)]
    with pytest.raises(ValueError, match="flash attention on only"):
        lc.provider_settings(["Q4_1/Q8_0"], [2], "off")
    assert [fa for _, fa, _, _ in lc.provider_settings(["Q4_0/F16"], [2], "on")] == [True]
    assert [fa for _, fa, _, _ in lc.provider_settings(["Q4_0/F16"], [2])] == [True, False]
    assert lc.flash_attn_settings("f16", "off") == ([False], "flash attention on not timed "
                                                             "(--llamacpp-flash-attn off)")
    assert lc.flash_attn_settings("q8_0", "on") == ([True], "flash attention on only: llama.cpp needs it for a "
                                                            "quantized V cache (q8_0)")
    with pytest.raises(ValueError, match="--llamacpp-flash-attn"):
        lc.flash_attn_settings("f16", "maybe")
    p = argparse.ArgumentParser()
    lc.add_arguments(p)
    assert p.parse_args([]).llamacpp_flash_attn == "both"
    # the providers made from the arguments: one setting, and their records' reason says which was left out
    fake = types.SimpleNamespace(__version__="0", Llama=_FakeLlama,
                                 llama_print_system_info=lambda: b"CPU : AVX2 = 1 | FMA = 1 |")
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    a = argparse.Namespace(llamacpp="Q4_1/F16", llamacpp_bench=None, llamacpp_dir="unused", llamacpp_state="none",
                           llamacpp_threads=None, llamacpp_flash_attn="off")
    (provider,) = lc.providers_from_args(a, lambda n: list(range(n)), 2, lambda _: None)
    assert provider.name == "llama.cpp Q4_1/F16 fa=off" and not provider.flash_attn
    assert provider.flash_attn_reason == "flash attention on not timed (--llamacpp-flash-attn off)"
