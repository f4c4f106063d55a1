"""Caches in other layouts: ``[B, L, H, D]`` buffers (Meta's reference Llama, flash-attention-style code),
written along dim 1 and transposed for SDPA, are rewritten and match the sparse reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tinyserve_compile as tc
from tests.support.backend_helpers import prompt, worst
from tests.support.backend_models import VOCAB
from tinyserve_compile.kernels.reference import page_bounds
from tinyserve_compile.kernels.spec import SelectionSpec
from tinyserve_compile.runtime import state_for
from tinyserve_compile.testing import reference_sparse_attention

DIM, HQ, HKV, HD = 64, 4, 2, 16
OPTS = {"token_budget": 16, "page_size": 8, "candidate_extra": 16, "dense_layers": 1}


def meta_repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Meta's ``repeat_kv`` on ``[B, L, Hkv, D]``: ``[B, L, Hkv * n_rep, D]``."""
    bs, slen, n_kv, hd = x.shape
    return x[:, :, :, None, :].expand(bs, slen, n_kv, n_rep, hd).reshape(bs, slen, n_kv * n_rep, hd)


class BLHDAttention(nn.Module):
    """Attention over ``[max_batch, max_len, Hkv, D]`` caches, in one of three idioms.

    ``meta``: ``cache[:b, start:start + n] = k``, reads ``cache[:b, :start + n]``,
    Meta's ``repeat_kv``, no mask in decode. ``index``: ``cache[:, pos] = k``, reads
    the whole cache through ``repeat_interleave`` on the head dim, with a mask.
    ``gqa``: ``cache.index_copy_(1, pos, k)``, ``enable_gqa=True``, with a mask.
    """

    def __init__(self, idiom: str, max_batch: int, max_len: int):
        super().__init__()
        self.idiom = idiom
        self.wq = nn.Linear(DIM, HQ * HD, bias=False)
        self.wk = nn.Linear(DIM, HKV * HD, bias=False)
        self.wv = nn.Linear(DIM, HKV * HD, bias=False)
        self.wo = nn.Linear(HQ * HD, DIM, bias=False)
        self.register_buffer("cache_k", torch.zeros(max_batch, max_len, HKV, HD), persistent=False)
        self.register_buffer("cache_v", torch.zeros(max_batch, max_len, HKV, HD), persistent=False)

    def forward(self, x, start, mask):
        b, n, _ = x.shape
        q = self.wq(x).view(b, n, HQ, HD)
        k = self.wk(x).view(b, n, HKV, HD)
        v = self.wv(x).view(b, n, HKV, HD)
        if self.idiom == "meta":
            self.cache_k[:b, start:start + n] = k
            self.cache_v[:b, start:start + n] = v
            keys = meta_repeat_kv(self.cache_k[:b, :start + n], HQ // HKV).transpose(1, 2)
            vals = meta_repeat_kv(self.cache_v[:b, :start + n], HQ // HKV).transpose(1, 2)
            y = F.scaled_dot_product_attention(q.transpose(1, 2), keys, vals, attn_mask=mask)
        elif self.idiom == "index":
            self.cache_k[:, start] = k
            self.cache_v[:, start] = v
            keys = self.cache_k.repeat_interleave(HQ // HKV, dim=2).transpose(1, 2)
            vals = self.cache_v.repeat_interleave(HQ // HKV, dim=2).transpose(1, 2)
            y = F.scaled_dot_product_attention(q.transpose(1, 2), keys, vals, attn_mask=mask)
        else:
            self.cache_k.index_copy_(1, start, k)
            self.cache_v.index_copy_(1, start, v)
            y = F.scaled_dot_product_attention(q.transpose(1, 2), self.cache_k.transpose(1, 2),
                                               self.cache_v.transpose(1, 2), attn_mask=mask, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(b, n, -1))


class BLHDModel(nn.Module):
    """``forward(idx, start) -> logits``; ``start`` is an int (``meta``) or int64 positions ``[n]``."""

    def __init__(self, idiom: str, n_layer: int = 3, max_batch: int = 3, max_len: int = 128):
        super().__init__()
        self.idiom, self.max_len = idiom, max_len
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(BLHDAttention(idiom, max_batch, max_len) for _ in range(n_layer))
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)), persistent=False)

    def forward(self, idx, start):
        x = self.emb(idx)
        n = idx.shape[1]
        if self.idiom == "meta":  # Meta: no mask for one token; a causal [n, start + n] mask for a prompt
            mask = None if n == 1 else torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
        else:
            mask = self.causal[None, None, start]  # [1, 1, n, max_len]
        for layer in self.layers:
            x = x + layer(x, start, mask)
        return self.out(x)


def _model(idiom, seed=0):
    """Meta's caches hold more rows (3) than the batch decoded (2); the others exactly the batch."""
    torch.manual_seed(seed)
    return BLHDModel(idiom, max_batch=3 if idiom == "meta" else 2).eval()


def _start(model, pos: int, n: int = 1):
    return pos if model.idiom == "meta" else torch.arange(pos, pos + n)


@torch.no_grad()
def _decode(model, step, batch=2, n_prompt=60, n_new=6, reference=None, prefill=None, after_step=None):
    """Prefill (eager, or through ``prefill``), then ``n_new`` greedy steps; logits ``[n_new, B, V]``."""
    for layer in model.layers:
        layer.cache_k.zero_()
        layer.cache_v.zero_()
    ids = prompt(n_prompt, batch=batch, seed=3)
    logits = (prefill if prefill is not None else model)(ids, _start(model, 0, n_prompt))
    tok, out = logits[:, -1:].argmax(-1), []
    for i in range(n_new):
        start = _start(model, n_prompt + i)
        if reference is not None:
            with reference_sparse_attention(HQ, HKV, reference):
                lg = model(tok, start)
        else:
            lg = step(tok, start)
        out.append(lg[:, -1])
        tok = lg[:, -1:].argmax(-1)
        if after_step is not None:
            after_step(i)
    return torch.stack(out)


def test_meta_reference_style_dynamic_start_matches_reference_without_recompiles():
    """``cache[:b, start:start + n] = k`` into ``[3, 128, Hkv, D]`` caches used at batch 2, read as
    ``cache[:b, :start + n]``; the start position becomes dynamic after the first step, then no recompile."""
    model = _model("meta")
    opts = dict(OPTS, lower="eager")
    ref = _decode(model, None, reference=opts)
    graphs = []
    compiled = torch.compile(model, backend="tinyserve", options=opts)
    got = _decode(model, compiled, n_new=8, after_step=lambda i: graphs.append(tc.counters["graphs"]))[:6]
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-4), worst(got, ref)
    assert graphs[1] == graphs[-1] == 2, f"graphs compiled after each step: {graphs}"
    rep = tc.explain()
    dynamic = rep.graphs[-1]["sites"]  # the first of dense_layers=1 is rewritten too, and attends densely at run time
    assert [s["status"] for s in dynamic] == ["sparse"] * 3, rep
    assert all(s.get("layout") == "[B, L, Hkv, D]" for s in dynamic), dynamic
    rt = rep.runtime
    assert (rt["decode_calls"], rt["dense_layer_calls"]) == (2 * 8, 8), rt
    dense = _decode(model, model)
    assert not torch.allclose(got, dense, atol=1e-4), "budget 16 of 60+ tokens should change the logits"


