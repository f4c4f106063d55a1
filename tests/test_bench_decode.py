"""bench/decode.py on a tiny random Llama: the record schema, the outputs, the prefill snapshot, and
that the left-padded batch rows decode exactly like each row alone. No timing is asserted."""
from __future__ import annotations

import csv
import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from bench import decode as bd  # noqa: E402

OPTS = {"token_budget": 16, "page_size": 8, "candidate_extra": 16, "lower": "eager"}  # sparse at 64 tokens
#: every record carries these, with these types
SCHEMA = {"provider": str, "context": int, "batch": int, "ms_per_token": float, "tokens_per_s": float,
          "compile_s": float, "first_call_s": float, "kv_bytes_per_step": int, "weight_bytes": int,
          "stream_gbps": float, "floor_ms": float, "pct_of_floor": float, "row_lengths": str, "steps": int,
          "sparse_sites": int, "timed_bounds_rebuilds": int, "options": str, "model": str, "dtype": str}


def test_row_lengths():
    assert bd.row_lengths(2048, 1) == [2048]
    lens = bd.row_lengths(2048, 8)
    assert lens[0] == 2048 and lens[-1] == 2048 * 9 // 16 and len(set(lens)) == 8
    with pytest.raises(ValueError, match="batches"):
        bd.row_lengths(2048, 0)
    with pytest.raises(ValueError, match="providers"):
        bd.provider_names(["eager", "vllm"], False, None)


