"""One client's decode loop through ``backend="tinyserve"``; runs inside that client's virtualenv.

``python bench/client_drivers.py NAME [--lower eager|inductor] [--out FILE]`` prints one JSON object (and
writes it to FILE). It builds a tiny random-init model with the library's own model code (nothing is
downloaded) and runs the library's own decode loop four times on CPU:

1. eagerly (the stock run);
2. compiled with a token budget covering the whole context (dense-exact: the greedy tokens must equal 1.);
3. compiled with a small budget and page size, so the selection drops pages at this tiny context;
4. eagerly, with the attention of the layers that 3. rewrote answered by the reference rule
   (``tinyserve_compile.testing``: ``sparse_decode_reference`` with the same options).

The worst ``|3 - 4|`` over every decode step's logits is the client's error; ``explain()`` of 3. gives the
sites rewritten and the sites left dense with their reasons.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import json
import sys
import time
import traceback

import torch

PROMPT, NEW, MAX_LEN = 40, 12, 64  # prompt tokens, greedy new tokens, cache length
VOCAB = 256
#: page_size 4 and 16 kept tokens out of 24 candidates: the selection drops pages from 10 pages up
SPARSE = dict(page_size=4, token_budget=16, sink_pages=1, dense_layers=0, candidate_factor=1, candidate_extra=8)
DENSE = dict(SPARSE, token_budget=256)  # covers every context of the run: must equal eager


def _prompt(batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, VOCAB, (batch, PROMPT), generator=g)  # [B, PROMPT] int64


def _record(module: torch.nn.Module, store: list):
    """Record the last position's logits of every call of ``module`` (the LM head) into ``store``."""

    def hook(_m, _inp, out):
        store.append(out[:, -1].detach().float().clone())  # [B, V] fp32

    # outside the graph: traced, the growing list would be guarded on its length and recompile every step
    # (a graph break after the LM head instead; every attention site stays in the graph before it)
    return module.register_forward_hook(torch.compiler.disable(hook))


# --------------------------------------------------------------------------------------- the clients
# Each client: build(seed) -> model; run(model, options or None, logits list) -> generated tokens [N]. Every model
# has HEADS. ``options is None`` runs the loop eagerly.

#: (query heads, KV heads, layers) of every client's tiny model
HEADS = (4, 2, 3)


class Torchtune:
    dist = "torchtune"

    def build(self):
        from torchtune.models.llama3._component_builders import llama3

        torch.manual_seed(0)
        m = llama3(vocab_size=VOCAB, num_layers=3, num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=MAX_LEN,
                   intermediate_dim=128)
        m.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=MAX_LEN)
        return m.eval()

    def run(self, m, options, logits):
        from torchtune import generation

        m.reset_caches()
        step = None
        if options is not None:  # as torchtune's generate recipe does with compile=True
            step = torch.compile(generation.generate_next_token, backend="tinyserve", options=options)
        with torch.no_grad():
            toks, lg = generation.generate(m, _prompt()[0], max_generated_tokens=NEW, pad_id=0, temperature=1.0,
                                           top_k=1, custom_generate_next_token=step)
        logits.extend(lg[0].float())  # [NEW, V]
        return toks[0, PROMPT:]


class LitGPT:
    dist = "litgpt"

    def build(self):
        from litgpt.config import Config
        from litgpt.model import GPT

        torch.manual_seed(0)
        cfg = Config(block_size=MAX_LEN, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=3, n_head=4,
                     n_query_groups=2, n_embd=64, rotary_percentage=1.0, parallel_residual=False, bias=False,
                     norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=128)
        m = GPT(cfg).eval()
        m.max_seq_length = MAX_LEN
        m.set_kv_cache(batch_size=1)
        return m

    def run(self, m, options, logits):
        import litgpt.generate.base as gen

        for blk in m.transformer.h:
            blk.attn.kv_cache.reset_parameters()
        orig = gen.next_token
        if options is not None:  # what litgpt's generate main does with --compile
            gen.next_token = torch.compile(orig, backend="tinyserve", options=options)
        h = _record(m.lm_head, logits)
        try:
            with torch.no_grad():
                out = gen.generate(m, _prompt()[0], max_returned_tokens=PROMPT + NEW, temperature=0.0,
                                   include_prompt=False)
        finally:
            gen.next_token = orig
            h.remove()
        return out