@pytest.mark.parametrize("idiom, lower", [("meta", "eager"), ("index", "eager"), ("gqa", "eager"),
                                          ("meta", "inductor")])
def test_blhd_cache_matches_sparse_reference(idiom, lower):
    model = _model(idiom, seed=1)
    opts = dict(OPTS, lower=lower)
    ref = _decode(model, None, reference=opts, n_new=4)
    compiled = torch.compile(model, backend="tinyserve", options=opts)
    got = _decode(model, compiled, n_new=4)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), worst(got, ref)
    assert tc.counters["rewritten"] >= 3, tc.explain()
    assert tc.explain().runtime["decode_calls"] == 4 * 2


@pytest.mark.parametrize("idiom", ["meta", "index"])
def test_blhd_bounds_follow_writes_and_foreign_writes(idiom):
    """Eager lowering: the bounds of the ``[B, Hkv, L, D]`` view are maintained page by page, equal a
    rebuild, and an eager write into the buffer between steps is noticed (the next step matches the
    reference run on the same edited cache)."""
    model = _model(idiom, seed=2)
    opts = dict(OPTS, lower="eager")

    def edit(i):  # overwrite an old position of every cache, behind the graph's back, after step 2
        if i == 2:
            for layer in model.layers:
                layer.cache_k[:, 5] = 3.0
    ref = _decode(model, None, reference=opts, after_step=edit)
    got = _decode(model, torch.compile(model, backend="tinyserve", options=opts), after_step=edit)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-4), worst(got, ref)
    rt = tc.explain().runtime
    assert rt["bounds_updates"] > 0 and rt["foreign_writes"] >= 2, rt
    rows = 2 if idiom == "meta" else None
    for layer in model.layers[1:]:
        view = layer.cache_k[:2].permute(0, 2, 1, 3)  # [B, Hkv, L, D]
        st = state_for(layer.cache_k, 8, perm=(0, 2, 1, 3), rows=rows)
        assert not st.stale and st.bounds.kmax.shape[0] == 2
        fresh = page_bounds(view, 8, dtype=st.bounds.kmax.dtype)
        assert torch.equal(st.bounds.kmax, fresh.kmax) and torch.equal(st.bounds.kmin, fresh.kmin)


