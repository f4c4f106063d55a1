"""Crash-only checks (issue 49): risky calls of the native kernel run in a subprocess each, so that a segfault, an
abort or a runaway allocation fails the test with the case named instead of taking pytest down.

Each case is a few lines run after a common set-up (a small cache, its int8 bounds); the subprocess must exit 0,
print ``ok``, and grow its peak resident memory by less than :data:`MAX_GROWTH_MB` during the call. Before the
spec's ranges and :meth:`~tinyserve_compile.kernels.spec.SelectionSpec.for_cache`, ``candidate_factor=2**62``
overflowed in C++ (a wrong answer), ``token_budget=10**12`` raised ``MemoryError: std::bad_alloc`` and
``10**8`` allocated 860 MB for a tiny model.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

#: peak resident memory a case may add during its calls (the cache and bounds are a few KB)
MAX_GROWTH_MB = 64

SETUP = """
import resource, torch
import torch.nn.functional as F
from tinyserve_compile.kernels import native
from tinyserve_compile.kernels.bounds import allocate_bounds, rebuild_bounds_
assert native.load_native(), native.native_unavailable_reason()
torch.manual_seed(0)
q, k, v = torch.randn(1, 4, 1, 32), torch.randn(1, 2, 256, 32), torch.randn(1, 2, 256, 32)
b = allocate_bounds(k, 8, torch.int8)
rebuild_bounds_(k, b, 8)
vl = torch.tensor([200])
dense = F.scaled_dot_product_attention(q, k[:, :, :200].repeat_interleave(2, 1), v[:, :, :200].repeat_interleave(2, 1))
op = torch.ops.tinyserve.sparse_decode
s = 32 ** -0.5  # the scale dense SDPA uses

def spec(page=8, budget=2048, sinks=1, factor=1, extra=1024, tokens=1):
    return [page, budget, sinks, factor, extra, tokens, 2]

def refused(name, *args):
    try:
        op(*args)
    except ValueError as e:
        assert f"'{name}'" in str(e), e
        return
    raise AssertionError(f"not refused: {name}")

rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
"""

CASES = {
    # a budget covering the context with a huge candidate factor: dense, not an overflowed selection
    "candidate_factor 2**31-1": "out = op(q, k, v, *b, vl, None, s, spec(factor=2**31 - 1), 'native', None)\n"
                                "torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)",
    "candidate_factor 2**62": "refused('candidate_factor', q, k, v, *b, vl, None, s, spec(factor=2**62), 'native', None)",
    "token_budget 10**12": "refused('token_budget', q, k, v, *b, vl, None, s, spec(budget=10**12), 'native', None)",
    "token_budget 10**8": "out = op(q, k, v, *b, vl, None, s, spec(budget=10**8), 'native', None)\n"
                         "torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)",
    "token_budget 2**31-1 with sinks": "out = op(q, k, v, *b, vl, None, s, spec(budget=2**31 - 1, sinks=10**6), "
                                       "'native', None)\ntorch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)",
    "candidate_extra 2**31-1, kept pages": "pages = native.native_module().kept_pages(q, k, *b, vl, None, s, "
                                           "spec(budget=64, extra=2**31 - 1), None)\nassert pages[..., :25].all()",
    "page_size 2**40": "refused('page_size', q, k, v, *b, vl, None, s, spec(page=2**40), 'native', None)",
    "negative sink_pages": "refused('sink_pages', q, k, v, *b, vl, None, s, spec(sinks=-1), 'native', None)",
}


@pytest.mark.parametrize("case", list(CASES))
def test_risky_native_call_does_not_crash(case):
    body = textwrap.dedent(SETUP) + CASES[case] + textwrap.dedent("""
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
        assert grown < %d, f"peak resident memory grew {grown:.0f} MB"
        print("ok")
        """ % MAX_GROWTH_MB)
    p = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, timeout=600)
    if p.returncode < 0:
        pytest.fail(f"case {case!r} died with signal {-p.returncode}:\n{p.stderr[-2000:]}")
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), f"case {case!r}:\n{p.stderr[-2000:]}"
