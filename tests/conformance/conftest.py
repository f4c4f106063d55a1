"""The conformance suite's set-up: the Triton kernels imported for the interpreter, and the table of the worst
mismatches printed at the end of the run (``pytest -s`` not needed: it is a terminal summary)."""
from __future__ import annotations

import pytest

from tests.support.conformance_cases import FUZZ, RESULTS  # one row per test: filled by the tests, printed below


@pytest.fixture(scope="session")
def triton_interpreted():
    """The Triton kernel modules, imported so that their kernels run in the interpreter (skips without triton)."""
    from tests.support.triton_interp import _import_interpreted

    return (_import_interpreted("tinyserve_compile.kernels.triton_sparse_decode"),
            _import_interpreted("tinyserve_compile.kernels.triton_bounds"))


def pytest_terminal_summary(terminalreporter):
    if FUZZ:
        terminalreporter.section("conformance: fuzz counts (test_fuzz.py)")
        for line in FUZZ:
            terminalreporter.write_line(line)
    if not RESULTS:
        return
    tr = terminalreporter
    tr.section("conformance: worst mismatch per implementation")
    tr.write_line(f"{'implementation':<16}{'cases':>6}{'worst |err|':>13}{'err/tol':>9}{'set diffs':>10}"
                  f"{'bounds diffs':>14}  worst case")
    by_impl: dict = {}
    for r in RESULTS:
        by_impl.setdefault(r["impl"], []).append(r)
    for impl, rows in by_impl.items():
        worst = max(rows, key=lambda r: r.get("ratio", 0.0))
        tr.write_line(f"{impl:<16}{len(rows):>6}{worst.get('err', 0.0):>13.3e}{worst.get('ratio', 0.0):>9.3f}"
                      f"{sum(r.get('set_diffs', 0) for r in rows):>10}{sum(r.get('bound_diffs', 0) for r in rows):>14}"
                      f"  {worst['case']}")
