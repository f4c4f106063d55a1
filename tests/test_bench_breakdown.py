"""The per-step breakdown of a profiled CPU step (``bench.timing.step_breakdown``, issue 54 item 3): each event's
self time goes to its category, and time in no event (Python, Dynamo's guards) is its own row."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.profiler import profile, record_function

from bench.timing import step_breakdown, step_profile


def _work():
    a = torch.randn(256, 256)
    q = torch.randn(1, 4, 1, 64)
    kv = torch.randn(1, 4, 512, 64)
    return a, q, kv


def test_each_events_self_time_goes_to_its_category():
    a, q, kv = _work()
    with profile() as prof:
        with record_function("bench_step"):
            for _ in range(20):
                torch.mm(a, a)
            F.scaled_dot_product_attention(q, kv, kv)
            (a * 2).relu()
            time.sleep(0.01)  # in no event: the Python/guards row
    b = step_breakdown(list(prof.events()))
    assert b["python_guards_ms"] >= 9
    assert b["linear_ms"] > 0 and b["attention_ms"] > 0 and b["other_ops_ms"] > 0
    parts = sum(v for k, v in b.items() if k != "step_ms")
    assert abs(parts - b["step_ms"]) < 0.05 * b["step_ms"], b  # the rows add up to the step
    assert b["python_guards_ms"] < b["step_ms"]


def test_without_the_mark_there_is_no_breakdown():
    with profile() as prof:
        torch.mm(torch.ones(4, 4), torch.ones(4, 4))
    assert step_breakdown(list(prof.events())) == {}


def test_a_cpu_step_profile_carries_the_breakdown():
    a, _, _ = _work()
    prof = step_profile(lambda: torch.mm(a, a), torch.device("cpu"))
    assert prof["profile_linear_ms"] > 0 and prof["profile_step_ms"] >= prof["profile_linear_ms"]


def test_bench_decode_prints_the_breakdown_of_each_profiled_provider():
    from bench.decode import breakdown_table

    rows = [dict(context=2048, batch=1, provider="tinyserve", profile_step_ms=20.0, profile_linear_ms=12.5,
                 profile_attention_ms=3.0, profile_other_ops_ms=2.0, profile_wrappers_ms=1.0,
                 profile_python_guards_ms=1.5),
            dict(context=2048, batch=1, provider="llama.cpp Q4_0/F16")]  # no profile: no row
    lines = breakdown_table(rows).splitlines()
    assert len(lines) == 3 and "Python + guards" in lines[0]
    assert lines[2] == "| 2K | 1 | tinyserve | 20.00 | 12.50 | 3.00 | 2.00 | 1.00 | 1.50 |"
