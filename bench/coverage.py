"""Coverage sweep: every decoder-only architecture of the installed transformers, through the backend.

For each architecture with a causal-LM class that supports SDPA: a tiny random-init
config, an eager prefill into a ``StaticCache``, then a few greedy decode steps
through ``torch.compile(model, backend="tinyserve")``. Each one is classified as

``rewritten``
    some decode sites became sparse attention, and the logits equal an eager run in
    which exactly those layers are answered by the pure-PyTorch sparse reference
    (:mod:`tinyserve_compile.testing`), the other layers dense;
``dense``
    no site was rewritten (the reasons are listed) and the logits equal eager;
``wrong``
    the logits differ from what they should be (a bug), or the backend raised;
``skipped``
    the model cannot run a static-cache decode eagerly (no static cache, needs
    other inputs ...): nothing to compare.

``python -m bench coverage [--out PATH] [--archs a,b] [--quick]`` prints the table.
"""
from __future__ import annotations

import contextlib
import io
import math
import re
import sys
import time
import traceback
import warnings
from collections import Counter
from typing import Dict, List, Optional

import torch

#: a small, quick, varied subset (CI): plain GQA, learned positions + fused QKV, sliding-window layers, MLA
QUICK = ("llama", "gpt2", "cohere2", "deepseek_v3")

PROMPT, STEPS, MAX_CACHE = 40, 4, 96
MAX_PARAMS = 20_000_000
#: the sweep's sparse configuration: 3 pages of 8 out of 40+ tokens, so the selection matters
OPTIONS = {"token_budget": 24, "page_size": 8, "candidate_extra": 16, "dense_layers": 0, "lower": "eager"}
ATOL = RTOL = 1e-4

#: tiny sizes, applied to every config attribute of that name that the default config has
SIZES = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, n_positions=256,
    # mixture of experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
    moe_num_experts=4, moe_topk=2,
    # multi-head latent attention
    rotary_dim=8, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, qk_head_dim=16,
    # windows, linear attention and state-space layers of hybrids
    sliding_window=32, attention_window_size=32, linear_num_key_heads=2, linear_num_value_heads=2,
    linear_key_head_dim=16, linear_value_head_dim=16, mamba_d_state=8, mamba_n_heads=4, mamba_d_head=32,
    mamba_expand=2, mamba_n_groups=1, state_size=8, ssm_state_size=8, conv_kernel=4, mamba_d_conv=4,
    time_step_rank=8, num_kv_shared_layers=0, vocab_size_per_layer_input=128, hidden_size_per_layer_input=8,
    laurel_rank=8, altup_num_inputs=2, global_head_dim=16, attn_layer_period=2, attn_layer_offset=1,
    expert_layer_period=2, expert_layer_offset=1,
)


class _NoTinyConfig(Exception):
    """The architecture's config could not be shrunk generically."""


def _attr_default(cfg, name):
    try:
        return getattr(cfg, name)
    except Exception:  # noqa: BLE001 - properties that raise on a default config
        return None


def _tiny_kwargs(cls, default) -> dict:
    """Constructor arguments of config class ``cls`` that shrink ``default`` (one of its instances), sub-configs too."""
    kw = {}
    for name, value in SIZES.items():
        cur = _attr_default(default, name)
        # None: derived later, or read as is by the model
        derived = name in ("head_dim", "num_key_value_heads", "num_experts_per_tok") and hasattr(default, name)
        if (cur is None and not derived) or isinstance(cur, bool) or isinstance(cur, (list, tuple)):
            continue
        kw[name] = value
    n = SIZES["num_hidden_layers"]
    for name in ("layer_types", "layers_block_type"):
        types = _attr_default(default, name)
        if isinstance(types, (list, tuple)) and types:
            kinds = list(dict.fromkeys(types))
            kw[name] = [kinds[i % len(kinds)] for i in range(n)]
    for tok in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        cur = _attr_default(default, tok)
        if isinstance(cur, int) and cur >= SIZES["vocab_size"]:
            kw[tok] = {"bos_token_id": 1, "eos_token_id": 2}.get(tok, 0)
        elif isinstance(cur, list):
            kw[tok] = [2]
    for name in getattr(cls, "sub_configs", None) or {}:
        sub = _attr_default(default, name)
        if sub is not None and hasattr(sub, "to_dict"):
            d = sub.to_dict()
            d.update(_tiny_kwargs(type(sub), sub))
            kw[name] = d
    return kw