def test_runner_json_schema_and_outputs(tmp_path):
    out = tmp_path / "decode.json"
    snaps = tmp_path / "snap"
    bd.main(["--model", "tiny", "--contexts", "64", "--batches", "1", "3", "--providers", "eager,tinyserve",
             "--compare", "paper", "--options", json.dumps(OPTS), "--steps", "2", "--rounds", "1", "--warmup", "1",
             "--warm-compile", "--prefill-cache", str(snaps), "--out", str(out)])
    rows = json.loads(out.read_text())
    assert isinstance(rows, list)
    assert [(r["batch"], r["provider"]) for r in rows] == [
        (b, p) for b in (1, 3) for p in ("eager", "tinyserve", "tinyserve-paper")]
    for r in rows:
        for key, typ in SCHEMA.items():
            assert isinstance(r[key], typ), (key, r[key])
        assert r["context"] == 64 and r["steps"] == 2 and r["ms_per_token"] > 0 and r["floor_ms"] > 0
        assert r["vs_best_stock"] == pytest.approx(r["best_stock_ms"] / r["ms_per_token"])
    ts = [r for r in rows if r["provider"].startswith("tinyserve")]
    assert all(r["sparse_sites"] >= 2 for r in ts), ts  # 4 layers, the first 2 dense (at run time)
    assert json.loads(ts[1]["options"]) == dict(OPTS, **bd.cli.PRESETS["paper"])
    # the paper's pages of 16 keep 1 page of 16 tokens: fewer K/V bytes than dense eager
    assert all(r["kv_bytes_per_step"] < rows[0]["kv_bytes_per_step"] * r["batch"] for r in ts)
    assert rows[3]["row_lengths"] == "64,54,44"
    with open(tmp_path / "decode.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert (tmp_path / "decode.png").stat().st_size > 0
    # the prefill snapshot is on disk and reused
    (snap,) = snaps.iterdir()
    mtime = snap.stat().st_mtime_ns
    model, name = bd.model_for("tiny", 64, torch.float32, torch.device("cpu"))
    assert bd.prefill_snapshot(model, name, 64, str(snaps)) == str(snap)
    assert snap.stat().st_mtime_ns == mtime


@torch.no_grad()
def test_left_padded_rows_decode_like_each_row_alone(tmp_path):
    """The batch the benchmark builds (right-aligned rows, 2-D mask, per-row positions) gives every row the
    logits of that row decoded alone from its own prefix."""
    from transformers import StaticCache

    model, name = bd.model_for("tiny", 48, torch.float32, torch.device("cpu"))
    lens = bd.row_lengths(48, 4)
    ctx, max_len = 48, 52
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    model(input_ids=torch.zeros(4, 1, dtype=torch.long), cache=cache, use_cache=True)
    bd.fill_cache(cache, model, name, lens, "prefill", str(tmp_path))
    mask = torch.ones(4, max_len, dtype=torch.long)
    for r, n in enumerate(lens):
        mask[r, : ctx - n] = 0
    toks = torch.tensor([[7], [8], [9], [10]])
    got = model(input_ids=toks, position_ids=torch.tensor(lens)[:, None], attention_mask=mask, cache=cache,
                use_cache=True).logits[:, -1]
    ids = bd._prompt_ids(name, ctx)
    for r, n in enumerate(lens):  # stock HF: prefill the row's own tokens, then one decode step
        one = StaticCache(config=model.config, max_cache_len=n + 4)
        model(input_ids=ids[:, :n], cache=one, use_cache=True)
        want = model(input_ids=toks[r:r + 1], cache=one, use_cache=True).logits
        torch.testing.assert_close(got[r], want[0, -1], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got[0], got[1], atol=1e-3)  # the rows really differ


def test_compile_options_reach_both_compiled_providers():
    guard = torch.compiler.skip_guard_on_all_nn_modules_unsafe
    io = {"cpp_wrapper": True}
    assert bd.compile_options("eager", None, io, True) is None
    assert bd.compile_options("inductor", None, io, True) == {"cpp_wrapper": True, "guard_filter_fn": guard}
    ts = bd.compile_options("tinyserve", {"token_budget": 16}, io, True)
    assert ts == {"token_budget": 16, "inductor_options": io, "guard_filter_fn": guard}
    # a tinyserve provider's own inductor_options win over the command line's, key by key
    ts = bd.compile_options("tinyserve", {"inductor_options": {"cpp_wrapper": False}}, {**io, "freezing": True})
    assert ts == {"inductor_options": {"cpp_wrapper": False, "freezing": True}}
    assert bd.compile_options("inductor", None) == {}


@pytest.mark.parametrize("flag, value, match", [("--inductor-options", "{bad", "not JSON"),
                                                ("--inductor-options", "[1]", "JSON object"),
                                                ("--inductor-options", '{"nope": 1}', "unknown")])
def test_inductor_options_flag_errors(flag, value, match, capsys):
    with pytest.raises(SystemExit):
        bd.main(["--model", "tiny", "--contexts", "64", "--batches", "1", flag, value])
    assert match in capsys.readouterr().err


def test_inductor_options_and_module_guards_in_rows(tmp_path):
    out = tmp_path / "decode.json"
    io = {"freezing": True}
    rows = bd.main(["--model", "tiny", "--contexts", "64", "--batches", "1", "--providers", "eager,inductor,tinyserve",
                    "--options", json.dumps({"token_budget": 16, "page_size": 8}), "--steps", "1", "--rounds", "1",
                    "--warmup", "1", "--warm-compile", "--prefill-cache", str(tmp_path / "snap"),
                    "--inductor-options", json.dumps(io), "--skip-module-guards", "--out", str(out)])
    assert [r["provider"] for r in rows] == ["eager", "inductor", "tinyserve"]
    by = {r["provider"]: r for r in json.loads(out.read_text())}
    assert by["eager"]["inductor_options"] == "" and by["eager"]["skip_module_guards"] is False
    for p in ("inductor", "tinyserve"):
        assert json.loads(by[p]["inductor_options"]) == io and by[p]["skip_module_guards"] is True
    assert json.loads(by["tinyserve"]["options"])["inductor_options"] == io
    assert by["tinyserve"]["sparse_sites"] >= 2
    from bench.timing import cpu_isa

    assert all(r["isa"] == cpu_isa() and r["cpu"] for r in by.values())  # every figure says where it was measured
    assert all(r["aten_isa"] == torch.backends.cpu.get_cpu_capability() and r["native_isa"] for r in by.values())


@pytest.mark.parametrize("flags, isa", [
    ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16", "avx2", "fma"},
     "AVX-512 (VNNI, BF16)"),
    ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"}, "AVX-512"),
    ({"avx2", "fma", "avx"}, "AVX2"),  # AMD Zen 3
    ({"sse4_2"}, "baseline"),
])
def test_cpu_isa_names(flags, isa):
    from bench.timing import cpu_isa

    assert cpu_isa(flags) == isa


