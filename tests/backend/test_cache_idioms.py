"""Cache idioms of third-party decode loops: positions of any integer dtype and shape, the in-place write's
return value used as K/V, writes through slice views and negative dims, and K/V read as a ``[:n]`` prefix of
the cache with a mask exactly as long as the keys read.

Each form is rewritten (the counters say so: without the feature the site stays dense and the count is 0),
matches the pure-PyTorch sparse reference with a small budget, and equals eager attention with a budget that
covers the context.
"""
from __future__ import annotations

import math

import pytest
from unittest import mock
import torch
import torch.nn as nn
import torch.nn.functional as F

import tinyserve_compile as tc
from tests.support.backend_helpers import hf_decode, prompt, worst
from tests.support.kernel_checks import cache_write_path
from tests.support.backend_models import VOCAB, gpt_fast_model
from tinyserve_compile import runtime
from tinyserve_compile.testing import reference_sparse_attention

HQ, HKV, HD = 4, 2, 16
G = HQ // HKV
L = 64  #: cache length of the function-level cases
#: two extra candidate pages: rows of more than 4 pages are sparse (a row of at most N1 pages attends densely)
SMALL = {"dense_layers": 0, "token_budget": 16, "page_size": 8, "candidate_extra": 16, "lower": "eager"}
COVER = dict(SMALL, token_budget=256)  #: every page kept: exactly dense


# ---------------------------------------------------------------------------------------------------------------
# one attention site per form: (q, kbuf, vbuf, k, v, pos, mask) -> [B, Hq, 1, D]
def litgpt_site(q, kbuf, vbuf, k, v, pos, mask, n=None):
    """litgpt's KVCache: ``k = self.k[:bs, ...].index_copy_(-2, pos, k)`` is K; with ``input_pos_maxp1`` = n,
    K, V and the mask are sliced to ``[..., :n]``; GQA through ``repeat_interleave``."""
    bs = k.size(0)
    kk = kbuf[:bs, ...].index_copy_(-2, pos, k)
    vv = vbuf[:bs, ...].index_copy_(-2, pos, v)
    if n is not None:
        kk, vv, mask = kk[..., :n, :], vv[..., :n, :], mask[..., :n]
    kk, vv = kk.repeat_interleave(G, dim=1), vv.repeat_interleave(G, dim=1)
    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=1.0 / math.sqrt(HD), is_causal=False)


def setitem_site(q, kbuf, vbuf, k, v, pos, mask):
    """gpt-fast's ``k_cache[:, :, input_pos] = k``."""
    kbuf[:, :, pos] = k
    vbuf[:, :, pos] = v
    return F.scaled_dot_product_attention(q, kbuf, vbuf, attn_mask=mask, enable_gqa=True)


def negative_dim_site(q, kbuf, vbuf, k, v, pos, mask):
    """``index_copy_`` along dim -2, the cache read as the buffer itself."""
    kbuf.index_copy_(-2, pos, k)
    vbuf.index_copy_(-2, pos, v)
    return F.scaled_dot_product_attention(q, kbuf, vbuf, attn_mask=mask, enable_gqa=True)


def prefix_view_site(q, kbuf, vbuf, k, v, pos, mask, n):
    """The write goes through the ``[..., :n, :]`` view that is then read, with the mask cut to n."""
    kk, vv = kbuf[..., :n, :], vbuf[..., :n, :]
    kk.index_copy_(2, pos, k)
    vv.index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask[..., :n], enable_gqa=True)


def transposed_setitem_site(q, kbuf, vbuf, k, v, pos, mask):
    """A ``[B, L, Hkv, D]`` cache written through its ``transpose(1, 2)`` view at dim -2 (the sequence dim)."""
    kbuf.transpose(1, 2)[..., pos, :] = k
    vbuf.transpose(1, 2)[..., pos, :] = v
    return F.scaled_dot_product_attention(q, kbuf.transpose(1, 2), vbuf.transpose(1, 2), attn_mask=mask,
                                          enable_gqa=True)


def _case(seed, cache_rows=1, blhd=False, pos_at=40, batch=1):
    """Random caches (``[rows, Hkv, L, D]`` or ``[rows, L, Hkv, D]``), one new token at ``pos_at``, a causal mask
    with a hole (so the ops read the mask itself, not only the valid length)."""
    g = torch.Generator().manual_seed(seed)
    shape = (cache_rows, L, HKV, HD) if blhd else (cache_rows, HKV, L, HD)
    kbuf, vbuf = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    q = torch.randn(batch, HQ, 1, HD, generator=g)
    k, v = torch.randn(batch, HKV, 1, HD, generator=g), torch.randn(batch, HKV, 1, HD, generator=g)
    t = torch.arange(L)
    mask = ((t <= pos_at) & ((t < 8) | (t >= 12)))[None, None, None]  # [1, 1, 1, L]: causal, keys 8-11 hidden
    return q, kbuf, vbuf, k, v, mask


