"""Tiny random-init models for backend tests: HF families with a static cache, and a gpt-fast-style model."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 96


def hf_config(family: str):
    """A tiny config of ``family`` (GQA where the family has it)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, max_position_embeddings=512)
    if family == "llama":
        return tf.LlamaConfig(num_key_value_heads=2, **common)
    if family == "mistral":
        return tf.MistralConfig(num_key_value_heads=2, sliding_window=None, **common)
    if family == "qwen2":
        return tf.Qwen2Config(num_key_value_heads=2, use_sliding_window=False, **common)
    if family == "gemma":
        return tf.GemmaConfig(num_key_value_heads=1, head_dim=16, **common)
    if family == "phi":
        # pad_token_id as every other version defaults it: transformers 5.0's PhiModel reads it, its PhiConfig lacks it
        return tf.PhiConfig(num_key_value_heads=4, pad_token_id=None, **common)
    if family == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=512)
    raise ValueError(f"unknown family {family!r}")


HF_FAMILIES = ["llama", "mistral", "qwen2", "gemma", "phi", "gpt2"]


def hf_model(family: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(family)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    return model


def n_heads(model):
    """``(query heads, KV heads)`` of an HF model."""
    c = model.config
    hq = getattr(c, "num_attention_heads", None) or c.n_head
    return hq, getattr(c, "num_key_value_heads", None) or hq


class GptFastAttention(nn.Module):
    """gpt-fast style: ``k_cache[:, :, input_pos] = k`` and GQA via ``repeat_interleave``."""

    def __init__(self, dim, n_head, n_kv, max_len, graph_break=False):
        super().__init__()
        self.graph_break = graph_break
        self.n_head, self.n_kv, self.hd = n_head, n_kv, dim // n_head
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * n_kv * self.hd, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.register_buffer("k_cache", torch.zeros(1, n_kv, max_len, self.hd), persistent=False)
        self.register_buffer("v_cache", torch.zeros(1, n_kv, max_len, self.hd), persistent=False)

    def forward(self, x, input_pos, mask):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.hd).transpose(1, 2)
        k, v = self.wkv(x).view(B, T, 2 * self.n_kv, self.hd).transpose(1, 2).split(self.n_kv, dim=1)
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        g = self.n_head // self.n_kv
        kk = self.k_cache.repeat_interleave(g, dim=1)
        vv = self.v_cache.repeat_interleave(g, dim=1)
        y = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
        if self.graph_break:
            torch._dynamo.graph_break()
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class GptFastModel(nn.Module):
    """A tiny decoder with gpt-fast's cache idiom; ``forward(idx, input_pos) -> logits``."""

    def __init__(self, n_layer=4, dim=64, n_head=4, n_kv=2, max_len=256, vocab=VOCAB, graph_breaks=False):
        super().__init__()
        self.max_len = max_len
        self.n_kv = n_kv
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        # graph_breaks: Dynamo compiles each attention layer as its own frame (one graph per layer)
        self.layers = nn.ModuleList(GptFastAttention(dim, n_head, n_kv, max_len, graph_breaks) for _ in range(n_layer))
        self.out = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)), persistent=False)

    def forward(self, idx, input_pos):
        x = self.emb(idx) + self.pos(input_pos)[None]
        mask = self.causal[None, None, input_pos]  # [1, 1, T, max_len]
        for layer in self.layers:
            x = x + layer(x, input_pos, mask)
        return self.out(x)


def gpt_fast_model(seed: int = 0, graph_breaks: bool = False) -> GptFastModel:
    torch.manual_seed(seed)
    return GptFastModel(graph_breaks=graph_breaks).eval()
