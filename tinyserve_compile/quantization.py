"""Weight-only int4 held as plain tensors: ``quantize_(model, Int4PlainWeightOnlyConfig())``, then compile.

torchao's ``PrototypeInt4WeightOnlyConfig`` makes every linear weight an ``Int4OpaqueTensor``, a tensor subclass.
``torch.compile``'s default guards check each subclass weight in Python on every call (its ``__tensor_flatten__``
twice: the metadata and the inner tensors), about 2 ms of a SmolLM2 decode step with 211 int4 linears. This config
packs the weight the same way (torchao's own quantization and ATen's CPU int4pack layout, so the codes, scales and
zero points are torchao's bit for bit) and swaps each ``nn.Linear`` for an :class:`Int4Linear` module that holds
them as plain buffers and calls ``tinyserve::linear_int4``: the native int4 GEMV on CPU for decode rows (at most 8
bf16 rows, output features a multiple of 64), ATen's int4 kernel (the call torchao makes) for every other case.
Dynamo then guards plain tensors, in C++.

Works eagerly and under any ``torch.compile`` backend; with ``backend="tinyserve"`` the ``decode_linear`` pass puts
the int4 calls that read one activation (q, k and v; gate and up) into one ``tinyserve::linear_int4_group`` call.
Inference only: the op has no backward.

Example
-------
>>> from torchao.quantization import quantize_
>>> from tinyserve_compile.quantization import Int4PlainWeightOnlyConfig
>>> quantize_(model.to(torch.bfloat16), Int4PlainWeightOnlyConfig(group_size=32))
>>> step = torch.compile(model, backend="tinyserve")

Needs torchao (``pip install torchao --no-deps``); importing this module registers the config's handler with
torchao's ``quantize_``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

try:
    import torchao
    from torchao.core.config import AOBaseConfig
    from torchao.quantization.transform_module import register_quantize_module_handler
except ImportError as e:  # pragma: no cover - torchao is in the dev and quant extras
    raise ImportError("tinyserve_compile.quantization needs torchao >= 0.18 (pip install torchao --no-deps, or the "
                      "'quant' extra; torchao 0.18 does not import on torch 2.8); installed: torch "
                      f"{torch.__version__}: {e}") from e
if tuple(int(x) for x in torchao.__version__.split("+")[0].split(".")[:2] if x.isdigit()) < (0, 18):
    # older ones lack Int4OpaqueTensor's module (0.13 is torch 2.8's)
    raise ImportError(f"tinyserve_compile.quantization needs torchao >= 0.18; installed: {torchao.__version__}")

from .kernels.linear import linear_int4

__all__ = ["Int4PlainWeightOnlyConfig", "Int4Linear", "INT4_GROUP_SIZE", "INT4_GROUP_SIZES"]

#: input channels per scale and zero point by default (llama.cpp's Q4_1 blocks hold 32 weights)
INT4_GROUP_SIZE = 32
#: group sizes ATen's CPU int4 kernel takes
INT4_GROUP_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True)
class Int4PlainWeightOnlyConfig(AOBaseConfig):
    """Asymmetric int4 weights with a bf16 scale and zero point per ``group_size`` input channels, held as plain
    buffers of :class:`Int4Linear` modules.

    Parameters
    ----------
    group_size : int
        Input channels per scale and zero point, one of :data:`INT4_GROUP_SIZES`. A linear whose input features
        are not a multiple of it stays as it is.
    """

    group_size: int = INT4_GROUP_SIZE

    def __post_init__(self):
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"Int4PlainWeightOnlyConfig: group_size={self.group_size!r}, expected one of "
                             f"{INT4_GROUP_SIZES}")


class Int4Linear(torch.nn.Module):
    """A linear layer with int4 weights in ATen's CPU int4pack layout, as plain buffers.

    Buffers
    -------
    qdata : torch.Tensor
        ``[N, K / 2]`` uint8, packed by ``aten._convert_weight_to_int4pack_for_cpu``.
    scale_and_zero : torch.Tensor
        ``[K / group_size, N, 2]`` bf16; the weight is ``(q - 8) * scale + zero``.

    ``bias`` is the linear's own (``[N]`` parameter) or None. The forward takes ``x`` ``[..., K]`` of any floating
    dtype (computed in bf16, returned in ``x``'s dtype).
    """

    def __init__(self, qdata: torch.Tensor, scale_and_zero: torch.Tensor, in_features: int, out_features: int,
                 group_size: int, bias: Optional[torch.nn.Parameter] = None):
        super().__init__()
        self.register_buffer("qdata", qdata)
        self.register_buffer("scale_and_zero", scale_and_zero)
        self.in_features, self.out_features, self.group_size = int(in_features), int(out_features), int(group_size)
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, group_size: int = INT4_GROUP_SIZE) -> "Int4Linear":
        """Quantize ``linear``'s weight with torchao's int4 quantization (the one ``PrototypeInt4WeightOnlyConfig``
        uses; the weight is rounded to bf16 first when it is not bf16)."""
        from torchao.prototype.quantization.int4 import Int4OpaqueTensor

        w = linear.weight.detach()
        if w.dtype != torch.bfloat16:
            w = w.to(torch.bfloat16)
        q = Int4OpaqueTensor.from_hp(w, [1, group_size])
        bias = linear.bias
        if bias is not None:
            bias = torch.nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)
        return cls(q.qdata, q.scale_and_zero, linear.in_features, linear.out_features, group_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sz = self.scale_and_zero
        xs = x if x.dtype == sz.dtype else x.to(sz.dtype)
        y = linear_int4(xs, self.qdata, sz, self.group_size, self.out_features, self.bias)  # [..., N] bf16
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4, "
                f"group_size={self.group_size}, bias={self.bias is not None}")


@register_quantize_module_handler(Int4PlainWeightOnlyConfig)
def _int4_plain_transform(module: torch.nn.Module, config: Int4PlainWeightOnlyConfig) -> torch.nn.Module:
    if not isinstance(module, torch.nn.Linear) or module.in_features % config.group_size != 0:
        return module
    return Int4Linear.from_linear(module, config.group_size)
