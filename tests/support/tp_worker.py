"""One rank of the tensor-parallel tests (spawned by ``tests/backend/test_tensor_parallel.py``; gloo on CPU).

A spawned rank imports this module as ``tests.support.tp_worker``: a spawned child starts with its parent's
import path, which holds the repository root (pyproject's ``pythonpath``).

Each scenario decodes a few greedy steps through ``torch.compile(backend="tinyserve")`` and saves, per
rank, ``{name}_{rank}.pt``: the logits, the decode sites found and rewritten, the dense reasons, or the
error raised.
"""
from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

WORLD = 2
OPTS = {"token_budget": 32, "page_size": 16, "candidate_extra": 32, "dense_layers": 0, "lower": "eager"}
HF_PROMPT, GF_PROMPT, DT_PROMPT = 70, 70, 30
STEPS = 3


# ---------------------------------------------------------------------------------------------- models
def hf_config():
    import transformers as tf

    return tf.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


class AllReduceLinear(nn.Module):
    """The row-parallel output projection of gpt-fast's TP: a local matmul, then a functional all-reduce."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)

    def forward(self, x):
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(F.linear(x, self.weight), "sum", dist.group.WORLD)


def shard_gpt_fast(model, rank: int, world: int = WORLD):
    """gpt-fast's tensor parallelism on :class:`models.GptFastModel`: each rank keeps its query and KV heads."""
    for layer in model.layers:
        hd, hq, hkv = layer.hd, layer.n_head, layer.n_kv
        lq, lkv = hq // world, hkv // world
        wq, wkv, wo = layer.wq.weight.data, layer.wkv.weight.data, layer.wo.weight.data
        q_rows = slice(rank * lq * hd, (rank + 1) * lq * hd)
        k_rows = wkv[rank * lkv * hd:(rank + 1) * lkv * hd]
        v_rows = wkv[(hkv + rank * lkv) * hd:(hkv + (rank + 1) * lkv) * hd]
        layer.wq = nn.Linear(wq.shape[1], lq * hd, bias=False)
        layer.wq.weight.data.copy_(wq[q_rows])
        layer.wkv = nn.Linear(wkv.shape[1], 2 * lkv * hd, bias=False)
        layer.wkv.weight.data.copy_(torch.cat([k_rows, v_rows]))
        layer.wo = AllReduceLinear(wo[:, q_rows])
        layer.n_head, layer.n_kv = lq, lkv
        L = layer.k_cache.shape[2]
        layer.k_cache = torch.zeros(1, lkv, L, hd)
        layer.v_cache = torch.zeros(1, lkv, L, hd)
    return model


#: torch 2.8: DTensor cannot index_put_ with DTensor indices (nor index_copy_)
OLD_DTENSOR = torch.torch_version.TorchVersion(torch.__version__) < (2, 9)


