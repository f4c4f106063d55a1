"""The client sweep (``python -m bench clients``) on the one client CI has installed: transformers' ``generate()``
with a static cache, run by the sweep's own driver in this interpreter, and the sweep's table and files."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from bench import client_drivers, clients  # noqa: E402
from tests.support.backend_state import _fresh_backend_state  # noqa: E402,F401  (autouse: fresh state per test)


@pytest.fixture(scope="module")
def hf_row():
    return client_drivers.drive("hf-static", "eager")


def test_hf_generate_static_cache_row(hf_row):
    """Every layer rewritten, equal to the reference rule on the rewritten layers, different from dense eager
    (the selection dropped pages), and dense-exact with a budget covering the context."""
    r = hf_row
    assert r["attention_sites"] == 3 and r["sites_rewritten"] == 3 and r["sites_dense"] == 0, r
    assert r["layers_rewritten"] == "3/3" and r["dense_reasons"] == []
    assert r["decode_calls"] == r["reference_sparse_calls"] == 3 * (client_drivers.NEW - 1), r
    assert r["worst_vs_reference"] < 1e-4 and r["tokens_equal_reference"], r
    assert r["sparse_vs_eager"] > 1e-2, r
    assert r["dense_exact"] and r["worst_dense_vs_eager"] < 1e-4, r
    assert clients.verdict(r) == "ok"


def test_table_and_files(hf_row, tmp_path):
    rows = [hf_row, dict(client="x", error="RuntimeError: boom"), dict(client="y", skipped="not on PyPI"),
            dict(hf_row, client="z", tokens_equal_reference=False)]
    assert [clients.verdict(r) for r in rows] == ["ok", "error", "skipped", "WRONG"]
    md = tmp_path / "clients.md"
    clients.write(rows, tmp_path / "clients.json", md, "eager")
    saved = json.loads((tmp_path / "clients.json").read_text())
    assert [r["verdict"] for r in saved] == ["ok", "error", "skipped", "WRONG"]
    assert (tmp_path / "clients.csv").read_text().splitlines()[0].startswith("client,")
    text = md.read_text()
    assert "| hf-static | ok | transformers==" in text and "| x | error |" in text and "boom" in text
    assert "mistral-inference" in text  # the clients not in the sweep, with their reasons


def test_unknown_client_is_named():
    with pytest.raises(SystemExit, match="nope"):
        clients.main(["--only", "nope"])