def _check(fn, args, extra=(), expect_sites=1):
    """Compiled ``fn`` equals the sparse reference (budget 16) and eager (budget covering L), with a rewritten site."""
    def fresh():
        return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args) + tuple(extra)

    dense = fn(*fresh())
    for opts in (SMALL, COVER):
        with reference_sparse_attention(HQ, HKV, opts):
            ref = fn(*fresh())
        torch._dynamo.reset()
        tc.reset()
        got = torch.compile(fn, backend="tinyserve", options=opts)(*fresh())
        assert tc.counters["rewritten"] == expect_sites, tc.explain()
        assert torch.allclose(got, ref, atol=1e-5), f"{opts['token_budget']}: {worst(got, ref)}"
        if opts is COVER:
            assert torch.allclose(got, dense, atol=1e-5), worst(got, dense)
        else:
            assert not torch.allclose(got, dense, atol=1e-4), "budget 16 of 37 keys should change the output"


@pytest.mark.parametrize("form, pos", [
    ("setitem", torch.tensor([40], dtype=torch.int32)),  # gpt-fast's decode positions
    ("setitem", torch.tensor([40], dtype=torch.int64)),
    ("index_copy_", torch.tensor(40)),  # 0-d (index_copy_ itself takes int64 only)
    ("index_copy_", torch.tensor([40])),
])
def test_positions_of_any_integer_dtype_and_shape(form, pos):
    """(A 0-d tensor used as a ``setitem`` index is read with ``.item()`` by Dynamo: a graph break before the
    write, so that form cannot reach a graph with its write; ``index_copy_`` takes it.)"""
    q, kbuf, vbuf, k, v, mask = _case(0)
    _check(setitem_site if form == "setitem" else negative_dim_site, (q, kbuf, vbuf, k, v, pos, mask))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_batched_rows_share_positions(dtype):
    """Two rows written at the same position (a ``[1]`` position shared by the batch of 2)."""
    q, kbuf, vbuf, k, v, mask = _case(1, cache_rows=2, batch=2)
    _check(setitem_site, (q, kbuf, vbuf, k, v, torch.tensor([40], dtype=dtype), mask))


@pytest.mark.parametrize("cache_rows", [1, 2])
@pytest.mark.parametrize("prefix", [False, True])
def test_litgpt_index_copy_result_read_as_kv(cache_rows, prefix):
    """litgpt's form, with the cache holding as many rows as the batch or more (``[:bs]`` of 2), read whole or
    as the ``[:n]`` prefix with the mask cut to n (``input_pos_maxp1``)."""
    q, kbuf, vbuf, k, v, mask = _case(2, cache_rows=cache_rows)
    _check(litgpt_site, (q, kbuf, vbuf, k, v, torch.tensor([40]), mask), extra=(41,) if prefix else ())


def test_negative_dim_write():
    q, kbuf, vbuf, k, v, mask = _case(3)
    _check(negative_dim_site, (q, kbuf, vbuf, k, v, torch.tensor([40]), mask))


def test_write_through_prefix_view_read_with_prefix_mask():
    q, kbuf, vbuf, k, v, mask = _case(4)
    _check(prefix_view_site, (q, kbuf, vbuf, k, v, torch.tensor([40]), mask, 41))


def test_write_through_transposed_view_of_blhd_cache():
    q, kbuf, vbuf, k, v, mask = _case(5, blhd=True)
    _check(transposed_setitem_site, (q, kbuf, vbuf, k, v, torch.tensor([40]), mask))


# ---------------------------------------------------------------------------------------------------------------
# litgpt: KVCache + CausalSelfAttention + GPT.forward(idx, input_pos, input_pos_maxp1) + generate's step loop
class LitKVCache(nn.Module):
    """``(batch, n_query_groups, max_seq_length, head_size)`` buffers; ``forward`` returns the written buffers."""

    def __init__(self, batch, max_len):
        super().__init__()
        self.register_buffer("k", torch.zeros(batch, HKV, max_len, HD), persistent=False)
        self.register_buffer("v", torch.zeros(batch, HKV, max_len, HD), persistent=False)

    def forward(self, input_pos, k, v):
        bs = k.size(0)
        k = self.k[:bs, ...].index_copy_(-2, input_pos, k)
        v = self.v[:bs, ...].index_copy_(-2, input_pos, v)
        return k, v


