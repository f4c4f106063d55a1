"""Shared helpers for the kernel tests: data builders, dense oracles and loud comparisons.

Every comparison goes through :func:`assert_close_report`, which names the worst
mismatch (max abs error, its index, both values) when it fails.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from typing import Optional
from unittest import mock

import torch
import torch.nn.functional as F

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# (atol, rtol) for op outputs of magnitude ~1 against an fp32 oracle; the op rounds its
# fp32 result to the input dtype, so the tolerance is a few ulps of that dtype.
TOL = {
    torch.float32: (3e-5, 3e-5),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def assert_close_report(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str) -> None:
    """Assert ``|actual - expected| <= atol + rtol*|expected|`` elementwise, reporting the worst offender.

    Parameters
    ----------
    actual, expected : torch.Tensor
        Same shape, any floating dtype (compared in float64).
    atol, rtol : float
    what : str
        Label for the failure message.
    """
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.double(), expected.double()
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    assert torch.equal(nan_a, nan_e), f"{what}: NaN pattern differs ({int(nan_a.sum())} vs {int(nan_e.sum())} NaNs)"
    a, e = a.masked_fill(nan_a, 0.0), e.masked_fill(nan_e, 0.0)
    err = (a - e).abs()
    excess = err - (atol + rtol * e.abs())
    if bool((excess > 0).any()):
        flat = int(excess.reshape(-1).argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape))
        n_bad = int((excess > 0).sum())
        raise AssertionError(
            f"{what}: {n_bad}/{a.numel()} elements out of tolerance (atol={atol}, rtol={rtol}); "
            f"max abs err {float(err.max()):.3e}; worst at {idx}: actual={float(a[idx]):.8e} "
            f"expected={float(e[idx]):.8e}"
        )


def assert_ge_report(upper: torch.Tensor, lower: torch.Tensor, what: str) -> None:
    """Assert ``upper >= lower`` elementwise (float64), reporting the worst violation."""
    u, lo = upper.double(), lower.double()
    gap = lo - u
    if bool((gap > 0).any()):
        flat = int(gap.reshape(-1).argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), u.shape))
        raise AssertionError(
            f"{what}: {int((gap > 0).sum())} violations; worst at {idx}: bound={float(u[idx]):.10e} < "
            f"value={float(lo[idx]):.10e} (short by {float(gap[idx]):.3e})"
        )


def make_gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, gen: torch.Generator, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    """Normal samples ``* scale`` in ``dtype``, clamped to the dtype's finite range."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
    lim = torch.finfo(dtype).max
    return x.clamp(-lim, lim).to(dtype)


def as_additive(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Bool (True = attend) or float mask -> fp32 additive mask."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    return mask.float()


def dense_sdpa(q, k, v, valid_len, attn_mask=None, scale=None, keep_kv=None, use_gqa_flag=True):
    """Dense ``F.scaled_dot_product_attention`` in fp32 over the valid (and kept) tokens.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, 1, D]``.
    k, v : torch.Tensor
        ``[B, Hkv, L, D]``.
    valid_len : torch.Tensor
        int64 ``[B]`` or ``[1]``.
    attn_mask : torch.Tensor, optional
        Bool or float, broadcastable to ``[B, Hq, 1, L]``.
    keep_kv : torch.Tensor, optional
        Bool ``[B, Hkv, L]``: tokens each KV head may read (others get -inf).
    use_gqa_flag : bool
        Use SDPA's ``enable_gqa``; otherwise ``repeat_interleave`` the KV heads.

    Returns
    -------
    torch.Tensor
        fp32 ``[B, Hq, 1, D]``.
    """
    B, Hq, _, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    vl = valid_len.reshape(-1).expand(B)
    add = torch.zeros(B, Hq, 1, L)
    add = add.masked_fill(~(torch.arange(L)[None, :] < vl[:, None])[:, None, None, :], float("-inf"))
    if keep_kv is not None:
        add = add.masked_fill(~keep_kv.repeat_interleave(G, dim=1)[:, :, None, :], float("-inf"))
    if attn_mask is not None:
        add = add + as_additive(attn_mask)
    qf, kf, vf = q.float(), k.float(), v.float()
    if use_gqa_flag:
        return F.scaled_dot_product_attention(qf, kf, vf, attn_mask=add, scale=scale, enable_gqa=True)
    kf, vf = kf.repeat_interleave(G, dim=1), vf.repeat_interleave(G, dim=1)
    return F.scaled_dot_product_attention(qf, kf, vf, attn_mask=add, scale=scale)


def default_scale(d: int) -> float:
    return 1.0 / math.sqrt(d)


def assert_equal_report(actual, expected, what):
    """Assert bit-equal tensors (NaN equal to NaN), naming how many elements differ and the first of them."""
    if torch.equal(actual, expected):
        return
    a, e = actual.double(), expected.double()
    bad = ~((a == e) | (torch.isnan(a) & torch.isnan(e)))
    idx = tuple(int(i) for i in bad.nonzero()[0])
    raise AssertionError(f"{what}: {int(bad.sum())}/{a.numel()} differ; first at {idx}: "
                         f"actual={float(a[idx]):.8e} expected={float(e[idx]):.8e}")


@contextlib.contextmanager
def cache_write_path(name: str):
    """Run ``tinyserve::cache_write`` through implementation ``name`` (a key of ``bounds.CACHE_WRITE_IMPLS``)
    inside the block, on every device: the op's Python kernel picks ``name``, and on CPU, where the native module
    makes its C++ kernel the op's CPU kernel, the Python kernel takes its place for the block (a registration of
    this process, dropped on exit, which brings the C++ kernel back)."""
    from tinyserve_compile.kernels import bounds
    from tinyserve_compile.kernels.native import load_native

    if name not in bounds.CACHE_WRITE_IMPLS:
        raise ValueError(f"cache_write_path: argument 'name' must be one of {sorted(bounds.CACHE_WRITE_IMPLS)}, "
                         f"got {name!r}")
    with mock.patch.object(bounds, "cache_write_impl", lambda device: name):
        if name == "native" or not load_native():
            yield
            return
        lib = torch.library.Library("tinyserve", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": the point here
            lib.impl("cache_write", bounds.python_cache_write_kernel, "CPU")
        try:
            yield
        finally:
            lib._destroy()
