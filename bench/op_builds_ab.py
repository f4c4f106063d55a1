"""The sparse decode op of several native builds side by side in one process:
``python bench/op_builds_ab.py KEY1,KEY2[,...] [L:dtype,...]`` with the keys of folders ``native-<key>`` under
``tinyserve_compile.kernels.native.cache_root()`` (each build of a changed source tree gets its own; a build's key is
``tinyserve_compile.kernels.native.native_module().__name__`` after ``load_native()``).

The shape of ``python -m bench op`` (B=1, 9 query / 3 KV heads, D=64, the defaults' selection: pages of 8, budget
2048, one sink page, candidates of the budget + 1024 tokens, kept tokens, int8 bounds), at the points given
(default ``16384:float32,65536:float32``). The builds must give equal outputs (checked first; ``SAME=0`` skips
the check, for builds whose selection rules differ). Each call starts from
cold caches (a 64 MB read before it, untimed) unless ``WARM=1``; ``REPS`` rounds (default 400) with the order of
the builds rotated every round; ``NT`` threads (default 2); ``BATCH`` rows of the same length (default 1); ``MASK=1``
a bool padding mask [B, 1, 1, L] that hides the first r * (L // (2 * B)) tokens of row r (``bench decode``'s batch
rows). Prints the median per build and its speed-up over the first.
"""
import os
import statistics
import sys
import time

import torch

from tinyserve_compile.kernels.bounds import allocate_bounds, rebuild_bounds_
from native_builds import load_build

torch.set_num_threads(int(os.environ.get("NT", "2")))

keys = sys.argv[1].split(",")
mods = [load_build(k) for k in keys]
points = sys.argv[2] if len(sys.argv) > 2 else "16384:float32,65536:float32"
pts = [(int(a.split(":")[0]), getattr(torch, a.split(":")[1])) for a in points.split(",")]
buf = torch.ones(64 * 2**20 // 4)
cold = os.environ.get("WARM") is None
B = int(os.environ.get("BATCH", "1"))
for L, dt in pts:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, 9, 1, 64, generator=gen).to(dt)  # [B, 9, 1, 64]
    k = torch.randn(B, 3, L, 64, generator=gen).to(dt)  # [B, 3, L, 64]
    v = torch.randn(B, 3, L, 64, generator=gen).to(dt)
    kmax, kmin, kabs = rebuild_bounds_(k, allocate_bounds(k, 8, torch.int8), 8)
    vl = torch.full((B,), L)
    mask = None
    if os.environ.get("MASK"):
        mask = torch.ones(B, 1, 1, L, dtype=torch.bool)  # [B, 1, 1, L]
        for r in range(B):
            mask[r, ..., : r * (L // (2 * B))] = False
    args = (q, k, v, kmax, kmin, kabs, vl, mask, 0.125, 8, 2048, 1, 1, None, 1024, True)
    outs = [m.sparse_decode(*args) for m in mods]
    for o in outs[1:] if os.environ.get("SAME", "1") != "0" else []:
        assert torch.equal(o, outs[0]), float((o.float() - outs[0].float()).abs().max())
    ts = [[] for _ in mods]
    for r in range(int(os.environ.get("REPS", "400"))):
        for j in range(len(mods)):
            i = (r + j) % len(mods)
            if cold:
                buf.sum()
            t0 = time.perf_counter()
            mods[i].sparse_decode(*args)
            ts[i].append(time.perf_counter() - t0)
    med = [statistics.median(t) * 1e6 for t in ts]
    name = f"L={L} {str(dt)[6:]}" + (f" B={B}" if B > 1 else "") + (" masked" if mask is not None else "")
    print(f"{name}: " + "  ".join(f"{k[:6]} {m:7.1f}us ({med[0] / m:.2f}x)" for k, m in zip(keys, med)), flush=True)
