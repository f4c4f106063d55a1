"""tinyserve::linear_int4 with the native int4 GEMV as its CPU kernel, against the PyTorch reference (the
dequantized weight, then a linear): ATen's int4pack layout, 1 to 8 bf16 activation rows, bias or not,
group sizes 32/64/128; the reference against ATen's own kernel; more rows and other shapes go to ATen's kernel."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from tinyserve_compile.kernels.linear import (GEMV_MAX_ROWS, dequantize_int4pack, int4_layout_problem, linear_int4,
                                              linear_int4_group,
                                              load_native_linear, native_linear_reason)

pytestmark = pytest.mark.skipif(not load_native_linear() or int4_layout_problem() is not None,
                                reason=f"native int4 GEMV unavailable: {native_linear_reason() or int4_layout_problem()}")


def _weight(K, N, gs, seed):
    """(qdata [N, K/2] uint8 int4pack, scale_and_zero [K/gs, N, 2] bf16) of random codes, scales and zeros."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K), dtype=torch.int32, generator=g)
    qdata = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack([torch.rand(K // gs, N, generator=g) * 0.1 + 1e-3,
                      torch.randn(K // gs, N, generator=g) * 0.1], -1).to(torch.bfloat16)
    return qdata, sz


def _want(x, qdata, sz, gs, b):
    """The reference in fp64: the dequantized weight (bf16, as ATen's kernel rounds it), then a linear."""
    w = dequantize_int4pack(qdata, sz, gs).double()  # [N, K]
    return F.linear(x.double(), w, None if b is None else b.double())


def test_reference_is_atens_dequantized_weight():
    # ATen's kernel against the identity returns W^T exactly: the reference reads the same codes and scales
    K, N, gs = 128, 192, 32
    qdata, sz = _weight(K, N, gs, 3)
    w_t = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(K, dtype=torch.bfloat16), qdata, gs, sz)  # [K, N]
    assert torch.equal(w_t.t(), dequantize_int4pack(qdata, sz, gs))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, GEMV_MAX_ROWS), groups=st.integers(1, 6), gs=st.sampled_from([32, 64, 128]),
       blocks=st.integers(1, 3), bias=st.booleans(),
       three_d=st.booleans(), seed=st.integers(0, 2**16))
def test_int4_gemv_matches_reference(rows, groups, gs, blocks, bias, three_d, seed):
    dtype = torch.bfloat16
    K, N = groups * gs, 64 * blocks
    qdata, sz = _weight(K, N, gs, seed)
    g = torch.Generator().manual_seed(seed + 1)
    lead = (rows, 1) if three_d else (rows,)  # [B, 1, K] is a decode step's activation
    x = torch.randn(*lead, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    out = linear_int4(x, qdata, sz, gs, N, b)
    want = _want(x, qdata, sz, gs, b)
    assert out.shape == (*lead, N) and out.dtype == dtype
    tol = 8e-3  # the bf16 output's rounding
    assert float((out.double() - want).abs().max()) <= tol * (float(want.abs().max()) + 1.0)


@pytest.mark.parametrize("rows", [9, 16])
def test_more_rows_run_atens_kernel(rows):
    K, N, gs = 64, 128, 32
    qdata, sz = _weight(K, N, gs, 5)
    x = torch.randn(rows, K).to(torch.bfloat16)
    want = torch.ops.aten._weight_int4pack_mm_for_cpu(x, qdata, gs, sz)
    assert torch.equal(linear_int4(x, qdata, sz, gs, N), want)


def test_opcheck_and_fake():
    K, N, gs = 64, 128, 32
    qdata, sz = _weight(K, N, gs, 7)
    x = torch.randn(2, 1, K).to(torch.bfloat16)
    b = torch.randn(N).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.tinyserve.linear_int4.default, (x, qdata, sz, gs, N, b))
    torch.library.opcheck(torch.ops.tinyserve.linear_int4.default, (x[0], qdata, sz, gs, N, None))
    with FakeTensorMode() as mode:
        out = torch.ops.tinyserve.linear_int4(mode.from_tensor(x), mode.from_tensor(qdata), mode.from_tensor(sz),
                                              gs, N, None)
    assert out.shape == (2, 1, N) and out.dtype == torch.bfloat16


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, GEMV_MAX_ROWS), groups=st.integers(1, 3), blocks=st.lists(st.integers(1, 3), min_size=1, max_size=3),
       seed=st.integers(0, 2**16))
def test_int4_group_equals_one_linear_per_weight(rows, groups, blocks, seed):
    gs = 32
    K = groups * gs
    weights = [_weight(K, 64 * nb, gs, seed + i) for i, nb in enumerate(blocks)]
    x = torch.randn(rows, 1, K, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    Ns = [64 * nb for nb in blocks]
    out = linear_int4_group(x, [q for q, _ in weights], [sz for _, sz in weights], gs, Ns)  # [rows, 1, sum N]
    assert out.shape == (rows, 1, sum(Ns)) and out.dtype == torch.bfloat16
    for o, (q, sz), n in zip(out.split(Ns, -1), weights, Ns):
        assert torch.equal(o, linear_int4(x, q, sz, gs, n))


def test_int4_group_opcheck_fake_and_bad_lists():
    K, gs = 64, 32
    (q1, s1), (q2, s2) = _weight(K, 128, gs, 1), _weight(K, 64, gs, 2)
    x = torch.randn(2, 1, K).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.tinyserve.linear_int4_group.default, (x, [q1, q2], [s1, s2], gs, [128, 64]))
    with FakeTensorMode() as mode:
        out = linear_int4_group(mode.from_tensor(x), [mode.from_tensor(q1)], [mode.from_tensor(s1)], gs, [128])
    assert out.shape == (2, 1, 128)
    with pytest.raises(RuntimeError, match="one entry per weight"):
        linear_int4_group(x, [q1, q2], [s1], gs, [128, 64])
