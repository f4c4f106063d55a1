"""``python -m bench ab``: one backend change compiled on and off in one process, timed side by side. A tiny
model, two short rounds: the rows, the counts of what each variant compiled, and the files; no timing is asserted."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import ab  # noqa: E402


def _spy_counters(monkeypatch, keys):
    """Patch ``ab.switched`` to record ``(on, *counters[keys])`` of each variant's compile, read when its switch
    is released; returns the list it fills."""
    import tinyserve_compile as tc

    seen = []
    real = ab.switched

    def spy(switch, on):
        cm = real(switch, on)

        class Wrap:
            def __enter__(self):
                tc.reset()
                return cm.__enter__()

            def __exit__(self, *exc):
                seen.append((on, *(tc.counters[k] for k in keys)))
                return cm.__exit__(*exc)
        return Wrap()

    monkeypatch.setattr(ab, "switched", spy)
    return seen


def test_group_switch_compiles_both_variants(tmp_path, monkeypatch):
    grouped = _spy_counters(monkeypatch, ["linear_grouped"])
    rows = ab.run("group", 256, steps=2, rounds=2, model_kind="tiny", log=lambda *a: None)
    assert [r["variant"] for r in rows] == ["on", "off"]
    assert all(r["ms_per_token"] > 0 and r["off_over_on"] > 0 for r in rows)
    assert grouped == [(True, 4 * 5), (False, 0)]  # 4 layers x (q, k, v, gate, up) grouped only when on
    out = tmp_path / "ab.json"
    monkeypatch.setattr(ab, "run", lambda *a, **k: rows)
    assert ab.main(["--switch", "group", "--json", str(out)]) == 0
    assert json.loads(out.read_text()) == rows
    assert out.with_suffix(".csv").exists() and out.with_suffix(".png").exists()


def test_unknown_switch_is_named():
    with pytest.raises(ValueError, match="switch"):
        ab.run("fast", 256, model_kind="tiny")


def test_huge_pages_switch_runs_the_on_variant_on_the_copy(monkeypatch):
    import torch

    from bench import bench_op

    copies = []
    real = bench_op.on_huge_pages

    def spy(t):
        h = real(t)
        copies.append((t, h))
        return h

    monkeypatch.setattr(bench_op, "on_huge_pages", spy)
    rows = ab.run("huge-pages", 256, steps=2, rounds=2, model_kind="tiny", log=lambda *a: None)
    assert [r["variant"] for r in rows] == ["on", "off"]
    assert all(r["ms_per_token"] > 0 and r["switch"] == "huge-pages" for r in rows)
    assert len(copies) == 2 * 4  # keys and values of the tiny model's 4 layers
    for src, huge in copies:  # [1, Hkv, 256 + 4, D]: the filled context copied, then the on variant's own steps
        assert huge.data_ptr() != src.data_ptr() and huge.is_contiguous()
        assert torch.equal(huge[:, :, :256], src[:, :, :256])
        assert bool(huge[:, :, 256:258].abs().sum() > 0), "the on variant did not write its steps into the copy"


def test_int4_plain_switch_compiles_the_plain_model_only_when_on(monkeypatch):
    pytest.importorskip("torchao")
    calls = _spy_counters(monkeypatch, ["linear_int4_calls", "linear_int4_rewritten"])
    rows = ab.run("int4-plain", 256, weights="int4", steps=2, rounds=2, model_kind="tiny", log=lambda *a: None)
    assert [r["variant"] for r in rows] == ["on", "off"] and all(r["ms_per_token"] > 0 for r in rows)
    on, off = calls
    assert on[0] and on[1] > 0 and on[2] == 0, calls  # Int4Linear modules: their own calls, nothing to rewrite
    assert not off[0] and off[1] == 0, calls  # torchao's weights: F.linear, rewritten or kept
    with pytest.raises(ValueError, match="--weights int4"):
        ab.run("int4-plain", 256, weights="fp32", model_kind="tiny")