def test_compiled_prefill_writes_through_the_view():
    """A prompt through the compiled model (prefill stays dense) writes the ``[B, L, H, D]`` cache through the
    bounds-keeping op; the decode steps after it match the reference."""
    model = _model("index", seed=4)
    opts = dict(OPTS, lower="eager")
    ref = _decode(model, None, reference=opts, n_new=4)
    compiled = torch.compile(model, backend="tinyserve", options=opts)
    got = _decode(model, compiled, prefill=compiled, n_new=4)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-4), worst(got, ref)
    assert tc.counters["prefill_sites"] == 3 and tc.counters["cache_writes_rewritten"] >= 2, tc.explain()


@pytest.mark.parametrize("candidate_factor", [1, 4])
@pytest.mark.parametrize("masked", [False, True])
def test_op_reads_strided_caches(candidate_factor, masked):
    """``tinyserve::sparse_decode`` on a permuted (non-contiguous) cache view equals the contiguous copy."""
    g = torch.Generator().manual_seed(5)
    B, L, S = 2, 96, 8
    kbuf, vbuf = torch.randn(B, L, HKV, HD, generator=g), torch.randn(B, L, HKV, HD, generator=g)
    q = torch.randn(B, HQ, 1, HD, generator=g)
    k, v = kbuf.permute(0, 2, 1, 3), vbuf.permute(0, 2, 1, 3)
    assert not k.is_contiguous()
    vl = torch.tensor([77])
    mask = (torch.arange(L) < 77)[None, None, None].expand(B, 1, 1, L) if masked else None
    bounds = page_bounds(k, S)
    ctrl = torch.zeros(2, dtype=torch.int32)
    args = (vl, mask, 0.25, SelectionSpec(S, 24, 1, candidate_factor, 0, False, torch.float32).to_list(), "torch", ctrl)
    got = torch.ops.tinyserve.sparse_decode(q, k, v, *bounds, *args)
    want = torch.ops.tinyserve.sparse_decode(q, k.contiguous(), v.contiguous(), *bounds, *args)
    assert torch.allclose(got, want, atol=1e-6), worst(got, want)


def _attend_all(q, kc, vc, k, v, pos, mask):
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("mask_kind", ["none", "all", "causal"])
def test_valid_length_is_what_dense_attends(mask_kind):
    """The keys a rewritten site attends are the ones dense SDPA would: every key without a mask, up to the
    newest one the mask allows with one, not just up to the newest write (here position 40 of 64)."""
    g = torch.Generator().manual_seed(6)
    L = 64
    kc, vc = torch.randn(1, HKV, L, HD, generator=g), torch.randn(1, HKV, L, HD, generator=g)
    q, k, v = (torch.randn(1, h, 1, HD, generator=g) for h in (HQ, HKV, HKV))
    pos = torch.tensor([40])
    mask = {"none": None, "all": torch.ones(1, 1, 1, L, dtype=torch.bool),
            "causal": (torch.arange(L) <= 40)[None, None, None]}[mask_kind]
    args = lambda: (q, kc.clone(), vc.clone(), k, v, pos, mask)  # noqa: E731
    dense = _attend_all(*args())
    for budget in (256, 16):  # every page kept (exactly dense), then a real selection
        opts = {"dense_layers": 0, "token_budget": budget, "page_size": 8, "lower": "eager"}
        with reference_sparse_attention(HQ, HKV, opts):
            ref = _attend_all(*args())
        torch._dynamo.reset()
        got = torch.compile(_attend_all, backend="tinyserve", options=opts)(*args())
        assert tc.counters["rewritten"] >= 1, tc.explain()
        assert torch.allclose(got, ref, atol=1e-5), f"budget {budget}: {worst(got, ref)}"
        if budget == 256:
            assert torch.allclose(got, dense, atol=1e-5), worst(got, dense)
