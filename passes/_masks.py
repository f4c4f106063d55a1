"""Attention masks of a rewritten decode site: its valid length, padding to the cache length, one compact copy."""
from __future__ import annotations

import contextlib
import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from tinyserve_compile.kernels.spec import MASKED_AT_OR_BELOW
from ._node_meta import example_value, fake


def decode_valid_len(graph: fx.Graph, k_view: fx.Node, attn_mask: Optional[fx.Node], length: Any,
                     device) -> fx.Node:
    """Insert the int64 ``[1]`` valid length of a rewritten decode site: the keys dense SDPA can attend.

    With a mask, one past the newest position the mask attends in any row (later
    keys are masked for every row; "attends" as :func:`tinyserve_compile.kernels.spec.attended`
    says, for boolean and additive masks alike); without one, every key read: the ``[:n]``
    prefix ``length`` (an int or a SymInt node) or the whole sequence dim of
    ``k_view`` (``[B, Hkv, L, D]``). This is how
    :func:`tinyserve_compile.testing.reference_sparse_attention` reads it too.
    """
    call = graph.call_function
    aten = torch.ops.aten
    if attn_mask is None:
        n = length if length is not None else call(aten.sym_size.int, (k_view, 2))
        return call(aten.full.default, ([1], n), {"dtype": torch.int64, "device": device})
    L = call(aten.sym_size.int, (attn_mask, -1))
    mt = fake(attn_mask)
    # kernels.spec.attended: what a float mask holds at or below MASKED_AT_OR_BELOW (-inf, finfo.min) is masked
    allowed = attn_mask if mt is not None and mt.dtype == torch.bool else \
        call(aten.gt.Scalar, (attn_mask, MASKED_AT_OR_BELOW))
    ends = call(aten.arange.start, (1, call(operator.add, (L, 1))), {"dtype": torch.int64, "device": device})
    last = call(aten.amax.default, (call(aten.mul.Tensor, (allowed, ends)), []))  # newest allowed + 1
    return call(aten.reshape.default, (last, [1]))


def pad_mask(graph: fx.Graph, attn_mask: Optional[fx.Node], kv_len: Any, length: int) -> Optional[fx.Node]:
    """Insert ``attn_mask`` padded along its last dim from ``kv_len`` keys to ``length`` with "not attended".

    A mask over a ``[:n]`` prefix read (``kv_len`` an int or a SymInt node) is
    padded with False (bool) or -inf (additive) up to the cache length the ops
    read; without a prefix (``kv_len`` None) or a mask, it is returned as is.
    """
    if attn_mask is None or kv_len is None:
        return attn_mask
    mt = fake(attn_mask)
    if mt is None:
        raise ValueError("pad_mask: the mask has no recorded example value")
    fill = False if mt.dtype == torch.bool else float("-inf")
    aten = torch.ops.aten
    extra = length - kv_len if isinstance(kv_len, int) else graph.call_function(operator.sub, (length, kv_len))
    # [..., 1] of the mask, filled, expanded to [..., L - n], appended (cat: the sizes may be symbolic)
    call = graph.call_function
    edge = call(aten.full_like.default, (call(aten.slice.Tensor, (attn_mask, -1, 0, 1)), fill))
    tail = call(aten.expand.default, (edge, [-1] * (mt.dim() - 1) + [extra]))
    out = call(aten.cat.default, ([attn_mask, tail], -1))
    # its example value (the later steps read the mask's dtype and shape from it), under the mask's fake mode
    n = kv_len if isinstance(kv_len, int) else example_value(kv_len)
    mode = getattr(mt, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        e = aten.full_like.default(aten.slice.Tensor(mt, -1, 0, 1), fill)
        out.meta["example_value"] = aten.cat.default([mt, aten.expand.default(e, [-1] * (mt.dim() - 1) + [length - n])], -1)
    return out


def compact_mask(graph: fx.Graph, attn_mask: Optional[fx.Node]) -> Optional[fx.Node]:
    """Insert one contiguous copy of ``attn_mask``, its broadcast (stride-0) leading dims narrowed to size 1.

    The decode mask of an HF model is a view (an ``expand`` of a comparison), and Inductor materializes a view
    that an extern kernel reads once per reader: 30 copies of the mask per step for 30 rewritten layers. Inductor
    removes a ``clone`` whose metadata matches its input, so the copy is ``prims.inductor_force_stride_order``
    (Inductor's own "copy unless it has these strides"): one buffer that every site reads (the ops broadcast a
    ``[B, 1, 1, L]`` mask themselves). A mask with symbolic sizes is returned as is.
    """
    mt = fake(attn_mask) if attn_mask is not None else None
    if mt is None or not all(isinstance(s, int) for s in mt.shape):
        return attn_mask
    import torch._inductor.inductor_prims  # noqa: F401  (defines prims.inductor_force_stride_order)

    call = graph.call_function
    aten = torch.ops.aten
    out = attn_mask
    narrow = [d for d in range(mt.dim() - 1) if mt.stride(d) == 0 and mt.shape[d] != 1]
    for d in narrow:
        out = call(aten.slice.Tensor, (out, d, 0, 1))
    mode = getattr(mt, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        e = mt
        for d in narrow:
            e = aten.slice.Tensor(e, d, 0, 1)
        e = e.contiguous()
    out = call(torch.ops.prims.inductor_force_stride_order.default, (out, list(e.stride())))
    out.meta["example_value"] = e
    return out
