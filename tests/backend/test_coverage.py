"""The coverage sweep (``python -m bench coverage``) on its quick subset: each architecture lands in the class
it should, and none is wrong. The full sweep over every architecture is a benchmark, run by hand."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bench import coverage  # noqa: E402

#: what each quick architecture must give, and the start of a dense reason it must show
EXPECTED = {
    "llama": ("rewritten", None),  # plain GQA over a static cache: every layer
    "gpt2": ("rewritten", None),  # learned positions, fused QKV, no GQA
    "cohere2": ("rewritten", "sliding-window cache"),  # full-attention layers rewritten, sliding ones dense
    "deepseek_v3": ("dense", "K/V are not views of a graph input: computed each step"),  # MLA latent cache
}


def test_quick_subset_is_the_expected_one():
    assert set(coverage.QUICK) == set(EXPECTED)


@pytest.mark.parametrize("arch", coverage.QUICK)
def test_quick_architecture(arch):
    status, reason = EXPECTED[arch]
    row = coverage._check_quietly(arch)
    if arch == "deepseek_v3" and row["status"] == "rewritten":  # transformers 4.x caches MLA's full K/V: rewritable
        import transformers

        assert int(transformers.__version__.split(".")[0]) < 5, row
        status, reason = "rewritten", None
    assert row["status"] == status, row
    assert row["max_diff"] is not None and row["max_diff"] <= 1e-4, row
    if status == "rewritten":
        assert row["rewritten"] > 0 and row["sparse_vs_dense"] > 1e-3, "the sparse run should differ from dense"
    if reason is None:
        assert row["rewritten"] == row["decode_sites"], row
    else:
        assert reason in row["reasons"], row
    assert row["recompiles_after_step_2"] == 0, row