class LitAttention(nn.Module):
    def __init__(self, dim, batch, max_len):
        super().__init__()
        self.qkv = nn.Linear(dim, (HQ + 2 * HKV) * HD, bias=False)
        self.proj = nn.Linear(HQ * HD, dim, bias=False)
        self.kv_cache = LitKVCache(batch, max_len)

    def forward(self, x, mask, input_pos, input_pos_maxp1):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split((HQ * HD, HKV * HD, HKV * HD), dim=-1)
        q = q.view(B, T, HQ, HD).transpose(1, 2)
        k = k.view(B, T, HKV, HD).transpose(1, 2)
        v = v.view(B, T, HKV, HD).transpose(1, 2)
        k, v = self.kv_cache(input_pos, k, v)
        if input_pos_maxp1 is not None:
            k = k[..., :input_pos_maxp1, :]
            v = v[..., :input_pos_maxp1, :]
        k = k.repeat_interleave(G, dim=1)
        v = v.repeat_interleave(G, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=1.0 / math.sqrt(HD),
                                           is_causal=mask is None)
        return self.proj(y.transpose(1, 2).reshape(B, T, HQ * HD))


class LitGPT(nn.Module):
    """``forward(idx, input_pos, input_pos_maxp1=None)``: the mask is ``index_select`` of a bool mask cache at
    ``input_pos`` (dim 2), cut to ``[..., :input_pos_maxp1]`` when that is given."""

    def __init__(self, n_layer=3, dim=64, batch=1, max_len=96):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, dim)
        self.wpe = nn.Embedding(max_len, dim)
        self.h = nn.ModuleList(LitAttention(dim, batch, max_len) for _ in range(n_layer))
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        self.register_buffer("mask_cache", torch.ones(max_len, max_len, dtype=torch.bool).tril()[None, None],
                             persistent=False)

    def forward(self, idx, input_pos, input_pos_maxp1=None):
        mask = torch.index_select(self.mask_cache, 2, input_pos)
        if input_pos_maxp1 is not None:
            mask = mask[..., :input_pos_maxp1]
        x = self.wte(idx) + torch.index_select(self.wpe.weight, 0, input_pos)[None]
        for block in self.h:
            x = x + block(x, mask, input_pos, input_pos_maxp1)
        return self.lm_head(x)


@torch.no_grad()
def litgpt_generate(model, step, n_prompt=40, n_new=6, use_maxp1=True, reference=None):
    """litgpt's generate loop: a prompt at ``arange(T)``, then ``input_pos = tensor([T])``, ``input_pos.add_(1)``
    and ``input_pos_maxp1 += 1`` per token. Logits ``[n_new, 1, V]``."""
    for blk in model.h:
        blk.kv_cache.k.zero_()
        blk.kv_cache.v.zero_()
    ids = prompt(n_prompt, seed=7)
    input_pos = torch.arange(0, n_prompt, dtype=torch.int64)
    maxp1 = n_prompt if use_maxp1 else None
    tok = model(ids, input_pos, maxp1)[:, -1:].argmax(-1)
    input_pos = torch.tensor([n_prompt], dtype=torch.int64)
    out = []
    for _ in range(n_new):
        n = input_pos_maxp1 = (maxp1 + 1 if use_maxp1 else None)
        if reference is not None:
            with reference_sparse_attention(HQ, HKV, reference):
                lg = model(tok, input_pos, n)
        else:
            lg = step(tok, input_pos, n)
        out.append(lg[:, -1])
        tok = lg[:, -1:].argmax(-1)
        input_pos.add_(1)
        if use_maxp1:
            maxp1 = input_pos_maxp1
    return torch.stack(out)


