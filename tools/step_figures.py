"""Interpreter-side figures of one decode step of a compiled tiny Llama on the Triton kernel (CPU, interpreted).

Run as a script, ``python tools/step_figures.py [two-stage|paper]``, from outside the checkout with the
virtualenv of the checkout to measure (the same script serves any checkout: it patches only Triton's interpreter
and the op's launcher ``sparse_decode_triton``). A random-init Llama (3 layers, 6 query and 2 KV heads, the
first layer dense) decodes at 101-103 tokens in a static cache of 320 slots, pages of 16, a budget of 32 tokens:
``two-stage`` (4 candidate pages, the tokens kept among them) or ``paper`` (one stage, fp32 bounds). Prints JSON:
the op's calls in the step, Triton launches by kernel, the ATen ops inside the op calls (launches excluded; the
compute ones named), and the host reads (``item``, ``_local_scalar_dense``, ``nonzero``, ``equal``,
``is_nonzero``) inside the op calls and in the whole step (the profiler's events). docs/gpu/interpreter_step.json
holds the figures before the fused op (e9da5a0) and now.
"""
import importlib.util
import json
import os
import sys
from collections import Counter
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import tinyserve_compile as tc  # noqa: E402
from tinyserve_compile.kernels import triton_sparse_decode as tsd  # noqa: E402


def _load_no_host_sync():
    """tests/support/no_host_sync.py of this script's checkout, loaded from its file: the repository root is not
    put on ``sys.path``, where its ``tinyserve_compile`` would shadow the one of the virtualenv being measured."""
    path = Path(__file__).resolve().parents[1] / "tests" / "support" / "no_host_sync.py"
    spec = importlib.util.spec_from_file_location("no_host_sync", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


VIEWS_AND_ALLOCATIONS = _load_no_host_sync().VIEWS_AND_ALLOCATIONS

#: host reads as the profiler names them; the dispatcher's names are the same with "." for "::"
READS = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::equal", "aten::is_nonzero")

launches, ops, paused, calls = Counter(), Counter(), [0], [0]
_run = InterpretedFunction.run


def _counted_run(self, *args, grid, warmup, **kwargs):
    """Every interpreted launch, counted by kernel; the ATen ops it runs on the host are not the op's."""
    if not warmup:
        launches[self.fn.__name__] += 1
    paused[0] += 1
    try:
        return _run(self, *args, grid=grid, warmup=warmup, **kwargs)
    finally:
        paused[0] -= 1


class _CountOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not paused[0]:
            ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


_launcher = tsd.sparse_decode_triton


def _counted_launcher(*args, **kwargs):
    calls[0] += 1
    with _CountOps():
        return _launcher(*args, **kwargs)


def main(setting: str) -> dict:
    import transformers as tf
    from transformers import StaticCache

    InterpretedFunction.run = _counted_run
    tsd.sparse_decode_triton = _counted_launcher
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=96, hidden_size=96, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    ids = torch.randint(0, 96, (1, 100), generator=torch.Generator().manual_seed(1))
    opts = {"token_budget": 32, "page_size": 16, "dense_layers": 1, "lower": "eager", "kernel": "triton"}
    if setting == "two-stage":  # 4 candidate pages of 20, the tokens kept among them (the defaults' shape of rule)
        opts.update(candidate_factor=2, candidate_extra=0, keep_tokens=True)
    else:  # the paper rule: one stage, fp32 bounds
        opts.update(candidate_factor=1, candidate_extra=0, bounds_dtype="float32", sink_pages=0)
    step = torch.compile(model, backend="tinyserve", options=opts)
    with torch.no_grad():
        cache = StaticCache(config=model.config, max_cache_len=320)
        tok = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(2):  # compile and warm up
            tok = step(tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        launches.clear(), ops.clear()
        calls[0] = 0
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step(tok, past_key_values=cache, use_cache=True)
    names = [e.name for e in prof.events()]
    compute = {k: v for k, v in ops.items() if not k.startswith(VIEWS_AND_ALLOCATIONS)}
    host_in_op = {k: v for k, v in ops.items() if k.startswith(tuple(r.replace("::", ".") for r in READS))}
    return dict(setting=setting, tinyserve=tc.__file__, op_calls=calls[0], layers=3, dense_layers=1,
                triton_launches_per_step=dict(launches), triton_launches_total=sum(launches.values()),
                aten_ops_in_op_calls=sum(ops.values()), aten_compute_ops_in_op_calls=sum(compute.values()),
                aten_compute_ops=dict(sorted(compute.items(), key=lambda kv: -kv[1])),
                host_reads_in_op_calls=sum(host_in_op.values()),
                host_reads_in_step=sum(n in READS for n in names),
                host_read_names=dict(Counter(n for n in names if n in READS)))


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "two-stage"), indent=1))
