"""Decode-shaped linears (a few activation rows against one weight) in GB/s of weight read, per method.

Each method runs over a stack of distinct weights larger than the last-level cache, so every call streams its
weight from memory; GB/s is weight bytes over time, next to the read bandwidth measured in the same run
(``bench.timing.read_bandwidth_gbs``). Methods:

``aten``      ``F.linear`` (what inductor emits for a decode linear: ``extern_kernels.mm``/``addmm``)
``mv``        ``torch.mv`` (one row only)
``mkl_packed`` MKL's packed-weight linear (inductor's ``freezing`` with ``cpp.weight_prepack``, fp32)
``onednn_packed`` oneDNN's prepacked linear (inductor's weight prepack for bf16)
``native``    ``tinyserve::linear``, the GEMV of ``kernels/csrc/gemv.cpp``
``inductor_autotune`` optional (``--autotune``): ``torch.compile(mode="max-autotune")`` with freezing, CPP GEMM
              templates

With ``--dtypes int4`` the weight is weight-only int4 as torchao's ``PrototypeInt4WeightOnlyConfig(group_size=32)``
stores it (ATen's CPU int4pack codes plus a bf16 scale and zero per 32 weights; the bytes counted are both) and the
activations are bf16. Methods: ``aten`` (``_weight_int4pack_mm_for_cpu``, the kernel torchao calls), ``torchao``
(``F.linear`` on the ``Int4OpaqueTensor`` weight: the kernel plus torchao's dispatch, what eager and stock
``torch.compile`` run) and ``native`` (``tinyserve::linear_int4``, ``kernels/csrc/gemv_int4.cpp``).

Usage: ``python -m bench linear [--rows 1 8] [--threads 1 2] [--dtypes float32 bfloat16 int4]
[--shapes smollm2 llama3-8b llama3-1b] [--out PATH]``.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F



def linear_shapes(model: str):
    """``(N, K)`` of a model shape's decode linears (``bench.models.SHAPES``): q/o, k/v, gate/up, down, lm_head.

    Parameters
    ----------
    model : str
        A key of ``bench.models.SHAPES`` (``smollm2``, ``llama3-8b``, ``llama3-1b``, ``tiny``).
    """
    from bench.models import SHAPES as MODELS

    if model not in MODELS:
        raise ValueError(f"argument '--shapes': unknown model shape {model!r}, expected one of {sorted(MODELS)}")
    m = MODELS[model]
    hidden, inter, hd = m["hidden_size"], m["intermediate_size"], m["head_dim"]
    return ((m["num_attention_heads"] * hd, hidden), (m["num_key_value_heads"] * hd, hidden), (inter, hidden),
            (hidden, inter), (m["vocab_size"], hidden))


#: (N, K) of SmolLM2-135M's linears (the default): q/o, k/v, gate/up, down, lm_head
SHAPES = linear_shapes("smollm2")
def last_level_cache_bytes() -> int:
    """The size of the CPU's last-level cache as Linux reports it (0 where it does not)."""
    import glob

    best = (0, 0)
    for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            level = int(open(f"{d}/level").read())
            text = open(f"{d}/size").read().strip()
        except (OSError, ValueError):
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        size = int(text[:-1] if text[-1:] in "KMG" else text) * unit
        best = max(best, (level, size))
    return best[1]


#: bytes of weight per method call stack: twice the last-level cache (a 2-core VM can see a whole host's L3: 260
#: MB on a Xeon of 2026-12-07), at least 192 MB
STACK_BYTES = max(192 * 2**20, 2 * last_level_cache_bytes())


