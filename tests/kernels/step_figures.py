"""Interpreter-side figures of one decode step of a compiled tiny Llama on the Triton kernel (CPU, ``TRITON_INTERPRET=1``).

Run as a script, ``python tests/kernels/step_figures.py [two-stage|paper]``, from outside the checkout with the
virtualenv of the checkout to measure (the same script serves any checkout: it patches only Triton's interpreter
and the op's launcher ``sparse_decode_triton``). A random-init Llama (3 layers, 6 query and 2 KV heads, the
first layer dense) decodes at 101-103 tokens in a static cache of 320 slots, pages of 16, a budget of 32 tokens:
``two-stage`` (4 candidate pages, the tokens kept among them) or ``paper`` (one stage, fp32 bounds). Prints JSON:
the op's calls in the step, Triton launches by kernel, the ATen ops inside the op calls (launches excluded; the
compute ones named), and the host reads (``item``, ``_local_scalar_dense``, ``nonzero``, ``equal``,
``is_nonzero``) inside the op calls and in the whole step (the profiler's events). docs/gpu/interpreter_step.json
holds the figures before the fused op (e9da5a0) and now.
"""
import json
import os
import sys
os.environ["TRITON_INTERPRET"] = "1"
from collections import Counter
import torch
from torch.utils._python_dispatch import TorchDispatchMode
import triton
from triton.runtime.interpreter import InterpretedFunction
import tinyserve_compile as tc
from tinyserve_compile.kernels import triton_sparse_decode as tsd

launches, ops, paused = Counter(), Counter(), [0]
orig_run = InterpretedFunction.run
def run(self, *args, grid, warmup, **kwargs):
    if not warmup:
        launches[self.fn.__name__] += 1
    paused[0] += 1
    try:
        return orig_run(self, *args, grid=grid, warmup=warmup, **kwargs)
    finally:
        paused[0] -= 1
InterpretedFunction.run = run

class Count(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not paused[0]:
            ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

calls = [0]
launcher = tsd.sparse_decode_triton
def counted(*a, **k):
    calls[0] += 1
    with Count():
        return launcher(*a, **k)
tsd.sparse_decode_triton = counted

import transformers as tf
from transformers import StaticCache
torch.manual_seed(0)
cfg = tf.LlamaConfig(vocab_size=96, hidden_size=96, intermediate_size=128, num_hidden_layers=3,
                     num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)
model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
ids = torch.randint(0, 96, (1, 100), generator=torch.Generator().manual_seed(1))
setting = sys.argv[1] if len(sys.argv) > 1 else "two-stage"
opts = {"token_budget": 32, "page_size": 16, "dense_layers": 1, "lower": "eager", "kernel": "triton"}
if setting == "two-stage":  # 4 candidate pages of 20, the tokens kept among them (the defaults' shape of rule)
    opts.update(candidate_factor=2, candidate_extra=0, keep_tokens=True)
else:  # the paper rule: one stage, fp32 bounds
    opts.update(candidate_factor=1, candidate_extra=0, bounds_dtype="float32", sink_pages=0)
step = torch.compile(model, backend="tinyserve", options=opts)
with torch.no_grad():
    cache = StaticCache(config=model.config, max_cache_len=320)
    tok = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    for _ in range(2):
        tok = step(tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    launches.clear(); ops.clear(); calls[0] = 0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        tok = step(tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
names = [e.name for e in prof.events()]
READS = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::equal", "aten::is_nonzero")
VIEWS = ("aten.view.", "aten._reshape_alias.", "aten.as_strided.", "aten.alias.", "aten.select.int", "aten.slice.Tensor",
         "aten.expand.", "aten.unsqueeze.", "aten.squeeze.", "aten.transpose.int", "aten.permute.", "aten.t.",
         "aten.detach.", "aten.empty.", "aten.empty_strided.", "aten.new_empty.", "aten.new_empty_strided.")
compute = {k: v for k, v in ops.items() if not k.startswith(VIEWS)}
host_in_op = {k: v for k, v in ops.items() if k.startswith(("aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.equal", "aten.is_nonzero"))}
out = dict(setting=setting, tinyserve=tc.__file__, op_calls=calls[0], layers=3, dense_layers=1,
           triton_launches_per_step=dict(launches), triton_launches_total=sum(launches.values()),
           aten_ops_in_op_calls=sum(ops.values()), aten_compute_ops_in_op_calls=sum(compute.values()),
           aten_compute_ops=dict(sorted(compute.items(), key=lambda kv: -kv[1])),
           host_reads_in_op_calls=sum(host_in_op.values()),
           host_reads_in_step=sum(n in READS for n in names), host_read_names=dict(Counter(n for n in names if n in READS)))
print(json.dumps(out, indent=1))