def tiny_config(model_type: str):
    """A random-init-sized config of ``model_type``: the default config with :data:`SIZES` applied (sub-configs too)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    if getattr(default, "is_encoder_decoder", False):
        raise ValueError("an encoder-decoder model, not decoder-only")
    kw = _tiny_kwargs(cls, default)
    for _ in range(4):  # drop what a config rejects (a read-only property, a derived list) and retry
        try:
            cfg = cls(**kw)
            break
        except Exception as e:  # noqa: BLE001
            bad = [k for k in kw if f"'{k}'" in str(e)] or [k for k in ("layer_types", "layers_block_type") if k in kw]
            if not bad:
                raise
            for k in bad:
                kw.pop(k)
    else:
        cfg = cls(**kw)
    model_cfg = getattr(_model_class(model_type), "config_class", None)
    if model_cfg is not None and not isinstance(cfg, model_cfg) and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()  # a composite config: the causal-LM class takes its text part
    return cfg


def architectures() -> List[str]:
    """Model types with a causal-LM class in the installed transformers, in name order."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _model_class(model_type: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def _calling_layer() -> Optional[int]:
    """The ``layer_idx`` of the HF attention module whose forward is on the stack (None if there is none)."""
    f = sys._getframe(2)
    for _ in range(40):
        if f is None:
            return None
        for name in ("module", "self"):
            obj = f.f_locals.get(name)
            idx = getattr(obj, "layer_idx", None)
            if isinstance(idx, int):
                return idx
        f = f.f_back
    return None


def _reference_mode(model, config, sparse_layers):
    """Eager SDPA answered by the sparse reference on ``sparse_layers`` (HF ``layer_idx``), dense elsewhere."""
    from tinyserve_compile.testing import _SDPA, _SparseReferenceMode

    class LayerReference(_SparseReferenceMode):
        def __init__(self):
            hq, hkv = _heads(model)
            super().__init__(config, hq, hkv)
            self.config_heads = (hq, hkv)
            self.layers_seen: List[Optional[int]] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in _SDPA:
                kw = kwargs or {}
                q = args[0] if args else kw["query"]
                k = args[1] if len(args) > 1 else kw["key"]
                gqa = bool(kw.get("enable_gqa", args[7] if len(args) > 7 else False))
                hq, hkv = self.config_heads
                if q.shape[2] == 1:  # heads of this call: KV heads as read, unless repeated to the query heads
                    self.n_q_heads = q.shape[1]
                    self.n_kv_heads = k.shape[1] if gqa or k.shape[1] != q.shape[1] else hkv
                elif q.shape[1] == k.shape[1] and q.shape[1] * q.shape[2] == hq:  # a GQA group folded into the length
                    self.n_q_heads, self.n_kv_heads = hq, k.shape[1]
                else:
                    return func(*args, **kw)
                layer = _calling_layer()
                self.layers_seen.append(layer)
                if layer not in sparse_layers:
                    return func(*args, **kw)
            return super().__torch_function__(func, types, args, kwargs)

    return LayerReference()


def _heads(model):
    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    hq = getattr(c, "num_attention_heads", None) or getattr(c, "n_head", None)
    return hq, getattr(c, "num_key_value_heads", None) or hq


class _AllLayers:
    """Every layer (``in`` is always True)."""

    def __contains__(self, layer) -> bool:
        return True


_ALL = _AllLayers()


def _layer_of(site: dict) -> Optional[int]:
    m = re.search(r"layers_(\d+)_", site.get("cache") or "")
    return int(m.group(1)) if m else None