def _time(fn, ws, x, reps):
    fn(ws[0], x)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for w in ws:
            fn(w, x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _methods(dtype, rows, autotune):
    out = {"aten": (lambda w, x: F.linear(x, w), None)}
    if rows == 1:
        out["mv"] = (lambda w, x: torch.mv(w, x[0]), None)
    if dtype == torch.float32:
        try:
            torch.ops.mkl._mkl_reorder_linear_weight(torch.zeros(4, 4), 1)
            out["mkl_packed"] = (lambda w, x: torch.ops.mkl._mkl_linear(x, w[0], w[1], None, rows),
                                 lambda w: (torch.ops.mkl._mkl_reorder_linear_weight(w, rows), w))
        except (RuntimeError, AttributeError):
            pass
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(4, 4, dtype=dtype), rows)
        out["onednn_packed"] = (
            lambda w, x: torch.ops.mkldnn._linear_pointwise(x, w[0], None, "none", [], ""),
            lambda w: (torch.ops.mkldnn._reorder_linear_weight(w, rows), w))
    except (RuntimeError, AttributeError):
        pass
    from tinyserve_compile.kernels.linear import load_native_linear

    if load_native_linear():
        out["native"] = (lambda w, x: torch.ops.tinyserve.linear(x, w, None), None)
    if autotune:
        import torch._inductor.config as icfg

        def prep(w):
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
            lin.weight.data = w
            lin.eval().requires_grad_(False)
            with icfg.patch(freezing=True):
                return torch.compile(lin, mode="max-autotune-no-cudagraphs", fullgraph=True)

        out["inductor_autotune"] = (lambda m, x: m(x), prep)
    return out


#: input channels per scale/zero pair of the int4 weights
INT4_GROUP = 32


