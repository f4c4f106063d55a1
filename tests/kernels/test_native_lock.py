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
