"""CUDA graphs under the backend: the ``cudagraphs`` option and ``torch.compile``'s ``mode``, what explain() says
about them, and what makes the rewritten graph capturable: ``ctrl`` on the cache's device (no CPU placeholder in a
CUDA graph), the bounds placeholders as static inputs, and a host mirror that copies flags only when they change.

This machine has no GPU: the CUDA graph's placeholders are checked on a decode graph whose example values are fake
CUDA tensors (``FakeTensorMode`` makes them without CUDA), and the mirror logic runs on CPU tensors by treating a
CPU cache as a device one (``runtime.device_ctrl``)."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import tinyserve_compile as tc
from tests.support.backend_helpers import decode_graph, prompt, worst
from tests.support.backend_models import GptFastModel, gpt_fast_model
from test_negative import _inputs, good
from tinyserve_compile import runtime
from tinyserve_compile.backend import _copy, _cudagraphs_decision, _finish_dynamo_metadata
from tinyserve_compile.config import COMPILE_MODES, DEFAULT_CUDAGRAPHS, TinyServeConfig
from tinyserve_compile.explain import latest_graph, record_cudagraphs
from tinyserve_compile.kernels.bounds import CTRL_SIZE, new_ctrl
from tinyserve_compile.kernels.reference import page_bounds
from tinyserve_compile.kernels.spec import SelectionSpec
from tinyserve_compile.passes import BOUNDS_PREFIX, run_passes
from tinyserve_compile.passes.keep_bounds_on_cache_writes import STATIC_INPUT_META
from tinyserve_compile.runtime import BoundsSlot, runtime_stats, state_for

SMALL = {"token_budget": 32, "page_size": 16}


# ---- the option and the mode ----------------------------------------------------------------------------------
def test_cudagraphs_default_follows_mode():
    assert TinyServeConfig().cudagraphs is DEFAULT_CUDAGRAPHS is None


@pytest.mark.parametrize("cudagraphs, mode, want", [
    (None, None, False),
    (None, "default", False),
    (None, "reduce-overhead", True),
    (None, "max-autotune", True),
    (None, "max-autotune-no-cudagraphs", False),
    (True, None, True),
    (True, "max-autotune-no-cudagraphs", True),
    (False, "reduce-overhead", False),
])
def test_cudagraphs_requested(cudagraphs, mode, want):
    assert TinyServeConfig.from_options({"cudagraphs": cudagraphs}).cudagraphs_requested(mode) is want


@pytest.mark.parametrize("value", ["yes", 1, 0, "True"])
def test_bad_cudagraphs_value_names_the_option(value):
    with pytest.raises(ValueError, match="'cudagraphs'"):
        TinyServeConfig.from_options({"cudagraphs": value})


def test_inductor_options_cannot_set_cudagraphs_behind_the_option():
    with pytest.raises(ValueError, match="'cudagraphs'"):
        TinyServeConfig.from_options({"inductor_options": {"triton.cudagraphs": True}})


@pytest.mark.parametrize("mode", ["reduce_overhead", "fast", "", 1])
def test_bad_mode_names_mode(mode):
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    with pytest.raises(ValueError, match="'mode'"):
        tc.tinyserve_backend(gm, [torch.ones(2)], mode=mode)


@pytest.mark.parametrize("mode", COMPILE_MODES)
def test_backend_called_with_each_mode_on_cpu(mode):
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    fn = tc.tinyserve_backend(gm, [torch.ones(2)], mode=mode)
    assert torch.equal(fn(torch.ones(2)), torch.full((2,), 2.0))
    requested = mode in ("reduce-overhead", "max-autotune")
    assert tc.explain().cudagraphs == [{"on": False, "reason": "device is cpu" if requested else "not requested"}]
    assert tc.counters["cudagraphs_off"] == int(requested) and tc.counters["cudagraphs"] == 0


@pytest.mark.parametrize("options, reason", [
    ({"cudagraphs": True}, "device is cpu"),
    ({"cudagraphs": True, "lower": "eager"}, "lower='eager'"),
    ({"cudagraphs": False}, "not requested"),
    ({}, "not requested"),
])
def test_options_without_mode_on_cpu(options, reason):
    out = torch.compile(good, backend="tinyserve", options=dict(SMALL, dense_layers=0, **options))(*_inputs())
    assert torch.allclose(out, good(*_inputs()), atol=1e-5, rtol=1e-5), worst(out, good(*_inputs()))
    rep = tc.explain()
    assert rep.cudagraphs == [{"on": False, "reason": reason}]
    assert f"CUDA graphs: off ({reason})" in str(rep)


def test_reduce_overhead_on_cpu_reports_why_off_and_matches_eager():
    model = gpt_fast_model()
    compiled = torch.compile(model, backend="tinyserve", mode="reduce-overhead")
    outs = []
    with torch.no_grad():
        for fn in (model, compiled):  # each from the same prefilled cache, eager prefill
            for layer in model.layers:
                layer.k_cache.zero_()
                layer.v_cache.zero_()
            model(prompt(40, seed=1), torch.arange(40))
            outs.append(torch.cat([fn(torch.tensor([[t]]), torch.tensor([40 + t])) for t in range(3)], 1))
    assert torch.allclose(outs[1], outs[0], atol=1e-4, rtol=1e-4), worst(outs[1], outs[0])
    rep = tc.explain()
    assert rep.counters["rewritten"] == 4, rep
    assert rep.cudagraphs and all(g == {"on": False, "reason": "device is cpu"} for g in rep.cudagraphs), rep
    assert "CUDA graphs: off (device is cpu)" in str(rep)


# ---- a CUDA decode graph, with fake CUDA example values --------------------------------------------------------
def _on_fake_cuda(gm):
    """``gm`` (a copy) with every example value a fake CUDA tensor of the same shape, strides and dtype."""
    gm = _copy(gm)
    mode = FakeTensorMode()

    def cuda(v):
        if isinstance(v, torch.Tensor):
            return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="cuda")
        if isinstance(v, (tuple, list)):
            return type(v)(cuda(x) for x in v)
        return v

    with mode:
        for n in gm.graph.nodes:
            if "example_value" in n.meta:
                n.meta["example_value"] = cuda(n.meta["example_value"])
    return gm


def _placeholders(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def test_cuda_decode_graph_has_no_cpu_placeholder_and_static_bounds():
    gm, _ = decode_graph(gpt_fast_model())
    cuda_gm = _on_fake_cuda(gm)
    assert all(n.meta["example_value"].device.type == "cuda" for n in _placeholders(cuda_gm))
    out = run_passes(cuda_gm, TinyServeConfig(**SMALL))
    _finish_dynamo_metadata(out)
    added = [n for n in _placeholders(out) if n.name.startswith(BOUNDS_PREFIX)]
    assert len(added) == 4 * 4, out.graph  # kmax, kmin, kabs, ctrl per layer
    cpu = [n.name for n in _placeholders(out) if n.meta["example_value"].device.type != "cuda"]
    assert cpu == [], f"CPU placeholders in a CUDA graph: {cpu}"
    ctrl = [n.meta["example_value"] for n in added if n.name.endswith("_ctrl")]
    assert len(ctrl) == 4 and all(c.dtype == torch.int32 and tuple(c.shape) == (CTRL_SIZE,) for c in ctrl)
    # static inputs for AOTAutograd (hence Inductor's CUDA graphs), and readable as Dynamo placeholders
    assert all(n.meta["tensor_dict"] == STATIC_INPUT_META for n in added)
    assert all(n._dynamo_source is None for n in added)
    assert out._param_name_to_source is gm._param_name_to_source
    kept = [n for n in _placeholders(out) if not n.name.startswith(BOUNDS_PREFIX)]
    assert all(n._dynamo_source is o._dynamo_source for n, o in zip(kept, _placeholders(gm)))


@pytest.mark.parametrize("policy, mode, want", [
    ("query_aware", "reduce-overhead", (True, "")),
    ("query_aware", None, (False, "not requested")),
    ("h2o", "reduce-overhead", (False, "policy h2o runs Python per call (tinyserve::policy_attention)")),
])
def test_cudagraphs_decision_on_a_cuda_graph(policy, mode, want):
    gm, _ = decode_graph(gpt_fast_model())
    config = TinyServeConfig(policy=policy, **SMALL)
    out = run_passes(_on_fake_cuda(gm), config)
    example_inputs = [n.meta["example_value"] for n in _placeholders(out) if not n.name.startswith(BOUNDS_PREFIX)]
    assert _cudagraphs_decision(out, example_inputs, config, mode) == want


def test_cudagraphs_off_for_the_pytorch_path_on_cuda():
    """kernel='torch' reads ctrl and the valid lengths on the host: no CUDA graphs, and explain says why."""
    gm, _ = decode_graph(gpt_fast_model())
    config = TinyServeConfig(kernel="torch", **SMALL)
    out = run_passes(_on_fake_cuda(gm), config)
    example_inputs = [n.meta["example_value"] for n in _placeholders(out) if not n.name.startswith(BOUNDS_PREFIX)]
    on, why = _cudagraphs_decision(out, example_inputs, config, "reduce-overhead")
    assert not on and "kernel='torch'" in why, why


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_bounds_slot_example_inputs_live_on_the_cache_device(device):
    slot = BoundsSlot(0, (1, 2, 64, 16), torch.float32, 16, torch.int8)
    with FakeTensorMode():
        kmax, kmin, kabs, ctrl = slot.example_inputs(torch.device(device))
    assert {t.device.type for t in (kmax, kmin, kabs, ctrl)} == {device}
    assert ctrl.dtype == torch.int32 and tuple(ctrl.shape) == (CTRL_SIZE,)


def test_bounds_placeholders_are_static_inputs_for_inductor(monkeypatch):
    """AOTAutograd's static input indices (what Inductor hands its CUDA graphs) hold the bounds placeholders, and
    Dynamo's parameters and buffers, on the graph the backend lowers; not the token ids and positions."""
    import torch._functorch.config as functorch_config
    import torch._inductor.compile_fx as compile_fx
    import torch._inductor.config as inductor_config

    got = []
    real = compile_fx.get_static_input_idxs
    monkeypatch.setattr(compile_fx, "get_static_input_idxs", lambda n: got.append(list(real(n))) or got[-1])
    model = GptFastModel(n_layer=1).eval()
    compiled = torch.compile(model, backend="tinyserve", options=SMALL)
    with torch.no_grad(), inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        model(prompt(40, seed=1), torch.arange(40))
        ref = model(torch.tensor([[3]]), torch.tensor([40]))
        model(prompt(40, seed=1), torch.arange(40))
        out = compiled(torch.tensor([[3]]), torch.tensor([40]))
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), worst(out, ref)
    assert len(got) == 1, got
    user_inputs = 2  # idx and input_pos; the rest are parameters, buffers and the 4 bounds (appended last)
    n_inputs = len(dict(model.named_parameters())) + len(dict(model.named_buffers())) + user_inputs + 4
    static = set(got[0])
    assert set(range(n_inputs - 4, n_inputs)) <= static, (got, n_inputs)
    assert len(static) == n_inputs - user_inputs, (got, n_inputs)


