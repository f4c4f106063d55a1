"""bench linear on one tiny shape: every method runs (no error rows) and the records carry the same-run bandwidth."""
from __future__ import annotations

import pytest
import torch

from bench.linear import run, table
from tinyserve_compile.kernels.linear import load_native_linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_run_has_every_method(dtype):
    records = run([1, 3], [1], [dtype], reps=1, autotune=False, shapes=((24, 32),), stack_bytes=16384)
    assert not [r for r in records if "error" in r], table(records)
    methods = {r["method"] for r in records}
    assert {"aten", "mv"} <= methods and ("native" in methods) == load_native_linear(), methods
    assert all(r["gbs"] > 0 and r["read_bw_gbs"] > 0 for r in records)
    assert "| 1 |" in table(records)


def test_tiny_int4_run_has_every_method():
    pytest.importorskip("torchao")
    from tinyserve_compile.kernels.linear import int4_layout_problem

    records = run([1, 3], [1], ["int4"], reps=1, autotune=False, shapes=((64, 64),), stack_bytes=16384)
    assert not [r for r in records if "error" in r], table(records)
    methods = {r["method"] for r in records}
    native = load_native_linear() and int4_layout_problem() is None
    assert {"aten", "torchao"} <= methods and ("native" in methods) == native, methods
    assert all(r["dtype"] == "int4" and r["gbs"] > 0 and r["read_bw_gbs"] > 0 for r in records)
    assert all(r["vs_aten"] > 0 for r in records)
    assert "| int4 | 1 | 64x64 | native |" in table(records) or not native


def test_shapes_flag_gives_each_models_linears(monkeypatch):
    """``--shapes llama3-8b llama3-1b``: q/o, k/v, gate/up, down and the head of each shape, in order, each once."""
    import bench.linear as bl

    seen = {}
    monkeypatch.setattr(bl, "run", lambda *a, **kw: seen.update(kw) or [])
    monkeypatch.setattr(bl, "table", lambda records: "")
    bl.main(["--shapes", "llama3-8b", "llama3-1b", "--dtypes", "int4", "--out", ""])
    assert seen["shapes"] == ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096),
                              (2048, 2048), (512, 2048), (8192, 2048), (2048, 8192), (128256, 2048))
    assert bl.linear_shapes("smollm2") == bl.SHAPES == ((576, 576), (192, 576), (1536, 576), (576, 1536),
                                                        (49152, 576))
    with pytest.raises(ValueError, match="'--shapes'"):
        bl.linear_shapes("llama3-70b")


def test_each_weight_stack_is_twice_the_last_level_cache(monkeypatch, tmp_path):
    # every call must stream its weight from memory: a stack of weights that a host's whole L3 (260 MB on the
    # Xeon of 2026-12-07, visible to a 2-core VM) cannot hold
    import glob as glob_mod

    from bench import linear as bl

    assert bl.STACK_BYTES == max(192 * 2**20, 2 * bl.last_level_cache_bytes())  # this machine's
    for i, (level, size) in enumerate([(1, "48K"), (2, "2048K"), (3, "266240K")]):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "size").write_text(f"{size}\n")
    monkeypatch.setattr(glob_mod, "glob", lambda pattern: sorted(str(p) for p in tmp_path.iterdir()))
    assert bl.last_level_cache_bytes() == 266240 * 1024
