"""``explain()`` tells the truth when the backend's compile fails or its graph never runs (issue 49, case 4).

A 0-d integer position (``torch.tensor(40)``) indexes as an int: ``cache[:, :, pos] = x`` and ``mask[..., pos]``
are selects, which AOTAutograd's trace for Inductor cannot make of a fake tensor
(``DataDependentOutputException: aten._local_scalar_dense.default``, stock ``torch.compile`` alike); Dynamo then
runs the code without the backend. Dynamo also guards on such a position's value, so each step would be a graph of
its own: a decode loop should pass its position as a 1-element tensor. For this and any other failure, the graph's
record says that its compile failed, with the exception, and its sites are not counted as rewritten.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tinyserve_compile as tc
from tests.support.backend_helpers import decode_graph, prompt, worst
from tests.support.backend_models import GptFastAttention, GptFastModel, gpt_fast_model
from tinyserve_compile import backend

HQ, HKV, L, D = 4, 2, 64, 16
OPTS = {"dense_layers": 0, "token_budget": 16, "page_size": 8, "lower": "eager"}
INJECTED = "injected lowering failure"


class ScalarPositionAttention(GptFastAttention):
    """gpt-fast's attention for a decode position that is a 0-d tensor: the write selects the position (the
    source has no sequence dim), the mask row is selected by the caller."""

    def forward(self, x, input_pos, mask):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.hd).transpose(1, 2)
        k, v = self.wkv(x).view(B, T, 2 * self.n_kv, self.hd).transpose(1, 2).split(self.n_kv, dim=1)
        if input_pos.dim() == 0:  # one position: cache[:, :, pos] is [B, Hkv, D]
            k, v = k[:, :, 0], v[:, :, 0]
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        g = self.n_head // self.n_kv
        y = F.scaled_dot_product_attention(q, self.k_cache.repeat_interleave(g, dim=1),
                                           self.v_cache.repeat_interleave(g, dim=1), attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


def scalar_position_model(n_layer: int = 2, max_len: int = 64) -> GptFastModel:
    """A tiny gpt-fast-style decoder whose decode steps take ``input_pos`` as a 0-d tensor (the mask row read as
    ``causal[None, None, pos]``, a 0-d select too)."""
    torch.manual_seed(0)
    model = GptFastModel(n_layer=n_layer, max_len=max_len)
    model.layers = nn.ModuleList(ScalarPositionAttention(64, 4, 2, max_len) for _ in range(n_layer))
    return model.eval()


def _step_inputs(seed: int = 0, pos=None):
    g = torch.Generator().manual_seed(seed)
    kc, vc = torch.randn(1, HKV, L, D, generator=g), torch.randn(1, HKV, L, D, generator=g)
    q = torch.randn(1, HQ, 1, D, generator=g)
    k, v = torch.randn(1, HKV, 1, D, generator=g), torch.randn(1, HKV, 1, D, generator=g)
    pos = torch.tensor([40]) if pos is None else pos
    return q, kc, vc, k, v, pos, (torch.arange(L) <= 40)[None, None, None]


def decode_step(q, kc, vc, k, v, pos, mask):
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)


def value_written_through_a_select(q, kc, vc, k, v, pos, mask):
    """The value cache written through the select ``vc[:, :, pos]`` of a 0-d position, which Inductor's lowering
    fails on."""
    kc[:, :, pos] = k[:, :, 0]
    vc[:, :, pos].copy_(v[:, :, 0])
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)


@pytest.fixture
def failing_lowering(monkeypatch):
    """The backend's lowering raises (as an Inductor bug would), after the passes rewrote the site."""
    def lower(*args, **kwargs):
        raise RuntimeError(f"{INJECTED}\nsecond line of the message, not shown")

    monkeypatch.setattr(backend, "_lower", lower)


def _assert_one_failed_graph(rep, stage: str, error: str):
    assert rep.counters.get("rewritten", 0) == 0 and rep.counters.get("failed_graphs") == 1, rep
    assert f"graph 0: compile FAILED in {stage} ({error})" in str(rep), rep
    assert "1 failed to compile" in str(rep) and "second line" not in str(rep), rep
    (site,) = rep.graphs[0]["sites"]
    assert site["status"] == "not compiled" and site["planned"] == "sparse", site
    assert rep.failures == [{"graph": 0, "stage": stage, "error": error}], rep


