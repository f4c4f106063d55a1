"""The OpenMP wait setting the benchmarks start with, set before torch loads OpenMP (``python -m bench``).

torch's CPU wheel runs its parallel regions (ATen's, Inductor's generated kernels, the native GEMV) on libgomp,
whose threads wait for the next region spinning for ``GOMP_SPINCOUNT`` spins (300000 by default: milliseconds)
before they sleep. On a machine shared with busy neighbours that spinning takes the core the neighbour or the
other thread needs. Measured on the 2-core Xeon of 2026-12-07 (SmolLM2 fp32 at 8K, ``bench decode
--neighbours``; docs/benchmarks.md "A shared machine"): 30000 spins kept tinyserve at 3.3-3.8x stock with two busy
neighbours (1.4-1.9x with libgomp's default), with idle decode within the run-to-run noise of the default; 1000
spins cost 30% idle, and ``OMP_WAIT_POLICY=passive`` 39%.
"""
from __future__ import annotations

import os

#: libgomp's spins before a waiting thread sleeps, where the environment sets neither of :data:`WAIT_VARIABLES`
GOMP_SPINCOUNT_DEFAULT = "30000"
#: what a user sets to choose OpenMP's waiting; either one set leaves the environment as it is
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def default_waits() -> bool:
    """Set ``GOMP_SPINCOUNT`` to :data:`GOMP_SPINCOUNT_DEFAULT` unless the environment chose a wait policy; whether
    it was set. Has an effect only before torch is first imported (libgomp reads its environment once, at load)."""
    if any(v in os.environ for v in WAIT_VARIABLES):
        return False
    os.environ["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT_DEFAULT
    return True
