"""Pass: rewrite decode-shaped linears into ``tinyserve::linear``, the native CPU GEMV.

A linear qualifies when its activation ``x`` ``[..., K]`` has at most
:data:`~tinyserve_compile.kernels.linear.GEMV_MAX_ROWS` rows (``GEMV_MAX_ROWS_BF16`` with bf16 weights; the
product of its leading dimensions, static),
lives on the CPU, and its weight ``[N, K]`` (fp32 or bf16, of ``x``'s dtype) is held by the graph: a
parameter or constant, as a placeholder or ``get_attr``, and its result needs no grad (the op has no
backward). Every other linear (prefill rows, symbolic rows, activations as weights, graphs that record grad,
other devices or dtypes) stays ATen's.

A linear whose weight is torchao's ``Int4OpaqueTensor`` (weight-only int4, ``PrototypeInt4WeightOnlyConfig``)
becomes ``tinyserve::linear_int4``, the native int4 GEMV over the subclass's own packed data (``qdata`` and
``scale_and_zero``, read with ``getattr`` in the graph), under the same row, device and grad conditions, when
ATen packs int4 weights in the layout the GEMV reads, the output features are a multiple of 64, and the
activations and scales are bf16. Bias-free linears of one kind that read the same ``x`` (a layer's q, k and v
projections; gate and up) become one ``tinyserve::linear_group`` or ``tinyserve::linear_int4_group`` call: one
call and one parallel region for all of them. So do the ``tinyserve::linear_int4`` calls that
:class:`~tinyserve_compile.quantization.Int4Linear` modules (``Int4PlainWeightOnlyConfig``) put in the graph
themselves, when they read the same bf16 ``x`` of at most :data:`GEMV_MAX_ROWS` static rows on the CPU with one
group size and no bias. The counts go to ``counters``
(``linear_rewritten``, ``linear_int4_rewritten``, ``linear_int4_calls`` (the modules' own calls found),
``linear_grouped``, ``linear_kept:<reason>``) and to the graph's :attr:`.state.PassState.linears` (a
:class:`~.state.LinearReport`) for :func:`~tinyserve_compile.explain`.
"""
from __future__ import annotations

import sys

import torch
import torch.fx as fx
import torch.nn.functional as F

from tinyserve_compile.config import TinyServeConfig
from tinyserve_compile.explain import counters
from tinyserve_compile.kernels.linear import (GEMV_MAX_ROWS, GEMV_MAX_ROWS_BF16, INT4_BLOCK_N, int4_layout_problem,
                                               load_native_linear, native_linear_reason)

from ._node_meta import fake
from .state import LinearReport, pass_state

__all__ = ["decode_linear"]

#: call targets of a linear in a dynamo graph
LINEAR_TARGETS = (torch._C._nn.linear, F.linear, torch.ops.aten.linear.default)
GEMV_DTYPES = (torch.float32, torch.bfloat16)


def _is_subclass(t: torch.Tensor) -> bool:
    """True for a tensor subclass (a quantized weight, DTensor), seen through dynamo's FakeTensor."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return is_traceable_wrapper_subclass(t) or type(t) not in (torch.Tensor, FakeTensor, torch.nn.Parameter)


def _is_int4_opaque(t: torch.Tensor) -> bool:
    """True for torchao's ``Int4OpaqueTensor`` (only looked up when torchao is imported)."""
    mod = sys.modules.get("torchao.prototype.quantization.int4")
    cls = getattr(mod, "Int4OpaqueTensor", None) if mod is not None else None
    return cls is not None and isinstance(t, cls)


def _rows(fx_: torch.Tensor):
    """The activation rows of ``x`` ``[..., K]`` (None when symbolic)."""
    if any(not isinstance(s, int) for s in fx_.shape):
        return None
    rows = 1
    for s in fx_.shape[:-1]:
        rows *= s
    return rows


