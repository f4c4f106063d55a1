"""A compiled model on the Triton kernel: tiny random-init Llama, interpreter on CPU.

``torch.compile(model, backend="tinyserve", options={"kernel": "triton"})`` must give
the greedy tokens (and, within fp32 tolerance, the logits) of ``kernel="torch"``; one whole decode step makes
three Triton launches per layer, no ATen compute op inside the op calls and no host read at all.
"""
from __future__ import annotations


import pytest
import torch

pytest.importorskip("transformers")


from tests.support.triton_interp import _import_interpreted  # noqa: E402


_import_interpreted("tinyserve_compile.kernels.triton_sparse_decode")

import tinyserve_compile as tc  # noqa: E402

VOCAB = 96


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch._dynamo.reset()
    tc.reset()
    yield
    torch._dynamo.reset()


def _tiny_llama(seed=0):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=96, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)
    return tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


@torch.no_grad()
def _greedy(model, step, ids, n_new, max_cache_len=160):
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    out = model(ids, past_key_values=cache, use_cache=True)
    toks, logits = [out.logits[:, -1:].argmax(-1)], []
    for _ in range(n_new):
        o = step(toks[-1], past_key_values=cache, use_cache=True)
        logits.append(o.logits[:, -1])
        toks.append(o.logits[:, -1:].argmax(-1))
    return torch.cat(toks, 1), torch.stack(logits)


def _count_launcher_calls(monkeypatch):
    """Count calls of the Triton launcher that ``tinyserve::sparse_decode`` dispatches to."""
    calls = []
    sib = _import_interpreted("tinyserve_compile.kernels.triton_sparse_decode")
    launcher = sib.sparse_decode_triton

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return launcher(*args, **kwargs)

    monkeypatch.setattr(sib, "sparse_decode_triton", counting)
    return calls


@pytest.mark.parametrize("candidate_factor", [1, 2])
def test_compiled_llama_triton_equals_torch(candidate_factor, monkeypatch):
    model = _tiny_llama()
    calls = _count_launcher_calls(monkeypatch)
    ids = torch.randint(0, VOCAB, (1, 100), generator=torch.Generator().manual_seed(1))
    opts = {"token_budget": 32, "page_size": 16, "dense_layers": 1, "lower": "eager",
            "candidate_factor": candidate_factor}
    runs = {}
    for kernel in ("torch", "triton"):
        torch._dynamo.reset()
        tc.reset()
        step = torch.compile(model, backend="tinyserve", options={**opts, "kernel": kernel})
        runs[kernel] = _greedy(model, step, ids, 4)
        assert tc.counters["rewritten"] == 3, tc.explain()  # the dense layer too (dense at run time)
    # every layer runs the launcher, the dense one too: ctrl's dense flag is read on the device, so that a CUDA
    # graph replays the same launches whatever the flags say
    assert len(calls) == 4 * 3, f"the Triton launcher ran {len(calls)} times, expected 4 steps x 3 layers"
    (t_toks, t_logits), (x_toks, x_logits) = runs["torch"], runs["triton"]
    d = (x_logits - t_logits).abs()
    assert torch.allclose(x_logits, t_logits, atol=1e-4, rtol=1e-4), f"max |logit diff| {float(d.max()):.3e}"
    assert torch.equal(x_toks, t_toks), f"tokens differ: triton {x_toks.tolist()} torch {t_toks.tolist()}"


def test_decode_step_launches_and_host_reads(monkeypatch):
    """One whole decode step of a compiled model on the Triton kernel: at most ``len(LAUNCHES)`` launches per
    attention site (the dense layer's too), and no host-synchronising op inside the sites' op calls. Prints the
    step's figures (``pytest -s``): launches by kernel, ATen ops inside the op calls, host reads in the step."""
    from collections import Counter

    from tests.support.no_host_sync import VIEWS_AND_ALLOCATIONS, ForbidHostSync

    tsd = _import_interpreted("tinyserve_compile.kernels.triton_sparse_decode")
    launches = Counter()
    for name in tsd.LAUNCHES:
        kernel = getattr(tsd, name)

        class _Counted:
            def __getitem__(self, grid, name=name, kernel=kernel):
                def launch(*args, **kwargs):  # the interpreter copies on the host what a device would not
                    launches[name] += 1
                    with op_modes[-1].paused():
                        return kernel[grid](*args, **kwargs)
                return launch

        monkeypatch.setattr(tsd, name, _Counted())
    op_modes = []
    launcher = tsd.sparse_decode_triton

    def checked(*args, **kwargs):  # the op's own ATen ops, with the interpreter's launches left out
        with ForbidHostSync() as mode:
            op_modes.append(mode)
            return launcher(*args, **kwargs)

    monkeypatch.setattr(tsd, "sparse_decode_triton", checked)
    model = _tiny_llama()
    ids = torch.randint(0, VOCAB, (1, 100), generator=torch.Generator().manual_seed(1))
    opts = {"token_budget": 32, "page_size": 16, "dense_layers": 1, "lower": "eager", "kernel": "triton",
            "candidate_factor": 2, "candidate_extra": 0}  # candidates: 4 pages of 20, the tokens kept among them
    from transformers import StaticCache

    step = torch.compile(model, backend="tinyserve", options=opts)
    with torch.no_grad():
        cache = StaticCache(config=model.config, max_cache_len=320)  # more pages than candidates: sparse
        tok = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(2):  # compile and warm up
            tok = step(tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        launches.clear(), op_modes.clear()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step(tok, past_key_values=cache, use_cache=True)
    layers = model.config.num_hidden_layers
    assert len(op_modes) == layers, f"{len(op_modes)} op calls in a step of {layers} layers"
    assert all(not m.violations for m in op_modes), [m.violations for m in op_modes]
    per_call = Counter(op for m in op_modes for op in m.seen)
    assert sum(launches.values()) <= len(tsd.LAUNCHES) * layers, dict(launches)
    assert launches == {name: layers for name in tsd.LAUNCHES}, dict(launches)  # the dense layer's the same
    allowed = [op for op in per_call if not op.startswith(VIEWS_AND_ALLOCATIONS)]
    assert not allowed, f"ATen compute ops inside the op calls: {allowed}"
    assert per_call["aten.empty.memory_format"] == layers, dict(per_call)  # the output, nothing else
    # the whole step, the backend's runtime and the model's own ops included, reads nothing on the host (the
    # profiler, not a dispatch mode: Dynamo runs a frame eagerly under a dispatch mode)
    names = [e.name for e in prof.events()]
    reads = [n for n in names if n in ("aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::equal")]
    assert reads == [], reads
    print(f"\nper decode step ({layers} layers, one dense): Triton launches {dict(launches)}; ATen ops inside the "
          f"op calls {dict(per_call)}; host-synchronising ops inside them 0; host reads in the whole step 0 (of {len(names)} profiled "
          f"events)")