# ---- Inductor's own skip reason --------------------------------------------------------------------------------
def test_inductor_skip_logged_during_a_call_turns_the_record_off():
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    from tinyserve_compile import backend

    torch.compile(good, backend="tinyserve", options=dict(SMALL, dense_layers=0, lower="eager"))(*_inputs())
    info = latest_graph()
    record_cudagraphs(info, True)
    assert tc.counters["cudagraphs"] == 1
    backend._watch_cudagraph_skips()
    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to an unrelated graph")  # no graph running
    assert info["cudagraphs"]["on"]
    backend._CURRENT[0] = info
    try:
        log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (1 instances)")
        log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to a second reason")
    finally:
        backend._CURRENT[0] = None
    assert tc.explain().cudagraphs == [{"on": False,
                                        "reason": "Inductor: skipping cudagraphs due to mutated inputs (1 instances)"}]
    assert tc.counters["cudagraphs"] == 0 and tc.counters["cudagraphs_off"] == 1


def test_cudagraph_skips_collects_the_skip_messages_logged_inside_the_with():
    """backend.cudagraph_skips() (bench decode's ``cudagraph_skips`` field): Inductor's skip messages logged inside
    the ``with``, in order, whoever logged them; not its other warnings, nothing before or after."""
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    from tinyserve_compile.backend import _cudagraph_skip_logger, cudagraph_skips

    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to something before")
    with cudagraph_skips() as skips:
        log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (1 instances)")
        _cudagraph_skip_logger().warning("CUDAGraph supports dynamic shapes by recording a new graph ...")
        log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to a second reason")
    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to something after")
    assert skips == ["skipping cudagraphs due to mutated inputs (1 instances)",
                     "skipping cudagraphs due to a second reason"]


