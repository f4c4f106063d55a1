"""kernels/ has no import circle, and the native loader imports no op module.

The import graph is read from the source (``ast``), every ``import`` of a file counted, at module level or inside a
function: a circle through a deferred import is still a circle, only hidden until the call that runs it.
Importing a submodule (``a.b``) counts as importing its package (``a``) too, as Python runs the package first,
unless the importer is inside that package (then it is running already).
"""
from __future__ import annotations

import ast
import os
from typing import Dict, List, Set

import pytest

KERNELS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "kernels")
#: the modules the loader may import: the selection spec and the reference its self-check compares against
LOADER_MAY_IMPORT = {"spec", "reference", "reference.attend", "reference.bounds", "reference.select"}


def module_files(root: str) -> Dict[str, str]:
    """Dotted name inside ``root`` (``""`` for the package itself) -> file, for every ``.py`` file."""
    mods = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("csrc", "__pycache__")]
        for f in files:
            if f.endswith(".py"):
                parts = os.path.relpath(os.path.join(folder, f), root)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                mods[".".join(parts)] = os.path.join(folder, f)
    return mods


def _targets(name: str, path: str, node: ast.AST, mods: Dict[str, str]) -> List[str]:
    """The modules of ``mods`` that the import statement ``node`` of module ``name`` (file ``path``) loads."""
    package = name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
    package = [p for p in package if p]

    def inside(dotted: str):  # the part after the package's own name, or None for an import from elsewhere
        parts = dotted.split(".")
        for prefix in (["tinyserve_compile", "kernels"], ["kernels"]):
            if parts[:len(prefix)] == prefix:
                return parts[len(prefix):]
        return None

    found = []
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = package[:len(package) - (node.level - 1)]
            target = base + (node.module.split(".") if node.module else [])
        else:
            target = inside(node.module or "")
            if target is None:
                return []
        for alias in node.names:  # `from a import b`: b a submodule, else a name of a
            sub = ".".join(target + [alias.name])
            found.append(sub if sub in mods else ".".join(target))
    else:
        for alias in node.names:
            target = inside(alias.name)
            if target is not None:
                found.append(".".join(target))
    # a submodule's packages run first, except those of the importer itself (already running when it runs)
    own = name.split(".") if name else []
    running = {".".join(own[:i]) for i in range(len(own) + 1)}
    loaded = set()
    for dotted in found:
        parts = dotted.split(".") if dotted else []
        loaded |= {".".join(parts[:i]) for i in range(len(parts) + 1)}
    return sorted(m for m in loaded - running if m in mods)


def import_graph(root: str = KERNELS) -> Dict[str, Set[str]]:
    """Module -> the modules of ``root`` it imports (anywhere in the file)."""
    mods = module_files(root)
    graph = {}
    for name, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        graph[name] = {t for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                       for t in _targets(name, path, node, mods)}
    return graph


def find_cycle(graph: Dict[str, Set[str]]) -> List[str]:
    """One import circle (``[a, b, ..., a]``), or ``[]``."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                cycle = visit(n)
                if cycle:
                    return cycle
        path.pop()
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            if cycle:
                return cycle
    return []


def _label(m: str) -> str:
    return f"kernels.{m}" if m else "kernels"


def test_kernels_have_no_import_circle():
    cycle = find_cycle(import_graph())
    assert not cycle, "import circle in kernels/: " + " -> ".join(_label(m) for m in cycle)


def test_the_loader_imports_no_op_module():
    """native.py builds and loads the library; each op module registers its own kernel (native.when_loaded)."""
    extra = import_graph()["native"] - LOADER_MAY_IMPORT
    assert not extra, f"kernels/native.py imports {sorted(_label(m) for m in extra)}"


def test_the_spec_imports_nothing_of_kernels():
    """spec.py is the one definition of the selection's vocabulary and rules: every other module reads it."""
    assert import_graph()["spec"] == set()


@pytest.mark.parametrize("graph, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": set(), "c": {"a", "b"}}, []),
])
def test_find_cycle(graph, cycle):
    assert find_cycle(graph) == cycle


def test_the_graph_reads_relative_absolute_and_deferred_imports(tmp_path):
    (tmp_path / "reference").mkdir()
    (tmp_path / "__init__.py").write_text("from .spec import X\n")
    (tmp_path / "spec.py").write_text("def f():\n    from tinyserve_compile.kernels.reference import select\n")
    (tmp_path / "reference" / "__init__.py").write_text("from .select import Y\n")
    (tmp_path / "reference" / "select.py").write_text("from ..spec import X\nimport kernels.op\n")
    (tmp_path / "op.py").write_text("import torch\n")
    graph = import_graph(str(tmp_path))
    assert graph == {"": {"spec"}, "spec": {"reference", "reference.select"}, "reference": {"reference.select"},
                     "reference.select": {"spec", "op"}, "op": set()}
    assert find_cycle(graph) == ["spec", "reference", "reference.select", "spec"]
