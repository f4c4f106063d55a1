"""A native build that fails is never silent: :func:`load_native` warns, and the reason (from
``native_unavailable_reason`` to ``explain()``) names the torch version the build ran against and the compiler's
error line, not cpp_extension's command line.

The build is made to fail by replacing ``torch.utils.cpp_extension.load`` with one that raises what it raises on a
compile error (the error of issue 38, torch 2.11 against the 2.13-only autograd calls), a missing compiler, a link
error, a module that does not import or a file it cannot write: the reason is one line with the root cause and the
path of the full build log (issue 49). One test runs the real build with no compiler on ``PATH`` (it stops at its
first step), one points the cache at a folder that cannot be made; nothing is compiled.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils import cpp_extension

import tinyserve_compile as tc
from tinyserve_compile.kernels import native

#: cpp_extension's own, before any test replaces them
REAL_LOAD, REAL_NINJA_CHECK = cpp_extension.load, cpp_extension.is_ninja_available
COMPILER_ERROR = "dispatch.cpp:97:35: error: no matching function for call to 'set_history(at::Tensor&, ...)'"
BUILD_ERROR = ("Error building extension 'tinyserve_native_0': [1/9] c++ -MMD -MF dispatch.o.d -O3 -c dispatch.cpp\n"
               "FAILED: [code=1] dispatch.o\n"
               "dispatch.cpp: In function 'void autograd_passthrough(...)':\n"
               f"{COMPILER_ERROR}\n"
               "   97 |       torch::autograd::set_history((*stack)[i].toTensor(), node);\n"
               "ninja: build stopped: subcommand failed.")


@pytest.fixture
def failed_build(monkeypatch, tmp_path):
    """A fresh load attempt (the process's own outcome restored afterwards) whose build fails."""
    def load(**kwargs):
        raise RuntimeError(BUILD_ERROR)

    monkeypatch.delenv("TINYSERVE_DISABLE_NATIVE", raising=False)
    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(native, "_state", {"loaded": None, "reason": None, "module": None, "build_dir": None})
    tc.reset()
    yield
    tc.reset()


def test_the_reason_names_the_torch_version_and_the_compiler_error(failed_build):
    with pytest.warns(RuntimeWarning, match=re.escape(f"against torch {torch.__version__}")) as caught:
        assert native.load_native() is False
    why = native.native_unavailable_reason()
    assert why.startswith(f"native kernel build failed against torch {torch.__version__} (RuntimeError): "), why
    assert COMPILER_ERROR in why and "c++ -MMD" not in why, why
    assert why in str(caught[0].message)
    # once per process: a second call neither builds nor warns again
    assert native.load_native() is False and len(caught) == 1


def test_disabling_the_native_kernel_does_not_warn(failed_build, monkeypatch, recwarn):
    monkeypatch.setenv("TINYSERVE_DISABLE_NATIVE", "1")
    assert native.load_native() is False
    assert native.native_unavailable_reason() == "disabled by TINYSERVE_DISABLE_NATIVE"
    assert not [w for w in recwarn if "tinyserve-compile" in str(w.message)]


def test_explain_shows_the_failed_build(failed_build):
    torch._dynamo.reset()

    def step(q, kc, vc, k, v, pos, mask):
        kc[:, :, pos] = k
        vc[:, :, pos] = v
        return F.scaled_dot_product_attention(q, kc.repeat_interleave(2, 1), vc.repeat_interleave(2, 1),
                                              attn_mask=mask)

    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(1, 2, 64, 16, generator=g), torch.randn(1, 2, 64, 16, generator=g)
    q = torch.randn(1, 4, 1, 16, generator=g)
    k, v = torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 2, 1, 16, generator=g)
    pos, mask = torch.tensor([40], dtype=torch.int32), (torch.arange(64) <= 40)[None, None, None]
    opts = {"dense_layers": 0, "token_budget": 16, "page_size": 8, "lower": "eager"}
    with pytest.warns(RuntimeWarning, match="native kernel build failed"):
        torch.compile(step, backend="tinyserve", options=opts)(q, kc, vc, k, v, pos, mask)
    torch._dynamo.reset()
    rep = tc.explain()
    assert rep.native_kernel.startswith("unavailable, PyTorch path used: native kernel build failed against torch "
                                        f"{torch.__version__}"), rep
    assert COMPILER_ERROR in rep.native_kernel and rep.native_kernel in str(rep), rep


@pytest.mark.skipif(__import__("platform").machine().lower() not in ("x86_64", "amd64"), reason="x86-64 flags")
def test_forced_isa_builds_leave_avx512_out():
    """TINYSERVE_NATIVE_ISA=avx2 compiles the AVX-512 paths out even on an AVX-512 machine (as a Zen 3 builds), and
    =default is the portable x86-64-v2 build: the flags the CI matrix's isa edge relies on."""
    from tinyserve_compile.kernels import native

    avx2, _ = native._flags("avx2")
    assert "-mno-avx512f" in avx2 and "-march=native" in avx2 and "-DCPU_CAPABILITY=AVX2" in avx2
    portable, _ = native._flags("default")
    assert "-march=x86-64-v2" in portable and "-mno-avx512f" not in portable
    assert "-mno-avx512f" not in native._flags("avx512")[0]


# ---- issue 49, case 5: one line that names the root cause, and the path of the full build log

