"""The paged sparse decode op alone, one layer of a continuous-batching decode step, side by side in one process.

``python -m bench paged-op`` runs :func:`main`: R requests of L tokens each in one paged buffer laid out like
transformers' CB cache (blocks of ``--cb-page`` rows, physical blocks in shuffled order), SmolLM2's attention shape
(9 query heads, 3 KV heads, D = 64) by default, and per provider the median time of ``--repeats`` calls:

* ``native``: ``tinyserve::paged_sparse_decode`` with ``kernel="native"`` (kernels/csrc/paged.cpp);
* ``torch``: the same op's PyTorch path (``kernel="torch"``);
* ``stock-gather``: what stock CB's CPU varlen path does per layer: ``index_select`` of every request's whole
  history, then one packed SDPA with a block-diagonal mask (dense);
* with ``--compare``, ``native <name>`` and ``torch <name>``: the same two with the options compared;
* ``write-native`` / ``write-torch``: the paged write of one new token per request with the bounds of the touched
  pages (``paged_write_``).

Bytes: K, V and bound bytes each provider reads by construction, against the read bandwidth measured in the same
run. Outputs: a table on stdout, ``<out>/paged_op.{json,csv,png}``. Timings on a shared machine are indicative only.
"""
from __future__ import annotations

import math
import os
import random
import statistics
import sys
import time
from typing import Optional, Sequence

import torch



