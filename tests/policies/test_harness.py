"""The eager evaluation harness (bench/harness.py) on a tiny random Llama: dense path equals HF,
roll-back to the prefill is exact, sparse steps go through the policy."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from bench.cli import PRESETS  # noqa: E402
from bench.harness import FULL, EvalModel, Sparse  # noqa: E402

#: one stage, whole pages, bf16 bounds: a selection with a certified bound on the dropped mass
ONE_STAGE = PRESETS["paper-bf16"]


@pytest.fixture(scope="module")
def tiny():
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_dense_decode_matches_hf_forward(tiny):
    ids = torch.randint(0, 97, (1, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = tiny(ids).logits[0]
    em = EvalModel(tiny, 96)
    first = em.prefill(ids[:, :60])
    torch.testing.assert_close(first, ref[59], atol=1e-4, rtol=1e-4)
    em.reset(FULL)
    got = em.teacher_forced(ids[0, 60:80])
    torch.testing.assert_close(got, ref[60:80], atol=1e-4, rtol=1e-4)
    # a budget that covers the context is dense too, through the policies
    for pol in ("query_aware", "oracle", "streaming", "h2o"):
        em.reset(Sparse(**dict(ONE_STAGE, policy=pol, token_budget=128, page_size=8, dense_layers=1)))
        torch.testing.assert_close(em.teacher_forced(ids[0, 60:80]), ref[60:80], atol=1e-4, rtol=1e-4)


def test_rollback_is_exact_and_sparse_differs(tiny):
    ids = torch.randint(0, 97, (1, 120), generator=torch.Generator().manual_seed(2))
    em = EvalModel(tiny, 128)
    em.prefill(ids[:, :100])
    cfg = Sparse(**dict(ONE_STAGE, policy="query_aware", token_budget=16, page_size=8, dense_layers=1, sink_pages=1))
    em.reset(cfg, collect=True)
    a = em.teacher_forced(ids[0, 100:120])
    stats = list(em.stats)
    em.reset(FULL)
    full = em.teacher_forced(ids[0, 100:120])
    em.reset(cfg)
    b = em.teacher_forced(ids[0, 100:120])
    torch.testing.assert_close(a, b)  # the roll-back restores the prefill exactly
    assert not torch.allclose(a, full, atol=1e-3)  # 2 of ~13 pages: the sparse path was really used
    assert len(stats) == 20
    assert all(s.bound_violations == 0 and s.bound >= s.dropped - 1e-6 for s in stats)
    assert all(0 < s.kv_fraction < 0.2 for s in stats)
