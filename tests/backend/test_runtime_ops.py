"""The ops the passes put into graphs pass torch.library.opcheck; the runtime finds foreign writes once per call."""
from __future__ import annotations

import torch

import tinyserve_compile  # noqa: F401  (registers the ops)
from tinyserve_compile import runtime
from tinyserve_compile.kernels.bounds import allocate_bounds
from tinyserve_compile.kernels.reference import page_bounds
from tinyserve_compile.kernels.spec import SelectionSpec
from tinyserve_compile.runtime import BoundsSlot, runtime_stats, state_for


def _cache(L=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, L, 8, generator=g), torch.randn(1, 2, L, 8, generator=g)


def _spec(dtype):
    return SelectionSpec(4, 8, 0, 1, 0, False, dtype).to_list()


def test_opcheck_cache_write_and_policy_attention():
    k, v = _cache()
    for dtype in (torch.float32, torch.bfloat16):
        b = allocate_bounds(k, 4, dtype)
        src = torch.randn(1, 2, 1, 8)
        for stale in (1, 0):
            for pos in (torch.tensor([5]), torch.tensor(6, dtype=torch.int32)):  # any int dtype, 0-d or [n]
                ctrl = torch.tensor([stale, 0], dtype=torch.int32)
                torch.library.opcheck(torch.ops.tinyserve.cache_write.default, (k, *b, ctrl, pos, src, _spec(dtype)))
        q = torch.randn(1, 4, 1, 8)
        mask = (torch.arange(40) < 30)[None, None, None]
        for m in (None, mask):
            for dense in (0, 1):
                ctrl = torch.tensor([0, dense], dtype=torch.int32)
                for policy in ("h2o", "full"):
                    args = (q, k, v, *b, ctrl, torch.tensor([30]), m, 0.35, _spec(dtype), policy, "torch")
                    torch.library.opcheck(torch.ops.tinyserve.policy_attention.default, args)


def _step(slot, args, pos):
    """One 'compiled call' as the backend makes it: enter, the graph's write, leave."""
    kmax, kmin, kabs, ctrl = runtime.enter([slot], args, dense_layers=0)
    torch.ops.tinyserve.cache_write(args[0], kmax, kmin, kabs, ctrl, torch.tensor([pos]), torch.randn(1, 2, 1, 8),
                                    _spec(slot.bounds_dtype))
    runtime.leave([slot], args)


def test_enter_rebuilds_after_a_foreign_write_only():
    runtime.reset_runtime()
    k, _ = _cache(seed=1)
    slot = BoundsSlot(0, tuple(k.shape), k.dtype, 4, torch.bfloat16, decode_sites=1)
    for i in range(3):  # first call: a new buffer, rebuilt; then incremental
        _step(slot, (k,), 10 + i)
    assert runtime_stats["bounds_rebuilds"] == 1 and runtime_stats["bounds_updates"] == 2
    st = state_for(k, 4)
    assert torch.equal(st.bounds.kmax, page_bounds(k, 4, dtype=torch.bfloat16).kmax)
    k[:, :, 0] = 100.0  # foreign (eager) write to a page the op will not touch
    _step(slot, (k,), 13)
    assert runtime_stats["foreign_writes"] == 1 and runtime_stats["bounds_rebuilds"] == 2
    fresh = page_bounds(k, 4, dtype=torch.bfloat16)
    assert torch.equal(st.bounds.kmax, fresh.kmax) and torch.equal(st.bounds.kabs, fresh.kabs)
    assert not st.stale


def test_layers_ranked_by_first_write_across_calls_and_graphs():
    """dense_layers counts layers in execution order, whatever graph writes them; a new cache starts again."""
    runtime.reset_runtime()
    slot = BoundsSlot(0, (1, 2, 40, 8), torch.float32, 4, torch.float32, decode_sites=1)

    def flags(caches):  # one graph per layer: each call sees one buffer
        return [int(runtime.enter([slot], (c,), dense_layers=2)[3][1]) for c in caches]

    old = [_cache(seed=s)[0] for s in range(4)]
    assert flags(old) == [1, 1, 0, 0]
    assert flags(old) == [1, 1, 0, 0]  # next step: same ranks
    new = [_cache(seed=s)[0] for s in range(4, 8)]  # a new cache while the old one lives
    assert flags(new) == [1, 1, 0, 0]
    assert [state_for(c, 4).rank for c in old + new] == [0, 1, 2, 3, 0, 1, 2, 3]
    # one graph writing every layer: the same ranks, in the graph's order
    runtime.reset_runtime()
    slots = [BoundsSlot(i, (1, 2, 40, 8), torch.float32, 4, torch.float32, decode_sites=1) for i in range(4)]
    extra = runtime.enter(slots, old, dense_layers=1)
    assert [int(extra[4 * i + 3][1]) for i in range(4)] == [1, 0, 0, 0]