def test_inductor_skipping_cudagraphs_at_compile_is_reported(monkeypatch):
    """Forced on for a CPU graph, Inductor skips CUDA graphs (counted, not logged for a CPU graph): the record says
    so, and the graph still runs right through the wrapper that watches its calls."""
    from tinyserve_compile import backend

    monkeypatch.setattr(backend, "_cudagraphs_decision", lambda *a: (True, ""))
    out = torch.compile(good, backend="tinyserve", options=dict(SMALL, dense_layers=0))(*_inputs())
    assert torch.allclose(out, good(*_inputs()), atol=1e-5, rtol=1e-5), worst(out, good(*_inputs()))
    (verdict,) = tc.explain().cudagraphs
    assert not verdict["on"] and verdict["reason"].startswith("Inductor"), verdict
    assert tc.explain().runtime["decode_calls"] == 1


# ---- the host mirror of a device ctrl --------------------------------------------------------------------------
def _mirrored_state(flags=(1, 0)):
    k = torch.randn(1, 2, 40, 8)
    b = page_bounds(k, 4, dtype=torch.float32)
    ctrl = new_ctrl(stale=bool(flags[0]))
    ctrl[1] = flags[1]
    return runtime.StaticKVState(None, (4, torch.float32, tuple(k.shape)), b, ctrl, 0, mirror=True)


