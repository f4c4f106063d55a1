"""Decode loops shared by the backend tests."""
from __future__ import annotations

import torch

from tests.support.backend_models import VOCAB, n_heads
from tinyserve_compile.testing import reference_sparse_attention


#: torch 2.8's Dynamo makes a static-address cache (HF's StaticCache layers) an attribute of the graph, guarded by
#: identity, so a new cache object recompiles (stock torch.compile alike); 2.9 and later make it a graph input
CACHE_IS_GRAPH_ATTRIBUTE = torch.torch_version.TorchVersion(torch.__version__) < (2, 9)


def torchao_problem():
    """Why torchao's quantization (what ``tinyserve_compile.quantization`` and ``bench/weights.py`` use) cannot run
    here, or None: the import error of ``tinyserve_compile.quantization``, which checks for torchao >= 0.18."""
    try:
        import tinyserve_compile.quantization  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def position_kwargs(pos: int) -> dict:
    """``{"cache_position": tensor([pos])}`` for a decode step at ``pos`` on transformers 4.x (as 4.x's ``generate()``
    passes it), else ``{}``. Without it a 4.x model takes the position from the static cache's contents: it counts
    the key rows of layer 0 that are not all zero, a host read that breaks Dynamo's graph in three, and an
    undercount where a token's key is zero (Gemma's padding token 0 embeds to zeros)."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        return {"cache_position": torch.tensor([pos])}
    return {}


def prompt(n: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, n), generator=g)


@torch.no_grad()
def hf_decode(model, step, ids, n_new, max_cache_len=192, cache=None, attention_mask=None, reference=None):
    """Eager prefill, then ``n_new`` greedy steps through ``step`` (or the eager reference).

    Returns (tokens [B, n_new+1], logits [n_new, B, V], cache).

    On transformers 4.x each step passes ``cache_position`` (:func:`position_kwargs`).
    """
    from transformers import StaticCache

    if cache is None:
        cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    kw = {} if attention_mask is None else {"attention_mask": attention_mask}
    out = model(ids, past_key_values=cache, use_cache=True, **kw)
    toks, logits = [out.logits[:, -1:].argmax(-1)], []
    mask = attention_mask
    for i in range(n_new):
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            kw = {"attention_mask": mask}
        kw = {**kw, **position_kwargs(ids.shape[1] + i)}
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
