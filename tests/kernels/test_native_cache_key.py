"""The native build's cache folder is keyed by everything its command lines hold (issue 49, case 8).

Two virtualenvs with the same torch version put different include and library folders on the command line
(``.../venv-a/.../torch/include`` and ``.../venv-b/...``); with one folder for both, ninja saw a changed command on
each switch and rebuilt in turns, every process of the other one waiting on the build lock. Each check here
computes the key of a changed set of inputs (another torch install, another Python prefix, another compiler,
another vector ISA); nothing is built.
"""
from __future__ import annotations

import inspect
import os
import shlex
import sysconfig

import pytest
import torch
from torch.utils import cpp_extension

from tinyserve_compile.kernels import native

OTHER_VENV = "/opt/other-venv/lib/python3.11/site-packages/torch"


def another_torch_install(monkeypatch):
    """The same torch version installed in another virtualenv: its include and library folders move."""
    real = cpp_extension.include_paths

    def include_paths(*args, **kwargs):
        torch_dir = os.path.dirname(torch.__file__)
        return [p.replace(torch_dir, OTHER_VENV) for p in real(*args, **kwargs)]

    monkeypatch.setattr(cpp_extension, "include_paths", include_paths)
    monkeypatch.setattr(cpp_extension, "TORCH_LIB_PATH", f"{OTHER_VENV}/lib")


def another_python_prefix(monkeypatch):
    """A virtualenv made from another Python of the same version: ``Python.h`` comes from elsewhere."""
    real = sysconfig.get_path

    def get_path(name, *args, **kwargs):
        return "/opt/python-3.11-other/include/python3.11" if name == "include" else real(name, *args, **kwargs)

    monkeypatch.setattr(sysconfig, "get_path", get_path)


def another_compiler(monkeypatch):
    monkeypatch.setenv("CXX", "clang++")


def another_isa(monkeypatch):
    """Other vector flags on the command line (-march=x86-64-v2 instead of the host's)."""
    monkeypatch.setenv("TINYSERVE_NATIVE_ISA", "avx2" if native.native_isa() == "default" else "default")


def extra_flags(monkeypatch):
    monkeypatch.setenv("TINYSERVE_NATIVE_CFLAGS", "-DTS_PROFILE")


CHANGES = [another_torch_install, another_python_prefix, another_compiler, another_isa, extra_flags]


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """This process's build inputs, whatever the caller's environment sets, and a cache root of its own."""
    for name in ("CXX", "TINYSERVE_NATIVE_ISA", "TINYSERVE_NATIVE_CFLAGS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path))


@pytest.mark.parametrize("change", CHANGES, ids=[c.__name__ for c in CHANGES])
def test_each_command_line_input_has_a_build_folder_of_its_own(clean_env, monkeypatch, change):
    here = native.build_folder()
    spec = native.build_spec()
    change(monkeypatch)
    other_spec = native.build_spec()
    assert other_spec != spec, "the change left the build inputs as they were"
    other = native.build_folder()
    assert os.path.dirname(other) == os.path.dirname(here) and other != here, (here, other)
    assert native.build_folder() == other  # the same inputs: the same folder


def test_the_same_inputs_give_the_same_folder(clean_env, tmp_path):
    spec = native.build_spec()
    shuffled = dict(reversed(list(spec.items())))
    assert native.build_key(shuffled) == native.build_key(spec)
    assert native.build_folder() == native.build_folder(spec) == str(tmp_path / f"native-{native.build_key(spec)}")


def test_two_virtualenvs_differ_in_their_include_paths_only(clean_env, monkeypatch):
    """The case of the issue: the same torch version, the same sources and flags, another install location."""
    spec = native.build_spec()
    another_torch_install(monkeypatch)
    other = native.build_spec()
    assert {k for k in spec if spec[k] != other[k]} == {"include_paths", "library_paths"}, (spec, other)
    assert all(p.startswith(OTHER_VENV) for p in other["include_paths"][:-1]), other["include_paths"]


def _ninja_command_line(build_dir, cflags, ldflags):
    """``(cxx, cflags, ldflags)`` of the build.ninja cpp_extension writes for our flags (its own functions; the
    file is written, nothing is run)."""
    prepare = cpp_extension._prepare_ldflags
    values = {"extra_ldflags": list(ldflags), "with_cuda": False, "with_sycl": False, "verbose": False,
              "is_standalone": False}
    ld = prepare(**{k: values[k] for k in inspect.signature(prepare).parameters})
    write = cpp_extension._write_ninja_file_to_build_library
    values = {"path": os.path.join(build_dir, "build.ninja"), "name": "tinyserve_native_key",
              "sources": [os.path.join(build_dir, "a.cpp")], "extra_cflags": list(cflags), "extra_cuda_cflags": [],
              "extra_sycl_cflags": [], "extra_ldflags": ld, "extra_include_paths": [], "with_cuda": False,
              "with_sycl": False, "is_standalone": False}
    write(**{k: values[k] for k in inspect.signature(write).parameters})
    found = {}
    with open(values["path"]) as f:
        for line in f:
            key, _, value = line.partition(" = ")
            if key in ("cxx", "cflags", "ldflags"):
                found[key] = shlex.split(value)
    return found["cxx"], found["cflags"], found["ldflags"]


def test_the_key_holds_every_folder_and_flag_of_the_command_line(clean_env, tmp_path):
    """Every include folder (-isystem, -I), library folder (-L), the compiler and our flags of the command lines
    that cpp_extension writes for this build are in the spec the key hashes; the rest of those lines is fixed by the
    torch version (also in the spec) or by the key itself (the module name)."""
    spec = native.build_spec()
    cxx, cflags, ldflags = _ninja_command_line(str(tmp_path), spec["cflags"], spec["ldflags"])
    assert cxx == spec["compiler"][:1], (cxx, spec["compiler"])
    includes = [cflags[i + 1] for i, t in enumerate(cflags) if t == "-isystem"]
    includes += [t[2:] for t in cflags if t.startswith("-I")]
    assert includes and set(includes) <= set(spec["include_paths"]), (includes, spec["include_paths"])
    libraries = [t[2:] for t in ldflags if t.startswith("-L")]
    assert libraries and set(libraries) <= set(spec["library_paths"]), (libraries, spec["library_paths"])
    assert all(flag in cflags for flag in spec["cflags"]), (spec["cflags"], cflags)
    assert all(flag in ldflags for flag in spec["ldflags"]), (spec["ldflags"], ldflags)


def test_the_loader_builds_each_virtualenv_in_its_own_folder(clean_env, monkeypatch):
    """The folder the loader hands cpp_extension: one per torch install, the same again for the same one. The
    build is replaced by one that records its arguments and fails (nothing is compiled, nothing loaded)."""
    builds = []

    def load(**kwargs):
        builds.append(kwargs)
        raise RuntimeError("recorded, not built")

    monkeypatch.delenv("TINYSERVE_DISABLE_NATIVE", raising=False)
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "load", load)

    def attempt():
        monkeypatch.setattr(native, "_state", {"loaded": None, "reason": None, "module": None, "build_dir": None})
        with pytest.warns(RuntimeWarning, match="recorded, not built"):
            assert native.load_native() is False
        return builds[-1]["build_directory"], builds[-1]["name"]

    here = attempt()
    another_torch_install(monkeypatch)
    other = attempt()
    again = attempt()
    assert other[0] != here[0] and other[1] != here[1], (here, other)
    assert again == other and other[0] == native.build_folder(), (other, again)
