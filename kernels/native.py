"""Build and load the native CPU kernels (the C++ files of ``kernels/csrc/``) at first use.

The C++ sources are compiled with :func:`torch.utils.cpp_extension.load` into a cache
folder keyed by a hash of every file of ``csrc/`` and of everything the build's command lines hold
(:func:`build_spec`): the compiler, our flags, the include and library folders of the torch install and Python's
include folder, the torch and Python versions and the CPU's vector features (``-march=native`` makes the binary
specific to the host). A second process loads it in milliseconds, and two virtualenvs (two torch installs, the
same version) get a folder each instead of rebuilding one folder in turns (ninja rebuilds when a command
changes); ``build.json`` in the folder lists what its key is made of. The result is a Python extension module with
the functions ``sparse_decode``, ``kept_pages``, ``cache_write``, ``rebuild_bounds`` and, for
continuous batching's paged buffer, ``paged_sparse_decode``, ``paged_write`` and
``paged_bounds_rebuild`` (:func:`native_module`). This loader imports no op module and registers no op:
each op module (:mod:`.sparse_decode`, :mod:`.paged_sparse_decode`, :mod:`.bounds`) hands :func:`when_loaded`
the function that makes its native kernel the CPU kernel of its op, and the loader calls it with the module
once the module has loaded and passed its self-check.

If anything fails (no compiler, no ninja, a cache folder it cannot write, a build error, a module that does not
import), :func:`load_native` returns False, warns once (a ``RuntimeWarning``) and :func:`native_unavailable_reason`
says why in one line: the root cause (the compiler's first error line, not cpp_extension's command line), the torch
version the build ran against, and the path of the full build log (``build.log`` in the build folder, or a temporary
file where that cannot be written); callers then use the PyTorch path. Nothing is built at import time.

Environment
-----------
``TINYSERVE_DISABLE_NATIVE=1``
    Never build or load; the PyTorch path runs.
``TINYSERVE_NATIVE_ISA``
    ``avx512``, ``avx2`` or ``default``: override the detected vector ISA (testing: ``avx2`` on an AVX-512 machine
    builds without AVX-512, ``default`` builds for x86-64-v2; .ci/matrix.sh's ``isa`` edge runs both).
``TINYSERVE_NATIVE_CFLAGS``
    Extra compiler flags (development, e.g. ``-DTS_PROFILE`` for phase timings on stderr).
``TINYSERVE_CACHE_DIR``
    Cache root (default ``~/.cache/tinyserve_compile``).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
import warnings
from typing import Optional

import torch

__all__ = ["load_native", "native_module", "native_unavailable_reason", "when_loaded", "SOURCE_DIR", "source_files",
           "build_spec", "build_key", "build_folder"]

#: the folder of the C++ sources (headers and .cpp files) of the native ops
SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")


def source_files() -> list:
    """The names of the files of :data:`SOURCE_DIR` (headers and sources), sorted; empty when it is missing."""
    try:
        names = os.listdir(SOURCE_DIR)
    except OSError:
        return []
    return sorted(n for n in names if os.path.isfile(os.path.join(SOURCE_DIR, n)))

_lock = threading.RLock()  # re-entrant: a registration run under it may call when_loaded
#: build_dir: the build folder of this process's load, once made (a failed build writes its log there)
_state: dict = {"loaded": None, "reason": None, "module": None, "build_dir": None}
#: the op modules' registrations (when_loaded), run in order once the module loads
_registrations: list = []


def _cpu_flags() -> set:
    """The CPU feature flags of the host (``/proc/cpuinfo``; empty where unavailable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags") or line.startswith("Features"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _isa(flags: set) -> str:
    forced = os.environ.get("TINYSERVE_NATIVE_ISA", "").strip().lower()
    if forced in ("avx512", "avx2", "default"):
        return forced
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "default"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return "default"


def native_isa() -> str:
    """The vector ISA the native kernels are built for here: ``"avx512"``, ``"avx2"`` or ``"default"`` (the CPU's,
    or ``TINYSERVE_NATIVE_ISA``'s when set)."""
    return _isa(_cpu_flags())


def _flags(isa: str):
    """Compiler and linker flags for ``isa``."""
    cflags = ["-O3", "-fopenmp", "-DNDEBUG", "-fno-math-errno"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        # "default": the portable build, x86-64-v2 (SSE4.2, no AVX); "avx2" on an AVX-512 machine: its AVX-512
        # code paths compiled out (-mno-avx512f drops every AVX-512 subset), as an AVX2-only CPU (Zen 3) builds it
        cflags.append("-march=native" if isa != "default" else "-march=x86-64-v2")
        if isa == "avx2":
            cflags.append("-mno-avx512f")
    else:
        cflags.append("-mcpu=native")
    if isa == "avx512":
        cflags += ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    elif isa == "avx2":
        cflags += ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    else:
        cflags += ["-DCPU_CAPABILITY=DEFAULT"]
    cflags += os.environ.get("TINYSERVE_NATIVE_CFLAGS", "").split()  # development only (e.g. -DTS_PROFILE)
    return cflags, ["-fopenmp"]


def cache_root() -> str:
    """Where native builds live: ``TINYSERVE_CACHE_DIR``, else ``~/.cache/tinyserve_compile``."""
    return os.environ.get("TINYSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tinyserve_compile")


def native_module():
    """The loaded extension module (call :func:`load_native` first; None when it is not loaded)."""
    return _state["module"] if _state["loaded"] else None


def native_unavailable_reason() -> Optional[str]:
    """Why the native kernels are not in use (None when they are loaded, or were never tried).

    Call :func:`load_native` first; this only reports its outcome.
    """
    return _state["reason"]


def when_loaded(register) -> None:
    """Call ``register(module)`` once the native module has loaded and passed its self-check: now, when it has
    already, else at the end of the load that does (none when it never loads). An op module hands this the
    function that makes its native kernel its op's CPU kernel; the load fails when one of them raises."""
    with _lock:
        _registrations.append(register)
        module = _state["module"] if _state["loaded"] else None
    if module is not None:
        register(module)


def load_native(verbose: bool = False) -> bool:
    """Build (first time) and load the native kernels; True when :func:`native_module` is usable.

    Thread-safe and cached: the build is attempted once per process. A failure (other than
    ``TINYSERVE_DISABLE_NATIVE``) warns once with :func:`native_unavailable_reason`.
    """
    if _state["loaded"] is not None:
        return _state["loaded"]
    with _lock:
        if _state["loaded"] is not None:
            return _state["loaded"]
        try:
            _state["loaded"] = _load(verbose)
            _state["reason"] = None if _state["loaded"] else _state["reason"]
        except Exception as e:  # any build or load failure means: fall back to the PyTorch path
            _state["loaded"] = False
            cause = _root_cause(e)
            log = _write_build_log(_state.get("build_dir"), f"root cause: {cause}\n\n{_failure_log(e)}")
            _state["reason"] = (f"native kernel build failed against torch {torch.__version__} "
                                f"({type(e).__name__}): {cause}; {log}")
        if not _state["loaded"] and not _disabled():
            warnings.warn(f"tinyserve-compile: {_state['reason']}; the PyTorch path runs instead", RuntimeWarning,
                          stacklevel=2)
        return _state["loaded"]


def _disabled() -> bool:
    return os.environ.get("TINYSERVE_DISABLE_NATIVE", "") not in ("", "0")


#: lines of cpp_extension's and ninja's own that name no cause: the command lines of the build steps
_COMMAND_LINE = re.compile(r"^(Error building extension '[^']*': )?\[\d+/\d+\] |^FAILED: |^ninja: ")
#: a tool that the shell could not find: ``/bin/sh: 1: c++: not found``, ``bash: c++: command not found``
_NOT_FOUND = re.compile(r"(?:^|: )([^\s:]+): (?:command )?not found\s*$")


def _root_cause(e: BaseException) -> str:
    """One line that names why a build or load failed, at most 300 characters.

    The first of: a compiler diagnostic (``file:line:col: error: ...``, as ``compile error: ...``), a tool the
    shell did not find (``no C++ compiler: c++: not found on PATH``), a compiler that is not on ``PATH`` at all, a
    link error, an import of the built module that failed, a file the build could not write; else the first line
    that mentions an error and is not a build step's command line (cpp_extension's first line, ``Error building
    extension ...: [1/9] c++ ...``, names no cause), else the message's last such line.
    """
    compiler = _compiler_command()[0]
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    own = [ln for ln in lines if not _COMMAND_LINE.match(ln) and not ln.startswith(compiler + " ")]

    def first(pred):
        return next((ln for ln in own if pred(ln)), None)

    found = first(lambda ln: (": error:" in ln or ": fatal error:" in ln) and not ln.startswith("collect2:"))
    if found:
        return _cut(f"compile error: {found}")
    missing = next((m for m in map(_NOT_FOUND.search, own) if m), None)
    if missing:
        tool = missing.group(1)
        if tool == os.path.basename(compiler):
            return _cut(f"no C++ compiler: {tool}: not found on PATH (install g++ or set CXX)")
        return _cut(f"a build tool is missing: {tool}: not found on PATH")
    if shutil.which(compiler) is None:
        return _cut(f"no C++ compiler: {compiler}: not found on PATH (install g++ or set CXX)")
    found = first(lambda ln: "undefined reference" in ln or "cannot find -l" in ln or "ld returned" in ln)
    if found:
        return _cut(f"link error: {found}")
    if isinstance(e, ImportError):
        return _cut(f"the built module does not import: {lines[0] if lines else type(e).__name__}")
    if isinstance(e, OSError) and e.filename is not None:
        return _cut(f"cannot write {e.filename}: {e.strerror or type(e).__name__}")
    found = first(lambda ln: "error" in ln.lower())
    if found:
        return _cut(found)
    return _cut(own[-1] if own else (lines[-1] if lines else type(e).__name__))


def _cut(line: str, limit: int = 300) -> str:
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _failure_log(e: BaseException) -> str:
    """The full text of a failed build or load: the exception with its traceback (cpp_extension's message holds
    the build's whole output)."""
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))


