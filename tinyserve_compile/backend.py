"""The ``tinyserve`` torch.compile backend: parse the config, run the passes, hand off.

``torch.compile(model, backend="tinyserve", options={...})`` works without importing
this package (``torch_dynamo_backends`` entry point) and after importing it.

CUDA graphs: ``mode="reduce-overhead"`` (HF generate's default ``CompileConfig``) or the
``cudagraphs`` option runs the rewritten graph under Inductor's CUDA graphs when it can
(:func:`_cudagraphs_decision`); :func:`~tinyserve_compile.explain` says per graph whether
they are on, and why not, including the reasons Inductor gives for skipping them;
:func:`cudagraph_skips` collects those reasons for any compiled function (``python -m bench decode`` records
them per provider).

A compile that fails (a pass, the Inductor lowering, ...) is recorded in its graph's explain record before the
exception goes on to Dynamo (which then graph-breaks, runs the frame eagerly under ``suppress_errors``, or raises
``BackendCompilerFailed``): :func:`~tinyserve_compile.explain` shows the graph as failed, with the exception, and
does not count its sites as rewritten. A rewritten graph counts its calls, so a graph that was compiled and never
run is shown as such too.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from . import runtime
from .config import INDUCTOR_DEFAULTS, TinyServeConfig
from .explain import latest_graph, record_cudagraphs, record_failure, record_graph
from .passes import run_passes
from .passes._views import is_written_in_place
from .passes.state import pass_state
from .policies.op import POLICY_ATTENTION

__all__ = ["tinyserve_backend", "register", "cudagraph_skips"]

BACKEND_NAME = "tinyserve"
#: ops that must run in PyTorch when the rest of the graph goes to TensorRT
TORCH_EXECUTED_OPS = (
    "torch.ops.tinyserve.cache_write.default",
    "torch.ops.tinyserve.sparse_decode.default",
    "torch.ops.tinyserve.policy_attention.default",
    "torch.ops.tinyserve.linear_int4.default",  # Int4Linear modules (tinyserve_compile.quantization)
    "torch.ops.tinyserve.linear_int4_group.default",
)


#: the graph whose compile or call is in progress (its explain record), to which Inductor's CUDA-graph skips belong
_CURRENT: List[Optional[dict]] = [None]
#: Inductor's warnings about CUDA graphs are logged here (``torch._inductor.cudagraph_utils.cudagraphs_log``)
CUDAGRAPH_LOGGER = "torch._inductor.cudagraph_utils.__cudagraphs"


class _CudagraphSkipLog(logging.Handler):
    """Inductor's "skipping cudagraphs due to ..." warnings, recorded in the explain record of the graph whose
    compile or call logged them (:data:`_CURRENT`); messages of other compiled functions are left alone."""

    def __init__(self):
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        info = _CURRENT[0]
        if info is None or not info["cudagraphs"]["on"]:  # not ours, or already off: the first reason stays
            return
        msg = _skip_message(record)
        if msg is not None:
            record_cudagraphs(info, False, "Inductor: " + msg.strip().splitlines()[0][:300])


def _skip_message(record: logging.LogRecord) -> Optional[str]:
    """The text of an Inductor "skipping cudagraphs ..." record; None for any other record (or a malformed one)."""
    try:
        msg = record.getMessage()
    except Exception:  # noqa: BLE001 - a malformed record: nothing to report
        return None
    return msg if "skipping cudagraph" in msg else None


def _cudagraph_skip_logger() -> logging.Logger:
    """The logger Inductor logs its CUDA-graph skips to: ``cudagraphs_log``, or on torch 2.8, which has none, its
    perf-hints logger (a handler keeps only "skipping cudagraph" messages: :func:`_skip_message`)."""
    import torch._inductor.cudagraph_utils as cg

    return (getattr(cg, "cudagraphs_log", None) or getattr(cg, "perf_hint_log", None)
            or logging.getLogger(CUDAGRAPH_LOGGER))


_SKIP_LOG = _CudagraphSkipLog()


def _watch_cudagraph_skips() -> None:
    """Attach :data:`_SKIP_LOG` to the logger Inductor logs its CUDA-graph skips to (once):
    :func:`_cudagraph_skip_logger`."""
    log = _cudagraph_skip_logger()
    if _SKIP_LOG not in log.handlers:
        log.addHandler(_SKIP_LOG)


class _SkipList(logging.Handler):
    """Appends the text of each "skipping cudagraphs ..." record to ``messages``."""

    def __init__(self, messages: List[str]):
        super().__init__(logging.WARNING)
        self.messages = messages

    def emit(self, record: logging.LogRecord) -> None:
        msg = _skip_message(record)
        if msg is not None:
            self.messages.append(msg)


@contextlib.contextmanager
def cudagraph_skips() -> Iterator[List[str]]:
    """Inductor's "skipping cudagraphs due to ..." messages logged while the ``with`` block runs: a list, filled in
    the order they come, whatever logged them (stock Inductor or this backend's lowering)::

        with cudagraph_skips() as skips:
            compiled(*args)  # e.g. the first call of torch.compile(model, mode="reduce-overhead")
        skips  # ["skipping cudagraphs due to mutated inputs (1 instances). Found from : ...", ...]

    It listens where the backend does for its explain records (:func:`_cudagraph_skip_logger`: ``cudagraphs_log``,
    on torch 2.8 the perf-hints logger, of whose messages only the skips are kept) and records nothing itself.
    """
    messages: List[str] = []
    handler = _SkipList(messages)
    log = _cudagraph_skip_logger()
    log.addHandler(handler)
    try:
        yield messages
    finally:
        log.removeHandler(handler)


def _inductor_cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def _cudagraphs_decision(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: TinyServeConfig,
                         mode: Optional[str]) -> Tuple[bool, str]:
    """Whether the rewritten graph runs under CUDA graphs, and why not when it does not.

    Parameters
    ----------
    gm : torch.fx.GraphModule
        The graph after the passes.
    example_inputs : sequence
        Dynamo's example inputs of ``gm``.
    config : TinyServeConfig
    mode : str, optional
        ``torch.compile``'s ``mode``.

    Returns
    -------
    (bool, str)
        On or off, and the reason when off ("" when on).
    """
    if not config.cudagraphs_requested(mode):
        return False, "not requested"
    if config.lower != "inductor":
        return False, f"lower={config.lower!r}"
    devices = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
    if "cuda" not in devices:
        return False, f"device is {'/'.join(sorted(devices)) or 'cpu'}"
    if any(n.op == "call_function" and n.target is POLICY_ATTENTION for n in gm.graph.nodes):
        return False, f"policy {config.policy} runs Python per call (tinyserve::policy_attention)"
    if any(n.op == "call_function" and n.target is torch.ops.tinyserve.sparse_decode.default for n in gm.graph.nodes):
        kernel = runtime.decode_kernel(torch.device("cuda"), config)
        if kernel != "triton":  # the PyTorch path reads ctrl and the valid lengths on the host
            return False, f"kernel={config.kernel!r} runs the PyTorch path ({kernel}), which reads the device on the host"
    return True, ""


def _lower(gm: torch.fx.GraphModule, example_inputs: List[Any], config: TinyServeConfig,
           cudagraphs: bool = False) -> Callable:
    if config.lower == "eager":
        return gm.forward
    if config.lower == "inductor":
        import torch._inductor.config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        # the backend's Inductor defaults under the caller's settings, and CUDA graphs as decided, for this
        # compile only
        with inductor_config.patch({**INDUCTOR_DEFAULTS, **(config.inductor_options or {}),
                                    "triton.cudagraphs": cudagraphs}):
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
    """A copy of ``gm`` to rewrite: dynamo reads its own graph's placeholders after the backend returns.

    The copy keeps what AOTAutograd reads from a Dynamo graph to find its static inputs (for CUDA graphs):
    ``meta`` (``dynamo_compile_id``, each placeholder's ``tensor_dict``), ``_param_name_to_source`` and each
    placeholder's ``_dynamo_source``. Without them AOTAutograd takes the graph for an exported one, and no
    input (not the parameters, not the caches) would count as static.
    """
    graph = torch.fx.Graph()
    val_map = {}
    out = graph.graph_copy(gm.graph, val_map)
    graph.output(out)
    new = torch.fx.GraphModule(gm, graph)
    new.meta.update(gm.meta)
    for old, node in val_map.items():
        if old.op == "placeholder" and hasattr(old, "_dynamo_source"):
            node._dynamo_source = old._dynamo_source
    if hasattr(gm, "_param_name_to_source"):
        new._param_name_to_source = gm._param_name_to_source
    return new


def _finish_dynamo_metadata(gm: torch.fx.GraphModule) -> None:
    """Keep the rewritten graph readable as a Dynamo graph by AOTAutograd (see :func:`_copy`).

    The placeholders the passes added have no source in user code (``_dynamo_source = None``, as for
    intermediates of DDPOptimizer's split graphs). Should the graph hold a parameter or buffer that Dynamo
    did not name, ``_param_name_to_source`` goes: AOTAutograd would reject it, and reads the graph as an
    exported one instead (its static inputs are then the graph's own parameters and buffers).
    """
    if not hasattr(gm, "_param_name_to_source"):
        return
    names = gm._param_name_to_source
    if any(n not in names for n, _ in (*gm.named_parameters(remove_duplicate=False),
                                       *gm.named_buffers(remove_duplicate=False))):
        del gm._param_name_to_source
        return
    for node in gm.graph.find_nodes(op="placeholder"):
        if not hasattr(node, "_dynamo_source"):
            node._dynamo_source = None


def _check_freezing(gm: torch.fx.GraphModule, config: TinyServeConfig) -> None:
    """Refuse Inductor's freezing for a graph that writes a tensor attribute in place.

    torch 2.8's Dynamo installs a tensor marked with ``mark_static_address`` (HF's ``StaticCache`` layers) as a
    ``get_attr`` of the graph; freezing folds attributes as constants, so the cache writes are lost and decode
    gives wrong tokens (stock ``torch.compile`` too). torch 2.9 makes such tensors graph inputs.
    """
    import torch._inductor.config as inductor_config

    opts = config.inductor_options or {}
    if config.lower != "inductor" or not opts.get("freezing", inductor_config.freezing):
        return
    written = [n.target for n in gm.graph.find_nodes(op="get_attr") if is_written_in_place(n)]
    if written:
        raise ValueError(f"tinyserve option 'inductor_options' freezing=True: the graph writes tensor attributes "
                         f"in place ({', '.join(written[:3])}{', ...' if len(written) > 3 else ''}; torch "
                         f"{torch.__version__.split('+')[0]}'s Dynamo makes static-address caches attributes), and "
                         f"freezing folds them as constants, losing the writes: needs torch >= 2.9, or freezing off")


def _describe_failure(e: BaseException) -> str:
    """``"Type: first line of the message"`` of a failed compile (the backend's own exception inside Dynamo's
    ``BackendCompilerFailed``), at most 300 characters."""
    inner = getattr(e, "inner_exception", None)
    if isinstance(inner, BaseException):
        e = inner
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:300]}" if lines else type(e).__name__


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
        ``torch.compile``'s ``mode`` (one of :data:`~tinyserve_compile.config.COMPILE_MODES`; torch passes it
        unless it is "default"): "reduce-overhead" and "max-autotune" turn CUDA graphs on unless the
        ``cudagraphs`` option says otherwise.
    """
    config = TinyServeConfig.from_options(options)
    config.cudagraphs_requested(mode)  # a bad mode raises before any work
    step = {"stage": "the passes", "info": None}  # what runs now, and the graph's explain record once made
    try:
        return _compile(gm, example_inputs, config, mode, step)
    except Exception as e:
        # recorded before Dynamo sees it: whatever Dynamo does next (a graph break, the frame run eagerly under
        # suppress_errors, BackendCompilerFailed to the caller), explain() shows the graph as failed
        if step["info"] is None:  # failed before the graph was recorded: a record without sites
            record_graph(gm, config)
            step["info"] = latest_graph()
        record_failure(step["info"], step["stage"], _describe_failure(e))
        raise


def _compile(gm: torch.fx.GraphModule, example_inputs: List[Any], config: TinyServeConfig, mode: Optional[str],
             step: dict) -> Callable:
    """The body of :func:`tinyserve_backend`; ``step["stage"]`` names the stage that runs and ``step["info"]``
    holds the graph's explain record once it is made, for the record of a failure."""
    _check_freezing(gm, config)
    gm = run_passes(_copy(gm), config)
    _finish_dynamo_metadata(gm)
    state = pass_state(gm)
    record_graph(gm, config, state)
    info = step["info"] = latest_graph()  # this graph's record in explain()
    step["stage"] = "the backend"
    if config.strict:
        for site in state.sites:
            if site.query_len == 1 and site.status == "dense" and "dense_layers" not in site.reason:
                raise ValueError(f"tinyserve option 'strict'=True: decode attention site {site.node.name} "
                                 f"stays dense: {site.reason}")
    slots = state.bounds
    # each buffer's bounds (and on CUDA its ctrl) live on the buffer's device
    extra = [t for slot in slots for t in slot.example_inputs(slot.cache(example_inputs).device)]
    cudagraphs, why_not = _cudagraphs_decision(gm, example_inputs, config, mode)
    record_cudagraphs(info, cudagraphs, why_not)
    if cudagraphs:
        _watch_cudagraph_skips()
    skips = _inductor_cudagraph_skips()
    step["stage"] = f"lowering ({config.lower})"
    _CURRENT[0] = info if cudagraphs else None  # a skip Inductor logs while compiling is this graph's
    try:
        compiled = _lower(gm, list(example_inputs) + extra, config, cudagraphs)
    finally:
        _CURRENT[0] = None
    if cudagraphs and info["cudagraphs"]["on"] and _inductor_cudagraph_skips() > skips:  # counted, not logged to us
        record_cudagraphs(info, False, "Inductor skipped them (TORCH_LOGS=cudagraphs logs its reason)")
    dense_layers = config.dense_layers
    if not slots and not cudagraphs:
        return compiled
    info["calls"] = 0  # a graph with rewritten sites counts its calls: explain() tells one that never ran

    if not cudagraphs:
        def run(*args):
            # one version check per key-cache buffer, then the graph with the bounds as inputs
            info["calls"] += 1
            out = compiled(*args, *runtime.enter(slots, args, dense_layers))
            runtime.leave(slots, args)
            return out

        return run

    def run_cudagraphs(*args):
        # as run, and a skip that CUDA graphs log during the call (a mutated input, re-recording) is this graph's
        info["calls"] += 1
        extra_now = runtime.enter(slots, args, dense_layers) if slots else ()
        _CURRENT[0] = info
        try:
            out = compiled(*args, *extra_now)
        finally:
            _CURRENT[0] = None
        if slots:
            runtime.leave(slots, args)
        return out

    return run_cudagraphs


def register() -> None:
    """Register the backend under ``"tinyserve"`` unless dynamo already knows it.

    When dynamo found the entry point first, it registers the backend itself on
    lookup, so registering here too would be a duplicate.
    """
    from torch._dynamo.backends import registry

    if BACKEND_NAME not in registry._BACKENDS and BACKEND_NAME not in registry._COMPILER_FNS:
        registry.register_backend(tinyserve_backend, name=BACKEND_NAME)
