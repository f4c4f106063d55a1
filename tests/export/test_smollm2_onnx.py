"""SmolLM2-135M-Instruct at 4K: 32 greedy steps in ONNX Runtime give the compiled backend's tokens."""
from __future__ import annotations

import time

import pytest
import torch

from tests.support.export_helpers import greedy, hf_step, prefill, worst

CTX, STEPS, L = 4064, 32, 4096
OPTIONS = {"token_budget": 1024}  # the defaults otherwise: pages of 8, a sink page, 1024 extra candidates, int8 bounds


@pytest.mark.slow
def test_smollm2_4k_greedy_tokens_equal_compiled_backend(tmp_path):
    pytest.importorskip("gguf")
    from pydoc_data.topics import topics

    from tinyserve_compile.onnx.export import decode_state, export_onnx
    from tinyserve_compile.onnx.runtime import OrtDecoder
    from tinyserve_compile.smollm2 import load_smollm2

    model, tok = load_smollm2()
    text = " ".join(topics[k] for k in sorted(topics))
    ids = tok(text[:40_000], return_tensors="pt").input_ids[:, :CTX]
    assert ids.shape[1] == CTX
    t0 = time.perf_counter()
    info = export_onnx(model, tmp_path / "smollm2.onnx", max_cache_len=L, options=OPTIONS)
    print(f"SmolLM2 export at L={L}: {time.perf_counter() - t0:.1f} s")
    assert len(info.sparse_layers) == 28
    first, cache = prefill(model, ids, L)
    dec = OrtDecoder(info.path)
    dec.load_state(decode_state(cache, options=OPTIONS))
    got_toks, got = greedy(dec.step, first, CTX, STEPS)
    compiled = torch.compile(model, backend="tinyserve", options={**OPTIONS, "lower": "eager"})
    want_toks, want = greedy(hf_step(compiled, cache), first, CTX, STEPS)
    assert torch.equal(got_toks, want_toks), (tok.decode(got_toks[0]), tok.decode(want_toks[0]), worst(got, want))
    assert torch.allclose(got, want, atol=1e-3, rtol=1e-3), worst(got, want)
