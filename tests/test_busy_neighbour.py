"""bench/busy_neighbour.py: the neighbour process, and a dry run of the op benchmark (no timing asserted)."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench import busy_neighbour as bn  # noqa: E402
from tinyserve_compile.kernels.native import load_native, native_unavailable_reason  # noqa: E402


def _nice_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def test_neighbour_runs_at_its_nice_level_and_stops():
    with bn.BusyNeighbour(seconds=60, nice=5) as nb:
        assert nb.proc.poll() is None
        assert _nice_of(nb.proc.pid) == 5
    assert nb.proc.poll() is not None


def test_neighbour_stops_by_itself():
    with bn.BusyNeighbour(seconds=0.3) as nb:
        assert nb.proc.wait(timeout=60) == 0


@pytest.mark.parametrize("bad", [{"nice": -1}, {"seconds": 0}])
def test_neighbour_rejects_bad_arguments(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        bn.BusyNeighbour(**bad)


@pytest.mark.skipif(not load_native(), reason=f"native kernel unavailable: {native_unavailable_reason()}")
def test_quick_run_writes_every_variant(tmp_path):
    path = str(tmp_path / "op.json")
    rows = bn.main(["--quick", "--calls", "2", "--json", path])
    assert {(r["neighbour"], r["variant"]) for r in rows} == {
        (nb, v) for nb in ("none", "busy (nice 0)") for v in bn.VARIANTS}
    assert all(r["calls"] == 2 and r["mean_us"] > 0 for r in rows)
    with open(path) as f:
        assert json.load(f) == rows
    assert os.path.exists(str(tmp_path / "op.csv"))
