"""The ops the passes put into graphs pass torch.library.opcheck, and the write op finds foreign writes."""
from __future__ import annotations

import torch

import tinyserve_compile  # noqa: F401  (registers the ops)
from tinyserve_compile.kernels.reference import page_bounds
from tinyserve_compile.runtime import runtime_stats, state_for


def _cache(L=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, L, 8, generator=g), torch.randn(1, 2, L, 8, generator=g)


def test_opcheck_cache_write_and_paged_attention():
    k, v = _cache()
    probe = torch.zeros(1)
    pos, src = torch.tensor([5]), torch.randn(1, 2, 1, 8)
    torch.library.opcheck(torch.ops.tinyserve.cache_write.default, (k, probe, pos, src, 4))
    q = torch.randn(1, 4, 1, 8)
    mask = (torch.arange(40) < 30)[None, None, None]
    for m in (None, mask):
        args = (q, k, v, torch.tensor([30]), m, 0.35, 4, 8, 0, 1, "query_aware", "torch")
        torch.library.opcheck(torch.ops.tinyserve.paged_attention.default, args)


def test_cache_write_rebuilds_after_a_foreign_write_only():
    k, _ = _cache(seed=1)
    probe = torch.zeros(1)
    runtime_stats.clear()
    for i in range(3):  # first call: a new buffer, rebuilt; then incremental
        torch.ops.tinyserve.cache_write(k, probe, torch.tensor([10 + i]), torch.randn(1, 2, 1, 8), 4)
    assert runtime_stats["bounds_rebuilds"] == 1 and runtime_stats["bounds_updates"] == 2
    k[:, :, 0] = 100.0  # foreign (eager) write to a page the op will not touch
    torch.ops.tinyserve.cache_write(k, probe, torch.tensor([13]), torch.randn(1, 2, 1, 8), 4)
    assert runtime_stats["foreign_writes"] == 1 and runtime_stats["bounds_rebuilds"] == 2
    st = state_for(k, 4)
    assert torch.equal(st.bounds.kmax, page_bounds(k, 4).kmax)
    # another probe (another compiled graph) writing the same buffer: rebuild, never stale bounds
    torch.ops.tinyserve.cache_write(k, torch.zeros(1), torch.tensor([14]), torch.randn(1, 2, 1, 8), 4)
    assert runtime_stats["bounds_rebuilds"] == 3
