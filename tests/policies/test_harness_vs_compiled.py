"""The study's eager harness (bench/harness.py) and the compiled backend compute the same thing on the real
model: SmolLM2-135M-Instruct at a 1K context, budget 256, the last two layers sparse. Same options, same
prefilled cache, the same tokens teacher-forced: the logits agree, so the pages kept agree too."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import tinyserve_compile as tc  # noqa: E402
from bench.harness import FULL, EvalModel, Sparse  # noqa: E402

N_PREFILL, N_STEPS, N_LAYERS = 1008, 4, 30
KNOBS = dict(token_budget=256, page_size=8, sink_pages=1, dense_layers=N_LAYERS - 2)


@pytest.fixture(scope="module")
def prefilled():
    pytest.importorskip("gguf")
    from pydoc_data.topics import topics

    from tinyserve_compile.smollm2 import load_smollm2

    model, tok = load_smollm2()
    text = " ".join(topics[k] for k in sorted(topics))[:8000]
    ids = tok(text, return_tensors="pt").input_ids[0, :N_PREFILL + N_STEPS]
    assert ids.numel() == N_PREFILL + N_STEPS
    em = EvalModel(model, 1024)
    em.prefill(ids[None, :N_PREFILL])
    em.reset(FULL)
    full = em.teacher_forced(ids[N_PREFILL:])
    return model, em, ids[N_PREFILL:], full


def _compiled_logits(model, em: EvalModel, feed, options) -> torch.Tensor:
    """Teacher-force ``feed`` through ``torch.compile(model, backend="tinyserve")`` on the harness's cache,
    rolled back to the same prefill."""
    torch._dynamo.reset()
    tc.reset()
    step = torch.compile(model, backend="tinyserve", options=options)
    em.reset(FULL)  # the cache rolled back; the backend sees a foreign write and rebuilds its bounds
    out = []
    with torch.no_grad():
        for t in feed:
            o = step(input_ids=torch.tensor([[int(t)]]), position_ids=torch.tensor([[em.pos]]), cache=em.cache,
                     use_cache=True)
            em.pos += 1
            out.append(o.logits[0, -1].float())
    torch._dynamo.reset()
    return torch.stack(out)


def _worst(a, b):
    d = (a - b).abs()
    i = int(d.argmax())
    return f"worst |diff| {float(d.max()):.3e} at step {i // d.shape[-1]}, token {i % d.shape[-1]}"


@pytest.mark.slow
@pytest.mark.parametrize("bounds_dtype,candidate_factor,candidate_extra,keep_tokens", [
    ("int8", 1, 256, True),  # the defaults' kind of selection (two-stage with a fixed margin, kept tokens)
    ("bfloat16", 1, 0, False),  # one stage
])
def test_harness_equals_compiled_backend(prefilled, bounds_dtype, candidate_factor, candidate_extra, keep_tokens):
    model, em, feed, full = prefilled
    knobs = dict(KNOBS, candidate_factor=candidate_factor, bounds_dtype=bounds_dtype, candidate_extra=candidate_extra,
                 keep_tokens=keep_tokens)
    em.reset(Sparse(**knobs))
    harness = em.teacher_forced(feed)
    other = "float32" if bounds_dtype == "bfloat16" else "bfloat16"
    em.reset(Sparse(**dict(knobs, bounds_dtype=other)))
    harness_other = em.teacher_forced(feed)
    got = _compiled_logits(model, em, feed, dict(knobs, lower="eager"))
    rt = tc.explain().runtime
    print(f"{bounds_dtype} c={candidate_factor}: compiled vs harness {_worst(got, harness)}; "
          f"vs full {_worst(got, full)}; harness {other} bounds vs {bounds_dtype} {_worst(harness_other, harness)}")
    assert tc.counters["rewritten"] == N_LAYERS, tc.explain()  # every layer; the first 28 dense at run time
    assert rt["decode_calls"] == 2 * N_STEPS and rt["dense_layer_calls"] == (N_LAYERS - 2) * N_STEPS, rt
    assert (harness - full).abs().max() > 0.05, "budget 256 of 1K tokens should change the logits"
    torch.testing.assert_close(got, harness, atol=1e-3, rtol=1e-4, msg=lambda m: m + "\n" + _worst(got, harness))
    if candidate_extra == 0:  # one stage: the bounds alone rank pages, their storage changes the selection here
        assert (harness_other - harness).abs().max() > 1e-2, "this case should tell bf16 bounds from fp32 ones"
