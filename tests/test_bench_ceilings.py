"""``python -m bench ceilings``: the probe reads exactly the chunks it is given, the patterns are the op's
(ascending, distinct, inside the buffer, of the right size), and bad arguments are named. No timing is asserted."""
from __future__ import annotations

import pytest
import torch

from bench import ceilings


@pytest.fixture(scope="module")
def probe():
    return ceilings.load_probe()


@pytest.mark.parametrize("kind", ["seq", "page", "row"])
def test_patterns_are_ascending_distinct_chunks_inside_the_buffer(kind):
    gen = torch.Generator().manual_seed(3)
    buf_bytes, page, row = 1 << 20, 2048, 256
    off, chunk = ceilings.offsets(kind, 64 * page, buf_bytes, page, row, gen)
    assert chunk == (row if kind == "row" else page)
    assert off.numel() * chunk == 64 * page
    assert bool((off[1:] > off[:-1]).all()), "offsets must be strictly ascending"
    assert bool((off % chunk == 0).all()) and int(off.min()) >= 0 and int(off.max()) + chunk <= buf_bytes
    if kind == "seq":
        assert torch.equal(off, torch.arange(0, 64 * page, page))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("chunk,ahead", [(256, 0), (256, 32), (2048, 4), (64, 1)])
def test_probe_sums_exactly_the_chunks_it_is_given(probe, threads, chunk, ahead):
    buf = ceilings.huge_buffer(1 << 21, huge=False)  # [524288] fp32, 2 MB
    gen = torch.Generator().manual_seed(chunk + ahead)
    buf.copy_(torch.randint(-4, 5, buf.shape, generator=gen).float())  # small integers: every sum is exact
    off, _ = ceilings.offsets("row", 40 * chunk, buf.numel() * 4, chunk, chunk, gen)
    want = sum(float(buf[o // 4:(o + chunk) // 4].sum()) for o in off.tolist())
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = probe.read_chunks(buf, off, chunk, ahead)
    finally:
        torch.set_num_threads(prev)
    assert got == want


def test_probe_names_bad_arguments(probe):
    buf = torch.zeros(1024)
    with pytest.raises(RuntimeError, match="chunk must be a positive multiple of 64"):
        probe.read_chunks(buf, torch.zeros(1, dtype=torch.int64), 100, 0)
    with pytest.raises(RuntimeError, match="out of the buffer"):
        probe.read_chunks(buf, torch.tensor([4096 - 64]), 128, 0)
    with pytest.raises(RuntimeError, match="offsets must be int64"):
        probe.read_chunks(buf, torch.zeros(1, dtype=torch.int32), 64, 0)


@pytest.mark.parametrize("argv,name", [(["--page-bytes", "100"], "--page-bytes"), (["--pages", "0"], "--pages"),
                                       (["--buffer-mb", "1"], "--buffer-mb")])
def test_cli_names_the_bad_argument(argv, name, capsys):
    with pytest.raises(SystemExit) as e:
        ceilings.main(argv)
    assert e.value.code == 2
    assert name in capsys.readouterr().err


@pytest.mark.parametrize("dtype,shape", [(torch.float32, (1, 3, 40, 64)), (torch.bfloat16, (1, 3, 33, 64)),
                                         (torch.int8, (1, 3, 5, 64)), (torch.float32, (1, 3, 5))])
def test_op_bench_huge_page_copy_is_equal(dtype, shape):
    from bench.op import on_huge_pages

    t = (torch.randn(shape) * 20).to(dtype)
    h = on_huge_pages(t)
    assert h.dtype == t.dtype and h.shape == t.shape and h.is_contiguous()
    assert h.data_ptr() != t.data_ptr() and torch.equal(h, t)


def test_op_bench_times_the_huge_page_copy_beside_the_op():
    from bench.op import bench_one
    from tinyserve_compile.kernels.native import load_native

    r = bench_one(512, torch.float32, "defaults", reps=1, native=load_native(), with_torch=False, cold=False,
                  warmup=1, huge=True)
    assert r["sparse_huge_ms"] > 0 and r["huge_speedup"] > 0
    r = bench_one(512, torch.float32, "defaults", reps=1, native=load_native(), with_torch=False, cold=False,
                  warmup=1)
    assert r["sparse_huge_ms"] is None and r["huge_speedup"] is None
