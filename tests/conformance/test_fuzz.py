"""A hypothesis fuzz of options x masks x dtypes x kernels (issue 49): every draw either raises a ``ValueError``
that names the option out of range, or equals the reference; where the budget covers the context it equals
dense attention too.

The options are drawn as the packed ``int[] spec`` the op takes, integers up to ``2**63 - 1``, and reach each
implementation through the op's dispatcher (the native kernel reads them in C++), so that no layer's check can
hide another's. Masks are every form HF and gpt-fast/torchtune/litgpt pass: none, boolean, additive with
``-inf``, ``finfo.min`` or a large negative at the masked positions, 2-D ``[1, L]`` or 4-D ``[B, 1|Hq, 1, L]``,
with per-row padding on the left (HF's padded batches) and per-row lengths. Each draw's additive mask is also run
as the boolean mask it means (:func:`~tinyserve_compile.kernels.spec.attended`): both must give one answer.

The counts of each run (draws, errors raised, equal to the reference, dense checks) are printed in the terminal
summary of the conformance suite ("fuzz counts").
"""
from __future__ import annotations

import math
import os
import sys
import time
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinyserve_compile.kernels import reference as ref
from tinyserve_compile.kernels.spec import (BOUNDS_CODES, MASKED_AT_OR_BELOW, MAX_INDEX, MAX_PAGE_SIZE,
                                            SelectionSpec, attended)

from tests.support.conformance_cases import FUZZ, TOL, export_and_run

#: examples per kernel (the Triton interpreter takes about 0.25 s a draw, the ONNX export 0.8 s: 120 of them); CI's
#: matrix edges, which run the table again on other torch versions, take a quarter of them (TINYSERVE_FUZZ_SCALE)
_SCALE = float(os.environ.get("TINYSERVE_FUZZ_SCALE", "1"))
EXAMPLES = {k: max(40, int(n * _SCALE)) for k, n in
            {"reference": 300, "torch": 300, "native": 300, "triton": 200, "onnx": 120}.items()}
FIELDS = ("page_size", "token_budget", "sink_pages", "candidate_factor", "candidate_extra")
#: the range of each integer field of the spec (SelectionSpec.check): lo, hi (hi of token_budget/sink_pages depend
#: on the page size: checked by the dataclass itself)
RANGES = {"page_size": (1, MAX_PAGE_SIZE), "token_budget": (1, MAX_INDEX), "sink_pages": (0, MAX_INDEX),
          "candidate_factor": (1, MAX_INDEX), "candidate_extra": (0, MAX_INDEX)}
MASK_FORMS = (None, "bool", "-inf", "finfo.min", "-1e9")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
COUNTS: Counter = Counter()


def _ints(small_lo: int, small_hi: int):
    """Mostly small values around the interesting range (15 draws in 16, so that about half the specs are valid),
    else the edges of the ranges or any int64 (the schema's ``int[]``)."""
    edges = st.one_of(st.sampled_from([MAX_INDEX, MAX_INDEX + 1, 2**62, 2**63 - 1, -1, 0]),
                      st.integers(-2**63, 2**63 - 1))
    return st.integers(0, 15).flatmap(lambda i: st.integers(small_lo, small_hi) if i else edges)


@st.composite
def draws(draw, onnx: bool = False):
    """One call: the packed spec (maybe out of range), the inputs' shapes and dtype, the mask's form."""
    S = draw(st.integers(0, 7).flatmap(lambda i: st.integers(1, 12) if i else
                                       st.sampled_from([16, MAX_PAGE_SIZE, MAX_PAGE_SIZE + 1, 0, 2**63 - 1])))
    spec = [S, draw(_ints(S if 1 <= S <= 12 else 1, 40)), draw(_ints(0, 2)), draw(_ints(1, 3)), draw(_ints(0, 24)),
            draw(st.booleans()),
            draw(st.integers(0, len(BOUNDS_CODES) - 1))]
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 4]))
    L = draw(st.integers(1, 160))
    if onnx:  # the ONNX twin: whole pages, no mask, fp32, one position per row
        L = (S if 1 <= S <= 16 else 4) * draw(st.integers(1, 6))
        return dict(spec=spec, B=B, Hkv=Hkv, G=G, L=L, dtype=torch.float32, mask=None, mask_dims=4,
                    per_head=False, biased=False, lens=[draw(st.integers(1, L)) for _ in range(B)], pad=[0] * B,
                    seed=draw(st.integers(0, 2**16)))
    lens = [draw(st.integers(1, L)) for _ in range(B)]
    return dict(spec=spec, B=B, Hkv=Hkv, G=G, L=L, dtype=draw(st.sampled_from(DTYPES)),
                mask=draw(st.sampled_from(MASK_FORMS)), mask_dims=draw(st.sampled_from([2, 4])),
                per_head=draw(st.booleans()), biased=draw(st.booleans()), lens=lens, pad=[draw(st.integers(0, n - 1)) for n in lens],
                seed=draw(st.integers(0, 2**16)))


