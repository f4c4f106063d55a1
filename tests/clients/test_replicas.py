"""Minimal replicas of third-party decode loops' KV-cache idioms, through ``backend="tinyserve"``.

CI installs none of the client libraries that ``python -m bench clients`` sweeps (docs/clients.md); each
replica keeps exactly what the backend sees of its client: the cache buffers (shape, layout), the write form,
the read form, the GQA expansion, the mask and the dtype of the positions the client's decode loop passes.
Each replica decodes teacher-forced tokens after a prompt and checks

- every decode site is rewritten (counted per decode graph), with no site left dense;
- small budget (the selection drops pages): logits equal the eager model whose decode SDPA calls are answered by
  the reference rule (``tinyserve_compile.testing.reference_sparse_attention``), and differ from dense eager;
- budget covering the context: logits equal eager (dense-exact), with the same greedy tokens.

Both the native kernel and the PyTorch ops (used when the native build is unavailable, and off CPU) run.
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tinyserve_compile as tc
from tinyserve_compile.testing import reference_sparse_attention

VOCAB, DIM, HQ, HKV, HD, LAYERS = 97, 32, 4, 2, 8, 2
MAX_LEN, PROMPT, STEPS = 64, 40, 6
SPARSE = dict(page_size=4, token_budget=12, sink_pages=1, dense_layers=0, candidate_factor=1, candidate_extra=4,
              lower="eager")
DENSE = dict(SPARSE, token_budget=256)


from tests.support.backend_state import _fresh_backend_state  # noqa: E402,F401  (autouse: fresh state per test)


class Proj(nn.Module):
    """q, k, v projections: ``[B, T, DIM] -> [B, T, H, HD]`` each."""

    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(DIM, HQ * HD, bias=False)
        self.wk = nn.Linear(DIM, HKV * HD, bias=False)
        self.wv = nn.Linear(DIM, HKV * HD, bias=False)
        self.wo = nn.Linear(HQ * HD, DIM, bias=False)

    def qkv(self, x):
        b, t, _ = x.shape
        return self.wq(x).view(b, t, HQ, HD), self.wk(x).view(b, t, HKV, HD), self.wv(x).view(b, t, HKV, HD)


# ----------------------------------------------------------------------------------------------- replicas


class TorchtuneAttention(Proj):
    """torchtune ``KVCache`` (a ``cache_pos`` buffer, ``k_out[:, :, cache_pos[:n]] = k``), GQA by
    ``unsqueeze(2).expand(...).flatten(1, 2)``, the ``[B, T, L]`` bool mask read as ``mask[:, None]``."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(1, HKV, MAX_LEN, HD), persistent=False)
        self.register_buffer("v_cache", torch.zeros(1, HKV, MAX_LEN, HD), persistent=False)
        self.register_buffer("cache_pos", torch.arange(MAX_LEN), persistent=False)

    def forward(self, x, mask):
        b, t, _ = x.shape
        q, k, v = (z.transpose(1, 2) for z in self.qkv(x))
        k_out, v_out = self.k_cache, self.v_cache
        k_out[:, :, self.cache_pos[:t]] = k
        v_out[:, :, self.cache_pos[:t]] = v
        self.cache_pos.add_(t)
        shape = (b, HKV, HQ // HKV, -1, HD)
        k = k_out.unsqueeze(2).expand(shape).flatten(1, 2)
        v = v_out.unsqueeze(2).expand(shape).flatten(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, :, :], dropout_p=0.0, is_causal=False)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class LitGPTAttention(Proj):
    """litgpt ``KVCache``: ``k = self.k[:bs, ...].index_copy_(-2, input_pos, k)`` (the write's return value
    is K), then ``k[..., :input_pos_maxp1, :]``, GQA by ``repeat_interleave``, ``scale`` and ``is_causal``
    passed; the mask is ``mask_cache`` rows at ``input_pos`` cut to ``[..., :input_pos_maxp1]``."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.zeros(1, HKV, MAX_LEN, HD), persistent=False)
        self.register_buffer("v", torch.zeros(1, HKV, MAX_LEN, HD), persistent=False)

    def forward(self, x, input_pos, mask, input_pos_maxp1):
        b, t, _ = x.shape
        q, k, v = (z.transpose(1, 2) for z in self.qkv(x))
        k = self.k[:b, ...].index_copy_(-2, input_pos, k)
        v = self.v[:b, ...].index_copy_(-2, input_pos, v)
        k = k[..., :input_pos_maxp1, :]
        v = v[..., :input_pos_maxp1, :]
        k = k.repeat_interleave(HQ // HKV, dim=1)
        v = v.repeat_interleave(HQ // HKV, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=1.0 / math.sqrt(HD),
                                           is_causal=mask is None)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class GptFastAttention(Proj):
    """gpt-fast (torchao/_models/llama): ``k_out[:, :, input_pos] = k`` with int32 positions,
    ``repeat_interleave`` on the head dim, the mask ``causal_mask[None, None, input_pos]``."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(1, HKV, MAX_LEN, HD))
        self.register_buffer("v_cache", torch.zeros(1, HKV, MAX_LEN, HD))

    def forward(self, x, input_pos, mask):
        b, t, _ = x.shape
        q, k, v = (z.transpose(1, 2) for z in self.qkv(x))
        k_out, v_out = self.k_cache, self.v_cache
        k_out[:, :, input_pos] = k
        v_out[:, :, input_pos] = v
        k = k_out.repeat_interleave(HQ // HKV, dim=1)
        v = v_out.repeat_interleave(HQ // HKV, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class ExecutorchAttention(GptFastAttention):
    """executorch examples/models/llama ``KVCache`` (static shapes): the same write as gpt-fast with int64
    positions; the 2-D mask ``mask[input_pos]`` of a ``[L, L]`` causal buffer."""


class ExecutorchDynamicAttention(Proj):
    """executorch examples/models/llama with ``enable_dynamic_shape=True`` (what its eager runner passes: one
    start position per call): ``start_pos = input_pos[0].item()``, ``k_cache.index_copy_(2, arange(n) + start_pos,
    k)``, the mask ``mask.narrow(0, start_pos, n)`` of a ``[L, L]`` causal buffer, ``repeat_interleave``."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(1, HKV, MAX_LEN, HD))
        self.register_buffer("v_cache", torch.zeros(1, HKV, MAX_LEN, HD))
        self.register_buffer("mask", torch.tril(torch.ones(MAX_LEN, MAX_LEN, dtype=torch.bool)), persistent=False)

    def update(self, input_pos, k_val, v_val):
        start_pos = input_pos[0].item()
        torch._check_is_size(start_pos)
        torch._check(start_pos < MAX_LEN)
        indices = torch.arange(k_val.size(2)) + start_pos
        self.k_cache.index_copy_(2, indices, k_val)
        self.v_cache.index_copy_(2, indices, v_val)
        return self.k_cache, self.v_cache

    def forward(self, x, input_pos):
        b, t, _ = x.shape
        q, k, v = (z.transpose(1, 2) for z in self.qkv(x))
        start_pos = input_pos[-1].item()
        torch._check_is_size(start_pos)
        torch._check(start_pos < MAX_LEN)
        attn_mask = self.mask.narrow(0, start_pos, t)  # [T, L]
        k, v = self.update(input_pos, k, v)
        k = k.repeat_interleave(HQ // HKV, dim=1)
        v = v.repeat_interleave(HQ // HKV, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MetaLlama4Attention(Proj):
    """Meta's reference Llama 4 (llama-models): ``[max_batch, L, Hkv, D]`` caches written as
    ``cache_k[:bsz, start_pos:start_pos + n] = xk`` (``start_pos`` a Python int), read as
    ``cache_k[:bsz, :start_pos + n]``, transposed, ``repeat_interleave`` on the head dim, no mask in decode. The
    caches are plain tensor attributes, re-assigned each call as ``self.cache_k = self.cache_k.to(xq)``."""

    def __init__(self):
        super().__init__()
        # plain tensor attributes (not buffers), max_batch_size 2 rows
        self.cache_k = torch.zeros(2, MAX_LEN, HKV, HD)
        self.cache_v = torch.zeros(2, MAX_LEN, HKV, HD)

    def forward(self, x, start_pos, mask):
        bsz, n, _ = x.shape
        xq, xk, xv = self.qkv(x)
        self.cache_k = self.cache_k.to(xq)  # a no-op at the same dtype and device: the cache itself
        self.cache_v = self.cache_v.to(xq)
        self.cache_k[:bsz, start_pos:start_pos + n] = xk
        self.cache_v[:bsz, start_pos:start_pos + n] = xv
        xk = self.cache_k[:bsz, :start_pos + n]
        xv = self.cache_v[:bsz, :start_pos + n]
        xq, xk, xv = [z.transpose(1, 2) for z in (xq, xk, xv)]
        xk = xk.repeat_interleave(HQ // HKV, dim=1)
        xv = xv.repeat_interleave(HQ // HKV, dim=1)
        y = F.scaled_dot_product_attention(xq, xk, xv, attn_mask=mask, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).contiguous().view(bsz, n, -1))


class Decoder(nn.Module):
    """Embedding, ``LAYERS`` residual attention layers of one replica, LM head; ``forward`` takes the
    client's own position arguments and builds the client's mask."""

    def __init__(self, client: str):
        super().__init__()
        client = client.removesuffix("-scalars")
        self.client = client
        attn = {"torchtune": TorchtuneAttention, "litgpt": LitGPTAttention, "gpt-fast": GptFastAttention,
                "executorch": ExecutorchAttention, "executorch-dynamic": ExecutorchDynamicAttention,
                "llama4-reference": MetaLlama4Attention}[client]
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(attn() for _ in range(LAYERS))
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        causal = torch.tril(torch.ones(MAX_LEN, MAX_LEN, dtype=torch.bool))
        if client == "litgpt":
            self.register_buffer("mask_cache", causal[None, None], persistent=False)  # [1, 1, L, L]
        elif client in ("gpt-fast", "executorch"):
            self.register_buffer("causal_mask", causal, persistent=False)  # [L, L]

    def forward(self, idx, *pos):
        x = self.emb(idx)  # [B, T, DIM]
        if self.client == "torchtune":
            (mask,) = pos  # [B, T, L] bool, built by torchtune's generate
            args = (mask,)
        elif self.client == "litgpt":
            input_pos, maxp1 = pos
            mask = torch.index_select(self.mask_cache, 2, input_pos)[..., :maxp1]  # [1, 1, T, maxp1]
            args = (input_pos, mask, maxp1)
        elif self.client == "gpt-fast":
            (input_pos,) = pos  # int32
            args = (input_pos, self.causal_mask[None, None, input_pos])  # [1, 1, T, L]
        elif self.client == "executorch":
            (input_pos,) = pos  # int64
            args = (input_pos, self.causal_mask[input_pos])  # [T, L]
        elif self.client == "executorch-dynamic":
            args = pos  # (input_pos,): int64 [1], the start position
        else:  # Meta: a [T, T] causal mask for the prompt at position 0, none for one token
            (start_pos,) = pos
            t = idx.shape[1]
            mask = None if t == 1 else torch.full((t, t), float("-inf")).triu(1)
            args = (start_pos, mask)
        for layer in self.layers:
            x = x + layer(x, *args)
        return self.out(x)  # [B, T, VOCAB]


CLIENTS = ("torchtune", "litgpt", "gpt-fast", "executorch", "executorch-dynamic-scalars", "llama4-reference",
           pytest.param("executorch-dynamic", marks=pytest.mark.xfail(strict=True, reason=(
               "the .item() of the start position breaks the graph between the cache write and the attention; "
               "the site stays dense (torch._dynamo.config.capture_scalar_outputs = True keeps them in one graph: "
               "the -scalars case)"))))


def position_args(client: str, start: int, t: int):
    """What the client's decode loop passes for ``t`` tokens from position ``start``."""
    if client == "torchtune":
        masks = torch.tril(torch.ones(MAX_LEN, MAX_LEN, dtype=torch.bool))[None]  # [1, L, L]
        return (masks[:, start:start + t, :] if t > 1 else masks[:, start, None, :],)
    if client == "litgpt":
        return torch.arange(start, start + t, dtype=torch.int64), start + t
    if client == "gpt-fast":
        return (torch.arange(start, start + t, dtype=torch.int32),)
    if client == "executorch":
        return (torch.arange(start, start + t, dtype=torch.int64),)
    if client == "executorch-dynamic":
        return (torch.tensor([start], dtype=torch.int64),)
    return (start,)


def reset_caches(model: Decoder) -> None:
    for layer in model.layers:
        for name in ("cache_k", "cache_v"):  # Meta's plain tensor attributes
            if isinstance(getattr(layer, name, None), torch.Tensor):
                getattr(layer, name).zero_()
    for name, b in model.named_buffers():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "cache_pos":
            b.copy_(torch.arange(MAX_LEN))
        elif leaf in ("k", "v", "k_cache", "v_cache", "cache_k", "cache_v"):
            b.zero_()


@torch.no_grad()
def decode(model: Decoder, step, tokens: torch.Tensor, reference=None) -> torch.Tensor:
    """Eager prefill of ``tokens[:, :PROMPT]``, then one ``step`` call per teacher-forced token; the decode
    logits ``[STEPS, VOCAB]``. ``reference``: options; the eager model with the reference rule instead."""
    reset_caches(model)
    model(tokens[:, :PROMPT], *position_args(model.client, 0, PROMPT))
    out = []
    for i in range(STEPS):
        pos = PROMPT + i
        args = (tokens[:, pos:pos + 1], *position_args(model.client, pos, 1))
        if reference is not None:
            with reference_sparse_attention(HQ, HKV, reference):
                out.append(model(*args)[0, -1])
        else:
            out.append(step(*args)[0, -1])
    return torch.stack(out)


def dynamo_config(client: str):
    """``-scalars``: Dynamo keeps ``.item()`` in the graph (no graph break)."""
    if client.endswith("-scalars"):
        return torch._dynamo.config.patch(capture_scalar_outputs=True)
    return contextlib.nullcontext()


def build(client: str) -> Decoder:
    """The replica, random-init."""
    torch.manual_seed(0)
    model = Decoder(client).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


TOKENS = torch.randint(0, VOCAB, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(3))


def assert_all_rewritten():
    """Every decode site of every compiled graph is rewritten: ``LAYERS`` per decode graph, none dense."""
    rep = tc.explain()
    decode_graphs = [g for g in rep.graphs if any(s["status"] != "prefill" for s in g["sites"])]
    assert decode_graphs, rep
    assert tc.counters["dense"] == 0, rep
    assert tc.counters["rewritten"] == LAYERS * len(decode_graphs), rep
    assert tc.counters["cache_writes_rewritten"] >= LAYERS * len(decode_graphs), rep


@pytest.fixture(params=["native", "pytorch"])
def kernel_path(request, monkeypatch):
    """The native CPU kernel, or the PyTorch ops (what runs when the native build is unavailable, and off CPU)."""
    if request.param == "pytorch":
        from tinyserve_compile.kernels import native

        monkeypatch.setitem(native._state, "loaded", False)
        monkeypatch.setitem(native._state, "reason", "disabled by the test")
    return request.param


@pytest.mark.parametrize("client", CLIENTS)
def test_replica_matches_reference(client, kernel_path):
    model = build(client)
    eager = decode(model, model, TOKENS)
    ref = decode(model, None, TOKENS, reference=SPARSE)
    step = torch.compile(model, backend="tinyserve", options=SPARSE)
    with dynamo_config(client):
        got = decode(model, step, TOKENS)
    assert_all_rewritten()
    assert (tc.explain().native_kernel == "in use") == (kernel_path == "native"), tc.explain()
    assert tc.explain().runtime["decode_calls"] >= LAYERS * (STEPS - 1)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert (got - eager).abs().max() > 1e-2  # the selection dropped pages: not the dense answer


@pytest.mark.parametrize("client", CLIENTS)
def test_replica_dense_exact(client):
    model = build(client)
    eager = decode(model, model, TOKENS)
    step = torch.compile(model, backend="tinyserve", options=DENSE)
    with dynamo_config(client):
        got = decode(model, step, TOKENS)
    assert_all_rewritten()
    torch.testing.assert_close(got, eager, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), eager.argmax(-1))


def converted_cache_site(q, kbuf, vbuf, k, v, start):
    """Meta's idiom with a conversion that does convert: ``cache.to(torch.float64)`` is a new tensor each call."""
    kc, vc = kbuf.to(torch.float64), vbuf.to(torch.float64)
    kc[:1, start:start + 1] = k.to(torch.float64)
    vc[:1, start:start + 1] = v.to(torch.float64)
    kk = kc[:1, :start + 1].transpose(1, 2).repeat_interleave(HQ // HKV, dim=1)
    vv = vc[:1, :start + 1].transpose(1, 2).repeat_interleave(HQ // HKV, dim=1)
    return F.scaled_dot_product_attention(q.to(torch.float64), kk, vv)


def test_converting_cache_copy_stays_dense():
    """A ``.to()`` that converts is a copy, not the cache: the site stays dense with its reason, and is exact."""
    g = torch.Generator().manual_seed(5)
    kbuf, vbuf = torch.randn(2, MAX_LEN, HKV, HD, generator=g), torch.randn(2, MAX_LEN, HKV, HD, generator=g)
    q = torch.randn(1, HQ, 1, HD, generator=g)
    k, v = torch.randn(1, 1, HKV, HD, generator=g), torch.randn(1, 1, HKV, HD, generator=g)
    want = converted_cache_site(q, kbuf.clone(), vbuf.clone(), k, v, 40)
    got = torch.compile(converted_cache_site, backend="tinyserve", options=SPARSE)(q, kbuf.clone(), vbuf.clone(),
                                                                                  k, v, 40)
    assert tc.counters["rewritten"] == 0 and tc.counters["dense"] == 1, tc.explain()
    assert "to" in tc.explain().dense_reasons[0], tc.explain()
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
