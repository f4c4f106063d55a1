"""The one frozen configuration of the backend, and its defaults as named constants.

``torch.compile(model, backend="tinyserve", options={...})`` parses ``options``
into :class:`TinyServeConfig` with :meth:`TinyServeConfig.from_options`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional

# the selection's defaults and vocabulary are defined once, in kernels/spec.py
from .kernels.spec import BOUNDS_DTYPE_NAMES as BOUNDS_DTYPES
from .kernels.spec import (
    DEFAULT_BOUNDS_DTYPE,
    DEFAULT_CANDIDATE_EXTRA,
    DEFAULT_CANDIDATE_FACTOR,
    DEFAULT_KEEP_TOKENS,
    DEFAULT_PAGE_SIZE,
    DEFAULT_SINK_PAGES,
    DEFAULT_TOKEN_BUDGET,
)
from .kernels.spec import KERNELS as KERNEL_CHOICES
from .kernels.spec import MAX_INDEX, SelectionSpec
from .policies import POLICIES

__all__ = [
    "TinyServeConfig",
    "DEFAULT_PAGE_SIZE",
    "DEFAULT_TOKEN_BUDGET",
    "DEFAULT_DENSE_LAYERS",
    "DEFAULT_SINK_PAGES",
    "DEFAULT_CANDIDATE_FACTOR",
    "DEFAULT_CANDIDATE_EXTRA",
    "DEFAULT_KEEP_TOKENS",
    "DEFAULT_POLICY",
    "DEFAULT_LOWER",
    "DEFAULT_KERNEL",
    "DEFAULT_BOUNDS_DTYPE",
    "DEFAULT_DECODE_LINEAR",
    "DEFAULT_DENSE_BY_COST",
    "DEFAULT_CUDAGRAPHS",
    "INDUCTOR_DEFAULTS",
    "COMPILE_MODES",
    "CUDAGRAPH_MODES",
    "BOUNDS_DTYPES",
    "LOWERINGS",
    "KERNEL_CHOICES",
    "check_mode",
]

DEFAULT_DENSE_LAYERS = 2
DEFAULT_POLICY = "query_aware"
DEFAULT_LOWER = "inductor"
DEFAULT_KERNEL = "auto"
#: rewrite decode-shaped linears (at most 8 activation rows, fp32/bf16 weights) into ``tinyserve::linear``, the
#: native CPU GEMV that streams each weight once (ATen's mm runs these shapes well below the read bandwidth)
DEFAULT_DECODE_LINEAR = True
#: attend a decode site densely (the op's one-launch dense mode) where the cost model says its page selection
#: cannot pay on the device, decided from the static shapes at compile time (:func:`.cost.selection_pays`): on a
#: GPU, a cache too short for the selection's extra launches to pay for the bytes they save
DEFAULT_DENSE_BY_COST = True
#: ``inductor_options`` with ``cpp_wrapper`` on: compile the C++ wrapper and the kernels as separate files unless
#: the caller says otherwise (a large decode graph compiles several times faster so: docs/design.md)
CPP_WRAPPER_BUILD_SEPARATE = True
#: Inductor settings the backend compiles with unless ``inductor_options`` sets them: no per-call re-check of the
#: compiled graph's input sizes, strides and alignment. Dynamo's guards check every tensor input's size and stride
#: before the graph runs (a weight held as a tensor subclass: its inner tensors too), so these asserts repeat them,
#: one ``assert_size_stride`` call per input per step (docs/design.md gives what they cost). vLLM turns them off for
#: serving the same way. ``inductor_options={"size_asserts": True}`` brings them back.
INDUCTOR_DEFAULTS = MappingProxyType({"size_asserts": False, "alignment_asserts": False})
#: ``cudagraphs``: None runs the rewritten graph under Inductor's CUDA graphs when ``torch.compile``'s ``mode`` asks
#: for them (:data:`CUDAGRAPH_MODES`), as Inductor itself does; True/False force it either way
DEFAULT_CUDAGRAPHS = None
#: ``torch.compile(..., mode=...)`` values the backend takes (torch hands ``mode`` to a backend unless it is
#: None or "default"; HF generate's ``CompileConfig`` defaults to "reduce-overhead")
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: the modes that turn CUDA graphs on (Inductor's ``triton.cudagraphs`` in ``torch._inductor.list_mode_options``)
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")

LOWERINGS = ("inductor", "eager", "tensorrt")


@dataclass(frozen=True)
class TinyServeConfig:
    """Settings of the tinyserve backend.

    Attributes
    ----------
    page_size : int
        Tokens per KV page ``S``.
    token_budget : int
        Tokens attended per KV head and step; ``token_budget // page_size`` pages.
    dense_layers : int
        The first ``dense_layers`` decode attention sites (graph order) stay dense.
    sink_pages : int
        First pages always kept (attention sinks).
    candidate_factor : int
        Two-stage selection: the bound keeps ``candidate_factor * token_budget + candidate_extra``
        tokens' worth of candidate pages, whose exact logits pick what is attended.
    candidate_extra : int
        Extra candidate tokens (rounded down to pages). Two-stage whenever the candidates exceed the budget.
    keep_tokens : bool
        Two-stage: keep the ``token_budget`` single tokens of highest softmax share (max over the GQA group)
        among the candidates, instead of the best whole pages.
    policy : str
        Page-selection policy name (see :mod:`tinyserve_compile.policies`).
    lower : {"inductor", "eager", "tensorrt"}
        What compiles the rewritten graph.
    kernel : {"auto", "native", "torch", "triton"}
        Sparse-attention implementation ("auto": Triton on CUDA, the native C++
        kernel on CPU when it builds, else PyTorch).
    bounds_dtype : {"bfloat16", "float32", "int8"}
        Storage of the page max/min: bfloat16 is rounded outward (max up, min down),
        so scores stay upper bounds at half the bytes of float32; int8 holds codes on a
        per-page grid of ``kabs / 126``, rounded outward, at a quarter of the bytes.
    strict : bool
        Raise instead of leaving a decode attention site dense.
    dense_by_cost : bool
        Attend a rewritten site densely (every key, in the op's dense mode) where the cost model says its page
        selection cannot beat that on the device, from the static shapes at compile time
        (:func:`tinyserve_compile.cost.selection_pays`; :data:`DEFAULT_DENSE_BY_COST`). The answer is then
        exact dense attention; ``explain()`` gives each such site's reason and counts it (``dense_by_cost``).
    decode_linear : bool
        Rewrite each CPU linear with at most 8 activation rows and fp32/bf16 weights held by the graph
        (parameters, constants) into ``tinyserve::linear``, the native GEMV (when the native module builds).
    inductor_options : dict, optional
        Settings of ``torch._inductor.config`` (``{"cpp_wrapper": True}``, ``{"freezing": True}``, ...) in force
        while Inductor compiles the rewritten graph (``lower="inductor"`` only), through
        ``torch._inductor.config.patch``: nothing changes outside that compile. They apply over
        :data:`INDUCTOR_DEFAULTS` (Inductor's input size/stride asserts off). With ``cpp_wrapper`` on,
        ``cpp_wrapper_build_separate`` defaults to :data:`CPP_WRAPPER_BUILD_SEPARATE` (True) unless given.
        ``triton.cudagraphs`` is not one of them: the ``cudagraphs`` option sets it.
    cudagraphs : bool, optional
        Run the rewritten graph under Inductor's CUDA graphs (``torch._inductor.config.triton.cudagraphs`` for
        this compile). None (:data:`DEFAULT_CUDAGRAPHS`) follows ``torch.compile``'s ``mode``: on for
        "reduce-overhead" and "max-autotune" (:data:`CUDAGRAPH_MODES`), the modes that turn them on for Inductor;
        the other settings of a mode (max-autotune's autotuning) are not applied, ``inductor_options`` sets those.
        ``torch.compile`` takes ``mode`` or ``options``, not both, so ``options={"cudagraphs": True, ...}`` is how
        to get CUDA graphs together with other options. They apply with ``lower="inductor"`` on a CUDA device and
        a policy that runs no Python per call; :func:`~tinyserve_compile.explain` says, per graph, whether they
        are on and why not when they are off.
    """

    page_size: int = DEFAULT_PAGE_SIZE
    token_budget: int = DEFAULT_TOKEN_BUDGET
    dense_layers: int = DEFAULT_DENSE_LAYERS
    sink_pages: int = DEFAULT_SINK_PAGES
    candidate_factor: int = DEFAULT_CANDIDATE_FACTOR
    candidate_extra: int = DEFAULT_CANDIDATE_EXTRA
    keep_tokens: bool = DEFAULT_KEEP_TOKENS
    policy: str = DEFAULT_POLICY
    lower: str = DEFAULT_LOWER
    kernel: str = DEFAULT_KERNEL
    bounds_dtype: str = DEFAULT_BOUNDS_DTYPE
    strict: bool = False
    dense_by_cost: bool = DEFAULT_DENSE_BY_COST
    decode_linear: bool = DEFAULT_DECODE_LINEAR
    inductor_options: Optional[Mapping[str, Any]] = field(default=None, hash=False)
    cudagraphs: Optional[bool] = DEFAULT_CUDAGRAPHS

    def __post_init__(self):
        def bad(name, msg):
            raise ValueError(f"tinyserve option '{name}' {msg}")

        if not isinstance(self.dense_layers, int) or isinstance(self.dense_layers, bool) or \
                not 0 <= self.dense_layers <= MAX_INDEX:
            bad("dense_layers", f"must be an int in [0, {MAX_INDEX}], got {self.dense_layers!r}")
        if self.bounds_dtype not in BOUNDS_DTYPES:
            bad("bounds_dtype", f"must be one of {BOUNDS_DTYPES}, got {self.bounds_dtype!r}")
        # the selection's fields are checked where they are defined: by the spec they build (ranges, MAX_INDEX)
        SelectionSpec.from_config(self)
        if self.lower not in LOWERINGS:
            bad("lower", f"must be one of {LOWERINGS}, got {self.lower!r}")
        if self.kernel not in KERNEL_CHOICES:
            bad("kernel", f"must be one of {KERNEL_CHOICES}, got {self.kernel!r}")
        if not isinstance(self.strict, bool):
            bad("strict", f"must be a bool, got {self.strict!r}")
        if not isinstance(self.dense_by_cost, bool):
            bad("dense_by_cost", f"must be a bool, got {self.dense_by_cost!r}")
        if not isinstance(self.decode_linear, bool):
            bad("decode_linear", f"must be a bool, got {self.decode_linear!r}")
        if self.cudagraphs is not None and not isinstance(self.cudagraphs, bool):
            bad("cudagraphs", f"must be None (follow torch.compile's mode), True or False, got {self.cudagraphs!r}")
        if self.inductor_options is not None:
            self._check_inductor_options(bad)
        if self.policy not in POLICIES:
            bad("policy", f"must be one of {sorted(POLICIES)}, got {self.policy!r}")

    def _check_inductor_options(self, bad) -> None:
        opts = self.inductor_options
        if not isinstance(opts, Mapping):
            bad("inductor_options", f"must be a dict of torch._inductor.config settings, got {type(opts).__name__}")
        if opts and self.lower != "inductor":
            bad("inductor_options", f"applies only with lower='inductor', got lower={self.lower!r}")
        import torch._inductor.config as inductor_config

        known = inductor_config.get_config_copy()
        unknown = sorted(str(k) for k in opts if not isinstance(k, str) or k not in known)
        if unknown:
            bad("inductor_options", f"has unknown torch._inductor.config key(s) {unknown}")
        if "triton.cudagraphs" in opts:
            bad("inductor_options", "sets 'triton.cudagraphs': use the tinyserve option 'cudagraphs' (True/False) "
                "or torch.compile's mode='reduce-overhead'")
        # a private copy, so that a caller's later change to its dict does not reach this frozen config
        opts = dict(opts)
        if opts.get("cpp_wrapper") and "cpp_wrapper_build_separate" not in opts:
            # the wrapper and the kernels compiled as separate files: SmolLM2's decode graph in 84 s, not 412 s
            opts["cpp_wrapper_build_separate"] = CPP_WRAPPER_BUILD_SEPARATE
        object.__setattr__(self, "inductor_options", opts)

    @classmethod
    def from_options(cls, options: Optional[Mapping[str, Any]] = None) -> "TinyServeConfig":
        """Parse ``torch.compile(..., options=...)``; unknown keys raise ``ValueError`` listing the valid ones."""
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        if not isinstance(options, Mapping):
            raise ValueError(f"tinyserve options must be a dict, got {type(options).__name__}")
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(f"unknown tinyserve option(s) {unknown}; valid options: {valid}")
        return cls(**dict(options))

    @property
    def bounds_torch_dtype(self):
        """:attr:`bounds_dtype` as a ``torch.dtype``."""
        import torch

        return getattr(torch, self.bounds_dtype)

    @property
    def candidate_pages(self) -> int:
        """Candidate pages of the first stage (two-stage when more than ``token_budget // page_size``)."""
        return SelectionSpec.from_config(self).n_candidates

    def cudagraphs_requested(self, mode: Optional[str] = None) -> bool:
        """Whether CUDA graphs are asked for: :attr:`cudagraphs`, or when it is None, ``mode``.

        Parameters
        ----------
        mode : str, optional
            ``torch.compile``'s ``mode`` as the backend received it; one of :data:`COMPILE_MODES`.

        Raises
        ------
        ValueError
            ``mode`` is not one of :data:`COMPILE_MODES` (the message names 'mode').
        """
        check_mode(mode)
        if self.cudagraphs is not None:
            return self.cudagraphs
        return mode in CUDAGRAPH_MODES

    def replace(self, **changes) -> "TinyServeConfig":
        return dataclasses.replace(self, **changes)


def check_mode(mode: Optional[str]) -> None:
    """Raise ``ValueError`` naming 'mode' unless ``mode`` is one of :data:`COMPILE_MODES`."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"tinyserve: torch.compile 'mode' must be one of {COMPILE_MODES}, got {mode!r}")
