"""The decode_linear pass: decode-shaped linears of a compiled decode step become tinyserve::linear (the native
GEMV), counted and reported; prefill-sized rows, bf16 weights above 4 rows, grad graphs, quantized weights and
the option turned off stay ATen's; tokens and logits match eager. Also: the caller's guard filter passes beside
the options."""
from __future__ import annotations

import pytest
import torch

import tinyserve_compile as tc
from tests.support.backend_helpers import hf_decode, prompt, worst
from tests.support.backend_models import hf_model
from tinyserve_compile.kernels.linear import load_native_linear, native_linear_reason

pytestmark = pytest.mark.skipif(not load_native_linear(), reason=f"native GEMV unavailable: {native_linear_reason()}")

#: linears of the tiny models' decode graph: 4 layers x (q, k, v, o, gate, up, down) + lm_head
LINEARS = 4 * 7 + 1
#: of those, the bias-free ones that share an input, per family: q/k/v and gate/up (qwen2's q/k/v have a bias)
GROUPED = {"llama": (4 * 5, 4 * 2), "qwen2": (4 * 2, 4)}  # (linears, calls)
PROMPT = 40
#: a decode batch above the GEMV's 8 rows
GEMV_ROWS_OVER = 9


def _gemv_nodes(gm):
    """Linears the graph runs on the GEMV: single calls plus the weights of grouped calls."""
    return sum(1 if n.target is torch.ops.tinyserve.linear.default else len(n.args[1])
               for n in gm.graph.nodes
               if n.target in (torch.ops.tinyserve.linear.default, torch.ops.tinyserve.linear_group.default))


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v with bias
def test_decode_step_rewritten_and_exact(family):
    model = hf_model(family)
    ids = prompt(PROMPT)
    ref_toks, ref_logits, _ = hf_decode(model, model, ids, 4)
    opts = {"token_budget": 256, "lower": "eager"}
    toks, logits, _ = hf_decode(model, torch.compile(model, backend="tinyserve", options=opts), ids, 4)
    assert torch.equal(toks, ref_toks), worst(logits, ref_logits)
    assert torch.allclose(logits, ref_logits, atol=1e-4, rtol=1e-4), worst(logits, ref_logits)
    c = tc.counters
    assert c["linear_rewritten"] == LINEARS, dict(c)
    assert c["linear_grouped"] == GROUPED[family][0], dict(c)
    assert not any(k.startswith("linear_kept") for k in c), dict(c)
    assert f"{LINEARS} to the native GEMV, {GROUPED[family][0]} of them in {GROUPED[family][1]} shared-input calls" \
        in str(tc.explain())


def test_big_batch_stays_aten():
    model = hf_model("llama")
    ids = prompt(PROMPT, batch=GEMV_ROWS_OVER)
    opts = {"token_budget": 256, "lower": "eager"}
    ref_toks, ref_logits, _ = hf_decode(model, model, ids, 2)
    toks, logits, _ = hf_decode(model, torch.compile(model, backend="tinyserve", options=opts), ids, 2)
    assert torch.equal(toks, ref_toks)
    c = tc.counters
    assert c["linear_rewritten"] == 0 and c["linear_kept:rows > 8"] == LINEARS, dict(c)
    assert f"kept in ATen (rows > 8: {LINEARS})" in str(tc.explain())


def test_bf16_above_four_rows_stays_aten():
    model = hf_model("llama").to(torch.bfloat16)
    ids = prompt(PROMPT, batch=5)
    hf_decode(model, torch.compile(model, backend="tinyserve", options={"token_budget": 256, "lower": "eager"}),
              ids, 1)
    c = tc.counters
    assert c["linear_rewritten"] == 0 and c["linear_kept:bf16 rows > 4"] == LINEARS, dict(c)


def test_option_off_keeps_aten():
    model = hf_model("llama")
    ids = prompt(PROMPT)
    opts = {"token_budget": 256, "lower": "eager", "decode_linear": False}
    hf_decode(model, torch.compile(model, backend="tinyserve", options=opts), ids, 1)
    assert tc.counters["linear_rewritten"] == 0
    assert "decode_linear=False" in str(tc.explain())
    with pytest.raises(ValueError, match="decode_linear"):
        tc.TinyServeConfig(decode_linear=1)


def test_pass_counts_nodes_of_the_graph():
    from tinyserve_compile.backend import _copy
    from tinyserve_compile.config import TinyServeConfig
    from tinyserve_compile.passes import pass_state, run_passes

    model = hf_model("llama")
    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    hf_decode(model, torch.compile(model, backend=grab), prompt(PROMPT), 1)
    gm = graphs[-1]
    on = run_passes(_copy(gm), TinyServeConfig(token_budget=256))
    off = run_passes(_copy(gm), TinyServeConfig(token_budget=256, decode_linear=False))
    assert _gemv_nodes(on) == LINEARS and pass_state(on).linears.rewritten == LINEARS
    groups = [n for n in on.graph.nodes if n.target is torch.ops.tinyserve.linear_group.default]
    assert [len(n.args[1]) for n in groups] == [3, 2] * 4  # each layer: q/k/v, then gate/up
    assert all(len(n.users) == len(n.args[1]) for n in groups)  # every item read
    assert _gemv_nodes(off) == 0