def test_push_flags_copies_only_on_change():
    st = _mirrored_state()
    assert st.stale
    st.ctrl[2] = 57  # the write op's end: the host copies the flags only, never over it
    assert runtime._push_flags(st, False, False) is True
    assert st.ctrl.tolist() == [0, 0, 57, 0]
    assert runtime._push_flags(st, False, False) is False
    assert runtime._push_flags(st, False, True) is True
    assert st.ctrl.tolist() == [0, 1, 57, 0] and runtime_stats["ctrl_copies"] == 2
    assert runtime._push_flags(st, False, True) is False
    st.ctrl[:2].zero_()  # as the PyTorch write op clears ctrl[0] on the device, unseen by the mirror
    for _ in range(2):  # a rebuild request is copied even when the mirror holds it already
        assert runtime._push_flags(st, True, True) is True
        assert st.ctrl.tolist() == [1, 1, 57, 0]
    assert runtime_stats["ctrl_copies"] == 4


def test_push_flags_writes_a_host_ctrl_in_place():
    k = torch.randn(1, 2, 40, 8)
    st = runtime.StaticKVState(None, (4, torch.float32, tuple(k.shape)), page_bounds(k, 4), new_ctrl(), 0)
    assert not st.mirror
    for flags in ((0, 1), (1, 1), (0, 0)):
        assert runtime._push_flags(st, *flags) is False
        assert st.ctrl.tolist() == [*flags, -1, 0] and st.stale == bool(flags[0])
    assert runtime_stats["ctrl_copies"] == 0


