"""Build and load the native CPU kernels (the C++ files of ``kernels/csrc/``) at first use.

The C++ sources are compiled with :func:`torch.utils.cpp_extension.load` into a cache
folder keyed by a hash of every file of ``csrc/``, the torch version, the compiler flags and the
CPU's vector features (``-march=native`` makes the binary specific to the host), so a
second process loads it in milliseconds. The result is a Python extension module with the
functions ``sparse_decode``, ``kept_pages``, ``cache_write``, ``rebuild_bounds`` and, for
continuous batching's paged buffer, ``paged_sparse_decode``, ``paged_write`` and
``paged_bounds_rebuild`` (:func:`native_module`). This loader imports no op module and registers no op:
each op module (:mod:`.sparse_decode`, :mod:`.paged_sparse_decode`, :mod:`.bounds`) hands :func:`when_loaded`
the function that makes its native kernel the CPU kernel of its op, and the loader calls it with the module
once the module has loaded and passed its self-check.

If anything fails (no compiler, no ninja, a build error), :func:`load_native` returns
False, warns once (a ``RuntimeWarning``) and :func:`native_unavailable_reason` says why, naming the torch
version the build ran against; callers then use the PyTorch path. Nothing is built at import time.

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
import os
import platform
import sys
import threading
import time
import warnings
from typing import Optional

import torch

__all__ = ["load_native", "native_module", "native_unavailable_reason", "when_loaded", "SOURCE_DIR", "source_files"]

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
_state: dict = {"loaded": None, "reason": None, "module": None}
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
            _state["reason"] = (f"native kernel build failed against torch {torch.__version__} "
                                f"({type(e).__name__}): {_summary(e)}")
        if not _state["loaded"] and not _disabled():
            warnings.warn(f"tinyserve-compile: {_state['reason']}; the PyTorch path runs instead", RuntimeWarning,
                          stacklevel=2)
        return _state["loaded"]


def _disabled() -> bool:
    return os.environ.get("TINYSERVE_DISABLE_NATIVE", "") not in ("", "0")


def _summary(e: Exception) -> str:
    """The first compiler error lines of a failed build (else the exception's last lines)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    # a compiler's diagnostics (`file:line:col: error: ...`) first: cpp_extension's own first line, "Error building
    # extension ...: [1/9] c++ ...", names no cause
    errors = [ln for ln in lines if ": error:" in ln] or [ln for ln in lines if "error" in ln.lower()]
    picked = errors[:2] if errors else lines[-3:]
    return " | ".join(picked)[:600] if picked else type(e).__name__


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
    # ---- cache key: source, torch version, flags, CPU features
    flags = _cpu_flags()
    isa = _isa(flags)
    cflags, ldflags = _flags(isa)
    srcs = {}
    for n in names:
        with open(os.path.join(SOURCE_DIR, n), "rb") as f:
            srcs[n] = f.read()
    vec_flags = sorted(x for x in flags if x.startswith(("avx", "fma", "f16c", "sse", "amx", "neon", "sve", "asimd")))
    h = hashlib.sha256()
    for n in names:  # every file of csrc/, name and content, in sorted order
        h.update(n.encode())
        h.update(b"\0")
        h.update(srcs[n])
        h.update(b"\0")
    for part in (torch.__version__.encode(), " ".join(cflags + ldflags).encode(), " ".join(vec_flags).encode(),
                 platform.machine().encode(), sys.version.split()[0].encode()):
        h.update(part)
        h.update(b"\0")
    key = h.hexdigest()[:16]
    root = cache_root()
    build_dir = os.path.join(root, f"native-{key}")
    os.makedirs(build_dir, exist_ok=True)
    clear_stale_lock(build_dir)
    # build from a copy of csrc/ inside the build folder: an editable checkout and an installed wheel (same
    # sources, other paths) then share one build instead of rebuilding each other's (ninja rebuilds when a command
    # changes); the headers travel with the sources, since the sources include them by relative name
    local_dir = os.path.join(build_dir, "csrc")
    os.makedirs(local_dir, exist_ok=True)
    for n in names:
        local = os.path.join(local_dir, n)
        if not os.path.exists(local) or open(local, "rb").read() != srcs[n]:
            tmp = f"{local}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(srcs[n])
            os.replace(tmp, local)
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