@pytest.mark.parametrize("use_maxp1, lower", [(True, "eager"), (False, "eager"), (True, "inductor")])
def test_litgpt_generate_matches_reference_and_dense(use_maxp1, lower):
    """Every layer of litgpt's cache is rewritten (the ``[:n]`` prefix grows each step: one dynamic recompile),
    the logits match the sparse reference, and a budget covering the context equals eager."""
    torch.manual_seed(0)
    model = LitGPT().eval()
    opts = {"token_budget": 16, "page_size": 8, "candidate_extra": 16, "dense_layers": 1, "lower": lower}
    ref = litgpt_generate(model, None, use_maxp1=use_maxp1, reference=opts)
    compiled = torch.compile(model, backend="tinyserve", options=opts)
    got = litgpt_generate(model, compiled, use_maxp1=use_maxp1)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), worst(got, ref)
    rep = tc.explain()
    last = rep.graphs[-1]["sites"]
    assert [s["status"] for s in last] == ["sparse"] * 3, rep
    assert rep.runtime["decode_calls"] == 2 * 6, rep.runtime
    assert tc.counters["graphs"] == (2 if use_maxp1 else 1), "one static graph, then one with a dynamic n"
    eager = litgpt_generate(model, model, use_maxp1=use_maxp1)
    assert not torch.allclose(got, eager, atol=1e-4), "budget 16 of 40+ tokens should change the logits"
    torch._dynamo.reset()
    tc.reset()
    cover = torch.compile(model, backend="tinyserve", options=dict(opts, token_budget=256, lower="eager"))
    dense = litgpt_generate(model, cover, use_maxp1=use_maxp1)
    assert torch.allclose(dense, eager, atol=1e-4, rtol=1e-4), worst(dense, eager)
    assert tc.counters["rewritten"] >= 3, tc.explain()


# ---------------------------------------------------------------------------------------------------------------
# gpt-fast: generate() prefills at int64 arange(T), then decodes at input_pos = tensor([T], dtype=torch.int)
@torch.no_grad()
def gpt_fast_generate(model, step, n_prompt=40, n_new=5, reference=None):
    for layer in model.layers:
        layer.k_cache.zero_()
        layer.v_cache.zero_()
    ids = prompt(n_prompt, seed=8)
    tok = model(ids, torch.arange(0, n_prompt))[:, -1:].argmax(-1)
    input_pos = torch.tensor([n_prompt], dtype=torch.int)
    out = []
    for _ in range(n_new):
        if reference is not None:
            with reference_sparse_attention(4, model.n_kv, reference):
                lg = model(tok, input_pos)
        else:
            lg = step(tok, input_pos)
        out.append(lg[:, -1])
        tok = lg[:, -1:].argmax(-1)
        input_pos += 1
    return torch.stack(out)


@pytest.mark.parametrize("path", ["native", "torch"])
def test_gpt_fast_int32_input_pos(path):
    """gpt-fast's int32 ``input_pos`` through the native write op and through ``tinyserve::cache_write``'s PyTorch
    path (what every device without a kernel of its own runs), which once required int64 positions."""
    from tinyserve_compile.kernels import bounds as bounds_mod

    model = gpt_fast_model(seed=3)
    opts = {"token_budget": 16, "page_size": 8, "candidate_extra": 16, "dense_layers": 1, "lower": "eager", "kernel": path}
    ref = gpt_fast_generate(model, None, reference=opts)
    calls = []
    torch_path = bounds_mod.CACHE_WRITE_IMPLS["torch"]
    with mock.patch.dict(bounds_mod.CACHE_WRITE_IMPLS, torch=lambda *a: calls.append(1) or torch_path(*a)), \
            cache_write_path(path):
        compiled = torch.compile(model, backend="tinyserve", options=opts)
        got = gpt_fast_generate(model, compiled)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), worst(got, ref)
    assert tc.counters["rewritten"] == 4, tc.explain()
    assert tc.counters["native_sites" if path == "native" else "python_op_sites"] == 4, tc.counters
    assert (len(calls) > 0) == (path == "torch"), len(calls)  # the write ran through the path under test


@pytest.mark.parametrize("impl", ["native", "torch"])
def test_cache_write_op_takes_any_integer_positions(impl):
    """``tinyserve::cache_write`` writes int32, int64, 0-d and ``[1]`` positions alike; float positions are an
    error naming the argument."""
    from tinyserve_compile.kernels import bounds as bounds_mod
    from tinyserve_compile.kernels.reference import page_bounds
    from tinyserve_compile.kernels.spec import SelectionSpec

    spec = SelectionSpec.default(page_size=8, bounds_dtype=torch.float32).to_list()
    g = torch.Generator().manual_seed(9)
    cache = torch.randn(2, HKV, 32, HD, generator=g)
    src = torch.randn(2, HKV, 1, HD, generator=g)
    want = cache.clone()
    want[:, :, 13] = src[:, :, 0]
    calls = []
    torch_path = bounds_mod.CACHE_WRITE_IMPLS["torch"]
    with mock.patch.dict(bounds_mod.CACHE_WRITE_IMPLS, torch=lambda *a: calls.append(1) or torch_path(*a)), \
            cache_write_path(impl):
        for pos in (torch.tensor(13, dtype=torch.int32), torch.tensor([13], dtype=torch.int32), torch.tensor([13]),
                    torch.tensor(13, dtype=torch.int16)):
            c = cache.clone()
            b = page_bounds(c, 8)
            ctrl = torch.zeros(2, dtype=torch.int32)
            torch.ops.tinyserve.cache_write(c, *b, ctrl, pos, src, spec)
            assert torch.equal(c, want), pos
            fresh = page_bounds(c, 8)
            assert torch.equal(b.kmax, fresh.kmax) and torch.equal(b.kmin, fresh.kmin), pos
        with pytest.raises(ValueError, match="positions"):
            torch.ops.tinyserve.cache_write(cache.clone(), *page_bounds(cache, 8), torch.zeros(2, dtype=torch.int32),
                                            torch.tensor([13.0]), src, spec)
    assert len(calls) == (5 if impl == "torch" else 0), len(calls)  # the write ran through the path under test