def _write_build_log(build_dir: Optional[str], text: str) -> str:
    """Write the full log of a failed build; the words naming it in a reason: ``"full build log: PATH"``.

    Into ``build_dir/build.log`` (the folder made if needed); where that folder is unknown or cannot be written,
    a new temporary file; where neither can be written, says so.
    """
    header = (f"tinyserve-compile native build, torch {torch.__version__}, Python {sys.version.split()[0]}, "
              f"{sys.executable}\ncompiler: {' '.join(_compiler_command())} "
              f"({shutil.which(_compiler_command()[0]) or 'not on PATH'})\nbuild folder: {build_dir}\n"
              f"PATH={os.environ.get('PATH', '')}\n\n")
    if build_dir is not None:
        path = os.path.join(build_dir, "build.log")
        try:
            os.makedirs(build_dir, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(header + text)
            os.replace(tmp, path)  # whole, even with another process writing its own
            return f"full build log: {path}"
        except OSError:
            pass
    try:
        fd, path = tempfile.mkstemp(prefix="tinyserve-native-build-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write(header + text)
        return f"full build log: {path}"
    except OSError as e:
        return f"no build log ({type(e).__name__}: {e})"


def _compiler_command() -> list:
    """The compiler cpp_extension's build runs (``CXX``, else ``c++``), split as the shell splits it
    (``CXX="ccache g++"``)."""
    from torch.utils import cpp_extension

    getter = getattr(cpp_extension, "get_cxx_compiler", None)
    cxx = getter() if getter is not None else os.environ.get("CXX", "c++")
    return shlex.split(cxx) or ["c++"]


#: a build lock older than this is left over from a build that was killed: it is removed (a real build of this
#: source takes under a minute)
STALE_LOCK_SECONDS = 600


def clear_stale_lock(build_dir: str, max_age_s: float = STALE_LOCK_SECONDS) -> bool:
    """Remove ``build_dir/lock`` when it is older than ``max_age_s`` seconds; whether one was removed.

    ``torch.utils.cpp_extension`` holds that file while it builds and waits for it to go away before
    building; a build killed half-way leaves it behind, and every later build would wait forever.
    """
    lock = os.path.join(build_dir, "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return False
    if age <= max_age_s:
        return False
    try:
        os.remove(lock)
    except OSError:
        return False
    return True


@contextlib.contextmanager
def build_guard(build_dir: str):
    """Hold ``build_dir/build.flock`` while ``torch.utils.cpp_extension`` builds and loads the module.

    It is an OS file lock, which the kernel drops when its holder exits or is killed. Every build of this
    project takes it before cpp_extension takes its own ``lock`` file, so a ``lock`` found while holding it was
    left by a build that was killed half-way (cpp_extension would wait for it forever): it is removed. Where
    ``fcntl`` is missing (Windows), only :func:`clear_stale_lock`'s age rule applies.
    """
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(os.path.join(build_dir, "build.flock"), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits while another process builds this source
        try:
            os.remove(os.path.join(build_dir, "lock"))
        except FileNotFoundError:
            pass
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _read_sources(names: list) -> dict:
    """``{name: bytes}`` of the files of :data:`SOURCE_DIR`."""
    srcs = {}
    for n in names:
        with open(os.path.join(SOURCE_DIR, n), "rb") as f:
            srcs[n] = f.read()
    return srcs


def _include_paths() -> list:
    """The include folders of the build's command lines, as cpp_extension puts them there: the torch install's
    (``torch/include``, ...), then Python's (``Python.h``)."""
    from torch.utils import cpp_extension

    try:
        paths = list(cpp_extension.include_paths("cpu"))
    except TypeError:  # an older signature: include_paths(cuda=False)
        paths = list(cpp_extension.include_paths())
    python = sysconfig.get_path("include", scheme="nt" if os.name == "nt" else "posix_prefix")
    return paths + ([python] if python else [])


def _library_paths() -> list:
    """The library folders of the build's link line (the torch install's ``torch/lib``)."""
    from torch.utils import cpp_extension

    lib = getattr(cpp_extension, "TORCH_LIB_PATH", None)
    return [lib] if lib else [os.path.join(os.path.dirname(torch.__file__), "lib")]


def build_spec(sources: Optional[dict] = None, isa: Optional[str] = None) -> dict:
    """Everything the native build's command lines hold, and its sources: what :func:`build_key` hashes.

    Parameters
    ----------
    sources : dict, optional
        ``{name: bytes}``, every file of :data:`SOURCE_DIR` (read from there by default).
    isa : str, optional
        The vector ISA to build for (:func:`native_isa` by default).

    Returns
    -------
    dict
        ``sources`` (name to SHA-256), ``compiler`` (the command and the file it resolves to on ``PATH``),
        ``cflags`` and ``ldflags`` (ours), ``include_paths`` (the torch install's and Python's),
        ``library_paths`` (the torch install's), ``cxx11_abi``, ``torch``, ``python``, ``machine`` and
        ``cpu_features`` (the vector features ``-march=native`` compiles for).
    """
    if sources is None:
        sources = _read_sources(source_files())
    flags = _cpu_flags()
    cflags, ldflags = _flags(_isa(flags) if isa is None else isa)
    compiler = _compiler_command()
    resolved = shutil.which(compiler[0])
    return {
        "sources": {n: hashlib.sha256(sources[n]).hexdigest() for n in sorted(sources)},
        "compiler": compiler + [os.path.realpath(resolved) if resolved else "(not on PATH)"],
        "cflags": cflags,
        "ldflags": ldflags,
        "include_paths": _include_paths(),
        "library_paths": _library_paths(),
        "cxx11_abi": bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "cpu_features": sorted(x for x in flags if x.startswith(("avx", "fma", "f16c", "sse", "amx", "neon", "sve",
                                                                 "asimd"))),
    }


def build_key(spec: dict) -> str:
    """The cache key of a :func:`build_spec`: 16 hex digits of the SHA-256 of its canonical JSON (any difference
    in a command line, a source or the CPU gives another key, and so another build folder)."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def build_folder(spec: Optional[dict] = None) -> str:
    """The build folder of a :func:`build_spec` (this process's by default): ``native-<key>`` in
    :func:`cache_root`."""
    return os.path.join(cache_root(), f"native-{build_key(build_spec() if spec is None else spec)}")


def _load(verbose: bool) -> bool:
    if _disabled():
        _state["reason"] = "disabled by TINYSERVE_DISABLE_NATIVE"
        return False
    if not torch.backends.openmp.is_available() and not torch.__config__.parallel_info().count("OpenMP"):
        _state["reason"] = "this torch build has no OpenMP (the native kernel's thread pool)"
        return False
    names = source_files()
    if not any(n.endswith(".cpp") for n in names):
        _state["reason"] = f"native kernel source missing: no .cpp file in {SOURCE_DIR}"
        return False
    # ---- the build must find ninja (pip-installed next to this interpreter) without an activated venv
    bindir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if bindir not in path.split(os.pathsep):
        os.environ["PATH"] = bindir + (os.pathsep + path if path else "")
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        _state["reason"] = "ninja not found (pip install ninja)"
        return False
    # ---- cache key: sources, and everything the build's command lines hold
    isa = _isa(_cpu_flags())
    cflags, ldflags = _flags(isa)
    srcs = _read_sources(names)
    spec = build_spec(srcs, isa)
    key = build_key(spec)
    root = cache_root()
    build_dir = os.path.join(root, f"native-{key}")
    try:
        os.makedirs(build_dir, exist_ok=True)
        described = os.path.join(build_dir, "build.json")  # what this folder's key is made of, for a reader
        if not os.path.exists(described):
            tmp = f"{described}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(spec, f, indent=1, sort_keys=True)
            os.replace(tmp, described)
        clear_stale_lock(build_dir)
        # build from a copy of csrc/ inside the build folder: an editable checkout and an installed wheel (same
        # sources, other paths) then share one build instead of rebuilding each other's (ninja rebuilds when a
        # command changes); the headers travel with the sources, since the sources include them by relative name
        local_dir = os.path.join(build_dir, "csrc")
        os.makedirs(local_dir, exist_ok=True)
        for n in names:
            local = os.path.join(local_dir, n)
            if not os.path.exists(local) or open(local, "rb").read() != srcs[n]:
                tmp = f"{local}.{os.getpid()}.tmp"
                with open(tmp, "wb") as f:
                    f.write(srcs[n])
                os.replace(tmp, local)
    except OSError as e:
        log = _write_build_log(build_dir, _failure_log(e))
        _state["reason"] = (f"the native kernel's cache folder {root} cannot be written ({type(e).__name__}: "
                            f"{e.strerror or e}{f': {e.filename}' if e.filename else ''}; set TINYSERVE_CACHE_DIR); "
                            f"{log}")
        return False
    _state["build_dir"] = build_dir  # a failure from here on logs into the build folder
    with build_guard(build_dir):
        module = cpp_extension.load(
            name=f"tinyserve_native_{key}",
            sources=[os.path.join(local_dir, n) for n in names if n.endswith(".cpp")],
            extra_cflags=cflags,
            extra_ldflags=ldflags,
            build_directory=build_dir,
            is_python_module=True,
            verbose=verbose,
        )
    problem = _self_check(module)
    _state["module"] = module
    if problem:
        _state["reason"] = (f"native kernel self-check failed ({isa} build against torch {torch.__version__} in "
                            f"{build_dir}): {problem}")
        return False
    # only kernels that passed their self-check become the dispatcher's CPU kernels of the ops (when_loaded)
    i = 0
    while i < len(_registrations):  # by index: a registration made meanwhile (when_loaded in this thread) runs too
        _registrations[i](module)
        i += 1
    return True


def _self_check(lib) -> Optional[str]:
    """Run the freshly loaded kernel on small cases against :mod:`.reference`; a description of the first
    mismatch, or None. Covers the three bound dtypes, fp32 and bf16 caches, one and two stages (pages, and single
    tokens with extra candidates), a mask (a few ms)."""
    from . import reference as ref
    from .spec import SelectionSpec

    gen = torch.Generator().manual_seed(1234)
    B, Hkv, G, L, D, S = 2, 1, 3, 131, 64, 8
    for dtype, bdt, cf, extra, keep_tokens, masked in (
        (torch.float32, torch.float32, 1, 0, False, False),
        (torch.bfloat16, torch.bfloat16, 4, 0, False, True),
        (torch.float32, torch.int8, 1, 2 * S, True, True),
    ):
        q = torch.randn(B, Hkv * G, 1, D, generator=gen).to(dtype)
        k = torch.randn(B, Hkv, L, D, generator=gen).to(dtype)
        v = torch.randn(B, Hkv, L, D, generator=gen).to(dtype)
        mask = (torch.rand(B, 1, 1, L, generator=gen) < 0.8) if masked else None
        vl = torch.tensor([L, 100])
        kmax = torch.empty(B, Hkv, ref.num_pages(L, S), D, dtype=bdt)
        kmin, kabs = torch.empty_like(kmax), torch.empty(B, Hkv, kmax.shape[2])
        lib.rebuild_bounds(k, kmax, kmin, kabs, S)
        b = ref.page_bounds(k, S, dtype=bdt)
        if not (torch.equal(kmax, b.kmax) and torch.equal(kmin, b.kmin) and torch.equal(kabs, b.kabs)):
            return f"rebuild_bounds differs from reference.page_bounds ({dtype}, bounds {bdt})"
        spec = SelectionSpec(S, 32, 1, cf, extra, keep_tokens, bdt)
        out = lib.sparse_decode(q, k, v, kmax, kmin, kabs, vl, mask, 0.125, spec.to_list(), None)
        want = ref.sparse_decode_reference(q, k, v, vl, mask, 0.125, spec, bounds=b)
        err = float((out.float() - want.float()).abs().max())
        if not err <= (1e-4 if dtype == torch.float32 else 2e-2):
            return (f"sparse_decode differs from the reference by {err:.3g} ({dtype}, bounds {bdt}, c={cf}, "
                    f"extra={extra}, keep_tokens={keep_tokens})")
    return None