def _spec():
    return SelectionSpec(4, 8, 0, 1, 0, False, torch.float32).to_list()


def _step(slot, k, pos, dense_layers):
    kmax, kmin, kabs, ctrl = runtime.enter([slot], (k,), dense_layers)
    torch.ops.tinyserve.cache_write(k, kmax, kmin, kabs, ctrl, torch.tensor([pos]), torch.randn(1, 2, 1, 8), _spec())
    runtime.leave([slot], (k,))


@pytest.mark.parametrize("dense_layers", [0, 1])
def test_steady_decode_loop_copies_no_flags(monkeypatch, dense_layers):
    """A CPU cache treated as a device one: its ctrl is mirrored. The first call asks for a rebuild (the state is
    new), the second clears ctrl[0], and then nothing is copied until a foreign write."""
    monkeypatch.setattr(runtime, "device_ctrl", lambda device: True)
    k = torch.randn(1, 2, 40, 8)
    slot = BoundsSlot(0, tuple(k.shape), k.dtype, 4, torch.float32, decode_sites=1)
    _step(slot, k, 10, dense_layers)
    st = state_for(k, 4)
    assert st.mirror and not st.stale
    assert runtime_stats["ctrl_copies"] == 1  # the rebuild request
    _step(slot, k, 11, dense_layers)
    assert runtime_stats["ctrl_copies"] == 2  # ctrl[0] back to 0
    for i in range(12, 20):
        _step(slot, k, i, dense_layers)
    assert runtime_stats["ctrl_copies"] == 2, "a steady loop copied flags"
    assert st.ctrl.tolist() == [0, int(dense_layers > 0), 20, 0]  # the write op's end: after position 19
    k[:, :, 0] = 50.0  # a foreign write: one rebuild (a copy), then ctrl[0] cleared (a copy)
    _step(slot, k, 20, dense_layers)
    _step(slot, k, 21, dense_layers)
    assert runtime_stats["ctrl_copies"] == 4
    assert runtime_stats["foreign_writes"] == 1 and runtime_stats["bounds_rebuilds"] == 2
    fresh = page_bounds(k, 4, dtype=torch.float32)
    assert torch.equal(st.bounds.kmax, fresh.kmax) and torch.equal(st.bounds.kabs, fresh.kabs)


def test_stale_of_a_mirrored_state_lasts_until_the_call_returns(monkeypatch):
    monkeypatch.setattr(runtime, "device_ctrl", lambda device: True)
    k = torch.randn(1, 2, 40, 8)
    slot = BoundsSlot(0, tuple(k.shape), k.dtype, 4, torch.float32, decode_sites=1)
    runtime.enter([slot], (k,), 0)
    st = state_for(k, 4)
    assert st.stale
    runtime.leave([slot], (k,))
    assert not st.stale
    runtime.enter([slot], (k,), 0)  # no call in between: nothing wrote the cache
    # (no write op ran either: its end is still unrecorded, so the first write still rebuilds)
    assert not st.stale and st.ctrl.tolist() == [0, 0, -1, 0]


