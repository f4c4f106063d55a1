"""Key caches that the graph reads as tensor attributes (``get_attr``) instead of graph inputs.

torch 2.8's Dynamo installs a tensor marked with ``torch._dynamo.mark_static_address`` (HF's ``StaticCache`` marks
every layer so) as a ``get_attr`` of the graph module, the tensor itself; torch 2.9 and later make it an input.
These tests build that graph on any torch: a wrapper backend moves the inputs that Dynamo's graph writes in place
into attributes before handing the graph to the tinyserve backend. CI's oldest edge (torch 2.8) runs the HF models'
tests on the real thing.
"""
from __future__ import annotations

import pytest
import torch

import tinyserve_compile as tc
from tests.support.backend_helpers import hf_decode, prompt, worst
from tests.support.backend_models import hf_model
from tinyserve_compile.backend import _copy, tinyserve_backend
from tinyserve_compile.kernels.reference import page_bounds
from tinyserve_compile.passes._views import is_written_in_place
from tinyserve_compile.runtime import state_for

N_LAYERS = 4
PROMPT = 90


def attr_backend(options, attrs):
    """A backend that turns the written inputs of Dynamo's graph into ``get_attr`` nodes, then calls tinyserve.

    ``attrs`` collects the targets of the graph's ``get_attr`` nodes (torch 2.8's own ones too).
    """

    def backend(gm, example_inputs):
        gm = _copy(gm)  # Dynamo calls the result with its own graph's inputs: that graph stays as it is
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        moved = [i for i, node in enumerate(placeholders) if is_written_in_place(node)]
        first_op = next(n for n in gm.graph.nodes if n.op != "placeholder")
        for i in moved:
            node = placeholders[i]
            gm.register_buffer(f"attr_cache_{i}", example_inputs[i])  # the tensor itself, as torch 2.8 installs it
            with gm.graph.inserting_before(first_op):
                attr = gm.graph.get_attr(f"attr_cache_{i}")
            attr.meta = dict(node.meta)
            node.replace_all_uses_with(attr)
            gm.graph.erase_node(node)
        gm.recompile()
        attrs.update(n.target for n in gm.graph.find_nodes(op="get_attr"))
        kept = [x for i, x in enumerate(example_inputs) if i not in moved]
        compiled = tinyserve_backend(gm, kept, options=options)
        return lambda *args: compiled(*[x for i, x in enumerate(args) if i not in moved])

    return backend


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_attribute_caches_are_rewritten_and_match_the_sparse_reference(family):
    model = hf_model(family)
    ids = prompt(PROMPT, seed=4)
    opts = {"token_budget": 32, "page_size": 16, "candidate_extra": 32, "lower": "eager"}
    ref_toks, ref_logits, _ = hf_decode(model, None, ids, 5, reference=opts)
    attrs = set()
    step = torch.compile(model, backend=attr_backend(opts, attrs))
    toks, logits, cache = hf_decode(model, step, ids, 5)
    assert tc.counters["rewritten"] == N_LAYERS, tc.explain()
    caches = {s["cache"] for g in tc.explain().graphs for s in g["sites"] if s["status"] == "sparse"}
    assert len(caches) == N_LAYERS and caches <= attrs, (caches, attrs)  # read through get_attr nodes
    assert torch.allclose(logits, ref_logits, atol=2e-5, rtol=1e-4), worst(logits, ref_logits)
    assert torch.equal(toks, ref_toks)
    rt = tc.explain().runtime
    assert rt["decode_calls"] == 5 * (N_LAYERS - 2) and rt["bounds_rebuilds"] == N_LAYERS, rt
    for layer in cache.layers:  # maintained bounds equal a rebuild from scratch
        st = state_for(layer.keys, 16)
        fresh = page_bounds(layer.keys, 16, dtype=st.bounds.kmax.dtype)
        assert torch.equal(st.bounds.kmax, fresh.kmax) and torch.equal(st.bounds.kmin, fresh.kmin)


def test_an_attribute_nothing_writes_is_not_a_cache():
    """A ``get_attr`` constant read as K stays dense with the not-a-view reason, as an unwritten input does."""

    class ConstantKV(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("k", torch.randn(1, 2, 64, 16))
            self.register_buffer("v", torch.randn(1, 2, 64, 16))

        def forward(self, q):
            return torch.nn.functional.scaled_dot_product_attention(q, self.k, self.v)

    gm = torch.fx.symbolic_trace(ConstantKV())  # k and v are get_attr nodes here
    from tinyserve_compile.passes.find_decode_attention import find_decode_attention
    from tinyserve_compile.passes.state import pass_state

    q = torch.randn(1, 2, 1, 16)
    for node in gm.graph.nodes:  # example values, as Dynamo records them
        if node.op == "placeholder":
            node.meta["example_value"] = q
        elif node.op == "get_attr":
            node.meta["example_value"] = getattr(gm, node.target)
        elif node.op == "call_function":
            node.meta["example_value"] = torch.empty(1, 2, 1, 16)
    gm = find_decode_attention(gm, tc.TinyServeConfig())
    (site,) = pass_state(gm).sites
    assert site.status == "dense" and site.reason.startswith("K/V are not views of a graph input"), site.reason


def test_freezing_refused_when_the_graph_writes_attributes():
    """Inductor's freezing folds tensor attributes as constants, losing the cache writes (stock torch.compile on torch
    2.8 decodes wrong tokens so): the backend refuses it, naming the option and the torch that fixes it."""
    model = hf_model("llama")
    opts = {"token_budget": 32, "page_size": 16, "inductor_options": {"freezing": True}}
    with pytest.raises(Exception, match=r"'inductor_options' freezing=True.*needs torch >= 2.9"):
        hf_decode(model, torch.compile(model, backend=attr_backend(opts, set())), prompt(PROMPT, seed=4), 2)
