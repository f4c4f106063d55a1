"""The random-init Llamas of :mod:`bench.models` as GGUF files, so that llama.cpp runs the same weights.

``python -m bench.gguf_writer --model llama3-1b --out results/.gguf/llama3-1b-all.BF16.gguf`` writes the model that
:func:`bench.models.build_llama` makes (the same seed, the same draws in the same order) in llama.cpp's ``llama``
architecture, one unit at a time: the tensor infos first, then each unit drawn, written and freed, so that the
peak memory is one unit (the 128256-row embedding) whatever the model's size. llama.cpp's ``llama-quantize``
then makes Q4_0 or Q4_1 of it (``bench.llamacpp.convert_gguf``).

What differs from the HF model and why:

* ``attn_q``/``attn_k`` rows are permuted as llama.cpp's ``convert_hf_to_gguf.py`` permutes Llama's: llama.cpp
  rotates adjacent pairs of a head's channels, HF rotates the two halves;
* the vocabulary is a placeholder (``<unk>``, ``<s>``, ``</s>``, then ``t3`` ...): the benchmarks and the logits
  check feed token ids, never text;
* a tied head is not written: llama.cpp uses the token embedding as the head when ``output.weight`` is absent.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import numpy as np
import torch

__all__ = ["GGUF_DTYPES", "write_llama_gguf", "gguf_tensor_name", "main"]

#: the float types the writer writes (llama-quantize takes any of them as its source): the numpy dtype of a matrix's
#: array (bf16 as its bits) and its GGML type where numpy's does not say it
_MATRIX_TYPES = {"f32": (np.float32, None), "f16": (np.float16, None), "bf16": (np.uint16, "BF16")}
GGUF_DTYPES = tuple(_MATRIX_TYPES)

#: HF's name of a decoder layer's tensor -> llama.cpp's (``blk.<i>.`` prefixed)
_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name of an HF Llama parameter (``model.layers.3.mlp.up_proj.weight`` -> ``blk.3.ffn_up.weight``).

    Raises
    ------
    ValueError
        For a name outside the Llama architecture's tensors.
    """
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER_NAMES:
        return f"blk.{parts[2]}.{_LAYER_NAMES[parts[3]]}"
    raise ValueError(f"hf_name: {hf_name!r} is not a Llama tensor")