@torch.no_grad()
def _decode(model, step, ids, steps, mode_factory=None):
    """Eager prefill into a new StaticCache, then ``steps`` greedy steps through ``step``; logits ``[steps, B, V]``."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=MAX_CACHE)
    out = model(ids, past_key_values=cache, use_cache=True)
    tok, logits, graphs = out.logits[:, -1:].argmax(-1), [], []
    import tinyserve_compile as tc

    for _ in range(steps):
        if mode_factory is not None:
            with mode_factory():
                o = model(tok, past_key_values=cache, use_cache=True)
        else:
            o = step(tok, past_key_values=cache, use_cache=True)
        graphs.append(tc.counters["graphs"])
        logits.append(o.logits[:, -1].float())
        tok = o.logits[:, -1:].argmax(-1)
    return torch.stack(logits), graphs


def _diff(a, b) -> float:
    return float((a - b).abs().max()) if a.shape == b.shape else math.inf


def check(model_type: str, options: Optional[dict] = None, steps: int = STEPS) -> Dict:
    """Run one architecture through the backend; a row of the coverage table."""
    import tinyserve_compile as tc
    from tinyserve_compile.config import TinyServeConfig

    opts = dict(OPTIONS, **(options or {}))
    row = {"arch": model_type, "status": "skipped", "decode_sites": 0, "rewritten": 0, "reasons": "", "graphs": 0,
           "recompiles_after_step_2": 0, "max_diff": None, "sparse_vs_dense": None, "seconds": 0.0}
    t0 = time.time()
    torch._dynamo.reset()
    tc.reset()
    try:
        cls = _model_class(model_type)
        if not getattr(cls, "_supports_sdpa", False):
            row["reasons"] = "no SDPA attention in this architecture"
            return row
        try:
            cfg = tiny_config(model_type)
        except Exception as e:  # noqa: BLE001
            raise _NoTinyConfig(f"{type(e).__name__}: {str(e).splitlines()[0][:100]}") from e
        if getattr(cfg, "kv_lora_rank", None):  # MLA: rotary on the qk_rope_head_dim part, one KV head per head
            cfg.head_dim = cfg.qk_rope_head_dim
            cfg.num_key_value_heads = cfg.num_attention_heads
        with torch.device("meta"):
            n_params = sum(p.numel() for p in cls._from_config(cfg).parameters())
        if n_params > MAX_PARAMS:
            raise _NoTinyConfig(f"it still has {n_params / 1e6:.0f}M parameters")
        torch.manual_seed(0)
        model = cls._from_config(cfg, attn_implementation="sdpa").eval()
        ids = torch.randint(3, SIZES["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(1))
        dense, _ = _decode(model, model, ids, steps)
    except _NoTinyConfig as e:
        row["reasons"] = f"no tiny config: {e}"
        row["seconds"] = round(time.time() - t0, 1)
        return row
    except Exception as e:  # noqa: BLE001 - the model cannot decode from a static cache eagerly: not ours
        row["reasons"] = f"eager static-cache decode fails: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
        row["trace"] = traceback.format_exc()[-2000:]
        row["seconds"] = round(time.time() - t0, 1)
        return row
    try:
        compiled = torch.compile(model, backend="tinyserve", options=opts)
        got, graphs = _decode(model, compiled, ids, steps)
    except Exception as e:  # noqa: BLE001 - the backend must never crash: a bug
        row.update(status="wrong", reasons=f"backend raised {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        row["trace"] = traceback.format_exc()[-2000:]
        row["seconds"] = round(time.time() - t0, 1)
        return row
    rep = tc.explain()
    sites = [s for g in rep.graphs for s in g["sites"] if s["query_len"] == 1]
    sparse = [s for s in sites if s["status"] == "sparse"]
    row.update(decode_sites=len(sites), rewritten=len(sparse), graphs=rep.counters.get("graphs", 0),
               recompiles_after_step_2=graphs[-1] - graphs[1] if len(graphs) > 2 else 0)
    reasons = Counter(s["reason"] for s in sites if s["status"] != "sparse")
    row["reasons"] = "; ".join(f"{r} (x{n})" if n > 1 else r for r, n in reasons.items())
    if not sparse:
        row["max_diff"] = _diff(got, dense)
        row["status"] = "dense" if torch.allclose(got, dense, atol=ATOL, rtol=RTOL) else "wrong"
    else:
        # every decode site rewritten: every decode call is sparse; otherwise the rewritten layers, by cache name
        layers = _ALL if len(sparse) == len(sites) else {_layer_of(s) for s in sparse}
        if layers is not _ALL and None in layers:
            row.update(status="wrong", reasons=row["reasons"] + "; rewritten site with no HF cache layer to check")
        else:
            config = TinyServeConfig.from_options(dict(opts, dense_layers=0))
            modes = []

            def factory():
                modes.append(_reference_mode(model, config, layers))
                return modes[-1]

            ref, _ = _decode(model, None, ids, steps, mode_factory=factory)
            seen = {x for m in modes for x in m.layers_seen}
            row["max_diff"] = _diff(got, ref)
            row["sparse_vs_dense"] = _diff(ref, dense)
            ok = torch.allclose(got, ref, atol=ATOL, rtol=RTOL) and (layers is _ALL or layers <= seen)
            row["status"] = "rewritten" if ok else "wrong"
    row["seconds"] = round(time.time() - t0, 1)
    return row


def _check_quietly(arch, options=None) -> Dict:
    import transformers

    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        return check(arch, options)


def _check_isolated(arch, timeout: float) -> Dict:
    """:func:`check` in a fresh interpreter (memory, dynamo state and crashes stay there)."""
    import json
    import subprocess

    try:
        p = subprocess.run([sys.executable, "-m", "bench.coverage", "--one", arch], capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"arch": arch, "status": "wrong", "decode_sites": 0, "rewritten": 0, "graphs": 0,
                "recompiles_after_step_2": 0, "max_diff": None, "sparse_vs_dense": None, "seconds": timeout,
                "reasons": f"timed out after {timeout:.0f} s"}
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode or not lines:
        return {"arch": arch, "status": "wrong", "decode_sites": 0, "rewritten": 0, "graphs": 0,
                "recompiles_after_step_2": 0, "max_diff": None, "sparse_vs_dense": None, "seconds": 0.0,
                "reasons": f"the check process died (exit {p.returncode})", "trace": p.stderr[-2000:]}
    return json.loads(lines[-1])


def sweep(archs=None, options=None, log=sys.stderr, isolate: bool = False, timeout: float = 900) -> List[Dict]:
    """Check every architecture in ``archs`` (default: all); one row each."""
    rows = []
    for a in archs or architectures():
        r = _check_isolated(a, timeout) if isolate else _check_quietly(a, options)
        rows.append(r)
        print(f"{a:28s} {r['status']:9s} {r['rewritten']}/{r['decode_sites']} {r['seconds']:6.1f}s  "
              f"{r['reasons'][:110]}", file=log, flush=True)
    return rows


def table(rows: List[Dict]) -> str:
    """The rows as a Markdown table, with the counts per status first."""
    counts = Counter(r["status"] for r in rows)
    head = ", ".join(f"{k}: {counts[k]}" for k in ("rewritten", "dense", "wrong", "skipped") if counts[k])
    lines = [f"{len(rows)} architectures - {head}", "",
             "| architecture | status | rewritten / decode sites | graphs (new after step 2) | max diff | why dense |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        d = "" if r["max_diff"] is None else f"{r['max_diff']:.1e}"
        lines.append(f"| {r['arch']} | {r['status']} | {r['rewritten']}/{r['decode_sites']} | {r['graphs']} ({r['recompiles_after_step_2']}) | {d} | "
                     f"{r['reasons']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """``python -m bench coverage``: the sweep and its table; exit status 1 when an architecture is wrong."""
    import argparse
    import json

    from bench import cli

    ap = cli.parser("coverage", "every decoder-only HF architecture through the backend",
                    quick="a few architectures (what CI runs)")
    ap.add_argument("--archs", default="", help="comma-separated model types (default: all)")
    ap.add_argument("--in-process", action="store_true", help="no fresh interpreter per architecture")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # one architecture, its row as one JSON line
    a = cli.parse(ap, argv, compare="coverage checks that every architecture compiles with the backend's defaults; "
                  "no variant is implemented")
    if a.one:  # the child process of _check_isolated
        print(json.dumps(_check_quietly(a.one), default=float))
        return 0
    from bench.output import write_rows

    archs = a.archs.split(",") if a.archs else (list(QUICK) if a.quick else architectures())
    rows = sweep(archs, isolate=not a.in_process)
    print(table(rows))
    path = cli.out_path(a.out, "coverage")
    if path:
        write_rows([{k: v for k, v in r.items() if k != "trace"} for r in rows], path)
    wrong = [r for r in rows if r["status"] == "wrong"]
    for r in wrong:
        print(f"\n{r['arch']}: {r['reasons']}\n{r.get('trace', '')}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