def _int4_weight(N, K, gen):
    """(qdata [N, K/2] uint8 int4pack, scale_and_zero [K/32, N, 2] bf16) of random codes, scales and zeros."""
    q = torch.randint(0, 16, (N, K), dtype=torch.int32, generator=gen)
    qdata = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack([torch.rand(K // INT4_GROUP, N, generator=gen) * 0.01,
                      torch.randn(K // INT4_GROUP, N, generator=gen) * 0.01], -1).to(torch.bfloat16)
    return qdata, sz


def _int4_methods(N, K):
    out = {"aten": (lambda w, x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w[0], INT4_GROUP, w[1]), None)}
    try:
        from torchao.prototype.quantization.int4 import Int4OpaqueTensor

        out["torchao"] = (lambda w, x: F.linear(x, w),
                          lambda w: Int4OpaqueTensor(w[0], w[1], [1, INT4_GROUP], torch.Size([N, K])))
    except ImportError:
        pass
    from tinyserve_compile.kernels.linear import int4_layout_problem, load_native_linear

    if load_native_linear() and int4_layout_problem() is None:
        out["native"] = (lambda w, x: torch.ops.tinyserve.linear_int4(x, w[0], w[1], INT4_GROUP, N, None), None)
    return out


def run(rows_list, threads_list, dtypes, reps, autotune, shapes=SHAPES, stack_bytes=STACK_BYTES):
    from bench.timing import read_bandwidth_gbs

    records = []
    default_threads = torch.get_num_threads()
    for threads in threads_list:
        torch.set_num_threads(threads)
        for dtype in dtypes:
            for rows in rows_list:
                for N, K in shapes:
                    gen = torch.Generator().manual_seed(0)
                    if dtype == "int4":  # codes plus a bf16 scale and zero per group
                        nbytes1 = N * K // 2 + N * (K // INT4_GROUP) * 4
                        n = max(1, stack_bytes // nbytes1)
                        ws = [_int4_weight(N, K, gen) for _ in range(n)]
                        x = torch.randn(rows, K, generator=gen).to(torch.bfloat16)
                        methods = _int4_methods(N, K)
                    else:
                        nbytes1 = N * K * dtype.itemsize
                        n = max(1, stack_bytes // nbytes1)
                        ws = [torch.randn(N, K, generator=gen).to(dtype) for _ in range(n)]
                        x = torch.randn(rows, K, generator=gen).to(dtype)
                        methods = _methods(dtype, rows, autotune)
                    dname = dtype if dtype == "int4" else str(dtype)[6:]
                    with torch.no_grad():
                        for name, (fn, prep) in methods.items():
                            try:
                                args = [prep(w) for w in ws] if prep else ws
                                t = _time(fn, args, x, reps)
                            except Exception as e:  # a method this build lacks: recorded, not fatal
                                records.append(dict(threads=threads, dtype=dname, rows=rows, N=N, K=K,
                                                    method=name, error=f"{type(e).__name__}: {str(e)[:80]}"))
                                continue
                            bw = read_bandwidth_gbs(mb=128, reps=3)
                            gbs = n * nbytes1 / t / 1e9
                            records.append(dict(threads=threads, dtype=dname, rows=rows, N=N, K=K,
                                                method=name, us_per_call=t / n * 1e6, gbs=gbs, read_bw_gbs=bw,
                                                share=gbs / bw))
    torch.set_num_threads(default_threads)
    # speed against ATen's method of the same case, timed side by side in this run
    key = lambda r: (r["threads"], r["dtype"], r["rows"], r["N"], r["K"])  # noqa: E731
    aten = {key(r): r["us_per_call"] for r in records if r["method"] == "aten" and "error" not in r}
    for r in records:
        if "error" not in r and key(r) in aten:
            r["vs_aten"] = aten[key(r)] / r["us_per_call"]
    return records


def table(records) -> str:
    lines = ["| threads | dtype | rows | N x K | method | us/call | GB/s | read GB/s | share | x aten |",
             "|---" * 10 + "|"]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['threads']} | {r['dtype']} | {r['rows']} | {r['N']}x{r['K']} | {r['method']} | "
                         f"{r['error']} | | | | |")
            continue
        lines.append(f"| {r['threads']} | {r['dtype']} | {r['rows']} | {r['N']}x{r['K']} | {r['method']} | "
                     f"{r['us_per_call']:.1f} | {r['gbs']:.1f} | {r['read_bw_gbs']:.1f} | {r['share']:.0%} | "
                     f"{r.get('vs_aten', float('nan')):.2f} |")
    return "\n".join(lines)


def plot(records, path):
    try:
        from bench.output import pyplot

        plt = pyplot()
    except ImportError:
        return
    ok = [r for r in records if "error" not in r]
    keys = sorted({(r["threads"], r["dtype"], r["rows"], r["N"], r["K"]) for r in ok})
    methods = sorted({r["method"] for r in ok})
    fig, ax = plt.subplots(figsize=(max(6, len(keys) * 0.6), 4))
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        ys = [next((r["share"] for r in ok if (r["threads"], r["dtype"], r["rows"], r["N"], r["K"]) == k
                    and r["method"] == m), 0) for k in keys]
        ax.bar([j + i * width for j in range(len(keys))], ys, width, label=m)
    ax.set_xticks([j + 0.4 for j in range(len(keys))])
    ax.set_xticklabels([f"t{k[0]} {k[1][:4]} m{k[2]}\n{k[3]}x{k[4]}" for k in keys], fontsize=6, rotation=90)
    ax.set_ylabel("share of read bandwidth")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    from bench import cli

    ap = cli.parser("linear", __doc__.split("\n")[0], quick="one shape, small stacks (a dry run)", threads=False)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()],
                    help="torch thread counts, each timed in turn (default: torch's default)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "int4"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shapes", nargs="+", default=["smollm2"], metavar="MODEL",
                    help="the linears of these model shapes (smollm2, llama3-8b, llama3-1b): q/o, k/v, gate/up, down, "
                         "lm_head")
    ap.add_argument("--autotune", action="store_true", help="also inductor max-autotune with freezing (slow)")
    a = cli.parse(ap, argv, compare="linear times single linear layers, not the backend: it has no "
                  "TinyServeConfig options to vary")
    path = cli.out_path(a.out, "linear")
    shapes = tuple(dict.fromkeys(nk for m in a.shapes for nk in linear_shapes(m)))  # in order, each once
    kw = dict(shapes=shapes[:1], stack_bytes=8 * 2**20) if a.quick else dict(shapes=shapes)
    records = run(a.rows, a.threads, [d if d == "int4" else getattr(torch, d) for d in a.dtypes], 1 if a.quick else a.reps, a.autotune,
                  **kw)
    print(table(records))
    if path:
        from bench.output import write_rows

        write_rows(records, path)
        plot(records, path.rsplit(".", 1)[0] + ".png")


if __name__ == "__main__":
    main()
