"""The native GEMV (``linear_rows``) of two native builds side by side in one process:
``python bench/gemv_builds_ab.py OLD_KEY NEW_KEY [ROWS]`` with the keys of two folders ``native-<key>`` under
``tinyserve_compile.kernels.native.cache_root()`` (each build of a changed source tree gets its own).

SmolLM2-135M's linear shapes, fp32 and bf16 (bf16 only up to 4 rows, where its GEMV stops), activation rows
``ROWS`` (comma-separated, default 1,2,4), two threads. Each call reads its weight
from memory, as in a decode step: the calls cycle through up to 40 copies of the weight (256 MB at most), after
a 64 MB write that evicts the caches; 6 rounds, the order of the builds flipped every round, medians per call.
"""
import sys, time, torch

from native_builds import load_build
torch.set_num_threads(2)
old, new = load_build(sys.argv[1]), load_build(sys.argv[2])
rows = [int(r) for r in sys.argv[3].split(",")] if len(sys.argv) > 3 else [1, 2, 4]
flush = torch.empty(64 << 20, dtype=torch.uint8)
shapes = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
for dt in (torch.float32, torch.bfloat16):
    for M in rows:
        if dt == torch.bfloat16 and M > 4:
            continue
        for N, K in shapes:
            # many distinct weights so that each call reads from memory, as in a decode step
            n_w = max(1, (256 << 20) // (N * K * dt.itemsize))
            n_w = min(n_w, 40)
            ws = [torch.randn(N, K).to(dt) for _ in range(n_w)]
            x = torch.randn(M, K).to(dt)
            assert torch.allclose(old.linear_rows(x, ws[0], None).float(), new.linear_rows(x, ws[0], None).float(), atol=1e-2, rtol=1e-2)
            t = {"old": [], "new": []}
            for r in range(6):
                for name, mod in ((("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old))):
                    flush.add_(1)
                    t0 = time.perf_counter()
                    for w in ws: mod.linear_rows(x, w, None)
                    t[name].append((time.perf_counter() - t0) / len(ws))
            o, n = sorted(t["old"])[3], sorted(t["new"])[3]
            print(f"{str(dt)[6:]:8} M={M} {N}x{K}: old {o*1e6:8.1f} us  new {n*1e6:8.1f} us  old/new {o/n:.2f}x  new {N*K*dt.itemsize/n/1e9:.1f} GB/s")
