"""bench/onnx_decode.py runs end to end on a tiny model and reports every requested provider."""
from __future__ import annotations

import json


def test_bench_onnx_dry_run(tmp_path, capsys):
    from bench.onnx_decode import main

    out = tmp_path / "onnx.json"
    rows = main(["--model", "tiny", "--contexts", "100", "--budget", "32", "--steps", "1", "--rounds", "1",
                 "--warmup", "1", "--providers", "eager", "ort-dense", "ort-tinyserve", "--label", "test",
                 "--export-dir", str(tmp_path / "exports"), "--out", str(out)])
    assert [r["provider"] for r in rows] == ["eager (HF SDPA)", "ONNX Runtime CPU, dense export",
                                            "ONNX Runtime CPU, tinyserve export B32"]
    assert all(r["ms_per_token"] > 0 and r["bytes_per_step"] > r["kv_bytes_per_token"] for r in rows)
    assert rows[2]["kv_bytes_per_token"] < rows[1]["kv_bytes_per_token"]  # the sparse layers read fewer bytes
    assert json.loads(out.read_text())[0]["label"] == "test"
    assert out.with_suffix(".csv").exists() and out.with_suffix(".png").exists()
    assert "TensorRT" not in capsys.readouterr().out
