"""The package has no import circle, its modules import downward only, and the native loader imports no op module.

The import graph is read from the source (``ast``), every ``import`` of a file counted, at module level or inside a
function: a circle through a deferred import is still a circle, only hidden until the call that runs it.
Importing a submodule (``a.b``) counts as importing its package (``a``) too, as Python runs the package first,
unless the importer is inside that package (then it is running already). Importing a name that a package defines
itself (``from a import f``, ``f`` no module) counts as importing the package whoever imports it: the package must
have run that far.

The package is ``tinyserve_compile``, with two folders of the repository inside it (pyproject's ``package-dir``):
``passes/`` is ``tinyserve_compile.passes`` and ``kernels/`` is ``tinyserve_compile.kernels``. Both are read, and
so are their top-level names (``kernels``, ``passes``: the repository root on ``sys.path``).
"""
from __future__ import annotations

import ast
import os
from typing import Dict, List, Optional, Set

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "tinyserve_compile"
KERNELS = f"{PACKAGE}.kernels"
#: top-level names of the package's folders -> their names inside the package
ALIASES = {"kernels": KERNELS, "passes": f"{PACKAGE}.passes"}
#: the modules the loader may import: the selection spec and the reference its self-check compares against
LOADER_MAY_IMPORT = {f"{KERNELS}.{m}" for m in ("spec", "reference", "reference.attend", "reference.bounds",
                                                "reference.select")}
#: the package's layers, lowest first: a module imports from its own layer and those below, never from one above. A
#: module is in the layer of the longest name listed here that is it or one of its packages, so the package itself,
#: last, holds what is not listed: its entry and what is built on the backend (continuous batching, serving, the
#: ONNX export, tools). The configuration sits above the policies, as it checks its policy against those registered.
LAYERS = [
    [f"{KERNELS}.spec"],  # the selection's vocabulary and rules
    [KERNELS],  # the ops and their implementations
    [f"{PACKAGE}.policies"],  # the page-selection policies
    [f"{PACKAGE}.config"],
    # the bounds state of the compiled graphs; the compile report; the cost model (bytes, the dense rule)
    [f"{PACKAGE}.runtime", f"{PACKAGE}.explain", f"{PACKAGE}.cost"],
    [f"{PACKAGE}.policies.op"],  # the policies' op, which reads the bounds state
    [f"{PACKAGE}.passes"],
    [f"{PACKAGE}.backend"],
    [PACKAGE],
]


def package_folders(root: str = ROOT) -> Dict[str, str]:
    """Dotted package name -> folder, for the package's folders in the repository at ``root``."""
    return {PACKAGE: os.path.join(root, "tinyserve_compile"), f"{PACKAGE}.passes": os.path.join(root, "passes"),
            KERNELS: os.path.join(root, "kernels")}


def module_files(folders: Dict[str, str]) -> Dict[str, str]:
    """Dotted name -> file, for every ``.py`` file under the ``folders`` (dotted package name -> folder)."""
    mods = {}
    for package, root in folders.items():
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d not in ("csrc", "__pycache__")]
            for f in files:
                if f.endswith(".py"):
                    parts = os.path.relpath(os.path.join(folder, f), root)[:-3].split(os.sep)
                    if parts[-1] == "__init__":
                        parts = parts[:-1]
                    mods[".".join([package, *parts])] = os.path.join(folder, f)
    return mods


def _inside(dotted: str) -> Optional[List[str]]:
    """The parts of the package's module ``dotted`` (a top-level alias resolved), or None for another module."""
    parts = dotted.split(".")
    if parts[0] in ALIASES:
        parts = ALIASES[parts[0]].split(".") + parts[1:]
    return parts if parts[0] == PACKAGE else None


