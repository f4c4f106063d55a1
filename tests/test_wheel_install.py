"""A non-editable install works like the checkout: the wheel and the sdist carry the native kernel's C++ source,
and a wheel installed into a fresh virtualenv (torch from the CPU wheel) builds or reuses the native kernel and
decodes like the reference, run from a folder outside the checkout."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "kernels" / "csrc"
#: every file of the native kernel's C++ source folder (headers and sources)
CSRC_FILES = sorted(p.name for p in CSRC.iterdir() if p.is_file())
#: what a clean clone holds that the build reads (the rest of the checkout is copied without these)
_SKIP = shutil.ignore_patterns(".git", ".venv", ".ci-venvs", "build", "dist", "results", "*.egg-info", "__pycache__",
                               ".hypothesis", ".pytest_cache", ".whl")


def _run(cmd, cwd, timeout=900, env=None):
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, f"{cmd} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    """The wheel and the sdist built from a copy of the checkout (the checkout itself stays untouched)."""
    tmp = tmp_path_factory.mktemp("dist")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_SKIP)
    out = tmp / "out"
    out.mkdir()
    for what in ("wheel", "sdist"):  # setuptools' PEP 517 hooks, no isolation: nothing is downloaded
        code = f"import sys; from setuptools import build_meta as b; print(b.build_{what}(sys.argv[1]))"
        _run([sys.executable, "-c", code, str(out)], cwd=src)
    wheel = next(out.glob("*.whl"))
    sdist = next(out.glob("*.tar.gz"))
    return wheel, sdist


def test_wheel_and_sdist_carry_the_native_source(dists):
    wheel, sdist = dists
    assert any(n.endswith(".cpp") for n in CSRC_FILES) and any(n.endswith(".h") for n in CSRC_FILES), CSRC_FILES
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        for name in CSRC_FILES:
            member = f"tinyserve_compile/kernels/csrc/{name}"
            assert member in names, (name, [n for n in names if "kernels" in n])
            assert z.read(member) == (CSRC / name).read_bytes(), name
    with tarfile.open(sdist) as t:
        members = t.getnames()
        for name in CSRC_FILES:
            assert any(n.endswith(f"kernels/csrc/{name}") for n in members), (name, members)


_CHECK = textwrap.dedent('''
    import sys
    import torch
    import torch.nn.functional as F
    import tinyserve_compile as tc
    from tinyserve_compile.kernels import native
    from tinyserve_compile.runtime import native_unavailable_reason
    from tinyserve_compile.testing import reference_sparse_attention

    assert "site-packages" in tc.__file__, tc.__file__   # the installed wheel, not the checkout
    assert native_unavailable_reason() is None, native_unavailable_reason()

    HQ, HKV, L, D = 4, 2, 64, 16
    def step(q, kc, vc, k, v, pos, mask):
        kc[:, :, pos] = k
        vc[:, :, pos] = v
        return F.scaled_dot_product_attention(q, kc.repeat_interleave(2, 1), vc.repeat_interleave(2, 1),
                                              attn_mask=mask)
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(1, HKV, L, D, generator=g), torch.randn(1, HKV, L, D, generator=g)
    q = torch.randn(1, HQ, 1, D, generator=g)
    k, v = torch.randn(1, HKV, 1, D, generator=g), torch.randn(1, HKV, 1, D, generator=g)
    pos = torch.tensor([40], dtype=torch.int32)
    mask = (torch.arange(L) <= 40)[None, None, None]
    opts = {"dense_layers": 0, "token_budget": 16, "page_size": 8, "lower": "eager"}
    with reference_sparse_attention(HQ, HKV, opts):
        ref = step(q, kc.clone(), vc.clone(), k, v, pos, mask)
    got = torch.compile(step, backend="tinyserve", options=opts)(q, kc.clone(), vc.clone(), k, v, pos, mask)
    assert tc.counters["native_sites"] == 1 and tc.counters["rewritten"] == 1, tc.counters
    assert tc.explain().native_kernel == "in use", tc.explain()
    err = (got - ref).abs().max().item()
    assert err < 1e-5, err
    print("ok", native.native_module().__file__, err)
''')


@pytest.mark.slow
def test_installed_wheel_uses_the_native_kernel(dists, tmp_path):
    """A fresh virtualenv: torch==2.13.0 (the CPU wheel), ninja and numpy, then the wheel with --no-deps. The native
    build cache (``TINYSERVE_CACHE_DIR`` or ``~/.cache/tinyserve_compile``) is shared with the checkout, so the
    kernel built for the same source, torch and CPU is reused."""
    wheel, _ = dists
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    py = venv / "bin" / "python"
    import torch

    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run(pip + [f"torch=={torch.__version__.split('+')[0]}", "ninja", "numpy"], cwd=tmp_path, timeout=1200)
    _run(pip + ["--no-deps", str(wheel)], cwd=tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TINYSERVE_DISABLE_NATIVE")}
    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "check.py").write_text(_CHECK)
    out = _run([str(py), "check.py"], cwd=work, env=env, timeout=1200)
    assert out.stdout.startswith("ok"), out.stdout