class GptFast:
    dist = "torchao"

    def build(self):
        from torchao._models.llama.model import ModelArgs, Transformer

        torch.manual_seed(0)
        return _meta_init(Transformer(ModelArgs(block_size=MAX_LEN, vocab_size=VOCAB, n_layer=3, n_head=4,
                                                n_local_heads=2, dim=64, intermediate_size=128, head_dim=16)))

    def run(self, m, options, logits):
        import torchao._models.llama.generate as gen

        m.max_seq_length = -1  # setup_caches inside generate() allocates fresh caches
        orig = gen.decode_one_token
        if options is not None:  # as gpt-fast's main() does with --compile
            gen.decode_one_token = torch.compile(orig, backend="tinyserve", options=options)
        h = _record(m.output, logits)
        try:
            with contextlib.redirect_stdout(sys.stderr):
                seq = gen.generate(m, _prompt()[0].to(torch.int32), NEW, batch_size=1, interactive=False,
                                   temperature=1.0, top_k=1)
        finally:
            gen.decode_one_token = orig
            h.remove()
        return seq[0, PROMPT:]


class HFStatic:
    dist = "transformers"

    def build(self):
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_LEN)
        return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()

    def run(self, m, options, logits):
        from transformers import CompileConfig

        kw = {}
        if options is not None:
            cc = CompileConfig(backend="tinyserve", options=options, mode=None, fullgraph=False)
            cc._compile_all_devices = True  # HF compiles only on accelerators otherwise
            kw["compile_config"] = cc
        with torch.no_grad():
            out = m.generate(_prompt(), max_new_tokens=NEW, do_sample=False, cache_implementation="static",
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kw)
        logits.extend(x[0].float() for x in out.logits)
        return out.sequences[0, PROMPT:]


class Executorch:
    dist = "executorch"

    def build(self):
        from executorch.examples.models.llama.llama_transformer import construct_transformer
        from executorch.examples.models.llama.model_args import ModelArgs

        torch.manual_seed(0)
        args = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, hidden_dim=128,
                         max_batch_size=1, max_seq_len=MAX_LEN, max_context_len=MAX_LEN, use_kv_cache=True,
                         enable_dynamic_shape=True)  # what its runner passes: input_pos = [start]
        return _meta_init(construct_transformer(args))

    def run(self, m, options, logits):
        from executorch.examples.models.llama.runner.generation import LlamaRunner

        for mod in m.modules():  # a fresh cache: the runner's loop starts at position 0
            for name in ("k_cache", "v_cache"):
                if isinstance(getattr(mod, name, None), torch.Tensor):
                    getattr(mod, name).zero_()
        fwd = m if options is None else torch.compile(m, backend="tinyserve", options=options)

        class Tok:  # the runner prints tokens as it goes; nothing to decode here
            eos_id, n_words, stop_tokens = -1, VOCAB, []

            @staticmethod
            def decode_token(t):
                return ""

        class Runner(LlamaRunner):  # the library's loop; its forward is what EagerLlamaRunner.forward does
            def __init__(self):
                self.max_seq_len, self.max_batch_size, self.use_kv_cache = MAX_LEN, 1, True
                self.tokenizer, self.device = Tok(), "cpu"

            def forward(self, tokens, input_pos=None):
                out = fwd(tokens, {"input_pos": input_pos})
                out = out[0] if isinstance(out, tuple) else out
                logits.append(out.reshape(-1, out.shape[-1])[-1:].float().clone())  # [1, V]
                return out.reshape(-1, out.shape[-1])[-1]

        with torch.no_grad(), contextlib.redirect_stdout(sys.stderr):
            toks = Runner().generate(_prompt()[0].tolist(), PROMPT + NEW, temperature=0.0)
        return torch.tensor(toks)