def _why_not_int4(fx_: torch.Tensor, fw: torch.Tensor, b) -> "str | None":
    """None when a linear with an ``Int4OpaqueTensor`` weight can become ``tinyserve::linear_int4``."""
    if fw.act_mapping_type is not None or fw.act_pre_scale is not None:
        return "int4 with activation quantization or pre-scale"
    if len(fw.block_size) != 2 or fw.block_size[0] != 1 or fw.block_size[1] % 2:
        return "int4 block size"
    if fx_.dtype != torch.bfloat16 or fw.scale_and_zero.dtype != torch.bfloat16:
        return "int4 dtype"
    N, K = fw.shape
    if N % INT4_BLOCK_N or tuple(fw.qdata.shape) != (N, K // 2) or fw.qdata.dtype != torch.uint8:
        return f"int4 output features not a multiple of {INT4_BLOCK_N}"
    if b is not None:
        fb = fake(b)
        if fb is None or fb.dim() != 1 or fb.dtype != torch.bfloat16 or _is_subclass(fb):
            return "bias"
    rows = _rows(fx_)
    if rows is None:
        return "symbolic rows"
    if rows > GEMV_MAX_ROWS or rows == 0:
        return f"rows > {GEMV_MAX_ROWS}"
    problem = int4_layout_problem()
    if problem:
        return problem
    return None


def _linear_args(node: fx.Node):
    """``(x, weight, bias)`` of a linear node."""
    args = list(node.args) + [None] * (3 - len(node.args))
    return args[0], args[1], node.kwargs.get("bias", args[2])


def _why_not(node: fx.Node):
    """None when ``node`` (a linear) can become ``tinyserve::linear``, else the reason it stays ATen's."""
    x, w, b = _linear_args(node)
    fx_, fw = fake(x), fake(w)
    if fx_ is None or fw is None:
        return "no example value"
    out = fake(node)
    if out is None or out.requires_grad:
        return "needs grad"  # the op has no backward: training graphs keep ATen's linear
    if fx_.device.type != "cpu" or fw.device.type != "cpu":
        return "not on the CPU"
    if fw.dtype not in GEMV_DTYPES or fx_.dtype != fw.dtype:
        return "dtype"
    if not isinstance(w, fx.Node) or w.op not in ("placeholder", "get_attr") or fw.dim() != 2:
        return "weight is computed in the graph"
    if _is_int4_opaque(fw) and not _is_subclass(fx_):
        return _why_not_int4(fx_, fw, b)
    if _is_subclass(fw) or _is_subclass(fx_):
        return "tensor subclass"  # quantized weights (torchao), DTensor: their own linear
    if b is not None:
        fb = fake(b)
        if fb is None or fb.dtype != fw.dtype or fb.dim() != 1:
            return "bias"
    rows = _rows(fx_)
    if rows is None:
        return "symbolic rows"
    if rows > GEMV_MAX_ROWS or rows == 0:
        return f"rows > {GEMV_MAX_ROWS}"
    if fw.dtype == torch.bfloat16 and rows > GEMV_MAX_ROWS_BF16:
        return f"bf16 rows > {GEMV_MAX_ROWS_BF16}"
    return None


def _int4_parts(graph: fx.Graph, w: fx.Node, fw):
    """``getattr`` nodes of an ``Int4OpaqueTensor`` weight's packed codes ``[N, K/2]`` uint8 and scales/zeros
    ``[K/gs, N, 2]`` bf16, inserted at the graph's insertion point."""
    qdata = graph.call_function(getattr, (w, "qdata"))
    qdata.meta["example_value"] = fw.qdata
    sz = graph.call_function(getattr, (w, "scale_and_zero"))
    sz.meta["example_value"] = fw.scale_and_zero
    return qdata, sz


def _uses_read_columns(graph: fx.Graph, call: fx.Node, members, outs) -> None:
    """Point each member's uses at its columns of the grouped ``call`` (``outs``: the members' example outputs
    ``[..., N_i]``, side by side in ``call``), made contiguous; inserted at the graph's insertion point."""
    call.meta["example_value"] = torch.cat(outs, -1)  # [..., sum N_i]
    start = 0
    for n, out in zip(members, outs):
        end = start + int(out.shape[-1])
        cols = graph.call_function(torch.ops.aten.slice.Tensor, (call, -1, start, end))  # [..., N_i] view
        cols.meta["example_value"] = call.meta["example_value"][..., start:end]
        item = graph.call_method("contiguous", (cols,))
        item.meta.update(n.meta)
        n.replace_all_uses_with(item)
        start = end


def _rewrite_group(graph: fx.Graph, members, report: LinearReport) -> None:
    """Replace bias-free linears that read one ``x`` (q, k and v; gate and up) by one grouped call.

    ``tinyserve::linear_group`` or ``tinyserve::linear_int4_group`` runs every weight in one parallel region: one
    call and one fork/join where there were ``len(members)``. Inserted before the first member (its ``x`` and
    weights are defined there); the result holds the members' outputs side by side, and each member's uses read
    its columns, made contiguous (a no-op for one activation row; a copy of a few KB for a batch, so that any view
    a model takes of a linear's output stays valid).
    """
    x = _linear_args(members[0])[0]
    weights = [_linear_args(n)[1] for n in members]
    fws = [fake(w) for w in weights]
    outs = [fake(n) for n in members]  # [..., N_i] each
    with graph.inserting_before(members[0]):
        if _is_int4_opaque(fws[0]):
            parts = [_int4_parts(graph, w, fw) for w, fw in zip(weights, fws)]
            call = graph.call_function(torch.ops.tinyserve.linear_int4_group.default,
                                       (x, [q for q, _ in parts], [sz for _, sz in parts], int(fws[0].block_size[1]),
                                        [int(fw.shape[0]) for fw in fws]))  # [..., sum N_i]
            report.int4 += len(members)
        else:
            call = graph.call_function(torch.ops.tinyserve.linear_group.default, (x, weights))  # [..., sum N_i]
        _uses_read_columns(graph, call, members, outs)
    for n in members:
        graph.erase_node(n)
    report.rewritten += len(members)
    report.grouped += len(members)
    report.groups += 1


def _int4_call_key(n: fx.Node):
    """``(x, group size)`` of a ``tinyserve::linear_int4`` call that may join a group, else None."""
    if len(n.args) < 5:  # arguments by keyword (not an Int4Linear module's call): left alone
        return None
    x, _, _, gs, N = n.args[:5]  # x, qdata, scale_and_zero, group_size, out_features
    bias = n.kwargs.get("bias", n.args[5] if len(n.args) > 5 else None)
    fx_, out = fake(x), fake(n)
    if bias is not None or fx_ is None or out is None or out.requires_grad or _is_subclass(fx_):
        return None
    if fx_.device.type != "cpu" or fx_.dtype != torch.bfloat16 or not isinstance(gs, int) or not isinstance(N, int):
        return None
    rows = _rows(fx_)
    if rows is None or rows == 0 or rows > GEMV_MAX_ROWS:
        return None
    return x, gs


def _group_int4_calls(graph: fx.Graph, calls, report: LinearReport) -> bool:
    """One ``tinyserve::linear_int4_group`` call per set of ``linear_int4`` calls that read one ``x``."""
    groups = {}
    for n in calls:
        key = _int4_call_key(n)
        if key is not None:
            groups.setdefault(key, []).append(n)
    order = {n: i for i, n in enumerate(graph.nodes)}
    changed = False
    for (x, gs), members in groups.items():
        # the group's call goes before its first member: only members whose packed weights are defined there
        members = [n for n in members if all(not isinstance(a, fx.Node) or order[a] < order[members[0]]
                                             for a in n.args[1:3])]
        if len(members) < 2:
            continue
        outs = [fake(n) for n in members]  # [..., N_i] each
        with graph.inserting_before(members[0]):
            call = graph.call_function(torch.ops.tinyserve.linear_int4_group.default,
                                       (x, [n.args[1] for n in members], [n.args[2] for n in members], gs,
                                        [n.args[4] for n in members]))  # [..., sum N_i]
            _uses_read_columns(graph, call, members, outs)
        for n in members:
            graph.erase_node(n)
        report.grouped += len(members)
        report.groups += 1
        changed = True
    return changed


#: the op that Int4Linear modules call (tinyserve_compile.quantization), as dynamo records it
INT4_CALL_TARGETS = (torch.ops.tinyserve.linear_int4.default, torch.ops.tinyserve.linear_int4)


def decode_linear(gm: fx.GraphModule, config: TinyServeConfig) -> fx.GraphModule:
    """Rewrite the decode-shaped linears (and group the Int4Linear modules' calls); the graph's
    :attr:`.state.PassState.linears` says what was done."""
    graph = gm.graph
    linears = [n for n in graph.nodes if n.op == "call_function" and n.target in LINEAR_TARGETS]
    int4_calls = [n for n in graph.nodes if n.op == "call_function" and n.target in INT4_CALL_TARGETS]
    report = LinearReport(int4_calls=len(int4_calls))
    pass_state(gm).linears = report
    counters["linear_int4_calls"] += len(int4_calls)
    if not linears and not int4_calls:
        return gm
    if not config.decode_linear:
        report.reason = "decode_linear=False"
        return gm
    if config.lower == "tensorrt":
        report.reason = "lower='tensorrt' compiles the linears itself"
        return gm
    grouped_calls = bool(int4_calls) and load_native_linear() and \
        _group_int4_calls(graph, int4_calls, report)
    candidates = []
    for n in linears:
        why = _why_not(n)
        if why is None:
            candidates.append(n)
        else:
            report.kept[why] += 1
    if candidates and not load_native_linear():
        report.reason = f"native GEMV unavailable: {native_linear_reason()}"
        report.kept["native GEMV unavailable"] += len(candidates)
        candidates = []
    groups = {}  # (x, kind, dtype or group size) -> the bias-free linears reading x, in graph order
    for n in candidates:
        x, w, b = _linear_args(n)
        fw = fake(w)
        if b is None:
            key = (x, "int4", int(fw.block_size[1])) if _is_int4_opaque(fw) else (x, "gemv", fw.dtype)
            groups.setdefault(key, []).append(n)
    order = {n: i for i, n in enumerate(graph.nodes)}
    # a group's call goes before its first member, so it takes the members whose weight is defined there (a
    # get_attr may come later, right before its own linear: that linear stays a single call)
    groups = [g for g in ([n for n in m if order[_linear_args(n)[1]] < order[m[0]]] for m in groups.values())
              if len(g) > 1]
    for members in groups:
        _rewrite_group(graph, members, report)
    grouped = {n for members in groups for n in members}
    for n in candidates:
        if n in grouped:
            continue
        x, w, b = _linear_args(n)
        fw = fake(w)
        with graph.inserting_before(n):
            if _is_int4_opaque(fw):
                qdata, sz = _int4_parts(graph, w, fw)
                new = graph.call_function(torch.ops.tinyserve.linear_int4.default,
                                          (x, qdata, sz, int(fw.block_size[1]), int(fw.shape[0]), b))  # [..., N]
                report.int4 += 1
            else:
                new = graph.call_function(torch.ops.tinyserve.linear.default, (x, w, b))  # [..., N]
        new.meta.update(n.meta)
        n.replace_all_uses_with(new)
        graph.erase_node(n)
        report.rewritten += 1
    counters["linear_rewritten"] += report.rewritten
    counters["linear_int4_rewritten"] += report.int4
    counters["linear_grouped"] += report.grouped
    for why, k in report.kept.items():
        counters[f"linear_kept:{why}"] += k
    if candidates or grouped_calls:
        graph.lint()
        gm.recompile()
    return gm
