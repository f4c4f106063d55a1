"""A row whose valid pages are all candidates attends densely, in every implementation.

Two-stage, a row of at most ``N1`` valid pages (``SelectionSpec.n_dense_pages``) would have every valid page among
its candidates: the exact stage would read every key anyway, so the row attends every valid token instead of
ranking them. The rule is per row: in a batch with a longer, sparse row the short row is still dense and the long
row gives what it gives alone. Checked for the reference, the PyTorch path, the native kernel, Triton (under the
interpreter) and the ONNX export (ONNX Runtime), against dense SDPA, at ``N1`` pages (dense) and ``N1 + 1`` pages
(sparse: the output differs from dense).
"""
from __future__ import annotations

import pytest
import torch

from tests.support.conformance_cases import _TwinStep, export_and_run
from tests.support.kernel_checks import TOL, assert_close_report, dense_sdpa, make_gen, randn
from tinyserve_compile.kernels import reference as ref
from tinyserve_compile.kernels.bounds import allocate_bounds, rebuild_bounds_
from tinyserve_compile.kernels.spec import SelectionSpec

#: pages of 4 tokens, K = 4 pages, N1 = 4 + 16 // 4 = 8 candidate pages, a cache of 32 pages
S, BUDGET, EXTRA, L, HKV, G, D = 4, 16, 16, 128, 2, 2, 16
N1_TOKENS = 8 * S


def _spec(keep_tokens: bool) -> SelectionSpec:
    return SelectionSpec(S, BUDGET, 1, 1, EXTRA, keep_tokens, torch.int8)


def _inputs(B, seed=0, dtype=torch.float32):
    gen = make_gen(seed)
    q = randn((B, HKV * G, 1, D), gen, dtype, scale=3.0)
    k, v = randn((B, HKV, L, D), gen, dtype), randn((B, HKV, L, D), gen, dtype)
    bounds = rebuild_bounds_(k, allocate_bounds(k, S, torch.int8), S)
    return q, k, v, bounds


def _run(impl, q, k, v, bounds, vl, spec, tmp_path):
    scale = D ** -0.5
    if impl == "reference":
        return ref.sparse_decode_reference(q, k, v, vl, None, scale, spec, ref.PageBounds(*bounds))
    if impl == "onnx":
        pytest.importorskip("onnxruntime")
        pytest.importorskip("onnxscript")
        return export_and_run(_TwinStep(spec, scale), (q, k, v, *bounds, vl - 1), tmp_path / "twin.onnx")[0]
    from tinyserve_compile.kernels.sparse_decode import run_kernel

    if impl == "native":
        from tinyserve_compile.kernels.native import load_native

        if not load_native():
            pytest.skip("native kernel unavailable")
    if impl == "triton":
        from tests.support.triton_interp import _import_interpreted

        _import_interpreted("tinyserve_compile.kernels.triton_sparse_decode")
    return run_kernel(impl, q, k, v, *bounds, vl, None, scale, spec)


IMPLS = ["reference", "torch", "native", "triton", "onnx"]


@pytest.fixture
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.usefixtures("_interpret")
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")
@pytest.mark.parametrize("keep_tokens", [True, False])
@pytest.mark.parametrize("impl", IMPLS)
def test_a_row_of_at_most_n1_pages_is_dense_also_beside_a_sparse_row(impl, keep_tokens, tmp_path):
    spec = _spec(keep_tokens)
    assert (spec.n_pages, spec.n_candidates, spec.n_dense_pages) == (4, 8, 8)
    q, k, v, bounds = _inputs(2, seed=1)
    atol, rtol = TOL[torch.float32]
    # row 0: 31 pages (sparse); row 1: N1 = 8 pages (dense, with more than K pages)
    vl = torch.tensor([L - 3, N1_TOKENS])
    out = _run(impl, q, k, v, bounds, vl, spec, tmp_path)
    dense = dense_sdpa(q, k, v, vl)
    assert_close_report(out[1], dense[1], atol, rtol, f"{impl}: the row of N1 pages vs dense")
    assert float((out[0] - dense[0]).abs().max()) > 1e-3, f"{impl}: the sparse row equals dense"
    # the sparse row gives what it gives alone (per-row rule, no batch dependence)
    alone = _run(impl, q[:1], k[:1], v[:1], tuple(b[:1] for b in bounds), vl[:1], spec, tmp_path)
    assert_close_report(out[0], alone[0], atol, rtol, f"{impl}: the sparse row in the batch vs alone")
    # one page more than the candidates: sparse again, and the reference's answer
    vl1 = torch.tensor([N1_TOKENS + 1])
    one = _run(impl, q[1:], k[1:], v[1:], tuple(b[1:] for b in bounds), vl1, spec, tmp_path)
    want = ref.sparse_decode_reference(q[1:], k[1:], v[1:], vl1, None, D ** -0.5, spec,
                                       ref.PageBounds(*(b[1:] for b in bounds)))
    assert_close_report(one, want, atol, rtol, f"{impl}: N1 + 1 pages vs the reference")
    assert float((one - dense_sdpa(q[1:], k[1:], v[1:], vl1)).abs().max()) > 1e-4, f"{impl}: N1 + 1 pages is dense"


def test_the_rule_is_in_the_spec_and_the_cost_model():
    from tinyserve_compile.cost import sparse_site_bytes

    spec = SelectionSpec.default()
    assert spec.n_dense_pages == 384  # budget 2048 + 1024 extra candidates, pages of 8
    assert SelectionSpec.default(candidate_extra=0).n_dense_pages == 256  # one stage: the budget
    assert spec.dense_cache(384) and not spec.dense_cache(385)
    dense = lambda ctx: 2 * 3 * ctx * 64 * 4  # noqa: E731
    assert sparse_site_bytes(3072, 3, 64, 4, 8, 2048, 1, 1, 1024) == dense(3072)
    assert sparse_site_bytes(3080, 3, 64, 4, 8, 2048, 1, 1, 1024) < dense(3080)
