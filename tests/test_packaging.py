"""The top-level source folders install under tinyserve_compile and never shadow HF's ``kernels``."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_subpackages_import_under_tinyserve_compile():
    import tinyserve_compile.kernels as k
    import tinyserve_compile.passes as p

    assert Path(k.__file__).resolve().parent == ROOT / "kernels"
    assert Path(p.__file__).resolve().parent == ROOT / "passes"
    assert hasattr(k, "sparse_decode") and p.PASSES


def test_top_level_kernels_import_is_inert_and_transformers_sees_no_kernels_library():
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "import transformers.utils.import_utils as iu\n"
        "assert not iu.is_kernels_available()\n"
        "import kernels, torch\n"
        "assert kernels.__all__ == [], kernels.__all__\n"
        "assert 'tinyserve_compile' not in sys.modules\n"
        "assert not hasattr(torch.ops.tinyserve, 'sparse_decode')\n"
        "import tinyserve_compile\n"
        "assert torch.ops.tinyserve.sparse_decode.default is not None\n"
        "print('ok')\n" % str(ROOT)
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ok" in out.stdout
