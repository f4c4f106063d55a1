"""Every implementation of the op and of the bounds writer, on one table of cases, against the reference.

For each case of :data:`tests.support.conformance_cases.CASES` (dtypes x GQA groups x masks x per-row lengths x
page sizes x bounds dtypes x one/two stages x keep_tokens x extra candidates) and each implementation (the
reference, the PyTorch path, the native kernel, Triton under the interpreter, the ONNX twin in ONNX Runtime):

* the output is within the dtype's tolerance of the reference's;
* the kept pages (and tokens, where the implementation exposes them) are the reference's, on every page whose
  score is finite (a page of -inf score contributes nothing either way);
* bounds written by each writer are bit-exact to a rebuild (``reference.page_bounds``) after every write.

The worst mismatch of each implementation is printed at the end of the run (a terminal summary).
"""
from __future__ import annotations

import zlib

import pytest
import torch

from tests.support.conformance_cases import (BOUND_CASES, CASES, IMPLS, RESULTS, TOL, case_inputs,
                                             comparable_pages, run_writer)

# log(0) = -inf is how a fully masked candidate page gets its -inf log-sum-exp in the interpreter; numpy warns
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) % 10_000  # stable across processes


@pytest.fixture
def impl_ready(request, monkeypatch):
    """Make ``impl`` runnable: the native kernel built (else skip, with the build's reason), Triton interpreted."""
    impl = request.getfixturevalue("impl")
    if impl == "native":
        from tinyserve_compile.kernels.native import load_native, native_unavailable_reason

        if not load_native():
            pytest.skip(f"native kernel unavailable: {native_unavailable_reason()}")
    if impl == "triton":
        request.getfixturevalue("triton_interpreted")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    if impl == "onnx":
        pytest.importorskip("onnxruntime")
    return impl


# the ONNX twin takes no mask, whole pages and fp32 (see conformance_cases): it runs only the cases it can
OP_RUNS = [pytest.param(case, impl, id=f"{case.id}-{impl}") for case in CASES for impl in IMPLS
           if impl != "onnx" or case.onnx_ok]
BOUND_RUNS = [pytest.param(*c, impl, id=f"{c[0]}-{c[1]}-S{c[2]}-L{c[3]}-{impl}") for c in BOUND_CASES
              for impl in ("torch", "native", "triton", "onnx")
              if impl != "onnx" or (c[0] == "fp32" and c[3] % c[2] == 0)]  # the twin: fp32 caches of whole pages


@pytest.mark.parametrize("case, impl", OP_RUNS)
def test_output_and_selection_match_the_reference(case, impl, impl_ready, tmp_path):
    q, k, v, vl, mask, bounds, scale = case_inputs(case, _seed(case.id))
    want, want_pages, want_tok = IMPLS["reference"](case, q, k, v, vl, mask, bounds, scale)
    out, pages, tok = IMPLS[impl](case, q, k, v, vl, mask, bounds, scale, tmp_path)
    assert out.shape == q.shape and out.dtype == q.dtype, (tuple(out.shape), out.dtype)
    atol, rtol = TOL[q.dtype]
    err = (out.double() - want.double()).abs()
    ratio = float((err / (atol + rtol * want.double().abs())).max())
    row = {"impl": impl, "case": case.id, "err": float(err.max()), "ratio": ratio}
    cmp = comparable_pages(case, q, k, vl, mask, bounds, scale)
    diffs = []
    if pages is not None:
        diffs += ((pages != want_pages) & cmp).nonzero().tolist()
    if tok is not None:
        cmp_tok = cmp.repeat_interleave(case.S, dim=-1)[..., :k.shape[2]]
        diffs += ((tok != want_tok) & cmp_tok).nonzero().tolist()
    row["set_diffs"] = len(diffs)
    RESULTS.append(row)
    assert not diffs, f"{impl} keeps another set than the reference at {diffs[:8]} ({case.id})"
    assert ratio <= 1.0, (f"{impl}: max |out - reference| {float(err.max()):.3e} is {ratio:.2f}x the tolerance "
                          f"(atol={atol}, rtol={rtol}) ({case.id})")


@pytest.mark.parametrize("dtype, bdt, S, L, impl", BOUND_RUNS)
def test_bounds_written_bit_exact(dtype, bdt, S, L, impl, impl_ready, tmp_path):
    steps = run_writer(impl, dtype, bdt, S, L, _seed(dtype, bdt, S, L), tmp_path)
    bad = 0
    for i, (got, want) in enumerate(steps):
        for name, g, w in zip(("kmax", "kmin", "kabs"), got, want):
            assert g.dtype == w.dtype, (impl, name, g.dtype, w.dtype)
            n = int((g.view(torch.uint8) != w.view(torch.uint8)).sum()) if g.dtype != torch.float32 else \
                int((g.view(torch.int32) != w.view(torch.int32)).sum())
            bad += n
            assert n == 0, f"{impl}: {name} after write {i} differs from a rebuild in {n} bytes/words " \
                           f"({dtype} keys, {bdt} bounds, S={S}, L={L})"
    RESULTS.append({"impl": f"{impl} (bounds)", "case": f"{dtype}-{bdt}-S{S}-L{L}", "bound_diffs": bad})
