"""A build lock left by a killed native build is cleared; a live one (a build running now) is kept."""
import os
import time

from tinyserve_compile.kernels.native import STALE_LOCK_SECONDS, clear_stale_lock


def test_stale_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    lock = tmp_path / "lock"
    assert not clear_stale_lock(str(tmp_path))  # no lock: nothing to do
    lock.write_text("")
    assert not clear_stale_lock(str(tmp_path)) and lock.exists()  # fresh: another process is building
    old = time.time() - STALE_LOCK_SECONDS - 5
    os.utime(lock, (old, old))
    assert clear_stale_lock(str(tmp_path)) and not lock.exists()


def test_build_guard_removes_a_lock_left_by_a_killed_build(tmp_path):
    # a builder killed while holding the guard: the OS drops its flock, and the next builder removes the
    # cpp_extension lock file it left (which cpp_extension alone would wait on forever, however fresh)
    import signal
    import subprocess
    import sys

    from tinyserve_compile.kernels.native import build_guard

    child = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(tmp_path / 'build.flock')!r}, os.O_CREAT | os.O_RDWR)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        f"open({str(tmp_path / 'lock')!r}, 'w').close()\n"
        "print('building', flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "building"
    assert (tmp_path / "lock").exists()
    child.send_signal(signal.SIGKILL)
    child.wait()
    with build_guard(str(tmp_path)):
        assert not (tmp_path / "lock").exists()
    assert not (tmp_path / "lock").exists()
