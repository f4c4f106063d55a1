"""Compact (bf16, outward-rounded) page bounds stay true upper bounds."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyserve_compile.kernels.bounds import allocate_bounds, rebuild_bounds_, update_bounds_
from tinyserve_compile.kernels.reference import (
    page_bounds,
    page_scores,
    round_down_bf16,
    round_up_bf16,
)


def test_outward_rounding_brackets_every_value():
    x = torch.cat([torch.randn(100_000) * 10.0 ** torch.randint(-30, 30, (100_000,)).float(),
                   torch.tensor([0.0, -0.0, 1.0, -1.0, 3.0e38, -3.0e38, 1e-40, -1e-40])])
    up, down = round_up_bf16(x), round_down_bf16(x)
    assert up.dtype == down.dtype == torch.bfloat16
    assert (up.float() >= x).all() and (down.float() <= x).all()
    # the tightest such values: one bf16 step inward crosses x (or they are exact)
    exact = up.float() == x
    assert torch.equal(exact, down.float() == x)
    inner_up = torch.nextafter(up.float(), torch.tensor(-float("inf"))).to(torch.bfloat16)
    assert (exact | (round_up_bf16(inner_up.float()).float() <= up.float())).all()
    # against round-to-nearest: never more than one bf16 step apart
    near = x.to(torch.bfloat16).float()
    assert ((up.float() == near) | (down.float() == near)).all()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), page_size=st.sampled_from([1, 3, 8, 16]), L=st.integers(1, 70),
       scale_exp=st.integers(-20, 20), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_bf16_bound_scores_are_upper_bounds(seed, page_size, L, scale_exp, dtype):
    g = torch.Generator().manual_seed(seed)
    B, Hq, Hkv, D = 2, 6, 3, 16
    if dtype == torch.float16:
        scale_exp = scale_exp * 6 // 20  # fp16 keys overflow past ~2^15; queries underflow below ~2^-14
    mag = 2.0 ** scale_exp
    k = (torch.randn(B, Hkv, L, D, generator=g) * mag).to(dtype)
    q = (torch.randn(B, Hq, 1, D, generator=g) / mag).to(dtype)
    scale = D ** -0.5
    b16 = page_bounds(k, page_size, dtype=torch.bfloat16)
    b32 = page_bounds(k, page_size)
    assert b16.kmax.dtype == torch.bfloat16 and b16.kabs.dtype == torch.float32
    assert (b16.kmax.float() >= b32.kmax).all() and (b16.kmin.float() <= b32.kmin).all()
    s = page_scores(q, b16, scale, group_reduce=False)  # [B,Hq,P]
    G = Hq // Hkv
    logits = (q.float().reshape(B, Hkv, G, D) @ k.float().transpose(-1, -2)).reshape(B, Hq, L) * scale
    pad = -L % page_size
    best = torch.nn.functional.pad(logits, (0, pad), value=-float("inf")).unflatten(-1, (-1, page_size)).amax(-1)
    worst = (best - s).max()
    assert (s >= best).all(), f"bf16-bound score below the page's best logit by {worst.item():.3e}"


def test_update_and_rebuild_keep_bf16_bounds_equal_to_page_bounds():
    torch.manual_seed(0)
    k = torch.randn(2, 3, 40, 8)
    b = allocate_bounds(k, 8, torch.bfloat16)
    rebuild_bounds_(k, b, 8)
    for pos in (5, 17, 39):
        k[:, :, pos] = torch.randn(2, 3, 8) * 3
        update_bounds_(k, b, torch.tensor([pos]), 8)
    k[:, :, 20:30] = torch.randn(2, 3, 10, 8)
    update_bounds_(k, b, torch.arange(20, 30), 8)
    fresh = page_bounds(k, 8, dtype=torch.bfloat16)
    for name, got, want in zip(("kmax", "kmin", "kabs"), b, fresh):
        assert torch.equal(got, want), f"{name} differs from a bf16 rebuild"
