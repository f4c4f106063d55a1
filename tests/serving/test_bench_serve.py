"""``python -m bench serve --quick`` runs end to end on the tiny model (eager providers: no compile in CI)."""
from __future__ import annotations

import json

from bench.serve import main, workload


def test_quick_run_writes_table_json_csv_png(tmp_path, capsys):
    out = tmp_path / "serve"
    assert main(["--quick", "--providers", "stock-eager,tinyserve", "--out", str(out)]) == 0
    data = json.loads((out / "serve.json").read_text())
    rows = {r["provider"]: r for r in data["rows"]}
    assert set(rows) == {"stock-eager", "tinyserve"}
    assert all(r["requests"] == 6 for r in rows.values())  # every request answered
    assert rows["tinyserve"]["sparse_rows"] > 0 and rows["tinyserve"]["steps"] > 0
    assert rows["tinyserve"]["kv_bytes_per_step"] < rows["tinyserve"]["dense_kv_bytes_per_step"]
    assert (out / "serve.csv").stat().st_size > 0 and (out / "serve.png").stat().st_size > 0
    assert "| tinyserve |" in capsys.readouterr().out


def test_workload_is_seeded_poisson_with_the_given_lengths():
    a = workload("tiny", 100, 50, [16, 64], 0.05, seed=3)
    b = workload("tiny", 100, 50, [16, 64], 0.05, seed=3)
    assert [(r.arrival, r.prompt) for r in a] == [(r.arrival, r.prompt) for r in b]
    assert {len(r.prompt) for r in a} == {16, 64}
    gaps = [y.arrival - x.arrival for x, y in zip(a, a[1:])]
    assert a[0].arrival == 0 and min(gaps) >= 0
    assert 0.02 < sum(gaps) / len(gaps) < 0.1  # mean interval 0.05 s (50 draws)


def test_a_provider_past_its_timeout_keeps_a_row_with_upper_bounds(tmp_path, capsys):
    out = tmp_path / "serve"
    # no warm-up and a timed run far shorter than 6 requests take: the run stops with a bounded row, no exception
    assert main(["--quick", "--providers", "stock-eager", "--warmup", "0", "--timeout", "0.05",
                 "--out", str(out)]) == 0
    (row,) = json.loads((out / "serve.json").read_text())["rows"]
    assert row["timed_out"] is True and row["requests"] < 6
    assert row["requests_per_s"] == 6 / row["wall_s"]  # every request over the time it ran: an upper bound
    assert row["tokens_per_s"] == 6 * 6 / row["wall_s"]
    assert "stock-eager (timed out) | <=" in capsys.readouterr().out