def test_policy_attention_reads_the_mirror_of_a_mirrored_ctrl(monkeypatch):
    """The policies' op takes the flags from the host mirror (no device read): here the mirror says 'dense layer'
    while the tensor itself says otherwise, and the op attends densely."""
    from tinyserve_compile.kernels.bounds import rebuild_bounds_impl

    monkeypatch.setattr(runtime, "device_ctrl", lambda device: True)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 40, 8, generator=g), torch.randn(1, 2, 40, 8, generator=g)
    q = torch.randn(1, 4, 1, 8, generator=g)
    slot = BoundsSlot(0, tuple(k.shape), k.dtype, 4, torch.float32, decode_sites=1)
    kmax, kmin, kabs, ctrl = runtime.enter([slot], (k,), dense_layers=1)
    rebuild_bounds_impl(k, kmax, kmin, kabs, 4)
    runtime.leave([slot], (k,))
    ctrl.zero_()  # the tensor: sparse, not stale; the mirror: [1, 1]
    assert state_for(k, 4)._flags.tolist() == [1, 1]
    args = (q, k, v, kmax, kmin, kabs, ctrl, torch.tensor([40]), None, 0.35, _spec())
    got = torch.ops.tinyserve.policy_attention(*args, "streaming", "torch")
    want = torch.ops.tinyserve.policy_attention(*args, "full", "torch")
    assert torch.equal(got, want)
    sparse = torch.ops.tinyserve.policy_attention(q, k, v, kmax, kmin, kabs, torch.zeros(2, dtype=torch.int32),
                                                  torch.tensor([40]), None, 0.35, _spec(), "streaming", "torch")
    assert not torch.equal(sparse, want)  # the check can fail: streaming over this cache is not dense


# ---- on a GPU: the real thing ----------------------------------------------------------------------------------
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU twins above)")


def _cudagraph_counters():
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return c["cudagraph_skips"], c["cudagraph_recorded_non_static_inputs"]


@requires_cuda
def test_reduce_overhead_on_cuda_runs_under_cuda_graphs():
    """A gpt-fast decode loop on CUDA under mode="reduce-overhead": recorded once with only the token ids and
    positions as non-static inputs (the bounds and ctrl are static), never skipped, no flag copied once steady,
    and the same logits as eager."""
    model = gpt_fast_model().cuda()
    compiled = torch.compile(model, backend="tinyserve", mode="reduce-overhead")
    skips, non_static = _cudagraph_counters()
    outs, copies = [], []
    with torch.no_grad():
        for fn in (model, compiled):
            for layer in model.layers:
                layer.k_cache.zero_()
                layer.v_cache.zero_()
            model(prompt(40, seed=1).cuda(), torch.arange(40, device="cuda"))
            steps = []
            for t in range(8):
                torch.compiler.cudagraph_mark_step_begin()
                steps.append(fn(torch.tensor([[t]], device="cuda"), torch.tensor([40 + t], device="cuda")).clone())
                copies.append(runtime_stats["ctrl_copies"])
            outs.append(torch.cat(steps, 1))
    assert torch.allclose(outs[1], outs[0], atol=1e-3, rtol=1e-3), worst(outs[1], outs[0])
    rep = tc.explain()
    assert rep.cudagraphs == [{"on": True, "reason": ""}], rep
    assert _cudagraph_counters() == (skips, non_static + 2), _cudagraph_counters()
    assert copies[-1] == copies[-6], f"flags copied in a steady loop: {copies}"
    assert all(state_for(layer.k_cache, 8).ctrl.is_cuda for layer in model.layers)


@requires_cuda
def test_hf_generate_default_compile_config_on_cuda():
    """HF generate's default CompileConfig (mode "reduce-overhead") with a static cache: CUDA graphs on, the same
    tokens as eager generate."""
    from transformers import CompileConfig

    from tests.support.backend_models import hf_model

    model = hf_model("llama").cuda()
    ids = prompt(40).cuda()
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static")
        skips, _ = _cudagraph_counters()
        out = model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static",
                             compile_config=CompileConfig(backend="tinyserve"))
    assert torch.equal(out, ref)
    rep = tc.explain()
    assert rep.counters["rewritten"] >= 4 and rep.cudagraphs, rep
    assert all(g["on"] for g in rep.cudagraphs), rep
    assert _cudagraph_counters()[0] == skips
