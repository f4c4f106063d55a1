"""Lower-precision weights for the decode benchmark and the tests: bf16 models, and torchao's weight-only
int8 and int4, applied before ``torch.compile`` (stock or ``backend="tinyserve"``).

What each choice of :data:`WEIGHTS` does to an fp32 (or bf16) HF model:

* ``fp32`` / ``bf16``: every parameter and buffer in that dtype (``model.to(dtype)``); the activations and the
  KV cache follow.
* ``int8``: ``torchao.quantization.Int8WeightOnlyConfig()`` on every ``nn.Linear`` (per-row symmetric int8
  codes with one scale per output channel, ``Int8Tensor``); the activations and the KV cache keep the
  model's dtype (bf16 in the benchmark by default, see :func:`weights_dtype`).
* ``int4-plain``: the same int4 codes, scales and zero points, through torchao's ``quantize_`` with
  :class:`tinyserve_compile.quantization.Int4PlainWeightOnlyConfig` (``group_size=32``): every ``nn.Linear``
  becomes an ``Int4Linear`` module holding them as plain buffers, so ``torch.compile`` guards plain tensors
  instead of tensor subclasses.
* ``int4``: ``torchao.prototype.quantization.int4.PrototypeInt4WeightOnlyConfig(group_size=32)`` on every
  ``nn.Linear``: asymmetric int4 with a scale and a zero point per group of 32 input channels (the blocks of
  llama.cpp's Q4_1), packed for ATen's CPU kernel (``Int4OpaqueTensor``, ``_weight_int4pack_mm_for_cpu``).
  torchao 0.18's ``Int4WeightOnlyConfig`` has no CPU packing format (tried on a CPU-only torch 2.13.0):
  ``plain`` and ``preshuffled`` raise ``ImportError: Requires mslk >= 1.0.0`` (CUDA kernels),
  ``tile_packed_to_4d`` ``AssertionError: Torch not compiled with CUDA enabled``, ``plain_int32``
  ``NotImplementedError: Int4PlainInt32Tensor does not support device 'cpu' yet``. ``IntxWeightOnlyConfig``
  with ``torch.int4`` runs on CPU but stores one int4 value per int8 byte (``IntxUnpackedToInt8Tensor``): no
  fewer bytes than int8.

The output head is quantized too (it is an ``nn.Linear``); with tied embeddings this unties it: the input
embedding keeps the model's dtype and a decode step reads one row of it. ``set_inductor_config=False``:
torchao leaves Inductor's global settings alone, so every row of a benchmark compiles with the same settings.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch

__all__ = ["WEIGHTS", "INT4_GROUP", "prepare_weights", "tensor_nbytes", "weights_dtype", "is_int4_linear"]

WEIGHTS = ("fp32", "bf16", "int8", "int4", "int4-plain")
#: int4 group size: input channels per scale/zero point (llama.cpp's Q4_1 blocks hold 32 weights)
INT4_GROUP = 32


def weights_dtype(weights: Optional[str], dtype: Optional[str]) -> str:
    """The model/activation dtype name (``fp32``, ``bf16``, ``fp16``) of a ``weights`` choice and ``dtype``.

    ``fp32``/``bf16`` weights set it (``dtype`` must agree when given); ``int8``/``int4`` quantize the linear
    weights of a model in ``dtype``, by default ``bf16``: torchao's CPU paths for weight-only int8/int4 are
    slow with fp32 activations (compiled with Inductor, a 576 x 49152 linear at batch 1 took 250 ms in int8 and
    150 ms in int4 against 19 ms dense fp32; with bf16 activations 17 and 9 ms against 15 ms dense bf16,
    measured on a loaded 2-core machine, so ratios only).
    """
    if weights is not None and weights not in WEIGHTS:
        raise ValueError(f"weights: {weights!r} not in {WEIGHTS}")
    if weights in ("fp32", "bf16"):
        if dtype is not None and dtype != weights:
            raise ValueError(f"weights: {weights} weights with dtype {dtype}: leave dtype out or make it {weights}")
        return weights
    if weights in ("int8", "int4", "int4-plain"):
        return dtype or "bf16"
    return dtype or "fp32"


def prepare_weights(model: torch.nn.Module, weights: Optional[str]) -> torch.nn.Module:
    """``model`` with ``weights`` applied: itself for ``None``/``fp32``/``bf16`` (the dtype is set by the
    caller, see :func:`weights_dtype`), a quantized deep copy for ``int8``/``int4`` (``model`` is untouched).

    Parameters
    ----------
    model : torch.nn.Module
        An eval-mode model in its activation dtype (float32 or bfloat16).
    weights : str or None
        One of :data:`WEIGHTS`, or ``None``.

    Raises
    ------
    ValueError
        ``weights`` is not one of :data:`WEIGHTS`, or no linear layer was quantized.
    ImportError
        torchao is missing (``pip install torchao --no-deps``).
    """
    if weights is not None and weights not in WEIGHTS:
        raise ValueError(f"weights: {weights!r} not in {WEIGHTS}")
    if weights in (None, "fp32", "bf16"):
        want = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(weights)
        if want is not None and any(p.dtype != want for p in model.parameters() if p.is_floating_point()):
            raise ValueError(f"weights: {weights} requested but the model's parameters are not all {want}")
        return model
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    if weights == "int8":
        config = Int8WeightOnlyConfig(set_inductor_config=False)
    elif weights == "int4-plain":
        from tinyserve_compile.quantization import Int4PlainWeightOnlyConfig

        config = Int4PlainWeightOnlyConfig(group_size=INT4_GROUP)
    else:
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        config = PrototypeInt4WeightOnlyConfig(group_size=INT4_GROUP, set_inductor_config=False)
    out = copy.deepcopy(model)
    quantize_(out, config)
    n = sum(1 for m in out.modules() if (isinstance(m, torch.nn.Linear) and _is_subclass(m.weight))
            or is_int4_linear(m))
    if n == 0:
        raise ValueError(f"weights: {weights} quantized no linear layer (shapes not divisible by the group "
                         f"size {INT4_GROUP}?)")
    return out


def is_int4_linear(m: torch.nn.Module) -> bool:
    """True for an ``Int4Linear`` of ``int4-plain`` weights (by name: no torchao import for other weights)."""
    return type(m).__name__ == "Int4Linear" and type(m).__module__ == "tinyserve_compile.quantization"


def _is_subclass(t: torch.Tensor) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return is_traceable_wrapper_subclass(t)


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds: for a tensor subclass (torchao's quantized weights), the sum over its inner
    tensors (codes, scales, zero points), else ``numel * element_size``."""
    if _is_subclass(t):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()