def two_layer_site(q, kbuf, vbuf, k, v, pos, mask, kbuf2, vbuf2):
    """Two attention layers reading one mask (as every layer of an HF model reads its decode mask)."""
    o = setitem_site(q, kbuf, vbuf, k, v, pos, mask)
    return setitem_site(o, kbuf2, vbuf2, k, v, pos, mask)


def test_sites_reading_one_mask_share_one_valid_length():
    q, kbuf, vbuf, k, v, mask = _case(4)
    kbuf2, vbuf2 = kbuf.flip(2).contiguous(), vbuf.flip(2).contiguous()
    _check(two_layer_site, (q, kbuf, vbuf, k, v, torch.tensor([40]), mask), extra=(kbuf2, vbuf2), expect_sites=2)
    graphs = []
    real = tc.backend.record_graph
    torch._dynamo.reset()
    tc.reset()
    with mock.patch.object(tc.backend, "record_graph", lambda gm, *rest: (graphs.append(gm), real(gm, *rest))):
        torch.compile(two_layer_site, backend="tinyserve", options=SMALL)(
            q, kbuf.clone(), vbuf.clone(), k, v, torch.tensor([40]), mask, kbuf2.clone(), vbuf2.clone())
    (gm,) = graphs
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.tinyserve.sparse_decode.default]
    amax = [n for n in gm.graph.nodes if n.target is torch.ops.aten.amax.default]
    assert len(calls) == 2 and len(amax) == 1, gm.graph  # one reduction of the shared mask, not one per site
    assert calls[0].args[6] is calls[1].args[6]  # the same valid length node feeds both sites


def _op_call_args(code: str, op: str) -> list:
    """The argument lists (as source strings) of every call of ``op`` in Inductor's generated wrapper code."""
    calls = []
    for start in [i + len(op) + 1 for i in range(len(code)) if code.startswith(op + "(", i)]:
        args, depth, cur = [], 0, ""
        for ch in code[start:]:
            if ch == ")" and depth == 0:
                break
            depth += ch in "([{"
            depth -= ch in ")]}"
            if ch == "," and depth == 0:
                args.append(cur.strip())
                cur = ""
            else:
                cur += ch
        calls.append(args + [cur.strip()])
    return calls


@pytest.mark.parametrize("batch", [1, 2])
def test_inductor_copies_a_shared_decode_mask_once_not_once_per_site(batch):
    """HF's decode mask is a view that every layer reads; Inductor materialized it once per rewritten site (30
    copies of the mask per SmolLM2 step). Every site now reads one buffer, and the tokens match eager."""
    from torch._inductor.utils import run_and_get_code
    from tests.support.backend_models import hf_model

    model = hf_model("llama")
    ids = prompt(40, batch=batch)
    mask = torch.ones(batch, 40, dtype=torch.long)
    mask[1:, :7] = 0  # the second row is left padded
    kw = {"attention_mask": mask} if batch > 1 else {}
    want, want_logits, _ = hf_decode(model, model, ids, 3, **kw)
    torch._dynamo.reset()
    tc.reset()
    step = torch.compile(model, backend="tinyserve", options={"dense_layers": 0, "token_budget": 512, "page_size": 8})
    (got, logits, _), code = run_and_get_code(hf_decode, model, step, ids, 3, **kw)
    calls = [_op_call_args(c, "torch.ops.tinyserve.sparse_decode.default") for c in code]
    calls = [c for c in calls if c]  # per compiled graph (the growing 2D mask recompiles once, dynamic)
    assert tc.counters["rewritten"] == 4 * len(calls) and all(len(c) == 4 for c in calls), tc.explain()
    for c in calls:
        assert len({args[7] for args in c}) == 1, c  # one mask buffer for the four sites
    assert torch.equal(got, want)
    torch.testing.assert_close(logits, want_logits, atol=2e-4, rtol=1e-4)