def dtensor_forward(mesh):
    """A :class:`models.GptFastAttention` forward for a plan that keeps DTensor activations (caches, positions
    and mask are DTensors too); SDPA through the math kernel, which DTensor runs op by op."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def forward(self, x, input_pos, mask):
        B, T, _ = x.shape
        pos = DTensor.from_local(input_pos, mesh, [Replicate()], run_check=False)
        mask = DTensor.from_local(mask, mesh, [Replicate()], run_check=False)
        q = self.wq(x).view(B, T, self.n_head, self.hd).transpose(1, 2)
        k, v = self.wkv(x).view(B, T, 2 * self.n_kv, self.hd).transpose(1, 2).split(self.n_kv, dim=1)
        if OLD_DTENSOR:  # torch 2.8's DTensor has no index_put_ with DTensor indices: each rank writes its shard
            r, w = mesh.get_local_rank(), mesh.size()
            self.k_cache.to_local()[:, :, input_pos] = k.full_tensor().chunk(w, dim=1)[r]
            self.v_cache.to_local()[:, :, input_pos] = v.full_tensor().chunk(w, dim=1)[r]
        else:
            self.k_cache[:, :, pos] = k
            self.v_cache[:, :, pos] = v
        g = self.n_head // self.n_kv
        kk, vv = self.k_cache.repeat_interleave(g, dim=1), self.v_cache.repeat_interleave(g, dim=1)
        with sdpa_kernel(SDPBackend.MATH):
            y = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    return forward


def dtensor_model(mesh=None, seed: int = 0):
    """Two-layer :class:`models.GptFastModel`; with ``mesh``, parallelised with DTensor outputs kept."""
    from tests.support import backend_models as models

    torch.manual_seed(seed)
    model = models.GptFastModel(n_layer=2, max_len=64).eval()
    if mesh is None:
        return model
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    fwd = dtensor_forward(mesh)
    for layer in model.layers:
        parallelize_module(layer, mesh, {"wq": ColwiseParallel(use_local_output=False),
                                         "wkv": ColwiseParallel(use_local_output=False), "wo": RowwiseParallel()})
        layer.k_cache = distribute_tensor(layer.k_cache, mesh, [Shard(1)])
        layer.v_cache = distribute_tensor(layer.v_cache, mesh, [Shard(1)])
        layer.forward = fwd.__get__(layer)
    return model


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------- decode loops
@torch.no_grad()
def hf_decode(model, step, ids, steps=STEPS):
    """Eager prefill into a StaticCache, then greedy steps through ``step`` (a callable or a context factory)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=128)
    out = model(ids, past_key_values=cache, use_cache=True)
    tok, logits = out.logits[:, -1:].argmax(-1), []
    for _ in range(steps):
        o = step(tok, past_key_values=cache, use_cache=True)
        logits.append(o.logits[:, -1])
        tok = o.logits[:, -1:].argmax(-1)
    return torch.stack(logits)


@torch.no_grad()
def gpt_fast_decode(model, step, ids, steps=STEPS):
    n = ids.shape[1]
    logits = model(ids, torch.arange(n))
    tok, out = logits[:, -1:].argmax(-1), []
    for i in range(steps):
        lg = step(tok, torch.tensor([n + i]))
        out.append(lg[:, -1])
        tok = lg[:, -1:].argmax(-1)
    return torch.stack(out)


# ---------------------------------------------------------------------------------------------- scenarios
def _hf(rank, path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", attn_implementation="sdpa").eval()
    attn = model.model.layers[0].self_attn
    local_heads = attn.q_proj.weight.to_local().shape[0] // attn.head_dim
    compiled = torch.compile(model, backend="tinyserve", options=OPTS)
    return hf_decode(model, compiled, prompt(HF_PROMPT, 1)), {"local_q_heads": local_heads}


def _gpt_fast(rank, path):
    from tests.support import backend_models as models

    model = shard_gpt_fast(models.gpt_fast_model(), rank)
    compiled = torch.compile(model, backend="tinyserve", options=OPTS)
    return gpt_fast_decode(model, compiled, prompt(GF_PROMPT, 2)), {"local_q_heads": model.layers[0].n_head}


def _dtensor(rank, path):
    from torch.distributed.device_mesh import init_device_mesh

    model = dtensor_model(init_device_mesh("cpu", (WORLD,)))
    compiled = torch.compile(model, backend="tinyserve", options=OPTS)
    return gpt_fast_decode(model, compiled, prompt(DT_PROMPT, 3), steps=2), {}


SCENARIOS = {"hf": _hf, "gpt_fast": _gpt_fast, "dtensor": _dtensor}


def run(rank: int, port: int, path: str, names) -> None:
    """Entry point of a spawned rank."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    import transformers

    import tinyserve_compile as tc

    transformers.logging.set_verbosity_error()
    try:
        for name in names:
            torch._dynamo.reset()
            tc.reset()
            res = {}
            try:
                logits, extra = SCENARIOS[name](rank, path)
                rep = tc.explain()
                sites = [s for g in rep.graphs for s in g["sites"] if s["query_len"] == 1]
                res = dict(logits=logits, decode_sites=len(sites), rewritten=sum(s["status"] == "sparse" for s in sites),
                           reasons=rep.dense_reasons, decode_calls=rep.runtime.get("decode_calls", 0), **extra)
            except Exception:  # noqa: BLE001 - reported to the test, which fails on it
                res = {"error": traceback.format_exc()[-3000:]}
            torch.save(res, os.path.join(path, f"{name}_{rank}.pt"))
    finally:
        dist.destroy_process_group()