def test_cudagraphs_providers_and_their_compile_calls():
    """The providers run in the order given; the CUDA-graphs ones compile with mode="reduce-overhead", or through
    options where options are given (torch.compile takes one of the two), and are skipped off CUDA."""
    names = [n for n, _ in bd.provider_names(["eager", "inductor-cudagraphs", "tinyserve-cudagraphs", "inductor",
                                              "tinyserve"], bd.cli.options_arg("paper"), None)]
    assert names == ["eager", "inductor-cudagraphs", "tinyserve-cudagraphs", "inductor", "tinyserve",
                     "tinyserve-paper"]
    assert set(bd.STOCK) == {"eager", "inductor", "inductor-cudagraphs", "inductor-flex", "inductor-flex-cudagraphs"}
    assert bd.compile_call("eager", None) == {}
    assert bd.compile_call("inductor", None) == {"backend": "inductor", "dynamic": False, "options": None}
    assert bd.compile_call("inductor-cudagraphs", None) == {"backend": "inductor", "dynamic": False,
                                                            "mode": "reduce-overhead"}
    assert bd.compile_call("tinyserve-cudagraphs", {}) == {"backend": "tinyserve", "dynamic": False,
                                                           "mode": "reduce-overhead"}
    # with options: Inductor's own CUDA-graphs setting, tinyserve's cudagraphs option
    call = bd.compile_call("inductor-cudagraphs", None, {"freezing": True})
    assert "mode" not in call and call["options"]["triton.cudagraphs"] is True and call["options"]["freezing"]
    call = bd.compile_call("tinyserve-cudagraphs B64", {"token_budget": 64})
    assert call["options"] == {"token_budget": 64, "cudagraphs": True} and "mode" not in call
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert "CUDA device" in bd.skip_reason("inductor-cudagraphs", cpu, None)
    assert bd.skip_reason("tinyserve", cpu, {"token_budget": 64}) is None
    assert bd.skip_reason("inductor-cudagraphs", cuda, None) is None
    assert bd.wants_cudagraphs("tinyserve-cudagraphs B64") and not bd.wants_cudagraphs("tinyserve-paper")


def test_cache_keyword_follows_the_transformers_version():
    """transformers 5.24 takes the cache as `cache`, 5.17 and 4.x as `past_key_values` (5.17 drops a `cache=`
    silently: the static cache would never be written)."""
    from bench.harness import allocate_cache, cache_kwarg
    from transformers import StaticCache

    model, _ = bd.model_for("tiny", 64, torch.float32, torch.device("cpu"))
    import inspect

    want = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    assert cache_kwarg(model) == want

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs):
            return input_ids

    assert cache_kwarg(Old()) == "past_key_values"
    cache = StaticCache(config=model.config, max_cache_len=16)
    allocate_cache(model, cache, batch=2)  # lazily created layers, allocated and rolled back to empty
    assert all(layer.keys.shape[0] == 2 and int(layer.cumulative_length) == 0 and not layer.keys.any()
               for layer in cache.layers)


def test_step_profile_counts_host_reads_on_cpu():
    from bench.timing import step_profile

    x = torch.arange(4.0)
    prof = step_profile(lambda: [x.sum().item() for _ in range(3)], torch.device("cpu"))
    assert prof["item_calls"] == 3 and prof["host_syncs"] == 3
    assert prof["gpu_kernels"] is None and prof["cudagraph_replayed"] is None


def test_llama3_8b_shape_and_layers():
    """The Llama-3-8B shape, cut to its first layers, made on the device in its dtype (the meta device here)."""
    model = bd._random_llama("llama3-8b", 1, "meta", torch.bfloat16)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size,
            cfg.vocab_size, cfg.num_hidden_layers) == (4096, 32, 8, 128, 14336, 128256, 1)
    assert next(model.parameters()).dtype == torch.bfloat16 and next(model.parameters()).device.type == "meta"
    assert bd.SHAPES["llama3-8b"]["num_hidden_layers"] == 32
    assert bd.model_shape("random") == "smollm2" and bd.model_kind("auto", 32768) == "random"


def test_time_budget_skips_and_points(tmp_path):
    """--points runs those (context, batch) pairs; a spent --time-budget skips the compiled providers (eager still
    runs) and says so in their records; the JSON is there."""
    out = tmp_path / "decode.json"
    rows = bd.main(["--model", "tiny", "--points", "48x1", "--providers", "eager,tinyserve",
                    "--compare", "paper", "--options", json.dumps(OPTS), "--steps", "1", "--rounds", "2", "--warmup", "1",
                    "--warm-compile", "--prefill-cache", str(tmp_path / "snap"), "--time-budget", "0",
                    "--no-profile", "--out", str(out)])
    assert [(r["context"], r["batch"], r["provider"]) for r in rows] == [
        (48, 1, "eager"), (48, 1, "tinyserve"), (48, 1, "tinyserve-paper")]
    assert rows[0]["ms_per_token"] > 0
    assert all(r["ms_per_token"] is None and r["skipped"].startswith("time budget") for r in rows[1:])
    assert rows[0]["steps"] == 1  # the interleaved rounds were dropped: the budget was spent
    assert [r["provider"] for r in json.loads(out.read_text())] == [r["provider"] for r in rows]


