"""The passes' shared helpers sit in one private module per concern, imported in one direction only (no circle)."""
import ast
import importlib
from pathlib import Path

PASSES = Path(__file__).resolve().parents[1] / "passes"

#: each helper module and the helper modules it may import (a module only imports those listed before it)
LAYERS = {
    "_node_meta": set(),
    "_views": {"_node_meta"},
    "_cache_writes": {"_node_meta", "_views"},
    "_masks": {"_node_meta"},
}


def _local_imports(name: str) -> set:
    tree = ast.parse((PASSES / f"{name}.py").read_text())
    return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 1}


def test_helper_modules_import_downward_only():
    for name, allowed in LAYERS.items():
        assert _local_imports(name) <= allowed, name


def test_every_private_module_is_a_known_helper():
    private = {p.stem for p in PASSES.glob("_*.py") if p.stem != "__init__"}
    assert private == set(LAYERS)


def test_passes_import_their_helpers_from_the_concern_modules():
    # the package exports functions named like their modules: the modules themselves are read from sys.modules
    cw, fda, sda = (importlib.import_module(f"tinyserve_compile.passes.{m}")
                    for m in ("_cache_writes", "find_decode_attention", "sparse_decode_attention"))
    assert fda.cache_writes is cw.cache_writes
    assert sda.compact_mask.__module__ == "tinyserve_compile.passes._masks"