class ExecutorchScalars(Executorch):
    """The same loop with ``torch._dynamo.config.capture_scalar_outputs = True``: the cache's ``.item()`` stays in
    the graph, so the write and the attention share one graph."""

    def run(self, m, options, logits):
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            return super().run(m, options, logits)


def _fairscale_single_process():
    """Meta's reference code runs under fairscale model parallelism: one gloo rank, one model-parallel group."""
    import os

    import fairscale.nn.model_parallel.initialize as fs_init
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not fs_init.model_parallel_is_initialized():
        fs_init.initialize_model_parallel(1)


def _meta_loop(fwd, m, logits, first_arg):
    """The decode loop of llama-models' ``generate()`` (``prev_pos`` -> ``cur_pos``, greedy), on CPU: the library's
    own ``generate()`` allocates its tensors with ``device="cuda"``, so it cannot run here as it is."""
    for mod in m.modules():  # a fresh cache (the model keeps it as plain tensor attributes)
        for name in ("cache_k", "cache_v"):
            if isinstance(getattr(mod, name, None), torch.Tensor):
                getattr(mod, name).zero_()
    prompt = _prompt()  # [1, PROMPT]
    tokens = torch.zeros(1, PROMPT + NEW, dtype=torch.long)
    tokens[:, :PROMPT] = prompt
    prev = 0
    for cur in range(PROMPT, PROMPT + NEW):
        out = fwd(first_arg(tokens[:, prev:cur], prev))
        lg = out.logits if hasattr(out, "logits") else out  # [1, T, V]
        logits.append(lg[:, -1].float().clone())
        tokens[:, cur] = torch.argmax(lg[:, -1], dim=-1)
        prev = cur
    return tokens[0, PROMPT:]


def _meta_init(m):
    """``m`` in eval mode with random weights and unit norms (the reference code, gpt-fast and executorch's model
    initialise nothing themselves: they load checkpoints)."""
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.fill_(1.0)
    return m.eval()


class Llama3Reference:
    """llama-models' reference Llama 3 (``llama_models.<version>``), tiny and random-init."""

    dist = "llama-models"
    version = "llama3"

    def build(self):
        import importlib

        ModelArgs = importlib.import_module(f"llama_models.{self.version}.args").ModelArgs
        Transformer = importlib.import_module(f"llama_models.{self.version}.model").Transformer
        _fairscale_single_process()
        torch.manual_seed(0)
        args = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, multiple_of=32,
                         max_batch_size=2, max_seq_len=MAX_LEN, rope_theta=10000.0)
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t  # Llama 4's attention allocates its cache with .cuda(): keep it on CPU
        try:
            return _meta_init(Transformer(args))
        finally:
            torch.Tensor.cuda = cuda

    def compiled(self, m, options):
        return m.forward if options is None else torch.compile(m.forward, backend="tinyserve", options=options)

    def run(self, m, options, logits):
        fwd = self.compiled(m, options)
        return _meta_loop(lambda a: fwd(*a), m, logits, lambda t, pos: (t, pos))


class Llama4Reference(Llama3Reference):
    """llama-models' reference Llama 4: its forward takes one ``TransformerInput``."""

    version = "llama4"

    def run(self, m, options, logits):
        from llama_models.llama4.datatypes import TransformerInput

        return _meta_loop(self.compiled(m, options), m, logits,
                          lambda t, pos: TransformerInput(tokens=t, tokens_position=pos))


CLIENTS = {"torchtune": Torchtune, "litgpt": LitGPT, "gpt-fast": GptFast, "hf-static": HFStatic,
           "executorch": Executorch, "executorch-scalars": ExecutorchScalars,
           "llama4-reference": Llama4Reference, "llama3-reference": Llama3Reference}


# --------------------------------------------------------------------------------------- the four runs