def test_reaches_inductor():
    model = hf_model("llama")
    ids = prompt(PROMPT)
    ref_toks, ref_logits, _ = hf_decode(model, model, ids, 2)
    opts = {"token_budget": 256, "lower": "inductor"}
    toks, logits, _ = hf_decode(model, torch.compile(model, backend="tinyserve", options=opts), ids, 2)
    assert torch.equal(toks, ref_toks)
    assert torch.allclose(logits, ref_logits, atol=1e-4, rtol=1e-4), worst(logits, ref_logits)
    assert tc.counters["linear_rewritten"] == LINEARS


def test_grad_graph_stays_aten():
    # outside no_grad the linears' results need grad: the op has no backward, so they stay ATen's
    lin = torch.nn.Linear(16, 8)
    f = torch.compile(lin, backend="tinyserve", options={"lower": "eager"})
    x = torch.randn(1, 16)
    out = f(x)
    out.sum().backward()
    assert lin.weight.grad is not None
    assert tc.counters["linear_rewritten"] == 0 and tc.counters["linear_kept:needs grad"] == 1, dict(tc.counters)
    with torch.no_grad():
        torch._dynamo.reset()
        assert torch.allclose(f(x), lin(x), atol=1e-6)
    assert tc.counters["linear_rewritten"] == 1, dict(tc.counters)


def test_quantized_weights_stay_aten():
    # torchao's int8 weight subclass runs its own linear: the pass leaves it alone
    pytest.importorskip("torchao")
    from bench.weights import prepare_weights

    model = prepare_weights(hf_model("llama").to(torch.bfloat16), "int8")
    hf_decode(model, torch.compile(model, backend="tinyserve", options={"token_budget": 256, "lower": "eager"}),
              prompt(PROMPT), 1)
    c = tc.counters
    assert c["linear_rewritten"] == 0 and c["linear_kept:tensor subclass"] == LINEARS, dict(c)


def test_guard_filter_fn_passes_beside_the_options():
    # torch.compile takes guard_filter_fn out of options before the backend parses them (README: guards)
    model = hf_model("llama")
    ids = prompt(PROMPT)
    ref_toks, _, _ = hf_decode(model, model, ids, 2)
    opts = {"token_budget": 256, "lower": "eager",
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    toks, _, _ = hf_decode(model, torch.compile(model, backend="tinyserve", options=opts), ids, 2)
    assert torch.equal(toks, ref_toks)
    assert tc.counters["linear_rewritten"] == LINEARS and tc.counters["rewritten"] == 4


def test_group_only_where_every_weight_is_defined_before_its_first_linear():
    # symbolic_trace puts each get_attr right before its linear: w2 is defined after the first linear (of w1), where
    # the group's call goes, so its linear stays a single call; w1 and the graph inputs w3, w4 are grouped
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from tinyserve_compile.config import TinyServeConfig
    from tinyserve_compile.passes import decode_linear, pass_state

    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = torch.nn.Parameter(torch.randn(24, 16), requires_grad=False)
            self.w2 = torch.nn.Parameter(torch.randn(8, 16), requires_grad=False)

        def forward(self, x, w3, w4):
            return (torch.nn.functional.linear(x, self.w1), torch.nn.functional.linear(x, self.w2),
                    torch.nn.functional.linear(x, w3), torch.nn.functional.linear(x, w4))

    m = TwoHeads()
    args = (torch.randn(1, 16), torch.randn(12, 16), torch.randn(4, 16))
    gm = torch.fx.symbolic_trace(m)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.no_grad():
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        FakeTensorProp(gm, mode).propagate(*args)
        want = m(*args)
        gm = decode_linear(gm, TinyServeConfig())
        got = gm(*args)
    gm.graph.lint()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.tinyserve.linear.default) == 1  # w2, the late get_attr
    (group,) = [n for n in gm.graph.nodes if n.target is torch.ops.tinyserve.linear_group.default]
    assert [w.target for w in group.args[1]] == ["w1", "w3", "w4"]
    assert pass_state(gm).linears.grouped == 3
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_explain_sums_the_linears_of_a_step_split_by_graph_breaks():
    from tinyserve_compile.explain import ExplainReport

    def graph(i, **lin):
        return {"graph": i, "sites": [], "linears": {"rewritten": 0, "kept": {}, "reason": "", **lin}}

    two = ExplainReport(graphs=[graph(0, rewritten=28, grouped=20, groups=8),
                                graph(1, rewritten=1, kept={"rows > 8": 2})])
    text = str(two)
    assert "graph 0 linears: 28 to the native GEMV, 20 of them in 8 shared-input calls" in text
    assert "linears of all 2 graphs: 29 to the native GEMV, 20 of them in 8 shared-input calls, " \
           "kept in ATen (rows > 8: 2)" in text
    one = ExplainReport(graphs=[graph(0, rewritten=29), graph(1)])  # the second graph has no linears
    assert "linears of all" not in str(one)