def test_scalar_position_decode_is_reported_as_failed_not_rewritten():
    """The 0-d position model of issue 49 with Inductor: its selects fail Inductor's trace (stock torch.compile
    alike), Dynamo runs the steps without the backend (dense and right), and explain() says so, with the
    exception, where it used to count every site as rewritten while the op ran 0 times."""
    eager, model = scalar_position_model(), scalar_position_model()
    opts = {"dense_layers": 0, "token_budget": 16, "page_size": 8, "lower": "inductor"}
    compiled = torch.compile(model, backend="tinyserve", options=opts)
    ids = prompt(40, seed=1)
    with torch.no_grad():
        eager(ids, torch.arange(40))
        model(ids, torch.arange(40))
        tok = torch.tensor([[3]])
        want = eager(tok, torch.tensor(40))
        got = compiled(tok, torch.tensor(40))
    assert torch.allclose(got, want, atol=1e-5), worst(got, want)
    rep = tc.explain()
    assert rep.runtime.get("decode_calls", 0) == 0 and tc.counters["rewritten"] == 0, rep
    assert rep.failures and all(f["stage"] == "lowering (inductor)" and "_local_scalar_dense" in f["error"]
                                for f in rep.failures), rep
    assert "compile FAILED in lowering (inductor)" in str(rep), rep


def test_a_failed_lowering_is_reported_when_dynamo_raises(failing_lowering):
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=INJECTED):
        torch.compile(decode_step, backend="tinyserve", options=OPTS)(*_step_inputs())
    _assert_one_failed_graph(tc.explain(), "lowering (eager)", f"RuntimeError: {INJECTED}")


def test_a_failed_lowering_is_reported_when_dynamo_runs_the_frame_eagerly(failing_lowering):
    """Under ``suppress_errors`` Dynamo runs the frame eagerly: the answer is dense attention's, and explain() says
    the graph failed, not that its site was rewritten."""
    want = decode_step(*_step_inputs())
    with torch._dynamo.config.patch(suppress_errors=True):
        got = torch.compile(decode_step, backend="tinyserve", options=OPTS)(*_step_inputs())
    assert torch.equal(got, want), worst(got, want)
    rep = tc.explain()
    _assert_one_failed_graph(rep, "lowering (eager)", f"RuntimeError: {INJECTED}")
    assert rep.runtime.get("decode_calls", 0) == 0, rep


def test_inductors_own_failure_is_reported_with_its_exception():
    """A 0-d select written in place, on which Inductor fails: every graph Dynamo hands the backend for this frame
    says so, with the exception, and the answer is eager's."""
    args = _step_inputs(pos=torch.tensor(40))
    want = value_written_through_a_select(*_step_inputs(pos=torch.tensor(40)))
    got = torch.compile(value_written_through_a_select, backend="tinyserve",
                        options=dict(OPTS, lower="inductor"))(*args)
    assert torch.equal(got, want), worst(got, want)
    rep = tc.explain()
    # nothing is counted as rewritten that has not run
    assert rep.runtime.get("decode_calls", 0) == 0 and tc.counters["rewritten"] == 0, rep
    error = "DataDependentOutputException: aten._local_scalar_dense.default"
    assert f"graph 0: compile FAILED in lowering (inductor) ({error})" in str(rep), rep
    assert rep.graphs[0]["sites"][0]["status"] == "not compiled", rep
    assert rep.failures and rep.failures[0]["graph"] == 0, rep
    assert all(f == {"graph": f["graph"], "stage": "lowering (inductor)", "error": error} for f in rep.failures), rep


def test_a_compiled_graph_that_never_ran_is_reported():
    gm, example_inputs = decode_graph(gpt_fast_model())
    compiled = backend.tinyserve_backend(gm, example_inputs, options=OPTS)
    rep = tc.explain()
    assert "graph 0: compiled, never called" in str(rep) and rep.not_run == [0], rep
    assert tc.counters["rewritten"] == 4, rep  # compiled as rewritten: the counters stay, the record says why
    with torch.no_grad():
        compiled(*example_inputs)
    rep = tc.explain()
    assert "never called" not in str(rep) and rep.not_run == [], rep
    assert rep.runtime["decode_calls"] == 4, rep