def build(R: int, L: int, Hq: int, Hkv: int, D: int, cb_page: int, spec, dtype, seed: int = 0):
    """A paged buffer ``[N, Hkv, D]`` holding R requests of L tokens in shuffled blocks, its bounds, page tables."""
    from tinyserve_compile.kernels import reference as ref
    from tinyserve_compile.kernels.paged_sparse_decode import paged_write_

    S = spec.page_size
    g = torch.Generator().manual_seed(seed)
    per_req = -(-(L + 1) // cb_page)
    n_blocks = R * per_req + 1
    k = torch.randn(n_blocks * cb_page, Hkv, D, generator=g).to(dtype)
    v = torch.randn(n_blocks * cb_page, Hkv, D, generator=g).to(dtype)
    m = cb_page // S
    NP = n_blocks * m
    z = ref.store_bounds(torch.zeros(NP, Hkv, D), torch.zeros(NP, Hkv, D), spec.bounds_dtype)
    bounds = ref.PageBounds(z.kmax.clone(), z.kmin.clone(), z.kabs.clone())
    fresh = torch.zeros(NP, dtype=torch.bool)
    order = list(range(n_blocks))
    random.Random(seed).shuffle(order)
    blocks = [order[r * per_req:(r + 1) * per_req] for r in range(R)]
    P = -(-L // S)
    page_rows = torch.tensor([[blocks[r][p // m] * cb_page + (p % m) * S for p in range(P)] for r in range(R)])
    page_ids = torch.tensor([[blocks[r][p // m] * m + p % m for p in range(P)] for r in range(R)])
    # every request's history, written through the paged write (bounds included)
    tok = torch.arange(L)
    rows = (page_rows[:, tok // S] + tok % S).reshape(-1)
    paged_write_(k, v, k[rows].clone(), v[rows].clone(), rows, bounds, fresh, S, cb_page, m)
    q = torch.randn(R, Hq, 1, D, generator=g).to(dtype)
    nxt = torch.tensor([blocks[r][L // cb_page] * cb_page + L % cb_page for r in range(R)])  # the next token's row
    return dict(q=q, k=k, v=v, bounds=bounds, fresh=fresh, page_rows=page_rows, page_ids=page_ids,
                seq_lens=torch.full((R,), L, dtype=torch.int64), next_rows=nxt, m=m, read_rows=rows)


def stock_gather(q, k, v, read_rows, R, L, scale):
    """Stock CB per layer on CPU: gather every history, then packed SDPA with a block-diagonal mask."""
    Hq, Hkv = q.shape[1], k.shape[1]
    kg = k.index_select(0, read_rows).transpose(0, 1)[None]  # [1,Hkv,R*L,D]
    vg = v.index_select(0, read_rows).transpose(0, 1)[None]
    mask = torch.zeros(R, R * L, dtype=torch.bool)
    for r in range(R):
        mask[r, r * L:(r + 1) * L] = True
    qq = q[:, :, 0].transpose(0, 1)[None]  # [1,Hq,R,D]
    return torch.nn.functional.scaled_dot_product_attention(qq, kg, vg, attn_mask=mask[None, None], scale=scale,
                                                            enable_gqa=Hq != Hkv)


def timed(fn, repeats: int, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def sparse_bytes(spec, R: int, L: int, Hkv: int, D: int, item: int) -> int:
    """K, V and bound bytes the sparse op reads for R requests of L tokens (all of K and V when every page is kept)."""
    from tinyserve_compile.kernels.reference import bounds_itemsize

    S, K = spec.page_size, spec.n_pages
    P = -(-L // S)
    if P <= K:
        return R * 2 * L * Hkv * D * item
    n1 = max(K, spec.n_candidates)
    return R * (P * Hkv * (2 * D * bounds_itemsize(spec.bounds_dtype) + 4) + (min(n1 * S, L) + K * S) * Hkv * D
                * item)


def _args(argv: Optional[Sequence[str]]):
    """``(parser, arguments)`` of ``python -m bench paged-op`` (``--quick``: small shapes, few repeats)."""
    from bench import cli

    ap = cli.parser("paged-op", __doc__.split("\n")[0], out="results/paged_op", options=True,
                    quick="small shapes, few repeats: checks the pipeline")
    ap.add_argument("--rows", type=int, default=8, help="decode rows (requests) R")
    ap.add_argument("--length", type=int, default=8000, help="tokens per request")
    ap.add_argument("--heads", default="9,3", help="query heads, KV heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--cb-page", type=int, default=64, help="CB page size (rows per block)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--repeats", type=int, default=30)
    a = cli.parse(ap, argv)
    if a.quick:
        a.rows, a.length, a.repeats = 3, 600, 3
        if not a.options:
            a.options = {"token_budget": 128, "candidate_extra": 64}
    return ap, a


def _op_args(d: dict, scale: float, spec) -> tuple:
    """The arguments of ``paged_sparse_decode`` for the buffer ``d`` of :func:`build`."""
    return (d["q"], d["k"], d["v"], d["page_rows"], d["page_ids"], d["seq_lens"], d["bounds"], scale, spec)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m bench paged-op`` (see the module doc)."""
    from bench import cli
    from tinyserve_compile.kernels.native import load_native, native_unavailable_reason
    from tinyserve_compile.kernels.paged_sparse_decode import paged_sparse_decode
    from tinyserve_compile.kernels.spec import SelectionSpec
    from bench.timing import read_bandwidth_gbs

    ap, a = _args(argv)
    torch.set_grad_enabled(False)
    if not load_native():
        raise SystemExit(f"python -m bench paged-op: the native kernel is unavailable: {native_unavailable_reason()}")
    spec = SelectionSpec.from_config(cli.config(a.options))
    Hq, Hkv = (int(x) for x in a.heads.split(","))
    dims = (a.rows, a.length, Hq, Hkv, a.head_dim)
    d = build(a.rows, a.length, Hq, Hkv, a.head_dim, a.cb_page, spec, getattr(torch, a.dtype))
    scale = 1.0 / math.sqrt(a.head_dim)
    args = _op_args(d, scale, spec)
    # ---- the two paths agree before anything is timed
    got = paged_sparse_decode(*args, kernel="native")
    want = paged_sparse_decode(*args, kernel="torch")
    err = float((got.float() - want.float()).abs().max())
    stream = read_bandwidth_gbs()
    rows = _time_providers(a, ap, d, spec, scale, dims)
    print(f"# paged op, {a.rows} rows x {a.length} tokens, heads {Hq}/{Hkv}, D={a.head_dim}, {a.dtype}, spec {spec}, "
          f"threads {torch.get_num_threads()}, {a.repeats} repeats (median); native vs torch max |diff| {err:.2e}")
    _print_table(rows)
    print(f"\nread bandwidth measured in this run: {stream:.1f} GB/s")
    meta = dict(rows=a.rows, length=a.length, heads=f"{Hq}/{Hkv}", head_dim=a.head_dim, dtype=a.dtype,
                spec=str(spec.to_list()), threads=torch.get_num_threads(), repeats=a.repeats, stream_gbps=stream,
                max_abs_diff=err, torch=torch.__version__)
    _write(rows, meta, a.out)
    return 0


def _variants(a, ap, spec) -> list:
    """``[(suffix, spec)]``: the options' spec, and with ``--compare`` the compared one (on the same buffer: its
    bounds are the base spec's, so page_size and bounds_dtype must agree)."""
    from bench import cli
    from tinyserve_compile.kernels.spec import SelectionSpec

    variants = [("", spec)]
    if a.compare is not None:
        other = SelectionSpec.from_config(cli.config({**a.options, **a.compare}))
        if (other.page_size, other.bounds_dtype) != (spec.page_size, spec.bounds_dtype):
            ap.error("argument --compare: page_size and bounds_dtype are the paged buffer's layout; compare them "
                     "in two runs with --options")
        variants.append((f" {a.compare.name}", other))
    return variants


def _time_providers(a, ap, d: dict, spec, scale: float, dims: tuple) -> list:
    """One row per provider (see the module doc): the median ms of ``--repeats`` calls, the bytes it reads by
    construction, and GB/s."""
    from tinyserve_compile.kernels.paged_sparse_decode import paged_sparse_decode, paged_write_

    R, L, _, Hkv, D = dims
    item = d["k"].element_size()
    S = spec.page_size
    dense_bytes = 2 * R * L * Hkv * D * item
    one_k = torch.randn(R, Hkv, D, dtype=getattr(torch, a.dtype))
    rows = []

    def add(name, ms, nbytes):
        rows.append(dict(provider=name, ms=ms, bytes=nbytes, gbps=nbytes / (ms * 1e-3) / 1e9 if ms > 0 else 0.0))

    for suffix, sp in _variants(a, ap, spec):
        vargs = _op_args(d, scale, sp)
        for kernel in ("native", "torch"):
            add(kernel + suffix, timed(lambda: paged_sparse_decode(*vargs, kernel=kernel), a.repeats),
                sparse_bytes(sp, R, L, Hkv, D, item))
    add("stock-gather", timed(lambda: stock_gather(d["q"], d["k"], d["v"], d["read_rows"], R, L, scale), a.repeats),
        dense_bytes)
    wargs = (d["k"], d["v"], one_k, one_k, d["next_rows"], d["bounds"], d["fresh"], S, a.cb_page, d["m"])
    wbytes = R * S * Hkv * D * item
    add("write-native", timed(lambda: paged_write_(*wargs, kernel="native"), a.repeats), wbytes)
    add("write-torch", timed(lambda: paged_write_(*wargs, kernel="torch"), a.repeats), wbytes)
    return rows


def _print_table(rows: list) -> None:
    """The markdown table: ms, the ratio to the native op (to the native write for the writes), MB read, GB/s."""
    by = {r["provider"]: r for r in rows}
    print("| provider | ms | x native | MB read | GB/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        base = by["write-native" if r["provider"].startswith("write") else "native"]["ms"]
        print(f"| {r['provider']} | {r['ms']:.3f} | {r['ms'] / base:.2f} | {r['bytes'] / 1e6:.2f} | {r['gbps']:.1f} |")


def _write(rows: list, meta: dict, out: str) -> None:
    """``<out>/paged_op.{json,csv}`` (each row with ``meta``) and the bar chart ``paged_op.png``."""
    from bench import cli
    from bench.output import bar_png, write_rows

    path = cli.out_path(out, "paged_op")
    write_rows([{**r, **meta} for r in rows], path)
    bar_png([r["provider"] for r in rows], [r["ms"] for r in rows], "ms per call (median)",
            f"paged op, {meta['rows']} x {meta['length']} tokens", os.path.splitext(path)[0] + ".png")


if __name__ == "__main__":
    sys.exit(main())
