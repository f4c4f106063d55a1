"""The one table of selection cases, and every implementation of the op and of the bounds writer behind one call.

:data:`CASES` samples the product of the axes below with a fixed seed (every value of every axis appears; the
sample is checked at import), so the suite stays a few minutes on 2 cores; twelve more cases, which the ONNX twin
runs too, pair every bounds dtype with every stage rule. Each implementation returns the
output, the pages it keeps where it exposes them, and the kept tokens where it exposes those:

============  =======================================  ============================================
name          output                                   selected set
============  =======================================  ============================================
reference     ``reference.sparse_decode_reference``    ``reference.choose`` (pages and tokens)
torch         the PyTorch path (``run_kernel``)        through its output (no selection exposed)
native        the C++ kernel (``run_kernel``)          ``kept_pages`` (pages)
triton        Triton under ``TRITON_INTERPRET=1``      ``select_pages_triton`` (pages and tokens)
onnx          ``tinyserve::export_sparse_decode``      through its output (no selection exposed)
              exported and run in ONNX Runtime
============  =======================================  ============================================

The ONNX twin takes no mask, one position per row (``valid_len = position + 1 <= L``) and a cache of whole
pages, so it runs the cases without a mask, with ``L % page_size == 0``, in fp32.
"""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from tinyserve_compile.kernels import reference as ref
from tinyserve_compile.kernels.spec import SelectionSpec

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BOUNDS = {"b32": torch.float32, "b16": torch.bfloat16, "b8": torch.int8}
#: (atol, rtol) of outputs of magnitude ~1 against the fp32-computed reference: a few ulps of the output dtype
TOL = {torch.float32: (3e-5, 3e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}

#: (candidate_factor, extra candidate pages): one stage, or two stages by factor, by extra candidates, or both
STAGES = {"one": (1, 0), "factor": (2, 0), "extra": (1, 3), "both": (2, 2)}

AXES = {
    "dtype": list(DTYPES),
    "G": [1, 3, 4],
    "mask": [None, "bool", "float_head"],
    "rows": ["uniform", "ragged"],
    "S": [4, 5, 8],
    "L": [120, 117],  # whole pages for every S, or a partial last page
    "bounds": list(BOUNDS),
    "stages": list(STAGES),
    "keep_tokens": [False, True],
}
N_CASES = 36

#: one row per (test, implementation): filled by the tests, printed by tests/conformance/conftest.py's terminal summary
RESULTS: list = []
#: one line per fuzzed implementation (test_fuzz.py): its draws and what each ended in
FUZZ: list = []


@dataclass(frozen=True)
class Case:
    dtype: str
    G: int
    mask: Optional[str]
    rows: str
    S: int
    L: int
    bounds: str
    stages: str
    keep_tokens: bool

    @property
    def id(self) -> str:
        return (f"{self.dtype}-G{self.G}-{self.mask or 'nomask'}-{self.rows}-S{self.S}-L{self.L}-{self.bounds}-"
                f"{self.stages}{'-tok' if self.keep_tokens else ''}")

    @property
    def spec(self) -> SelectionSpec:
        cf, extra_pages = STAGES[self.stages]
        # extra tokens not a multiple of the page: the rule rounds down to pages
        return SelectionSpec(self.S, 4 * self.S, 1, cf, extra_pages * self.S + (self.S // 2 if extra_pages else 0),
                             self.keep_tokens, BOUNDS[self.bounds])

    @property
    def valid_len(self) -> List[int]:
        # ragged: the second row fits the budget (dense inside a sparse batch)
        return [self.L - 3, self.L - 3] if self.rows == "uniform" else [self.L - 1, 3 * self.S + 1]

    @property
    def onnx_ok(self) -> bool:
        return self.mask is None and self.L % self.S == 0 and self.dtype == "fp32"


def _sample() -> List[Case]:
    rng = random.Random(0)
    every = [Case(*v) for v in itertools.product(*AXES.values())]
    cases = rng.sample(every, N_CASES)
    for axis, values in AXES.items():  # every value of every axis appears
        seen = {getattr(c, axis) for c in cases}
        assert seen == set(values), (axis, seen)
    # cases the ONNX twin runs too (no mask, whole pages, fp32): every bounds dtype with every stage rule
    for i, (bounds, stages) in enumerate(itertools.product(BOUNDS, STAGES)):
        cases.append(Case("fp32", (1, 3, 4)[i % 3], None, ("uniform", "ragged")[i % 2], (4, 5, 8)[i % 3], 120,
                          bounds, stages, stages != "one" and i % 2 == 0))
    return cases


CASES = _sample()


def case_inputs(c: Case, seed: int):
    """``q, k, v, valid_len, mask, bounds, scale`` of a case (B = 2, Hkv = 2, D = 16)."""
    g = torch.Generator().manual_seed(seed)
    B, Hkv, D, dtype = 2, 2, 16, DTYPES[c.dtype]
    Hq = Hkv * c.G
    q = (torch.randn(B, Hq, 1, D, generator=g) * 2).to(dtype)
    k = torch.randn(B, Hkv, c.L, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, c.L, D, generator=g).to(dtype)
    vl = torch.tensor(c.valid_len, dtype=torch.int64)
    for b, n in enumerate(c.valid_len):  # empty slots past a row's tokens, as in a static cache
        k[b, :, n:] = 0
        v[b, :, n:] = 0
    mask = None
    if c.mask == "bool":  # HF's [B, 1, 1, L] layout
        mask = torch.rand(B, 1, 1, c.L, generator=g) < 0.8
    elif c.mask == "float_head":  # additive per head, with -inf holes
        mask = torch.randn(B, Hq, 1, c.L, generator=g)
        mask = mask.masked_fill(torch.rand(B, Hq, 1, c.L, generator=g) < 0.2, float("-inf"))
    bounds = ref.page_bounds(k, c.S, dtype=BOUNDS[c.bounds])
    return q, k, v, vl, mask, bounds, 1.0 / math.sqrt(D)


# ---- selections as bool maps -------------------------------------------------------------------------------------
def page_map_of_tokens(tok: torch.Tensor, S: int) -> torch.Tensor:
    """bool ``[B, Hkv, L]`` kept tokens -> bool ``[B, Hkv, P]`` pages holding one."""
    B, H, L = tok.shape
    P = ref.num_pages(L, S)
    return torch.nn.functional.pad(tok, (0, P * S - L)).reshape(B, H, P, S).any(-1)


def reference_selection(c: Case, q, k, vl, mask, bounds, scale):
    """The reference's kept tokens, bool ``[B, Hkv, L]`` (every valid token when it attends densely)."""
    B, Hkv, L = k.shape[0], k.shape[1], k.shape[2]
    sel, unit = ref.choose(q, k, bounds, vl, mask, scale, c.spec)
    if sel is None:
        return (torch.arange(L)[None, None, :] < vl[:, None, None]).expand(B, Hkv, L).clone()
    return ref.selected_token_mask(sel, unit, L, vl) & (torch.arange(L)[None, None, :] < vl[:, None, None])


def comparable_pages(c: Case, q, k, vl, mask, bounds, scale) -> torch.Tensor:
    """Pages whose group score is finite and valid: where keeping one or not changes the result."""
    B, Hq, L = q.shape[0], q.shape[1], k.shape[2]
    scores = ref.page_scores(q, bounds, scale, ref.mask_page_max(mask, B, Hq, L, c.S))
    P = scores.shape[-1]
    n_valid = ((vl + c.S - 1) // c.S).clamp(max=P)
    return torch.isfinite(scores) & (torch.arange(P)[None, None, :] < n_valid[:, None, None])


# ---- the implementations ------------------------------------------------------------------------------------------
def run_reference(c, q, k, v, vl, mask, bounds, scale, tmp_path=None):
    out = ref.sparse_decode_reference(q, k, v, vl, mask, scale, c.spec, bounds)
    tok = reference_selection(c, q, k, vl, mask, bounds, scale)
    return out, page_map_of_tokens(tok, c.S), tok


def run_torch(c, q, k, v, vl, mask, bounds, scale, tmp_path=None):
    from tinyserve_compile.kernels.sparse_decode import run_kernel

    return run_kernel("torch", q, k, v, *bounds, vl, mask, scale, c.spec), None, None


def run_native(c, q, k, v, vl, mask, bounds, scale, tmp_path=None):
    from tinyserve_compile.kernels.native import native_module
    from tinyserve_compile.kernels.sparse_decode import run_kernel

    s = c.spec
    out = run_kernel("native", q, k, v, *bounds, vl, mask, scale, s)
    pages = native_module().kept_pages(q, k, *bounds, vl, mask, scale, s.to_list(), None)
    return out, pages, None


def run_triton(c, q, k, v, vl, mask, bounds, scale, tmp_path=None):
    import sys

    tsd = sys.modules["tinyserve_compile.kernels.triton_sparse_decode"]  # imported interpreted by the conftest
    out = tsd.sparse_decode_triton(q, k, v, *bounds, vl, mask, scale, c.spec)
    sel = tsd.select_pages_triton(q, k, *bounds, vl, mask, scale, c.spec)
    B, Hkv, L = k.shape[0], k.shape[1], k.shape[2]
    valid = torch.arange(L)[None, None, :] < vl[:, None, None]
    if sel is None:
        tok = valid.expand(B, Hkv, L).clone()
    else:
        unit = 1 if c.spec.two_stage and c.keep_tokens else c.S
        tok = ref.selected_token_mask(sel, unit, L, vl) & valid
    return out, page_map_of_tokens(tok, c.S), tok


class _TwinStep(torch.nn.Module):
    def __init__(self, spec: SelectionSpec, scale: float):
        super().__init__()
        self.spec, self.scale = spec.to_list(), scale

    def forward(self, q, k, v, kmax, kmin, kabs, position):
        return torch.ops.tinyserve.export_sparse_decode(q, k, v, kmax, kmin, kabs, position, self.scale, self.spec)


def export_and_run(module, args, path, int8_write="tensorrt"):
    """``torch.onnx.export`` of ``module`` with the tinyserve translations, then one ONNX Runtime run."""
    from tests.support.export_helpers import export_module, ort_run

    from tinyserve_compile.onnx import ops  # noqa: F401  (registers the export ops)

    return ort_run(export_module(module, args, path, int8_write), args)


def run_onnx(c, q, k, v, vl, mask, bounds, scale, tmp_path=None):
    assert c.onnx_ok
    args = (q, k, v, *bounds, vl - 1)
    out = export_and_run(_TwinStep(c.spec, scale), args, tmp_path / "twin.onnx")[0]
    return out, None, None


IMPLS: Dict[str, object] = {"reference": run_reference, "torch": run_torch, "native": run_native,
                            "triton": run_triton, "onnx": run_onnx}


# ---- the bounds writers ------------------------------------------------------------------------------------------
#: distinct (cache dtype, bounds dtype, page size, cache length) of the table
BOUND_CASES = sorted({(c.dtype, c.bounds, c.S, c.L) for c in CASES})


def _writes(S: int, L: int):
    """In-place writes ``(positions, stale)``: a stale first write (every page rebuilt), then positions of several
    integer dtypes and shapes (0-d, ``[1]``, ``[n]`` over two pages and one written before)."""
    return [(torch.tensor([L - 1]), 1), (torch.tensor(S, dtype=torch.int32), 0),
            (torch.tensor([2 * S - 1, 2 * S, 5], dtype=torch.int16), 0), (torch.tensor([L - 2]), 0)]


def run_writer(impl: str, dtype: str, bdt: str, S: int, L: int, seed: int, tmp_path=None):
    """Write into a cache through ``impl``; ``[(got, want)]`` bounds after each write, ``want`` a rebuild."""
    from tinyserve_compile.kernels.bounds import CACHE_WRITE_IMPLS, allocate_bounds

    g = torch.Generator().manual_seed(seed)
    B, Hkv, D, dt, bd = 2, 2, 16, DTYPES[dtype], BOUNDS[bdt]
    k = (torch.randn(B, Hkv, L, D, generator=g) * 3).to(dt)
    out = []
    if impl == "onnx":
        return _run_onnx_writer(k, S, bd, g, tmp_path)
    bounds = allocate_bounds(k, S, bd)
    ctrl = torch.zeros(2, dtype=torch.int32)
    for pos, stale in _writes(S, L):
        ctrl[0] = stale
        src = torch.randn(B, Hkv, pos.numel(), D, generator=g).to(dt)
        CACHE_WRITE_IMPLS[impl](k, *bounds, ctrl, pos, src, S)
        assert int(ctrl[0]) == 0
        out.append((ref.PageBounds(*(t.clone() for t in bounds)), ref.page_bounds(k, S, dtype=bd)))
    return out


class _TwinWrite(torch.nn.Module):
    def __init__(self, spec: SelectionSpec):
        super().__init__()
        self.spec = spec.to_list()

    def forward(self, k, kmax, kmin, kabs, position, src):
        k2 = torch.ops.tinyserve.export_kv_write(k, position, src)
        return (k2, *torch.ops.tinyserve.export_bounds_write(k2, kmax, kmin, kabs, position, self.spec))


def _run_onnx_writer(k, S, bd, g, tmp_path):
    from tests.support.export_helpers import ort_run

    B, Hkv, L, D = k.shape
    module = _TwinWrite(SelectionSpec(S, S, 0, 1, 0, False, bd))
    bounds = ref.page_bounds(k, S, dtype=bd)
    out, path = [], None
    for pos in ([L - 1, 3], [S, 2 * S - 1], [5, L - 2]):  # one position per row
        args = (k, *bounds, torch.tensor(pos), torch.randn(B, Hkv, 1, D, generator=g).to(k.dtype))
        if path is None:
            path = tmp_path / "twin_write.onnx"
            got = export_and_run(module, args, path)
        else:
            got = ort_run(path, args)
        k, bounds = got[0], ref.PageBounds(*got[1:])
        out.append((bounds, ref.page_bounds(k, S, dtype=bd)))
    return out

