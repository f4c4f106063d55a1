"""The C++ AutogradCPU pass-through of the native ops (``kernels/csrc/dispatch.cpp``).

Once the native module loads, ``tinyserve::sparse_decode``, ``cache_write`` and ``paged_sparse_decode`` reach their
CPU kernels without ``torch.library.custom_op``'s Python autograd and ADInplaceOrView kernels. What those kernels
did must still happen: written arguments get new version counters, and with an input that requires grad under
grad mode the output carries a grad_fn that raises on backward (the ops have no derivative), not a result that
silently drops the gradient.
"""
from __future__ import annotations

import pytest
import torch

from tinyserve_compile.kernels import reference as ref
from tinyserve_compile.kernels.bounds import allocate_bounds
from tinyserve_compile.kernels.native import load_native, native_unavailable_reason
from tinyserve_compile.kernels.spec import SelectionSpec

pytestmark = pytest.mark.skipif(not load_native(), reason=f"native kernel unavailable: {native_unavailable_reason()}")


def _registered_keys(op: str) -> str:
    return torch._C._dispatch_dump(f"tinyserve::{op}")


@pytest.mark.parametrize("op", ["sparse_decode", "cache_write", "paged_sparse_decode"])
def test_autograd_cpu_kernel_is_the_cpp_one(op):
    line = [ln for ln in _registered_keys(op).splitlines() if ln.startswith("AutogradCPU:")]
    assert line and "dispatch.cpp" in line[0], _registered_keys(op)


def _write_args():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 32, 8, generator=g)
    b = allocate_bounds(k, 8, torch.int8)
    ctrl = torch.tensor([1, 0], dtype=torch.int32)  # stale: the write rebuilds every page
    return k, b, ctrl, torch.tensor([5]), torch.randn(1, 2, 1, 8, generator=g)


def test_cache_write_bumps_the_versions_of_what_it_writes():
    k, b, ctrl, pos, src = _write_args()
    spec = SelectionSpec.default(page_size=8).to_list()
    written = (k, b.kmax, b.kmin, b.kabs, ctrl)
    before = [t._version for t in written]
    with torch.no_grad():
        torch.ops.tinyserve.cache_write(k, *b, ctrl, pos, src, spec)
    assert all(t._version > v for t, v in zip(written, before)), [t._version for t in written]
    assert pos._version == 0 and src._version == 0
    assert torch.equal(k[:, :, 5], src[:, :, 0]) and int(ctrl[0]) == 0
    want = ref.page_bounds(k, 8, dtype=torch.int8)
    assert torch.equal(b.kmax, want.kmax) and torch.equal(b.kmin, want.kmin)


def test_backward_through_the_op_is_an_error_naming_it():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 1, 8, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 64, 8, generator=g)
    v = torch.randn(1, 2, 64, 8, generator=g)
    b = ref.page_bounds(k, 8, dtype=torch.int8)
    spec = SelectionSpec.default(page_size=8, token_budget=16, candidate_extra=0).to_list()
    args = (q, k, v, b.kmax, b.kmin, b.kabs, torch.tensor([64]), None, 0.35, spec, "auto", None)
    out = torch.ops.tinyserve.sparse_decode(*args)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="tinyserve::sparse_decode"):
        out.sum().backward()
    with torch.no_grad():  # the same call without grad mode: no grad_fn, and the same values
        plain = torch.ops.tinyserve.sparse_decode(*args)
        want = ref.sparse_decode_reference(q.detach(), k, v, torch.tensor([64]), None, 0.35,
                                           SelectionSpec.from_list(spec), bounds=b)
    assert not plain.requires_grad and torch.equal(out.detach(), plain)
    assert torch.allclose(plain, want, atol=1e-5, rtol=1e-5)