def _children() -> list:
    """Pids of this process's live (not zombie) child processes, from /proc."""
    import os

    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                kids.append(int(d))
    return kids


def test_busy_neighbours_run_beside_the_block_and_stop_after_it():
    from bench.timing import busy_neighbours

    before = set(_children())
    with busy_neighbours(2):
        assert len(set(_children()) - before) == 2
    assert set(_children()) - before == set()
    with pytest.raises(ValueError, match="'n'"):
        with busy_neighbours(-1):
            pass


def test_neighbours_and_the_wait_policy_are_in_the_records(tmp_path, monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "1234")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    out = tmp_path / "decode.json"
    bd.main(["--model", "tiny", "--contexts", "64", "--batches", "1", "--providers", "eager", "--options",
             json.dumps(OPTS), "--steps", "2", "--rounds", "1", "--warmup", "1", "--neighbours", "1",
             "--no-profile", "--prefill-cache", str(tmp_path / "snap"), "--out", str(out)])
    (row,) = json.loads(out.read_text())
    assert row["neighbours"] == 1 and row["gomp_spincount"] == "1234" and row["omp_wait_policy"] is None


@torch.no_grad()
def test_flex_providers_decode_through_flex_attention_like_sdpa(monkeypatch, tmp_path):
    """The GQA-native dense providers (issue 51, item 5) run the model's attention through transformers'
    FlexAttention inside their steps only (every layer, the config restored after), are stock providers (the anchor
    of vs_best_stock), and decode a left-padded batch with the logits of HF's SDPA path: the static cache has
    unwritten slots, which transformers' own flex mask attends one of (its query offset read after the cache's
    update), and the provider's mask does not."""
    from transformers import StaticCache
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert {"inductor-flex", "inductor-flex-cudagraphs"} <= set(bd.STOCK)
    assert bd.attention_of("inductor-flex-cudagraphs") == bd.attention_of("inductor-flex") == "flex_attention"
    assert bd.attention_of("inductor-cudagraphs") is None and bd.attention_of("tinyserve B64") is None
    assert bd.wants_cudagraphs("inductor-flex-cudagraphs") and not bd.wants_cudagraphs("inductor-flex")
    assert bd.compile_call("inductor-flex-cudagraphs", None) == {"backend": "inductor", "dynamic": False,
                                                                 "mode": "reduce-overhead"}
    model, name = bd.model_for("tiny", 40, torch.float32, torch.device("cpu"))
    lens, ctx, max_len = bd.row_lengths(40, 3), 40, 44
    mask = torch.ones(3, max_len, dtype=torch.long)
    for r, n in enumerate(lens):
        mask[r, : ctx - n] = 0
    toks, pos = torch.tensor([[7], [8], [9]]), torch.tensor(lens)[:, None]
    flex = ALL_ATTENTION_FUNCTIONS["flex_attention"]
    calls = []

    def counting(module, query, key, *args, **kwargs):
        calls.append((query.shape[1], key.shape[1]))  # query and KV heads: GQA reaches it unrepeated
        return flex(module, query, key, *args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, "flex_attention", counting)
    before = model.config._attn_implementation
    logits = {}
    for impl in (None, "flex_attention"):
        cache = StaticCache(config=model.config, max_cache_len=max_len)
        model(input_ids=torch.zeros(3, 1, dtype=torch.long), cache=cache, use_cache=True)
        bd.fill_cache(cache, model, name, lens, "prefill", str(tmp_path))
        with bd.attention_implementation(model, impl):
            logits[impl] = model(input_ids=toks, position_ids=pos, attention_mask=mask, cache=cache,
                                 use_cache=True).logits[:, -1]
        assert model.config._attn_implementation == before
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert "flex_attention" not in ALL_MASK_ATTENTION_FUNCTIONS._local_mapping  # the mask builder restored too
    cfg = model.config
    assert calls == [(cfg.num_attention_heads, cfg.num_key_value_heads)] * cfg.num_hidden_layers
    assert cfg.num_attention_heads > cfg.num_key_value_heads
    torch.testing.assert_close(logits["flex_attention"], logits[None], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(logits[None][0], logits[None][1], atol=1e-3)  # the rows really differ
