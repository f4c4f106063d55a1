"""bench/gpu_check.py: the summary of a GPU check from the files its steps leave, here made up as a CUDA run's
would be (no GPU needed); and the env step on this machine. No timing is asserted."""
from __future__ import annotations

import csv
import json

from bench import gpu_check


def _decode_row(provider, ctx, batch, ms, best, **kw):
    row = dict(provider=provider, context=ctx, batch=batch, ms_per_token=ms, vs_best_stock=None if ms is None else
               best / ms, best_stock="inductor-cudagraphs", compile_s=None if ms is None else 10.0,
               cold_compile=False, floor_ms=0.1, model="random-init llama (Llama-3-8B shape)", shape="llama3-8b",
               layers=8, full_model_layers=32, dtype="bfloat16", device="cuda", skipped="", failed="",
               complete=True, cudagraphs="off", cudagraphs_why="not asked for", gpu_kernels_per_step=120,
               launch_calls_per_step=120, host_syncs_per_step=0)
    row.update(kw)
    return row


def _write(tmp_path):
    (tmp_path / "steps.tsv").write_text("env\t0\t14\t20\nkernel\t0\t58\t70\ndecode_smollm\t0\t160\t175\n"
                                        "decode_8b\t124\t205\t205\n")
    (tmp_path / "env.json").write_text(json.dumps(dict(device="NVIDIA H200", driver="580.159.04", torch="2.11.0",
                                                       cuda="13.0", triton="3.6.0", transformers="5.17.0",
                                                       commit="abc1234", dry_run=False)))
    kernel = tmp_path / "kernel"
    kernel.mkdir()
    rows = [dict(setting="defaults", stages=2, kept="tokens", bounds_dtype="int8", context=32768, batch=8, dtype="bf16",
                 ok=True, tol_ratio=0.2, pages_agree=1.0, oracle="reference", sparse_graph_ms=0.1, sparse_ms=0.12,
                 best_sdpa="sdpa_flash", speedup_vs_sdpa=7.5, speedup_basis="cudagraph", speedup_vs_sdpa_plain=6.0,
                 speedup_vs_sdpa_graph=7.5, speedup_vs_dense=5.0, sparse_gbs=2000.0, sparse_pct_peak=47.0,
                 sparse_pct_datasheet=42.0, sparse_graph_error="")]
    targets = [dict(target="defaults: >= 7x the fastest SDPA at 32K batch 8", setting="defaults", context=32768,
                    batch=8, want=7.0, worst=7.5, met=True),
               dict(target="defaults: >= 12x the fastest SDPA at 128K batch 8", setting="defaults", context=131072,
                    batch=8, want=12.0, worst=None, met=None)]
    (kernel / "bench_kernel_gpu.json").write_text(json.dumps(dict(meta=dict(copy_gbs=4269.0, datasheet_gbs=4800.0),
                                                                  targets=targets, rows=rows)))
    smol = tmp_path / "decode_smollm"
    smol.mkdir()
    best = 2.0
    (smol / "decode.json").write_text(json.dumps([
        _decode_row("eager", 8192, 1, 6.0, best),
        _decode_row("inductor-cudagraphs", 8192, 1, 2.0, best, cudagraphs="on", cudagraphs_why="",
                    graph_launches_per_step=1, launch_calls_per_step=0),
        _decode_row("tinyserve-cudagraphs", 8192, 1, 2.5, best, cudagraphs="off",
                    cudagraphs_why="tinyserve: off: lower='eager'"),
        _decode_row("tinyserve", 8192, 1, None, best, skipped="time budget: 3 s left for this point"),
        _decode_row("eager", 32768, 1, 8.0, best),
        _decode_row("inductor-cudagraphs", 32768, 1, 3.0, 3.0, cudagraphs="on", cudagraphs_why=""),
        _decode_row("tinyserve-cudagraphs", 32768, 1, 1.5, 3.0, cudagraphs="on", cudagraphs_why=""),
    ]))
    big = tmp_path / "decode_8b"
    big.mkdir()
    (big / "decode.json").write_text(json.dumps([
        _decode_row("eager", 32768, 8, 20.0, 10.0),
        _decode_row("inductor-cudagraphs", 32768, 8, 10.0, 10.0, cudagraphs="on", cudagraphs_why=""),
        _decode_row("tinyserve-cudagraphs", 32768, 8, None, 10.0, skipped="FAILED: RuntimeError: boom",
                    failed="FAILED: RuntimeError: boom", complete=False),
    ]))


def test_summary_of_a_cuda_run(tmp_path, capsys):
    _write(tmp_path)
    assert gpu_check.summary(str(tmp_path), 437.0, 10) == 1  # decode_8b timed out
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["limits_total"] == 480 and not s["ok"]
    assert [x["state"] for x in s["steps"]] == ["ok", "ok", "ok", "TIMED OUT"]
    assert s["kernel_check"]["failures"] == 0 and s["kernel_peak"]["copy_gbs"] == 4269.0
    assert [t["met"] for t in s["kernel_targets"]] == [True, None]
    t = {(x["step"], x["context"]): x for x in s["decode_targets"]}
    # the best tinyserve row against the best stock provider of each point; a point not run: met None
    assert t[("decode_smollm", 8192)]["met"] is False and t[("decode_smollm", 8192)]["value"] == 0.8
    assert t[("decode_smollm", 32768)]["met"] is True and t[("decode_smollm", 32768)]["by"] == "tinyserve-cudagraphs"
    assert t[("decode_8b", 32768)]["met"] is None  # tinyserve failed there
    assert t[("decode_8b", None)]["met"] is None  # the 128K point never started
    assert len(s["decode"]) == 10 and {r["step"] for r in s["decode"]} == {"decode_smollm", "decode_8b"}
    with open(tmp_path / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 11 and rows[0]["section"] == "op"
    out = capsys.readouterr().out
    assert "NVIDIA H200" in out and "transformers 5.17.0" in out and "commit abc1234" in out
    assert "MISSED" in out and "-> met" in out and "time budget" in out and "FAILED: RuntimeError" in out
    assert "off: tinyserve: off: lower='eager'" in out
    assert out.rstrip().splitlines()[-1].startswith("SOME STEPS FAILED")
    assert len(out) < 8000  # the device's reply keeps the last 12,000 characters


def test_env_without_gpu(tmp_path, capsys):
    rc = gpu_check.env(str(tmp_path), dry_run=True)
    info = json.loads((tmp_path / "env.json").read_text())
    assert rc == 0 and info["dry_run"] and info["commit"]
    assert {"python", "torch", "triton", "transformers", "tinyserve_compile", "device", "driver"} <= set(info)
