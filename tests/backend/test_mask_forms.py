"""Masks that mean the same select the same (issue 49, case 3): a decode loop passing its causal mask as a boolean
(gpt-fast, torchtune, litgpt), as an additive float with ``torch.finfo(dtype).min`` at the masked positions (HF),
with ``-inf``, or with a large negative (``-1e9``) gives the same logits through the backend.

An additive ``finfo.min`` mask used to count every cache slot as valid (the valid length is one past the newest
position a row attends, and ``finfo.min > -inf``): a context the budget covers was then attended sparsely over the
whole cache, 0.27 (relative) away from the boolean mask's logits.
"""
from __future__ import annotations

import pytest
import torch

import tinyserve_compile
from tests.support.backend_models import GptFastModel

#: 2 pages of budget and 2 extra candidate pages: a row of at most 32 tokens attends densely by the rule
OPTIONS = {"token_budget": 16, "page_size": 8, "candidate_extra": 16, "dense_layers": 0, "lower": "eager"}
FORMS = ("bool", "finfo.min", "-inf", "-1e9")


class MaskFormModel(GptFastModel):
    """gpt-fast's decoder with its causal mask handed to SDPA in one of :data:`FORMS`."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form

    def forward(self, idx, input_pos):
        x = self.emb(idx) + self.pos(input_pos)[None]
        keep = self.causal[None, None, input_pos]  # [1, 1, T, max_len] bool
        mask = keep
        if self.form != "bool":
            fill = {"finfo.min": torch.finfo(x.dtype).min, "-inf": float("-inf"), "-1e9": -1e9}[self.form]
            mask = torch.zeros(keep.shape, dtype=x.dtype).masked_fill(~keep, fill)
        for layer in self.layers:
            x = x + layer(x, input_pos, mask)
        return self.out(x)


def _decode(form: str, n_prompt: int, n_new: int = 3):
    """Logits ``[n_new, 1, V]`` of ``n_new`` compiled decode steps after an eager prefill of ``n_prompt`` tokens,
    and the same steps in eager (dense) attention."""
    torch.manual_seed(0)
    model = MaskFormModel(form).eval()
    torch._dynamo.reset()
    step = torch.compile(model, backend="tinyserve", options=OPTIONS)
    ids = torch.randint(0, 96, (1, n_prompt), generator=torch.Generator().manual_seed(1))
    got, dense = [], []
    with torch.no_grad():
        model(ids, torch.arange(n_prompt))
        for i in range(n_new):
            tok, pos = torch.tensor([[i + 1]]), torch.tensor([n_prompt + i])
            got.append(step(tok, pos)[:, -1])
            dense.append(model(tok, pos)[:, -1])  # rewrites the same slot: the same cache for the next step
    return torch.stack(got), torch.stack(dense)


@pytest.mark.parametrize("form", FORMS)
def test_dense_context_attends_densely_with_every_mask_form(form):
    """A context the budget covers (20 tokens + 3 new, under 32): every form equals eager dense attention."""
    got, dense = _decode(form, 20)
    torch.testing.assert_close(got, dense, atol=2e-5, rtol=2e-5)
    report = tinyserve_compile.explain()  # the sites were rewritten and their op ran: not left dense
    assert [s["status"] for g in report.graphs for s in g["sites"]] == ["sparse"] * 4 * len(report.graphs)
    assert report.runtime.get("decode_calls", 0) >= 4 * 3


def test_sparse_context_selects_the_same_with_every_mask_form():
    """A context past the budget (100 tokens): every form keeps the tokens the boolean mask keeps."""
    want, dense = _decode("bool", 100)
    assert (want - dense).abs().max() > 1e-4  # sparse here: the forms are compared where selection matters
    for form in FORMS[1:]:
        got, _ = _decode(form, 100)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=lambda m: f"{form}: {m}")
