"""The top-level source folders install under tinyserve_compile and never shadow HF's ``kernels``."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_subpackages_import_under_tinyserve_compile():
    import tinyserve_compile.kernels as k
    import tinyserve_compile.passes as p

    assert Path(k.__file__).resolve().parent == ROOT / "kernels"
    assert Path(p.__file__).resolve().parent == ROOT / "passes"
    assert hasattr(k, "sparse_decode") and p.PASSES


def _run(code: str, *flags: str, cwd=None) -> str:
    out = subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_transformers_imports_with_the_repository_root_first_on_sys_path():
    # transformers >= 5.25 depends on HF's kernels library and imports it with transformers.activations: the
    # top-level folder hands the name over to it; without it installed, the folder stays inert
    code = (
        "import sys, importlib.metadata as md; sys.path.insert(0, %r)\n"
        "from transformers import LlamaConfig\n"
        "import transformers.activations, kernels, torch\n"
        "try:\n"
        "    md.version('kernels'); installed = True\n"
        "except md.PackageNotFoundError:\n"
        "    installed = False\n"
        "if installed:\n"
        "    assert not kernels.__file__.startswith(%r), kernels.__file__\n"
        "else:\n"
        "    assert kernels.__all__ == [], kernels.__all__\n"
        "assert 'tinyserve_compile' not in sys.modules\n"
        "assert not hasattr(torch.ops.tinyserve, 'sparse_decode')\n"
        "import tinyserve_compile\n"
        "assert torch.ops.tinyserve.sparse_decode.default is not None\n"
        "print('ok', installed)\n" % (str(ROOT), str(ROOT / "kernels"))
    )
    assert "ok" in _run(code)


def test_top_level_kernels_hands_over_to_a_library_of_that_name(tmp_path):
    lib = tmp_path / "site" / "kernels"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text("LIBRARY = 'other'\n")
    (lib / "sub.py").write_text("from kernels import LIBRARY\n")
    code = (
        "import sys; sys.path[:0] = [%r, %r]\n"
        "import kernels, kernels.sub\n"
        "assert kernels.LIBRARY == 'other' and kernels.sub.LIBRARY == 'other'\n"
        "assert kernels.__file__ == %r, kernels.__file__\n"
        "assert sys.modules['kernels'] is kernels and 'tinyserve_compile' not in sys.modules\n"
        "print('ok')\n" % (str(ROOT), str(tmp_path / "site"), str(lib / "__init__.py"))
    )
    assert "ok" in _run(code)


@pytest.mark.parametrize("repo_first", [False, True], ids=["copy-alone", "repo-then-copy"])
def test_top_level_kernels_stays_inert_without_a_library_of_that_name(tmp_path, repo_first):
    # no site-packages (-S): copy-alone, the folder's own __init__ is the only 'kernels' on the path; repo-then-copy,
    # a second checkout after this one: the first copy hands over to the second, which stays inert (no recursion)
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text((ROOT / "kernels" / "__init__.py").read_text())
    path = [str(ROOT), str(tmp_path)] if repo_first else [str(tmp_path)]
    code = (
        "import sys; sys.path[:0] = %r\n"
        "import kernels\n"
        "assert kernels.__all__ == [] and kernels.__file__.startswith(%r), kernels.__file__\n"
        "assert 'torch' not in sys.modules and not hasattr(sys, '_tinyserve_kernels_hand_over')\n"
        "print('ok')\n" % (path, str(tmp_path))
    )
    assert "ok" in _run(code, "-S", cwd=tmp_path)
