"""tinyserve::linear with the native GEMV as its CPU kernel, against F.linear: fp32 and bf16 weights, 1 to 8
activation rows, bias or not, K with and without a vector tail; more rows, other dtypes go to ATen."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from tinyserve_compile.kernels.linear import GEMV_MAX_ROWS, linear, linear_group, load_native_linear, native_linear_reason

pytestmark = pytest.mark.skipif(not load_native_linear(), reason=f"native GEMV unavailable: {native_linear_reason()}")


def _args(lead, K, N, dtype, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, w, b


def _want(x, w, b):
    """F.linear in fp64 over the same (rounded) inputs."""
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, GEMV_MAX_ROWS), K=st.integers(1, 80), N=st.integers(1, 70),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), bias=st.booleans(), three_d=st.booleans(),
       seed=st.integers(0, 2**16))
def test_gemv_matches_linear(rows, K, N, dtype, bias, three_d, seed):
    lead = (rows, 1) if three_d else (rows,)  # [B, 1, K] is a decode step's activation
    x, w, b = _args(lead, K, N, dtype, bias, seed)
    out = linear(x, w, b)
    want = _want(x, w, b)
    assert out.shape == (*lead, N) and out.dtype == dtype
    scale = float(want.abs().max()) + 1.0
    # fp32: accumulation order only; bf16: the result's rounding to bf16 (8 mantissa bits)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    err = float((out.double() - want).abs().max())
    assert err <= tol * scale, (err, scale)


def test_decode_shapes_fp32():
    # SmolLM2-135M's linears at one and eight rows, K a multiple of the vector width
    for N, K in ((576, 576), (192, 576), (1536, 576), (576, 1536)):
        for rows in (1, 8):
            x, w, b = _args((rows,), K, N, torch.float32, False, N + rows)
            err = float((linear(x, w, b).double() - _want(x, w, b)).abs().max())
            assert err <= 1e-4, (N, K, rows, err)


def test_more_rows_run_aten_linear():
    x, w, b = _args((GEMV_MAX_ROWS + 1,), 40, 24, torch.float32, True, 3)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))


def test_bf16_above_four_rows_runs_aten_linear():
    x, w, b = _args((5,), 40, 24, torch.bfloat16, True, 6)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))


def test_non_contiguous_weight_runs_aten_linear():
    x, w, _ = _args((2,), 40, 24, torch.float32, False, 4)
    wt = w.t().contiguous().t()  # [24, 40] with column-major strides
    assert torch.equal(linear(x, wt), F.linear(x, wt))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_activations_equal_contiguous_ones(dtype):
    # the kernel reads x's data in place or widens it into a buffer; a strided x is copied first, never misread
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(3, 2 * 40, generator=g).to(dtype)
    x = wide[:, ::2]  # [3, 40], row stride 80, column stride 2
    w = torch.randn(24, 40, generator=g).to(dtype)
    ws = [w, torch.randn(8, 40, generator=g).to(dtype)]
    assert not x.is_contiguous()
    assert torch.equal(linear(x, w), linear(x.contiguous(), w))
    assert torch.equal(linear_group(x, ws), linear_group(x.contiguous(), ws))
    assert torch.equal(linear_group(x.contiguous(), ws), torch.cat([linear(x.contiguous(), v) for v in ws], -1))


def test_mixed_dtypes_fail_like_linear():
    x, w, _ = _args((1,), 16, 8, torch.float32, False, 5)
    with pytest.raises(RuntimeError):
        F.linear(x, w.to(torch.bfloat16))
    with pytest.raises(RuntimeError):
        linear(x, w.to(torch.bfloat16))


def test_fake_gives_shape_and_dtype():
    with FakeTensorMode():
        x = torch.empty(3, 1, 32, dtype=torch.bfloat16)
        out = linear(x, torch.empty(20, 32, dtype=torch.bfloat16), None)
    assert out.shape == (3, 1, 20) and out.dtype == torch.bfloat16


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, GEMV_MAX_ROWS), K=st.integers(1, 80), Ns=st.lists(st.integers(1, 70), min_size=1, max_size=4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_group_equals_one_linear_per_weight(rows, K, Ns, dtype, seed):
    # one call for the weights that read one x (q/k/v, gate/up): each result is exactly the single op's (the same
    # row kernels), so it is as close to F.linear as test_gemv_matches_linear shows
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 1, K, generator=g).to(dtype)
    ws = [torch.randn(n, K, generator=g).to(dtype) for n in Ns]
    out = linear_group(x, ws)  # [rows, 1, sum N]: the outputs side by side
    assert out.shape == (rows, 1, sum(Ns)) and out.dtype == dtype
    for o, w in zip(out.split(Ns, -1), ws):
        assert torch.equal(o, linear(x, w, None))


def test_group_above_the_gemv_rows_is_aten_linear():
    x = torch.randn(GEMV_MAX_ROWS + 1, 32)
    ws = [torch.randn(20, 32), torch.randn(7, 32)]
    out = linear_group(x, ws)
    assert out.shape == (GEMV_MAX_ROWS + 1, 27)
    for o, w in zip(out.split([20, 7], -1), ws):
        assert torch.equal(o, F.linear(x, w))


def test_group_opcheck_and_fake():
    x = torch.randn(2, 1, 32)
    ws = [torch.randn(20, 32), torch.randn(12, 32)]
    torch.library.opcheck(torch.ops.tinyserve.linear_group.default, (x, ws))
    xb, wb = x.to(torch.bfloat16), [w.to(torch.bfloat16) for w in ws]
    with FakeTensorMode() as mode:
        out = linear_group(mode.from_tensor(xb), [mode.from_tensor(w) for w in wb])
    assert out.shape == (2, 1, 32) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_with_long_rows_equals_one_linear_per_weight(dtype):
    # K over 1024 at 5-8 rows: two weight rows per group in the single op, and so in the grouped one
    rows = 8 if dtype == torch.float32 else 4
    g = torch.Generator().manual_seed(11)
    x = torch.randn(rows, 1100, generator=g).to(dtype)
    ws = [torch.randn(n, 1100, generator=g).to(dtype) for n in (41, 24, 7)]
    for o, w in zip(linear_group(x, ws).split([41, 24, 7], -1), ws):
        assert torch.equal(o, linear(x, w, None))