def _reference(n_q, n_kv, n_layers, rewritten_layers, options):
    """The eager run with the attention of ``rewritten_layers`` answered by the reference rule."""
    from tinyserve_compile.config import TinyServeConfig
    from tinyserve_compile.testing import _SDPA, _SparseReferenceMode

    class OnlyRewritten(_SparseReferenceMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            q = args[0] if args else (kwargs or {}).get("query")
            if func in _SDPA and q is not None and q.shape[-2] == 1 \
                    and self.decode_calls % n_layers not in rewritten_layers:
                self.decode_calls += 1  # this layer stays dense in the compiled run too
                return func(*args, **(kwargs or {}))
            return super().__torch_function__(func, types, args, kwargs)

    return OnlyRewritten(TinyServeConfig.from_options(options), n_q, n_kv, n_layers)


def drive(name: str, lower: str) -> dict:
    import tinyserve_compile as tc

    c = CLIENTS[name]()
    row = dict(client=name, library=f"{c.dist}=={md.version(c.dist)}", torch=torch.__version__,
               tinyserve=md.version("tinyserve-compile"), lower=lower,
               options=SPARSE, dense_options=DENSE, prompt=PROMPT, new=NEW)
    t0 = time.time()
    eager_logits, dense_logits, sparse_logits, ref_logits = [], [], [], []
    eager = c.run(c.build(), None, eager_logits)
    n_q, n_kv, n_layers = HEADS

    torch._dynamo.reset()
    tc.reset()
    dense = c.run(c.build(), dict(DENSE, lower=lower), dense_logits)
    torch._dynamo.reset()
    tc.reset()
    sparse = c.run(c.build(), dict(SPARSE, lower=lower), sparse_logits)
    rep = tc.explain()
    torch._dynamo.reset()

    decode_sites = [s for g in rep.graphs for s in g["sites"] if s["status"] != "prefill"]
    sparse_sites = [s["status"] == "sparse" for s in decode_sites]
    if all(sparse_sites):  # one compiled site may serve every layer (a graph per layer, reused)
        rewritten_layers = set(range(n_layers)) if sparse_sites else set()
    else:  # some sites dense: one decode step's sites, in layer order
        rewritten_layers = {i for i, sp in enumerate(sparse_sites[:n_layers]) if sp}
    decode_steps = len(eager_logits) - 1  # the first token comes from the (dense) prefill
    with _reference(n_q, n_kv, n_layers, rewritten_layers, SPARSE) as mode:
        ref = c.run(c.build(), None, ref_logits)
    eager_l, dense_l = torch.stack(eager_logits), torch.stack(dense_logits)
    sparse_l, ref_l = torch.stack(sparse_logits), torch.stack(ref_logits)
    reasons = sorted({s["reason"] for s in decode_sites if s["status"] != "sparse"})
    if not rep.counters.get("attention_sites", 0):
        reasons = ["no scaled_dot_product_attention call in any compiled graph: nothing to rewrite"]
    row.update(
        graphs=rep.counters.get("graphs", 0),
        attention_sites=rep.counters.get("attention_sites", 0),
        sites_rewritten=rep.counters.get("rewritten", 0),
        sites_dense=rep.counters.get("dense", 0),
        # sparse attention calls per decode step, over the model's layers
        layers_rewritten=f"{rep.runtime.get('decode_calls', 0) / max(decode_steps, 1):g}/{n_layers}",
        dense_reasons=reasons,
        native_kernel=rep.native_kernel,
        decode_calls=rep.runtime.get("decode_calls", 0),
        reference_sparse_calls=mode.sparse_calls,
        worst_vs_reference=float((sparse_l - ref_l).abs().max()),
        tokens_equal_reference=bool(torch.equal(sparse.cpu(), ref.cpu())),
        sparse_vs_eager=float((sparse_l - eager_l).abs().max()),  # > 0: the selection dropped something
        dense_exact=bool(torch.equal(dense.cpu(), eager.cpu())),
        worst_dense_vs_eager=float((dense_l - eager_l).abs().max()),
        steps=len(sparse_logits), seconds=round(time.time() - t0, 1))
    return row


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("client", choices=sorted(CLIENTS))
    ap.add_argument("--lower", default="eager", choices=("eager", "inductor"))
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    try:
        row = drive(a.client, a.lower)
    except Exception as e:  # the sweep records the failure as the client's result
        row = dict(client=a.client, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-3000:])
    text = json.dumps(row)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