def _targets(name: str, path: str, node: ast.AST, mods: Dict[str, str]) -> List[str]:
    """The modules of ``mods`` that the import statement ``node`` of module ``name`` (file ``path``) loads."""
    package = name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
    found, names_of = [], set()  # names_of: packages that a name (no module) is imported from
    if isinstance(node, ast.ImportFrom):
        if node.level:
            target = package[:len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
        else:
            target = _inside(node.module or "")
            if target is None:
                return []
        for alias in node.names:  # `from a import b`: b a submodule, else a name of a
            sub = ".".join(target + [alias.name])
            if sub in mods:
                found.append(sub)
            else:
                found.append(".".join(target))
                names_of.add(".".join(target))
    else:
        for alias in node.names:
            target = _inside(alias.name)
            if target is not None:
                found.append(".".join(target))
    # a submodule's packages run first, except those of the importer itself (already running when it runs)
    own = name.split(".")
    running = {".".join(own[:i]) for i in range(1, len(own) + 1)} - names_of
    loaded = set()
    for dotted in found:
        parts = dotted.split(".")
        loaded |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return sorted(m for m in loaded - running if m in mods and m != name)


def import_graph(folders: Optional[Dict[str, str]] = None) -> Dict[str, Set[str]]:
    """Module -> the modules of the package it imports (anywhere in the file), over the package's ``folders``
    (:func:`package_folders` of this repository by default)."""
    mods = module_files(folders if folders is not None else package_folders())
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


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module``'s layer."""
    best, layer = -1, len(LAYERS) - 1
    for i, names in enumerate(LAYERS):
        for n in names:
            if (module == n or module.startswith(n + ".")) and len(n) > best:
                best, layer = len(n), i
    return layer


def upward_imports(graph: Dict[str, Set[str]]) -> List[str]:
    """``"a -> b"`` for every import of a module ``b`` of a higher layer than ``a``'s."""
    return [f"{m} -> {t}" for m in sorted(graph) for t in sorted(graph[m]) if layer_of(t) > layer_of(m)]


def test_the_package_has_no_import_circle():
    cycle = find_cycle(import_graph())
    assert not cycle, "import circle in tinyserve_compile: " + " -> ".join(cycle)


def test_the_package_imports_downward_only():
    assert upward_imports(import_graph()) == []


def test_the_graph_reads_every_module_of_the_package():
    graph = import_graph()
    assert {f"{PACKAGE}.backend", f"{PACKAGE}.policies.op", f"{PACKAGE}.passes.state", f"{KERNELS}.spec",
            f"{KERNELS}.reference.select"} <= set(graph)
    assert f"{PACKAGE}.passes" in graph[f"{PACKAGE}.backend"]


def test_the_loader_imports_no_op_module():
    """native.py builds and loads the library; each op module registers its own kernel (native.when_loaded)."""
    extra = import_graph()[f"{KERNELS}.native"] - LOADER_MAY_IMPORT
    assert not extra, f"kernels/native.py imports {sorted(extra)}"


def test_the_spec_imports_nothing_of_the_package():
    """spec.py is the one definition of the selection's vocabulary and rules: every other module reads it."""
    assert import_graph()[f"{KERNELS}.spec"] == set()


def test_the_spec_defaults_are_the_configurations():
    """``SelectionSpec.default`` builds the spec from spec.py's own defaults, without the configuration (which sits
    above it): the spec of the default configuration all the same."""
    from tinyserve_compile.config import TinyServeConfig
    from tinyserve_compile.kernels.spec import SelectionSpec

    assert SelectionSpec.default() == SelectionSpec.from_config(TinyServeConfig())
    assert SelectionSpec.default(page_size=4, keep_tokens=False) == \
        SelectionSpec.from_config(TinyServeConfig(page_size=4, keep_tokens=False))


@pytest.mark.parametrize("graph, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": set(), "c": {"a", "b"}}, []),
])
def test_find_cycle(graph, cycle):
    assert find_cycle(graph) == cycle


def _short(graph: Dict[str, Set[str]], prefix: str) -> Dict[str, Set[str]]:
    """``graph`` with ``prefix`` cut from every name (the package itself is ``""``)."""
    def cut(m):
        return m[len(prefix) + 1:] if m.startswith(prefix + ".") else ("" if m == prefix else m)

    return {cut(m): {cut(t) for t in ts} for m, ts in graph.items()}


def test_the_graph_reads_relative_absolute_and_deferred_imports(tmp_path):
    (tmp_path / "reference").mkdir()
    (tmp_path / "__init__.py").write_text("from .spec import X\n")
    (tmp_path / "spec.py").write_text("def f():\n    from tinyserve_compile.kernels.reference import select\n")
    (tmp_path / "reference" / "__init__.py").write_text("from .select import Y\n")
    (tmp_path / "reference" / "select.py").write_text("from ..spec import X\nimport kernels.op\n")
    (tmp_path / "op.py").write_text("import torch\n")
    graph = _short(import_graph({KERNELS: str(tmp_path)}), KERNELS)
    assert graph == {"": {"spec"}, "spec": {"reference", "reference.select"}, "reference": {"reference.select"},
                     "reference.select": {"spec", "op"}, "op": set()}
    assert find_cycle(graph) == ["spec", "reference", "reference.select", "spec"]


def test_a_deferred_circle_across_the_folders_is_found(tmp_path):
    """The circle of the tree before issue 52: the spec's defaults read the configuration, which checks its policy
    against the policies, which attend through a kernel module that reads the spec, every link but the last
    deferred into a function; and one through a name that the package defines itself."""
    top, kernels, passes = (tmp_path / d for d in ("tinyserve_compile", "kernels", "passes"))
    for d in (top / "policies", kernels, passes):
        d.mkdir(parents=True)
    (top / "__init__.py").write_text("from . import kernels\nfrom .backend import f\nNAME = 1\n")
    (top / "config.py").write_text("def check():\n    from .policies import POLICIES\n")
    (top / "policies" / "__init__.py").write_text("from .base import POLICIES\n")
    (top / "policies" / "base.py").write_text("from ..kernels.attend import attend\n")
    (top / "backend.py").write_text("def f():\n    from tinyserve_compile.passes import run\n")
    (kernels / "__init__.py").write_text("")
    (kernels / "attend.py").write_text("from .spec import SPEC\n")
    (kernels / "spec.py").write_text("def default():\n    from tinyserve_compile.config import check\n")
    (passes / "__init__.py").write_text("from tinyserve_compile import NAME, config\n")
    graph = _short(import_graph(package_folders(str(tmp_path))), PACKAGE)
    assert graph["kernels.spec"] == {"config"} and graph["passes"] == {"", "config"}
    assert find_cycle(graph) == ["", "backend", "passes", ""]
    del graph["passes"]
    assert find_cycle(graph) == ["config", "policies", "policies.base", "kernels.attend", "kernels.spec", "config"]
