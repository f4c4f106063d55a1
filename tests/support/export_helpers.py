"""Shared by the export tests: quiet export of small modules, ORT runs through IOBinding, decode loops."""
from __future__ import annotations

import contextlib
import copy
import io

import torch


def export_module(module, args, path, int8_write="tensorrt"):
    """``torch.onnx.export`` of ``module`` with the tinyserve translations, quietly; returns ``path``."""
    from tinyserve_compile.onnx.translate import translation_table

    with contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
        prog = torch.onnx.export(module, args, dynamo=True, opset_version=18,
                                 custom_translation_table=translation_table(int8_write))
    prog.save(str(path))
    return str(path)


def ort_run(path, args):
    """Run ``path`` in ONNX Runtime (CPU) on torch tensors (bf16 included, via DLPack); returns torch tensors."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    s = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    b = s.io_binding()
    for i, a in zip(s.get_inputs(), args):
        b.bind_ortvalue_input(i.name, ort.OrtValue.from_dlpack(a.contiguous()))
    for o in s.get_outputs():
        b.bind_output(o.name)
    s.run_with_iobinding(b)
    return [torch.from_dlpack(o).clone() for o in b.get_outputs()]


@torch.no_grad()
def prefill(model, ids, max_cache_len):
    """Eager prefill into a fresh StaticCache: (first greedy token [B, 1], cache)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    out = model(ids, past_key_values=cache, use_cache=True)
    return out.logits[:, -1:].argmax(-1), cache


@torch.no_grad()
def greedy(step, tok, start, n):
    """``n`` greedy steps of ``step(tok [B,1], position [B]) -> logits [B, V]``; returns (tokens [B, n], logits [n, B, V])."""
    toks, logits = [], []
    for i in range(n):
        pos = torch.full((tok.shape[0],), start + i, dtype=torch.int64)
        lg = step(tok, pos)
        logits.append(lg)
        tok = lg.argmax(-1, keepdim=True)
        toks.append(tok)
    return torch.cat(toks, 1), torch.stack(logits)


def hf_step(model_or_compiled, cache):
    """A ``step`` for :func:`greedy` from an HF model (or its compiled wrapper) and a static cache it advances."""

    def step(tok, pos):
        return model_or_compiled(tok, past_key_values=cache, use_cache=True).logits[:, -1]

    return step


def clone_cache(cache):
    return copy.deepcopy(cache)


def worst(a: torch.Tensor, b: torch.Tensor) -> str:
    d = (a.float() - b.float()).abs()
    i = int(d.argmax())
    return (f"max |diff| {d.max().item():.3e} at flat index {i}: {a.flatten()[i].item():.6f} vs "
            f"{b.flatten()[i].item():.6f}")
