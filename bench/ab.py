"""One backend change on and off, side by side in one process: ``python -m bench ab --switch NAME``.

The same model is compiled twice with ``backend="tinyserve"``, once with the change and once without, on one
static cache; then rounds of ``--steps`` decode steps alternate between the two (the order flips every round) and
the median step time of each is reported with their ratio. Two processes run one after the other see this VM's
speed move by more than the changes measured here, so the comparison is only made inside one process.

Switches:

``mask``         the sites' shared contiguous copy of the decode mask under Inductor
                 (``passes._graph.compact_mask``; off: Inductor materializes the mask view once per site)
``group``        bias-free linears that read one input in one GEMV call (``passes.decode_linear``'s
                 ``GROUP_SHARED_INPUTS``; off: one call per linear)
``cpp-wrapper``  Inductor's C++ wrapper (``inductor_options={"cpp_wrapper": True, "cpp_wrapper_build_separate":
                 True}``; off: the Python wrapper)
``size-asserts`` the backend's Inductor defaults (``config.INDUCTOR_DEFAULTS``: no re-check of the graph's input
                 sizes, strides and alignment in the wrapper); off: ``inductor_options={"size_asserts": True,
                 "alignment_asserts": True}``, Inductor's own defaults
``int4-plain``   int4 weights as plain buffers (``--weights int4`` only; on: ``Int4PlainWeightOnlyConfig``'s
                 ``Int4Linear`` modules, ``tinyserve_compile.quantization``; off: torchao's ``Int4OpaqueTensor``
                 weights); the same codes, scales and zero points either way
``huge-pages``   the static cache's keys and values on transparent huge pages (on: a copy of the filled cache in
                 buffers advised for huge pages before their first write, :func:`bench.ceilings.huge_buffer`;
                 off: the cache as allocated); not a backend change, a property of the memory it reads

The model is the random-init Llama of SmolLM2's shape (``--model tiny``: a 4-layer toy, for tests), its cache
filled with random keys and values; ``--weights`` as in ``python -m bench decode``. Prints a table; ``--json PATH``
writes the rows (and a ``.csv`` and ``.png`` next to it).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Dict, List

import torch

SWITCHES = ("mask", "group", "cpp-wrapper", "huge-pages", "size-asserts", "int4-plain")
CPP_WRAPPER = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}


@contextlib.contextmanager
def switched(switch: str, on: bool):
    """The pass-level state of ``switch`` while a variant compiles (``cpp-wrapper`` is an option, not state)."""
    import tinyserve_compile.passes  # noqa: F401  (the pass modules)

    dl = sys.modules["tinyserve_compile.passes.decode_linear"]
    sda = sys.modules["tinyserve_compile.passes.sparse_decode_attention"]
    saved = dl.GROUP_SHARED_INPUTS, sda.compact_mask
    try:
        if switch == "group":
            dl.GROUP_SHARED_INPUTS = on
        if switch == "mask" and not on:
            sda.compact_mask = lambda graph, mask: mask
        yield
    finally:
        dl.GROUP_SHARED_INPUTS, sda.compact_mask = saved


def run(switch: str, ctx: int, weights: str = "fp32", batch: int = 1, steps: int = 16, rounds: int = 6,
        model_kind: str = "random", log=print) -> List[dict]:
    """Rows ``{"variant": "on"|"off", "ms_per_token", ...}`` of one A/B at one point (see the module doc)."""
    from transformers import StaticCache

    from bench.bench_decode import DTYPES, _compile, fill_cache, model_for, read_bandwidth_gbs, row_lengths
    from bench.weights import prepare_weights, weights_dtype
    from tinyserve_compile.config import DEFAULT_TOKEN_BUDGET

    if switch not in SWITCHES:
        raise ValueError(f"switch: {switch!r} not in {SWITCHES}")
    if steps < 1 or rounds < 2:
        raise ValueError(f"steps/rounds: need >= 1 / >= 2, got {steps}/{rounds}")
    if switch == "int4-plain" and weights != "int4":
        raise ValueError(f"weights: the int4-plain switch compares two int4 models, run it with --weights int4, "
                         f"not {weights!r}")
    dtype = DTYPES[weights_dtype(weights, None)]
    base, name = model_for(model_kind, ctx, dtype, torch.device("cpu"))
    model = prepare_weights(base, weights)
    models = {"on": prepare_weights(base, "int4-plain") if switch == "int4-plain" else model, "off": model}
    n_pos = steps + 2
    cache = StaticCache(config=model.config, max_cache_len=ctx + n_pos)
    toks = torch.tensor([[100 + r] for r in range(batch)])
    lens = row_lengths(ctx, batch)  # rows of different lengths, left padded, as in bench decode
    mask = None
    if batch > 1:
        mask = torch.ones(batch, ctx + n_pos, dtype=torch.long)
        for r, n in enumerate(lens):
            mask[r, : ctx - n] = 0
    torch._dynamo.reset()
    with torch.no_grad():
        model(input_ids=torch.zeros(batch, 1, dtype=torch.long), cache=cache, use_cache=True)
        fill_cache(cache, base, name, lens, "random", "")

    caches = {"on": cache, "off": cache}
    if switch == "huge-pages":
        from bench.bench_op import on_huge_pages

        huge = StaticCache(config=model.config, max_cache_len=ctx + n_pos)
        with torch.no_grad():
            model(input_ids=torch.zeros(batch, 1, dtype=torch.long), cache=huge, use_cache=True)
        for dst, src in zip(huge.layers, cache.layers):
            dst.keys, dst.values = on_huge_pages(src.keys), on_huge_pages(src.values)
        caches["on"] = huge

    def rollback(variant):
        for layer in caches[variant].layers:
            layer.cumulative_length.fill_(ctx)

    def step(variant, i):
        kw = {} if mask is None else {"attention_mask": mask}
        fns[variant](input_ids=toks, position_ids=torch.full((batch, 1), ctx + i), cache=caches[variant],
                     use_cache=True, **kw)

    fns, compile_s = {}, {}
    with torch.no_grad():
        for variant, on in (("on", True), ("off", False)):
            # a different options dict per variant: Dynamo compiles each anew instead of reusing the other's code
            if switch == "size-asserts" and not on:
                opts = {"inductor_options": {"size_asserts": True, "alignment_asserts": True}}
            elif not on:
                opts = {"token_budget": DEFAULT_TOKEN_BUDGET}  # the default, spelled out
            else:
                opts = {"inductor_options": CPP_WRAPPER} if switch == "cpp-wrapper" else {}
            fns[variant] = _compile(models[variant], "tinyserve", opts)
            with switched(switch, on):
                rollback(variant)
                t0 = time.perf_counter()
                step(variant, 0)
                compile_s[variant] = time.perf_counter() - t0
            log(f"# compiled {switch} {variant}: {compile_s[variant]:.1f} s")
        gbps = read_bandwidth_gbs(torch.device("cpu"))
        times: Dict[str, List[float]] = {"on": [], "off": []}
        for r in range(rounds):
            for variant in (("on", "off") if r % 2 == 0 else ("off", "on")):
                rollback(variant)
                step(variant, 0)  # untimed
                for i in range(1, steps + 1):
                    t0 = time.perf_counter()
                    step(variant, i)
                    times[variant].append(time.perf_counter() - t0)
    torch._dynamo.reset()
    med = {v: statistics.median(t) * 1e3 for v, t in times.items()}
    return [dict(switch=switch, variant=v, context=ctx, batch=batch, weights=weights, model=name,
                 ms_per_token=round(med[v], 3), off_over_on=round(med["off"] / med["on"], 4), steps=steps,
                 rounds=rounds, compile_s=round(compile_s[v], 1), stream_gbps=round(gbps, 1),
                 threads=torch.get_num_threads(), date=time.strftime("%Y-%m-%dT%H:%M:%S%z")) for v in ("on", "off")]


def table(rows: List[dict]) -> str:
    lines = [f"{'switch':<12} {'point':<16} {'on ms':>8} {'off ms':>8} {'off/on':>7} {'compile s on/off':>17}"]
    on, off = rows
    point = f"{on['context'] // 1024}K b{on['batch']} {on['weights']}"
    lines.append(f"{on['switch']:<12} {point:<16} {on['ms_per_token']:>8.2f} {off['ms_per_token']:>8.2f} "
                 f"{on['off_over_on']:>6.3f}x {on['compile_s']:>8.1f}/{off['compile_s']:.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from bench.weights import WEIGHTS

    ap = argparse.ArgumentParser(prog="python -m bench ab", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--switch", required=True, choices=SWITCHES)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--weights", default="fp32", choices=WEIGHTS)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--model", default="random", choices=("random", "tiny"))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", help="write the rows here (a .csv and .png go next to it)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = run(a.switch, a.context, a.weights, a.batch, a.steps, a.rounds, a.model)
    print(table(rows))
    if a.json:
        from bench.output import bar_png, write_rows

        write_rows(rows, a.json)
        bar_png([f"{a.switch} {r['variant']}" for r in rows], [r["ms_per_token"] for r in rows], "ms per step",
                f"{a.switch}: {rows[0]['context']} tokens, batch {a.batch}, {a.weights}",
                os.path.splitext(a.json)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