def _bad_field(spec: list):
    """The field a packed spec must be refused for (the first out of its range, in the check's order), or None."""
    S, budget = spec[0], spec[1]
    for name, v in zip(FIELDS, spec):
        lo, hi = RANGES[name]
        if name == "token_budget":
            lo = S
        if name == "sink_pages":
            hi = budget // S - 1
        if not lo <= v <= hi:
            return name
    return None


def _inputs(d):
    """``q, k, v, valid_len, bool mask or None, the mask in its drawn form, scale``."""
    g = torch.Generator().manual_seed(d["seed"])
    B, Hkv, L, D, dt = d["B"], d["Hkv"], d["L"], 16, d["dtype"]
    Hq = Hkv * d["G"]
    q = (torch.randn(B, Hq, 1, D, generator=g) * 2).to(dt)
    k = torch.randn(B, Hkv, L, D, generator=g).to(dt)
    v = torch.randn(B, Hkv, L, D, generator=g).to(dt)
    lens = torch.tensor(d["lens"])
    pos = torch.arange(L)
    keep = (pos[None, :] < lens[:, None]) & (pos[None, :] >= torch.tensor(d["pad"])[:, None])  # [B, L]
    if d["mask"] is None:
        return q, k, v, lens, None, None, 1.0 / math.sqrt(D)
    heads = Hq if d["per_head"] else 1
    keep = keep[:, None, None, :].expand(B, heads, 1, L).clone()
    if d["per_head"]:  # holes in some heads, never the row's newest token (the query attends itself)
        holes = torch.rand(B, heads, 1, L, generator=g) < 0.2
        keep &= ~(holes & (pos < lens[:, None, None, None] - 1))
    if d["mask_dims"] == 2 and B == 1 and heads == 1:
        keep = keep.reshape(1, L)
    if d["mask"] == "bool":
        return q, k, v, lens, keep, keep, 1.0 / math.sqrt(D)
    fill = {"-inf": float("-inf"), "finfo.min": torch.finfo(dt).min, "-1e9": -1e9}[d["mask"]]
    bias = torch.zeros(keep.shape, dtype=dt)
    if d["biased"]:  # an additive mask may carry biases (ALiBi, ...) where it attends
        bias = (torch.randn(keep.shape, generator=g) * 0.5).to(dt)
    if d["mask"] == "-1e9":  # past fp16's range: an fp32 mask over a half-precision model
        bias = bias.float()
    return q, k, v, lens, keep, bias.masked_fill(~keep, fill), 1.0 / math.sqrt(D)


def _dense(q, k, v, lens, keep, mask):
    """Exact attention over every valid token, in fp32, with the drawn mask added as SDPA adds it."""
    B, Hq, _, D = q.shape
    G, L = Hq // k.shape[1], k.shape[2]
    add = torch.zeros(B, 1, 1, L).masked_fill(torch.arange(L) >= lens[:, None, None, None], float("-inf"))
    if mask is not None:
        add = add + (torch.zeros(mask.shape).masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool
                     else mask.float())
    kk, vv = (t.float().repeat_interleave(G, 1) for t in (k, v))
    return torch.softmax(q.float() @ kk.transpose(-1, -2) / math.sqrt(D) + add, -1) @ vv


def _run(impl: str, d, q, k, v, lens, mask, bounds, scale, spec_list, tmp_path):
    if impl == "reference":
        return ref.sparse_decode_reference(q, k, v, lens, mask, scale, SelectionSpec.from_list(spec_list), bounds)
    if impl == "triton":
        tsd = sys.modules["tinyserve_compile.kernels.triton_sparse_decode"]  # interpreted (the fixture)
        return tsd.sparse_decode_triton(q, k, v, *bounds, lens, mask, scale, SelectionSpec.from_list(spec_list))
    if impl == "onnx":
        from tests.support.conformance_cases import _TwinStep

        step = _TwinStep(SelectionSpec.from_list(spec_list), scale)
        return export_and_run(step, (q, k, v, *bounds, lens - 1), tmp_path / "fuzz.onnx")[0]
    # torch and native through the op's dispatcher: the packed list reaches the C++ kernel as it is
    return torch.ops.tinyserve.sparse_decode(q, k, v, *bounds, lens, mask, scale, spec_list, impl, None)