#: the build's output where the shell finds no compiler (a cpp_extension message of torch 2.13, paths shortened)
NO_COMPILER = ("Error building extension 'tinyserve_native_0': [1/9] c++ -MMD -MF bounds.o.d -isystem "
               "/venv/lib/python3.11/site-packages/torch/include -fPIC -std=c++20 -O3 -c bounds.cpp -o bounds.o\n"
               "FAILED: [code=127] bounds.o\n"
               "c++ -MMD -MF bounds.o.d -isystem /venv/lib/python3.11/site-packages/torch/include -fPIC -std=c++20 "
               "-O3 -c bounds.cpp -o bounds.o\n"
               "/bin/sh: 1: c++: not found\n"
               "ninja: build stopped: subcommand failed.")
LINK_ERROR = ("Error building extension 'tinyserve_native_0': [9/9] c++ bounds.o dispatch.o -shared -fopenmp "
              "-L/venv/lib/python3.11/site-packages/torch/lib -lc10 -ltorch_cpu -o tinyserve_native_0.so\n"
              "FAILED: [code=1] tinyserve_native_0.so\n"
              "c++ bounds.o dispatch.o -shared -fopenmp -L/venv/lib/python3.11/site-packages/torch/lib -lc10 "
              "-ltorch_cpu -o tinyserve_native_0.so\n"
              "/usr/bin/ld: cannot find -lgomp: No such file or directory\n"
              "collect2: error: ld returned 1 exit status\n"
              "ninja: build stopped: subcommand failed.")
UNDEFINED = "/cache/native-0/tinyserve_native_0.so: undefined symbol: _ZN3c1017RegisterOperatorsD1Ev"
#: (id, the exception cpp_extension.load raises, the root cause the reason must give, a line only the log holds)
FAILURES = [
    ("compile_error", lambda: RuntimeError(BUILD_ERROR), f"compile error: {COMPILER_ERROR}", "[1/9] c++ -MMD"),
    ("no_compiler", lambda: RuntimeError(NO_COMPILER),
     "no C++ compiler: c++: not found on PATH (install g++ or set CXX)", "FAILED: [code=127]"),
    ("link_error", lambda: RuntimeError(LINK_ERROR),
     "link error: /usr/bin/ld: cannot find -lgomp: No such file or directory", "-ltorch_cpu -o"),
    ("import_error", lambda: ImportError(UNDEFINED), f"the built module does not import: {UNDEFINED}",
     "Traceback"),
    ("unwritable_lock", lambda: PermissionError(13, "Permission denied", "/cache/native-0/lock"),
     "cannot write /cache/native-0/lock: Permission denied", "Traceback"),
]


def _log_path(why: str) -> Path:
    found = re.search(r"; full build log: (\S+)$", why)
    assert found, why
    return Path(found.group(1))


@pytest.mark.parametrize("error, cause, log_only", [f[1:] for f in FAILURES], ids=[f[0] for f in FAILURES])
def test_the_reason_is_one_line_with_the_root_cause_and_the_build_log(failed_build, monkeypatch, tmp_path, error,
                                                                        cause, log_only):
    raised = error()

    def load(**kwargs):
        raise raised

    monkeypatch.setattr(cpp_extension, "load", load)
    with pytest.warns(RuntimeWarning, match="the PyTorch path runs instead"):
        assert native.load_native() is False
    why = native.native_unavailable_reason()
    assert why.startswith(f"native kernel build failed against torch {torch.__version__} "
                          f"({type(raised).__name__}): {cause}; full build log: "), why
    assert "\n" not in why and len(why) < 400 and log_only not in why and "-isystem" not in why, why
    log = _log_path(why)
    assert log.name == "build.log" and log.parent.parent == tmp_path, log  # in the build folder of the cache
    text = log.read_text()
    assert str(raised) in text and log_only in text, text


@pytest.mark.skipif(shutil.which("ninja") is None, reason="the build needs ninja to get as far as the compiler")
@pytest.mark.skipif(shutil.which("c++", path=os.path.dirname(sys.executable)) is not None,
                    reason="a compiler next to the interpreter (the loader puts its folder on PATH)")
def test_without_a_compiler_on_path_the_reason_says_so(failed_build, monkeypatch, tmp_path):
    """A real build (cpp_extension, ninja) with no ``c++`` on PATH: the shell's ``c++: not found`` is the reason,
    not the 700 characters of the build's first command line."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "ninja").symlink_to(shutil.which("ninja"))
    monkeypatch.setenv("PATH", str(bindir))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpp_extension, "load", REAL_LOAD)
    monkeypatch.setattr(cpp_extension, "is_ninja_available", REAL_NINJA_CHECK)
    with pytest.warns(RuntimeWarning, match="no C"):
        assert native.load_native() is False
    why = native.native_unavailable_reason()
    assert "no C++ compiler: c++: not found on PATH" in why and "-isystem" not in why and len(why) < 400, why
    log = _log_path(why)
    assert log.parent.parent == tmp_path / "cache" and "c++: not found" in log.read_text(), log


def test_an_unwritable_cache_folder_is_named(failed_build, monkeypatch, tmp_path):
    """A cache root that cannot be made (here a path through a file; a read-only folder alike): the reason names the
    folder and the error, and the log goes to a temporary file."""
    (tmp_path / "a_file").write_text("")
    root = tmp_path / "a_file" / "cache"
    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(root))
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    with pytest.warns(RuntimeWarning, match="cannot be written"):
        assert native.load_native() is False
    why = native.native_unavailable_reason()
    assert why.startswith(f"the native kernel's cache folder {root} cannot be written (NotADirectoryError: "), why
    assert "\n" not in why and "set TINYSERVE_CACHE_DIR" in why, why
    log = _log_path(why)
    assert log.parent == temp and "NotADirectoryError" in log.read_text(), log
