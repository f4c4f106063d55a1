"""A model-agnostic pure-PyTorch run of what the backend computes, for tests and evaluation.

:func:`reference_sparse_attention` intercepts every decode-mode
``F.scaled_dot_product_attention`` call of an *uncompiled* model and answers it
with :func:`tinyserve_compile.kernels.reference.sparse_decode_reference`, so a
compiled model's logits can be compared with the reference run of the same
model, step by step.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .config import TinyServeConfig
from .kernels.spec import SelectionSpec, attended
from .kernels.reference import page_bounds, sparse_decode_reference
from .policies import DecodeContext, get_policy

__all__ = ["reference_sparse_attention"]

_SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}


class _SparseReferenceMode(TorchFunctionMode):
    def __init__(self, config: TinyServeConfig, n_q_heads: int, n_kv_heads: int, n_layers: int = 0):
        super().__init__()
        self.n_layers = n_layers
        self.config = config
        self.n_q_heads = n_q_heads
        self.n_kv_heads = n_kv_heads
        self.decode_calls = 0
        self.sparse_calls = 0
        self.policy_states = {}  #: per layer, for stateful policies (kept across steps)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _SDPA:
            return func(*args, **kwargs)
        names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
        a = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)
        a.update(zip(names, args))
        a.update(kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        Hq, Hkv = self.n_q_heads, self.n_kv_heads
        G = Hq // Hkv
        # transformers folds a GQA group into the query-length dim in eager mode: [B, Hkv, G, D]
        folded = G > 1 and q.shape[1] == Hkv and q.shape[2] == G and k.shape[1] == Hkv
        if q.shape[2] != 1 and not folded:
            return func(*args, **kwargs)
        layer = self.decode_calls % self.n_layers if self.n_layers else self.decode_calls
        self.decode_calls += 1
        if layer < self.config.dense_layers:
            return func(*args, **kwargs)
        mask = a["attn_mask"]
        if mask is not None and mask.dim() < 4:  # SDPA broadcasts a [L] / [1, L] / [B, 1, L] mask from the left
            mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        if folded:
            q = q.reshape(q.shape[0], Hq, 1, q.shape[-1])
            if mask is not None and mask.dim() == 4 and mask.shape[1] == Hkv and mask.shape[2] == G:
                mask = mask.reshape(mask.shape[0], Hq, 1, mask.shape[-1])  # a per-head mask, folded like q
        elif not a["enable_gqa"] and k.shape[1] == q.shape[1] and G > 1:
            k, v = k[:, ::G], v[:, ::G]  # undo repeat_kv: query head h reads KV head h // G
        L = k.shape[2]
        if mask is None:
            valid = torch.tensor([L])
        else:
            allowed = attended(mask)
            allowed = allowed.expand(q.shape[0], -1, 1, L).any(1)[:, 0]  # [B, L]
            pos = torch.arange(L).expand_as(allowed)
            valid = torch.where(allowed, pos + 1, torch.zeros_like(pos)).amax(-1)  # newest attendable + 1
            valid = valid.amax().reshape(1)  # rows share the write position
        scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
        self.sparse_calls += 1
        c = self.config
        spec = SelectionSpec.from_config(c)
        bounds = page_bounds(k, c.page_size, dtype=c.bounds_torch_dtype)
        if c.policy == "query_aware":
            out = sparse_decode_reference(q, k, v, valid, mask, scale, spec, bounds)  # [B, Hq, 1, D]
        else:  # the policy itself, over bounds rebuilt from scratch (as the backend maintains them)
            B = q.shape[0]
            ctx = DecodeContext(q, k, v, bounds, valid.expand(B), mask, scale, spec,
                                self.policy_states.setdefault(layer, {}), "auto")
            out = get_policy(c.policy)(ctx)
        return out.reshape(out.shape[0], Hkv, G, out.shape[-1]) if folded else out


@contextlib.contextmanager
def reference_sparse_attention(n_q_heads: int, n_kv_heads: int, options=None, n_layers: int = 0):
    """Answer decode SDPA calls of eager code with the pure-PyTorch sparse reference.

    Parameters
    ----------
    n_q_heads, n_kv_heads : int
        Query and KV heads of the model (the reference selects per KV head).
    options : dict, optional
        Backend options (page_size, token_budget, dense_layers, sink_pages,
        candidate_factor, candidate_extra, keep_tokens, bounds_dtype, policy). ``query_aware`` runs the pure-PyTorch
        reference; other policies run their own class over bounds rebuilt from
        scratch each step, with per-layer state kept across steps.
    n_layers : int, optional
        Decode SDPA calls per forward pass; when given, the context may span many
        steps (``generate``). Otherwise ``dense_layers`` counts calls since entry,
        so enter it once per decode step.

    Yields
    ------
    _SparseReferenceMode
        Its ``sparse_calls`` counts the calls answered sparsely.
    """
    mode = _SparseReferenceMode(TinyServeConfig.from_options(options), n_q_heads, n_kv_heads, n_layers)
    with mode:
        yield mode
