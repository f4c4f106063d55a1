"""How the native kernel schedules its work: its own thread pool, ``at::parallel_for``, one thread, many callers.

The two forced schedulings, pool and omp (``TINYSERVE_NATIVE_SCHED`` at load, or ``set_scheduling``), split the work
into the same chunks, so with the same thread count their outputs are bitwise equal (the default, auto, picks one of
the two by the machine's load); every output is also checked against the reference. Skipped, with the build's
reason, only where the native kernel cannot be built.
"""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.support.kernel_checks import TOL, assert_close_report, make_gen, randn
from tinyserve_compile.kernels import reference as ref
from tinyserve_compile.kernels.native import load_native, native_module, native_unavailable_reason
from tinyserve_compile.kernels.spec import SelectionSpec

pytestmark = pytest.mark.skipif(not load_native(), reason=f"native kernel unavailable: {native_unavailable_reason()}")


def _case(seed, B=2, Hkv=3, G=3, L=1024, D=64, S=8, valid=(1000, 700)):
    gen = make_gen(seed)
    q = randn((B, Hkv * G, 1, D), gen)
    k = randn((B, Hkv, L, D), gen)
    v = randn((B, Hkv, L, D), gen)
    vl = torch.tensor(valid[:B], dtype=torch.int64)
    b = ref.page_bounds(k, S, dtype=torch.int8)
    return q, k, v, vl, b


def _spec(budget, cf, extra, keep_tokens):
    return SelectionSpec(8, budget, 1, cf, extra, keep_tokens, torch.int8)


def _native(q, k, v, vl, b, budget=128, cf=2, extra=64, keep_tokens=True):
    # q: [B, Hq, 1, D] fp32; k, v: [B, Hkv, L, D] fp32; vl: int64 [B]
    return native_module().sparse_decode(q, k, v, b.kmax, b.kmin, b.kabs, vl, None, 0.125,
                                         _spec(budget, cf, extra, keep_tokens).to_list(), None)


def _reference(q, k, v, vl, b, budget=128, cf=2, extra=64, keep_tokens=True):
    return ref.sparse_decode_reference(q, k, v, vl, None, 0.125, _spec(budget, cf, extra, keep_tokens), bounds=b)


@pytest.fixture
def scheduling():
    """``scheduling(name)`` forces the native kernels' scheduling (``auto``, ``omp`` or ``pool``) for the test."""
    before = native_module().set_scheduling("auto")
    yield native_module().set_scheduling
    native_module().set_scheduling(before)


@pytest.fixture
def two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


@pytest.mark.parametrize("keep_tokens", [False, True])
def test_pool_and_parallel_for_agree_bitwise(two_threads, scheduling, keep_tokens):
    args = _case(1)
    scheduling("pool")
    pooled = _native(*args, keep_tokens=keep_tokens)
    scheduling("omp")
    omp = _native(*args, keep_tokens=keep_tokens)
    assert torch.equal(pooled, omp)
    assert_close_report(pooled, _reference(*args, keep_tokens=keep_tokens), *TOL[torch.float32], "pool")


def test_one_thread_matches_reference():
    args = _case(2)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = _native(*args)
    finally:
        torch.set_num_threads(old)
    assert_close_report(out, _reference(*args), *TOL[torch.float32], "one thread")


def test_calls_of_different_sizes_in_a_row(two_threads):
    """Jobs with different task lists follow each other (a helper late for one job must not run the next one's
    items with the old one's function): every output equals that of the same call made alone."""
    cases = [_case(10 + i, B=1 + i % 2, L=256 * (1 + i % 4), valid=(256 * (1 + i % 4) - 3, 200)) for i in range(4)]
    want = [_native(*c, budget=64 + 32 * i) for i, c in enumerate(cases)]
    for rep in range(50):
        for i, c in enumerate(cases):
            assert torch.equal(_native(*c, budget=64 + 32 * i), want[i]), f"call {rep}/{i}"
    for i, c in enumerate(cases):
        assert_close_report(want[i], _reference(*c, budget=64 + 32 * i), *TOL[torch.float32], f"case {i}")


