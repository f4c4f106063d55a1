"""Decode loops shared by the backend tests."""
from __future__ import annotations

import torch

from models import VOCAB, n_heads
from tinyserve_compile.testing import reference_sparse_attention


def prompt(n: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, n), generator=g)


@torch.no_grad()
def hf_decode(model, step, ids, n_new, max_cache_len=192, cache=None, attention_mask=None, reference=None):
    """Eager prefill, then ``n_new`` greedy steps through ``step`` (or the eager reference).

    Returns (tokens [B, n_new+1], logits [n_new, B, V], cache).
    """
    from transformers import StaticCache

    if cache is None:
        cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    kw = {} if attention_mask is None else {"attention_mask": attention_mask}
    out = model(ids, past_key_values=cache, use_cache=True, **kw)
    toks, logits = [out.logits[:, -1:].argmax(-1)], []
    mask = attention_mask
    for _ in range(n_new):
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            kw = {"attention_mask": mask}
        if reference is not None:
            with reference_sparse_attention(*n_heads(model), reference):
                o = model(toks[-1], past_key_values=cache, use_cache=True, **kw)
        else:
            o = step(toks[-1], past_key_values=cache, use_cache=True, **kw)
        logits.append(o.logits[:, -1])
        toks.append(o.logits[:, -1:].argmax(-1))
    return torch.cat(toks, 1), torch.stack(logits), cache


def worst(a: torch.Tensor, b: torch.Tensor) -> str:
    d = (a.float() - b.float()).abs()
    i = int(d.argmax())
    return f"max |diff| {d.max().item():.3e} at flat index {i}: {a.flatten()[i].item():.6f} vs {b.flatten()[i].item():.6f}"


def decode_graph(model):
    """``(gm, example_inputs)``: the FX graph Dynamo captures of a gpt-fast style model's decode step (its second
    call, after a 40-token prefill), before any backend pass."""
    graphs = []

    def grab(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    compiled = torch.compile(model, backend=grab)
    with torch.no_grad():
        compiled(prompt(40, seed=1), torch.arange(40))
        compiled(torch.tensor([[3]]), torch.tensor([40]))
    return graphs[-1]
