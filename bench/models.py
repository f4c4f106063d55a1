"""Random-init Llama models of the shapes the benchmarks measure, and the layer-by-layer builder for the large ones.

``python -m bench decode --model llama3-8b`` (32 layers) or ``--model llama3-1b`` (16) on the CPU makes its model
with :func:`build_llama`: the config on the meta device, then one unit at a time (the embedding, each decoder layer,
the final norm, the head) materialised, filled from one seeded generator and converted straight to the measured
format (fp32, bf16, or ``int4-plain``'s :class:`~tinyserve_compile.quantization.Int4Linear`), so that the peak
memory stays near the final size: Llama-3-8B is 32 GB in fp32, which no 24 GB machine can make whole, and about
4.5 GB in int4.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

__all__ = ["SHAPES", "SMOLLM2_SHAPE", "TINY_SHAPE", "LLAMA3_8B_SHAPE", "LLAMA3_1B_SHAPE", "LAYERED_FORMATS",
           "random_llama", "build_llama"]

#: SmolLM2-135M's shape (its config.json), used for the random-init model beyond 8K
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                     rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=65536 + 1024)
TINY_SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=8192)
#: Llama-3-8B's shape (--model llama3-8b; --layers keeps the first N of its 32 layers)
LLAMA3_8B_SHAPE = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=131072 + 1024)
#: Llama-3.2-1B's shape (--model llama3-1b): 16 layers, GQA 32/8 heads of 64, tied embeddings
LLAMA3_1B_SHAPE = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=131072 + 1024)
SHAPES = {"smollm2": SMOLLM2_SHAPE, "tiny": TINY_SHAPE, "llama3-8b": LLAMA3_8B_SHAPE, "llama3-1b": LLAMA3_1B_SHAPE}
#: the formats :func:`build_llama` makes directly (``bench.weights.WEIGHTS`` names)
LAYERED_FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "int4-plain": torch.bfloat16}


def _config(shape: str, layers: Optional[int]):
    from transformers import LlamaConfig

    cfg = LlamaConfig(**dict(SHAPES[shape], **({} if layers is None else {"num_hidden_layers": layers})))
    cfg._attn_implementation = "sdpa"
    return cfg


@functools.lru_cache(maxsize=4)
def random_llama(shape: str, layers: Optional[int] = None, device: Optional[str] = None,
                 dtype: Optional[torch.dtype] = None):
    """A random-init Llama of one of :data:`SHAPES` (``layers``: its first ``layers`` layers), made whole. With
    ``device`` and ``dtype`` its weights are made there, in that dtype (no copy through the CPU: the Llama-3-8B
    shape on a GPU); without, on the CPU in fp32 (seeded: the same weights every time)."""
    from transformers import LlamaForCausalLM

    cfg = _config(shape, layers)
    torch.manual_seed(0)
    if device is None:
        return LlamaForCausalLM(cfg).eval()
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(old)


#: rows drawn or quantized at a time: a multiple of the row blocks of both int4pack layouts (64 on AVX-512, 32 on
#: AVX2), so that quantizing row blocks gives the codes of the whole matrix; the temporaries stay a few MB
ROW_BLOCK = 4096


def _materialise(unit: torch.nn.Module, gen: torch.Generator, std: float, dtype: torch.dtype) -> None:
    """Give ``unit``'s meta parameters CPU storage in ``dtype``: matrices ``N(0, std)`` (HF's Llama init), drawn in
    blocks of rows, vectors (RMSNorm weights) ones."""
    unit.to_empty(device="cpu")
    with torch.no_grad():
        for p in unit.parameters():
            if p.dim() < 2:
                p.fill_(1.0)
                continue
            for rows in p.split(ROW_BLOCK):
                rows.copy_(torch.randn(rows.shape, generator=gen, dtype=torch.float32).mul_(std))


def _to_int4(linear: torch.nn.Linear, group_size: int):
    """``linear`` as an :class:`Int4Linear`, quantized a block of rows at a time (the codes of the whole weight,
    without its fp32 temporaries)."""
    from torchao.prototype.quantization.int4 import Int4OpaqueTensor

    from tinyserve_compile.quantization import Int4Linear

    parts = [Int4OpaqueTensor.from_hp(rows.detach().to(torch.bfloat16), [1, group_size])
             for rows in linear.weight.split(ROW_BLOCK)]
    qdata = torch.cat([p.qdata for p in parts])
    scale_and_zero = torch.cat([p.scale_and_zero for p in parts], dim=1)  # [K / group, N, 2]
    return Int4Linear(qdata, scale_and_zero, linear.in_features, linear.out_features, group_size)


def _int4_linears(unit: torch.nn.Module, group_size: int) -> None:
    """Replace every ``nn.Linear`` under ``unit`` (Llama's have no bias) by its :class:`Int4Linear`, one at a time
    (each bf16 weight is freed once its int4 codes exist)."""
    for name, child in list(unit.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(unit, name, _to_int4(child, group_size))
        else:
            _int4_linears(child, group_size)


@torch.no_grad()
def build_llama(shape: str, layers: Optional[int] = None, weights: str = "fp32", seed: int = 0):
    """A random-init Llama of :data:`SHAPES`\\ ``[shape]`` on the CPU, made unit by unit in its final format.

    Parameters
    ----------
    shape : str
        A key of :data:`SHAPES` (``llama3-8b``, ``llama3-1b``, ...).
    layers : int, optional
        Keep the first ``layers`` decoder layers (all of them by default).
    weights : {"fp32", "bf16", "int4-plain"}
        The format (:data:`LAYERED_FORMATS`): fp32 or bf16 parameters, or ``int4-plain``: every linear (the head
        included) an ``Int4Linear`` of group 32 with bf16 scales, the embedding and norms in bf16 (the head of a
        tied model is quantized from the embedding, as ``bench.weights.prepare_weights`` unties it).
    seed : int
        Seed of the one generator every weight is drawn from, in module order: the same model every time.

    Returns
    -------
    transformers.LlamaForCausalLM
        In eval mode, on the CPU; peak memory during the build is the final size plus one decoder layer (or the
        head) in ``weights``' dtype.
    """
    from transformers import LlamaForCausalLM

    from bench.weights import INT4_GROUP

    if weights not in LAYERED_FORMATS:
        raise ValueError(f"weights: build_llama makes {sorted(LAYERED_FORMATS)}, got {weights!r}")
    dtype = LAYERED_FORMATS[weights]
    cfg = _config(shape, layers)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    gen = torch.Generator().manual_seed(seed)
    std = cfg.initializer_range
    inner = model.model
    for unit in (inner.embed_tokens, *inner.layers, inner.norm):
        _materialise(unit, gen, std, dtype)
        if weights == "int4-plain" and unit is not inner.embed_tokens:
            _int4_linears(unit, INT4_GROUP)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = inner.embed_tokens.weight
    else:
        _materialise(model.lm_head, gen, std, dtype)
    if weights == "int4-plain":  # a tied head becomes a quantized copy of the embedding
        model.lm_head = _to_int4(model.lm_head, INT4_GROUP)
    inner.rotary_emb = type(inner.rotary_emb)(config=cfg)  # its buffers are computed, not random: made anew
    return model.eval()