def _check_draw(impl: str, d, tmp_path) -> None:
    spec_list = [int(x) for x in d["spec"]]
    q, k, v, lens, keep, mask, scale = _inputs(d)
    want_bad = _bad_field(spec_list)
    if want_bad is not None:
        with pytest.raises(ValueError, match=f"'{want_bad}'"):
            bounds = ref.page_bounds(k, max(1, min(spec_list[0], MAX_PAGE_SIZE)), dtype=BOUNDS_CODES[spec_list[6]])
            _run(impl, d, q, k, v, lens, mask, bounds, scale, spec_list, tmp_path)
        COUNTS[impl, "raised"] += 1
        return
    spec = SelectionSpec.from_list(spec_list)
    bounds = ref.page_bounds(k, spec.page_size, dtype=spec.bounds_dtype)
    got = _run(impl, d, q, k, v, lens, mask, bounds, scale, spec_list, tmp_path).float()
    atol, rtol = TOL[q.dtype]
    want = ref.sparse_decode_reference(q, k, v, lens, mask, scale, spec, bounds).float()
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m: f"{impl} vs reference, {d}: {m}")
    COUNTS[impl, "equal to the reference"] += 1
    if mask is not None and mask.dtype != torch.bool:  # the additive form and the boolean mask it means: one answer
        assert torch.equal(attended(mask), keep), "spec.attended reads the drawn mask wrongly"
        assert mask[~keep].le(MASKED_AT_OR_BELOW).all()
        same = _run(impl, d, q, k, v, lens, keep, bounds, scale, spec_list, tmp_path).float()
        if torch.equal(mask[keep].float(), torch.zeros(int(keep.sum()))):
            torch.testing.assert_close(got, same, atol=atol, rtol=rtol, msg=lambda m: f"{impl} mask forms, {d}: {m}")
            COUNTS[impl, "additive mask = boolean mask"] += 1
    if spec.n_pages * spec.page_size >= int(lens.max()):  # the budget covers the context: dense
        torch.testing.assert_close(got, _dense(q, k, v, lens, keep, mask), atol=atol, rtol=rtol,
                                   msg=lambda m: f"{impl} vs dense, {d}: {m}")
        COUNTS[impl, "budget covers the context: equal to dense"] += 1
    elif -(-int(lens.max()) // spec.page_size) <= spec.n_dense_pages:  # the dense rule (every page a candidate)
        torch.testing.assert_close(got, _dense(q, k, v, lens, keep, mask), atol=atol, rtol=rtol,
                                   msg=lambda m: f"{impl} vs dense, {d}: {m}")
        COUNTS[impl, "every page a candidate: equal to dense"] += 1


def _fuzz(impl: str, tmp_path, onnx: bool = False):
    t0 = time.monotonic()

    @settings(max_examples=EXAMPLES[impl], deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(d=draws(onnx=onnx))
    def run(d):
        COUNTS[impl, "draws"] += 1
        _check_draw(impl, d, tmp_path)

    run()
    FUZZ.append(f"{impl}: {time.monotonic() - t0:.0f} s, " +
                ", ".join(f"{what} {n}" for (i, what), n in sorted(COUNTS.items()) if i == impl))
    assert COUNTS[impl, "draws"] >= EXAMPLES[impl]
    assert COUNTS[impl, "raised"] > 0 and COUNTS[impl, "equal to the reference"] > 0


@pytest.mark.parametrize("impl", ["reference", "torch", "native"])
def test_fuzz_options_masks_dtypes(impl, tmp_path):
    if impl == "native":
        from tinyserve_compile.kernels.native import load_native, native_unavailable_reason

        if not load_native():
            pytest.skip(f"native kernel unavailable: {native_unavailable_reason()}")
    _fuzz(impl, tmp_path)


@pytest.mark.slow  # the Triton interpreter: about 100 s on 2 cores
def test_fuzz_triton_interpreter(triton_interpreted, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernels launch in the interpreter (as test_conformance)
    _fuzz("triton", tmp_path)


@pytest.mark.slow  # an ONNX export per case: about 220 s on 2 cores
def test_fuzz_onnx_twin(tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    _fuzz("onnx", tmp_path, onnx=True)