def _permute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection ``[n_heads * head_dim, hidden]`` from HF's rotate-half order to llama.cpp's
    adjacent pairs (convert_hf_to_gguf.py's ``LlamaModel.permute``)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _as_numpy(t: torch.Tensor, dtype: str) -> np.ndarray:
    """``t`` (fp32) as the GGUF tensor's array: fp32, fp16, or bf16's bits as uint16; norms stay fp32."""
    if dtype == "f32" or t.dim() < 2:
        return t.float().contiguous().numpy()
    if dtype == "f16":
        return t.to(torch.float16).contiguous().numpy()
    return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def _units(model) -> Iterator[Tuple[str, torch.nn.Module]]:
    """``(HF name prefix, module)`` in the order :func:`bench.models.build_llama` draws them."""
    inner = model.model
    yield "model.embed_tokens.", inner.embed_tokens
    for i, layer in enumerate(inner.layers):
        yield f"model.layers.{i}.", layer
    yield "model.norm.", inner.norm
    if not model.config.tie_word_embeddings:
        yield "lm_head.", model.lm_head


def _metadata(writer, cfg) -> None:
    import gguf

    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_name("tinyserve-compile random-init Llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_rope_dimension_count(hd)
    writer.add_rope_freq_base(float(cfg.rope_theta if hasattr(cfg, "rope_theta") else
                                    cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    # a placeholder vocabulary of the model's size (token ids in, logits out)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, cfg.vocab_size)])
    writer.add_token_scores([0.0] * cfg.vocab_size)
    types = [gguf.TokenType.NORMAL] * cfg.vocab_size
    types[0], types[1], types[2] = gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)


@torch.no_grad()
def write_llama_gguf(shape: str, path: str, layers: Optional[int] = None, dtype: str = "bf16",
                     seed: int = 0) -> Path:
    """Write :func:`bench.models.build_llama`\\ ``(shape, layers, seed=seed)``'s weights as a GGUF file.

    Parameters
    ----------
    shape : str
        A key of :data:`bench.models.SHAPES` (``llama3-1b``, ``llama3-8b``, ``tiny``, ...).
    path : str
        The file to write (its folder is made).
    layers : int, optional
        The first ``layers`` decoder layers (all by default), as ``build_llama``'s.
    dtype : {"f32", "f16", "bf16"}
        The matrices' type: ``f32`` holds ``build_llama(..., weights="fp32")``'s values exactly, ``bf16`` those of
        ``weights="bf16"`` (and the source ``int4-plain`` quantizes). Norm weights are always f32.
    seed : int
        ``build_llama``'s seed.

    Returns
    -------
    pathlib.Path
        ``path``. Peak memory is one unit in fp32 plus its converted copy.
    """
    import gguf

    from bench.models import _config, _materialise

    if dtype not in GGUF_DTYPES:
        raise ValueError(f"dtype: expected one of {GGUF_DTYPES}, got {dtype!r}")
    from transformers import LlamaForCausalLM

    cfg = _config(shape, layers)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    np_dtype, ggml = _MATRIX_TYPES[dtype]
    raw = getattr(gguf.GGMLQuantizationType, ggml) if ggml else None
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), "llama")
    _metadata(writer, cfg)
    for prefix, unit in _units(model):
        for name, p in unit.named_parameters():
            kind, raw_kind = (np.dtype(np.float32), None) if p.dim() < 2 else (np.dtype(np_dtype), raw)
            writer.add_tensor_info(gguf_tensor_name(prefix + name), list(p.shape), kind, p.numel() * kind.itemsize,
                                   raw_dtype=raw_kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    gen = torch.Generator().manual_seed(seed)
    # the meta model is fp32: each unit holds build_llama's fp32 draws, rounded to ``dtype`` as it is written (as
    # build_llama's bf16 parameters round them)
    for prefix, unit in _units(model):
        _materialise(unit, gen, cfg.initializer_range, torch.float32)
        for name, p in unit.named_parameters():
            t = p.detach().float()
            if name.endswith("q_proj.weight"):
                t = _permute_rope(t, cfg.num_attention_heads)
            elif name.endswith("k_proj.weight"):
                t = _permute_rope(t, cfg.num_key_value_heads)
            writer.write_tensor_data(_as_numpy(t, dtype))
        unit.to("meta")  # frees the unit's storage
    writer.close()
    return out


def llama_cpp_logits(path: str, ids: List[int], threads: int = 2) -> np.ndarray:
    """llama.cpp's logits (llama-cpp-python) of ``ids`` from the GGUF at ``path``: fp32 ``[len(ids), vocab]``."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(64, len(ids)), n_threads=threads, logits_all=True,
                          verbose=False, seed=0)
    try:
        llm.eval(ids)
        return np.array(llm.scores[:len(ids)], dtype=np.float32)
    finally:
        llm.close()


@torch.no_grad()
def check_logits(path: str, shape: str, layers: Optional[int] = None, seed: int = 0,
                 ids: Tuple[int, ...] = (1, 5, 17, 42, 99, 3, 64, 7)) -> dict:
    """llama.cpp's logits from ``path`` against the HF model's (``build_llama(shape, layers, "fp32", seed)``) on
    ``ids``: ``rel`` (largest difference over the largest HF logit), ``min_cos`` (the least cosine of a position)
    and ``argmax_equal`` (positions whose top token agrees, of ``positions``)."""
    from bench.models import build_llama

    got = llama_cpp_logits(path, list(ids))
    model = build_llama(shape, layers, "fp32", seed)
    want = model(torch.tensor([list(ids)])).logits[0].float().numpy()
    del model
    cos = [float(np.dot(g, w) / np.linalg.norm(g) / np.linalg.norm(w)) for g, w in zip(got, want)]
    return dict(rel=float(np.abs(got - want).max() / np.abs(want).max()), min_cos=min(cos),
                argmax_equal=int((got.argmax(-1) == want.argmax(-1)).sum()), positions=len(ids))


def main(argv=None) -> None:
    from bench.models import SHAPES

    ap = argparse.ArgumentParser(prog="python -m bench.gguf_writer", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="the first N decoder layers (default: all)")
    ap.add_argument("--dtype", choices=GGUF_DTYPES, default="bf16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="the GGUF file to write")
    ap.add_argument("--check", nargs="*", default=None, metavar="GGUF",
                    help="then compare llama.cpp's logits from the written file (and from each GGUF named, e.g. its "
                         "Q4_0 conversion) with the HF model's (llama-cpp-python)")
    a = ap.parse_args(argv)
    if a.layers is not None and a.layers < 1:
        ap.error(f"argument --layers: must be at least 1, got {a.layers}")
    path = write_llama_gguf(a.model, a.out, a.layers, a.dtype, a.seed) if not Path(a.out).exists() else Path(a.out)
    print(path)
    for p in ([str(path)] + list(a.check)) if a.check is not None else []:
        print(p, check_logits(p, a.model, a.layers, a.seed))


if __name__ == "__main__":
    main()