def test_concurrent_callers(two_threads):
    """Python threads calling the kernel at once (one holds the pool, the others run their work themselves)."""
    cases = [_case(20 + i) for i in range(4)]
    want = [_native(*c) for c in cases]
    bad, errors = [], []

    def worker(i):
        try:
            for _ in range(20):
                if not torch.equal(_native(*cases[i]), want[i]):
                    bad.append(i)
        except Exception as e:  # reported below
            errors.append(repr(e))

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors and not bad, (errors, bad)


def test_bounds_rebuild_pool_and_parallel_for(two_threads, scheduling):
    gen = make_gen(3)
    k = randn((2, 3, 4096, 64), gen)
    want = ref.page_bounds(k, 8, dtype=torch.float32)
    outs = []
    for sched in ("pool", "omp"):
        scheduling(sched)
        kmax, kmin, kabs = torch.empty_like(want.kmax), torch.empty_like(want.kmin), torch.empty_like(want.kabs)
        native_module().rebuild_bounds(k, kmax, kmin, kabs, 8)
        outs.append((kmax, kmin, kabs))
    for kmax, kmin, kabs in outs:
        assert torch.equal(kmax, want.kmax) and torch.equal(kmin, want.kmin) and torch.equal(kabs, want.kabs)



def test_scheduling_names(scheduling):
    scheduling("auto")
    assert native_module().scheduling().startswith("auto (")
    for forced in ("omp", "pool"):
        assert scheduling(forced) in ("auto", "omp")  # the previous setting
        assert native_module().scheduling() == forced
    with pytest.raises(ValueError, match="name"):
        scheduling("threads")


@pytest.mark.parametrize("env", ["pool", "bogus"])
def test_environment_is_read_once_at_load(env, tmp_path):
    """``TINYSERVE_NATIVE_SCHED`` sets the scheduling when the module loads (an unknown value: auto); changing the
    variable later in the process changes nothing (set_scheduling does)."""
    code = ("import os; from tinyserve_compile.kernels.native import load_native, native_module; "
            "assert load_native(); m = native_module(); print(m.scheduling()); "
            "os.environ['TINYSERVE_NATIVE_SCHED'] = 'pool' if m.scheduling() == 'omp' else 'omp'; print(m.scheduling())")
    env_vars = dict(os.environ, TINYSERVE_NATIVE_SCHED=env)
    out = subprocess.run([sys.executable, "-c", code], env=env_vars, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr[-2000:]
    first, second = out.stdout.split("\n")[:2]
    if env == "bogus":  # auto's own choice may change between the two reads: only the setting is compared
        assert first.startswith("auto (") and second.startswith("auto ("), (first, second)
    else:
        assert first == second == env, (first, second)


@pytest.mark.slow  # spins more processes than cores for up to 10 s: loads the whole machine
@pytest.mark.skipif(not os.path.exists("/proc/loadavg"), reason="no /proc/loadavg to read the machine's load from")
def test_auto_takes_the_pool_on_an_oversubscribed_machine(scheduling):
    """With more spinning processes than usable cores, auto switches to the pool within a few 50 ms samples."""
    scheduling("auto")
    n = len(os.sched_getaffinity(0)) + 2
    stop = multiprocessing.get_context("spawn").Event()
    spinners = [multiprocessing.get_context("spawn").Process(target=_spin, args=(stop,), daemon=True)
                for _ in range(n)]
    for p in spinners:
        p.start()
    try:
        seen = []
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            seen.append(native_module().scheduling())
            if "pool" in seen[-1]:
                break
            time.sleep(0.02)
    finally:
        stop.set()
        for p in spinners:
            p.join(5)
    assert "pool" in seen[-1], seen[-5:]


def _spin(stop):
    while not stop.is_set():
        pass
