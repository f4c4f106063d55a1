"""The ``tinyserve`` torch.compile backend: parse the config, run the passes, hand off.

``torch.compile(model, backend="tinyserve", options={...})`` works without importing
this package (``torch_dynamo_backends`` entry point) and after importing it.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch

from . import runtime
from .config import INDUCTOR_DEFAULTS, TinyServeConfig
from .explain import record_graph

__all__ = ["tinyserve_backend", "register"]

BACKEND_NAME = "tinyserve"
#: ops that must run in PyTorch when the rest of the graph goes to TensorRT
TORCH_EXECUTED_OPS = (
    "torch.ops.tinyserve.cache_write.default",
    "torch.ops.tinyserve.sparse_decode.default",
    "torch.ops.tinyserve.paged_attention.default",
    "torch.ops.tinyserve.linear_int4.default",  # Int4Linear modules (tinyserve_compile.quantization)
    "torch.ops.tinyserve.linear_int4_group.default",
)


def _lower(gm: torch.fx.GraphModule, example_inputs: List[Any], config: TinyServeConfig) -> Callable:
    if config.lower == "eager":
        return gm.forward
    if config.lower == "inductor":
        import torch._inductor.config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        # the backend's Inductor defaults under the caller's settings, for this compile only
        with inductor_config.patch({**INDUCTOR_DEFAULTS, **(config.inductor_options or {})}):
            return compile_fx(gm, example_inputs)
    # "tensorrt": Torch-TensorRT's torch.compile backend, with our ops left to PyTorch.
    try:
        import torch_tensorrt  # noqa: F401  (registers the "torch_tensorrt" dynamo backend)
    except ImportError as e:  # pragma: no cover - not installable on these machines
        raise NotImplementedError(
            "tinyserve option 'lower'='tensorrt' needs torch-tensorrt (pip install 'tinyserve-compile[tensorrt]'); "
            f"importing it failed: {e}"
        ) from e
    from torch._dynamo.backends.registry import lookup_backend

    trt = lookup_backend("torch_tensorrt")
    return trt(gm, example_inputs, options={"torch_executed_ops": set(TORCH_EXECUTED_OPS), "min_block_size": 1})


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` to rewrite: dynamo reads its own graph's placeholders after the backend returns."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    new = torch.fx.GraphModule(gm, graph)
    new.meta.update(gm.meta)
    return new


def tinyserve_backend(gm: torch.fx.GraphModule, example_inputs: List[Any], options: Optional[dict] = None,
                      mode: Optional[str] = None, **unused) -> Callable:
    """Dynamo backend: rewrite decode-mode SDPA into paged sparse attention, then lower.

    Parameters
    ----------
    gm : torch.fx.GraphModule
        The graph dynamo captured.
    example_inputs : list
        Its example inputs.
    options : dict, optional
        Parsed into :class:`~tinyserve_compile.config.TinyServeConfig`.
    mode : str, optional
        Accepted for HF's compile path; ignored.
    """
    from tinyserve_compile.passes import run_passes

    config = TinyServeConfig.from_options(options)
    gm = run_passes(_copy(gm), config)
    record_graph(gm, config)
    if config.strict:
        for site in gm.meta.get("tinyserve_sites", []):
            if site.query_len == 1 and site.status == "dense" and "dense_layers" not in site.reason:
                raise ValueError(f"tinyserve option 'strict'=True: decode attention site {site.node.name} "
                                 f"stays dense: {site.reason}")
    slots = gm.meta.get("tinyserve_bounds", [])
    device = next((t.device for t in example_inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
    extra = [t for slot in slots for t in slot.example_inputs(device)]
    compiled = _lower(gm, list(example_inputs) + extra, config)
    if not slots:
        return compiled
    dense_layers = config.dense_layers

    def run(*args):
        # one version check per key-cache buffer, then the graph with the bounds as inputs
        out = compiled(*args, *runtime.enter(slots, args, dense_layers))
        runtime.leave(slots, args)
        return out

    return run


def register() -> None:
    """Register the backend under ``"tinyserve"`` unless dynamo already knows it.

    When dynamo found the entry point first, it registers the backend itself on
    lookup, so registering here too would be a duplicate.
    """
    from torch._dynamo.backends import registry

    if BACKEND_NAME not in registry._BACKENDS and BACKEND_NAME not in registry._COMPILER_FNS:
        registry.register_backend(tinyserve_backend, name=BACKEND_NAME)
