"""The selection spec: every knob of the page selection in one object.

Custom ops cannot take a dataclass, so every op schema takes the spec as one
``int[] spec`` argument, built by :meth:`SelectionSpec.to_list` and read back by
:meth:`SelectionSpec.from_list` (in C++, ``Spec::from_list`` of ``csrc/spec.h``).

This module is the one definition of the selection's vocabulary and rules: the bounds dtypes, the kernel
choices, the defaults (``DEFAULT_*``, which :class:`tinyserve_compile.config.TinyServeConfig`'s fields take;
:meth:`SelectionSpec.default`), the candidate count (:func:`candidate_pages`) and the dense rule
(:attr:`SelectionSpec.n_dense_pages`). No other layer has constants of its own.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Sequence

import torch

__all__ = ["SelectionSpec", "BOUNDS_CODES", "BOUNDS_DTYPE_NAMES", "KERNELS", "PAGED_KERNELS", "candidate_pages",
           "MAX_INDEX", "MAX_PAGE_SIZE", "MASKED_AT_OR_BELOW", "attended", "reads_every_key",
           "DEFAULT_PAGE_SIZE", "DEFAULT_TOKEN_BUDGET", "DEFAULT_SINK_PAGES", "DEFAULT_CANDIDATE_FACTOR",
           "DEFAULT_CANDIDATE_EXTRA", "DEFAULT_KEEP_TOKENS", "DEFAULT_BOUNDS_DTYPE"]

# ---- the selection's defaults (TinyServeConfig's fields take them) ----------------------------------------------
#: tokens per page; 8 chosen in the selection-quality study (README "Results: accuracy and selection quality")
DEFAULT_PAGE_SIZE = 8
DEFAULT_TOKEN_BUDGET = 2048
#: attention-sink pages always kept (0 = the paper's rule; 1 chosen in the selection-quality study)
DEFAULT_SINK_PAGES = 1
#: two-stage selection: the bound keeps ``candidate_factor * K + candidate_extra // page_size`` candidate pages,
#: exact logits over their keys pick what is attended (two-stage when that exceeds K). The selection study
#: (docs/selection_study.md, 4 windows per cell, chosen on the tuning text) settled on 1 and 1024 extra tokens:
#: a fixed margin, not a multiple of the budget, fixes the bound's misranking near the cut at every budget, and
#: 1024 is the most the byte targets allow at budget 2048 (34.5% of dense K+V at 8K, 11.0% at 32K).
DEFAULT_CANDIDATE_FACTOR = 1
DEFAULT_CANDIDATE_EXTRA = 1024
#: two-stage: keep the single tokens of highest softmax share among the candidates, not whole pages
#: (held-out +2.3% ppl at budget 512 against +3.2% keeping pages, same bytes)
DEFAULT_KEEP_TOKENS = True
#: storage of the page bounds: int8 codes on a per-page grid, rounded outward, a quarter of fp32's bytes; every
#: score stays an upper bound (property-tested); held-out quality within 0.1% of bf16 bounds
DEFAULT_BOUNDS_DTYPE = "int8"

#: storage dtypes of ``kmax``/``kmin`` by name (the ``bounds_dtype`` option of ``TinyServeConfig``), in the order of
#: their code in the packed spec
BOUNDS_DTYPE_NAMES = ("float32", "bfloat16", "int8")
#: the same as ``torch.dtype``\ s: the code of ``BOUNDS_CODES[i]`` in the packed spec is ``i``
BOUNDS_CODES = tuple(getattr(torch, name) for name in BOUNDS_DTYPE_NAMES)

#: the ``kernel`` choices of the fused op (``auto`` picks per device, see :func:`.sparse_decode.resolve_kernel`)
KERNELS = ("auto", "native", "torch", "triton")
#: those of the paged op (:mod:`.paged_sparse_decode`), which has no Triton kernel
PAGED_KERNELS = tuple(k for k in KERNELS if k != "triton")


#: the largest value of every integer field of the spec (and option of the config): the kernels index pages and
#: tokens with 32-bit integers (the native kernel's page lists, Triton's offsets), and the native kernel forms
#: ``candidate_factor * K`` in 64 bits, which two 31-bit factors cannot overflow
MAX_INDEX = 2**31 - 1
#: the largest page: the kernels hold a page's tokens in one tile (Triton pads it to a power of two in registers),
#: and every implementation pads the cache to whole pages
MAX_PAGE_SIZE = 1024

#: what "masked" means in an additive float mask, for every path: a value at or below this (``-inf``,
#: ``torch.finfo(dtype).min`` of any float dtype, ``-1e9``, BERT's ``-10000``) is a masked position, as ``False`` is
#: in a boolean mask. Where a row attends a position above it, such a position's softmax weight is exactly 0 in
#: fp32 whether it is added or left out (``exp`` underflows to 0 below -104), so the ops add float masks as they
#: are; the rule decides where a site's valid length ends (one past the newest position attended in any row).
MASKED_AT_OR_BELOW = -1.0e4


def attended(attn_mask: torch.Tensor) -> torch.Tensor:
    """Which positions a mask attends: itself when boolean, else ``attn_mask > MASKED_AT_OR_BELOW`` (NaN: masked).

    Parameters
    ----------
    attn_mask : torch.Tensor
        Bool (True = attend) or additive float, any shape.

    Returns
    -------
    torch.Tensor
        Bool, the shape of ``attn_mask``.
    """
    return attn_mask if attn_mask.dtype == torch.bool else attn_mask > MASKED_AT_OR_BELOW


def candidate_pages(page_size: int, token_budget: int, candidate_factor: int = 1, candidate_extra: int = 0) -> int:
    """Number of candidate pages of the first stage: ``candidate_factor * K + candidate_extra // page_size``
    with ``K = token_budget // page_size``; two-stage when it exceeds ``K``."""
    K = token_budget // page_size
    return max(1, int(candidate_factor)) * K + max(0, int(candidate_extra)) // page_size

def reads_every_key(n_candidates: int, n_pages: int) -> bool:
    """Whether the exact stage scores every key of the ``n_pages`` valid pages instead of gathering its
    ``n_candidates`` pages: when they are at least half of them, one pass over every key costs less than copying
    most of them. A choice of cost, not of selection: both give the same logits (the PyTorch path, the ONNX twin).
    """
    return 2 * n_candidates >= n_pages

_FIELDS = ("page_size", "token_budget", "sink_pages", "candidate_factor", "candidate_extra", "keep_tokens",
           "bounds_dtype")


@dataclass(frozen=True)
class SelectionSpec:
    """Which tokens a decode step attends to, and how the page bounds are stored.

    Attributes
    ----------
    page_size : int
        Tokens per KV page ``S``.
    token_budget : int
        Tokens attended per KV head (``K = token_budget // page_size`` pages).
    sink_pages : int
        Leading pages always kept (attention sinks), ``< K``.
    candidate_factor, candidate_extra : int
        Two-stage selection: ``candidate_factor * K + candidate_extra // page_size``
        candidate pages by the bound (:meth:`n_candidates`); two-stage when that exceeds ``K``.
    keep_tokens : bool
        Two-stage: keep the ``K * page_size`` best single tokens instead of ``K`` pages.
    bounds_dtype : torch.dtype
        Storage of ``kmax``/``kmin``: ``torch.float32``, ``torch.bfloat16`` or ``torch.int8``.
    """

    page_size: int
    token_budget: int
    sink_pages: int
    candidate_factor: int
    candidate_extra: int
    keep_tokens: bool
    bounds_dtype: torch.dtype

    def __post_init__(self):
        self.check()

    # ---- construction --------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config) -> "SelectionSpec":
        """The spec of a :class:`~tinyserve_compile.config.TinyServeConfig`."""
        return cls(config.page_size, config.token_budget, config.sink_pages, config.candidate_factor,
                   config.candidate_extra, config.keep_tokens, config.bounds_torch_dtype)

    @classmethod
    def default(cls, **changes) -> "SelectionSpec":
        """The spec of the defaults (``DEFAULT_*``, which ``TinyServeConfig()`` holds too), with ``changes`` applied
        (a field name each): ``from_config(TinyServeConfig())`` without the config, which sits above this module."""
        return cls(DEFAULT_PAGE_SIZE, DEFAULT_TOKEN_BUDGET, DEFAULT_SINK_PAGES, DEFAULT_CANDIDATE_FACTOR,
                   DEFAULT_CANDIDATE_EXTRA, DEFAULT_KEEP_TOKENS, getattr(torch, DEFAULT_BOUNDS_DTYPE)).replace(**changes)

    @classmethod
    def from_list(cls, spec: Sequence[int]) -> "SelectionSpec":
        """Read the packed ``int[] spec`` argument of an op (:meth:`to_list`)."""
        if len(spec) != len(_FIELDS) or not all(isinstance(v, int) for v in spec):
            raise ValueError(f"argument 'spec' must be {len(_FIELDS)} ints {_FIELDS} (SelectionSpec.to_list()), "
                             f"got {list(spec)!r}")
        code = spec[6]
        if not 0 <= code < len(BOUNDS_CODES):
            raise ValueError(f"argument 'spec' has bounds dtype code {code}, valid: 0..{len(BOUNDS_CODES) - 1}")
        return cls(*spec[:5], bool(spec[5]), BOUNDS_CODES[code])

    def to_list(self) -> List[int]:
        """The packed form every op schema takes as ``int[] spec``."""
        return [self.page_size, self.token_budget, self.sink_pages, self.candidate_factor, self.candidate_extra,
                int(self.keep_tokens), BOUNDS_CODES.index(self.bounds_dtype)]

    def replace(self, **changes) -> "SelectionSpec":
        unknown = sorted(set(changes) - set(_FIELDS))
        if unknown:
            raise ValueError(f"SelectionSpec has no field(s) {unknown}; fields: {_FIELDS}")
        return dataclasses.replace(self, **changes)

    # ---- derived sizes -------------------------------------------------------------------------------
    @property
    def n_pages(self) -> int:
        """``K``: pages kept per KV head (one stage) or pages' worth of kept tokens."""
        return self.token_budget // self.page_size

    @property
    def n_candidates(self) -> int:
        """Candidate pages of the first stage (:func:`candidate_pages`, the one formula)."""
        return candidate_pages(self.page_size, self.token_budget, self.candidate_factor, self.candidate_extra)

    @property
    def two_stage(self) -> bool:
        return self.n_candidates > self.n_pages

    @property
    def n_dense_pages(self) -> int:
        """A row of at most this many valid pages attends densely: ``max(K, n_candidates)``.

        Up to ``K`` pages every page fits in the budget; two-stage, up to ``n_candidates`` pages every valid page
        is a candidate, so the exact stage would read every key anyway, and attending every valid token is both
        exact and cheaper than ranking them."""
        return max(self.n_pages, self.n_candidates)

    def dense_cache(self, cache_pages: int) -> bool:
        """Whether a cache of ``cache_pages`` pages (``ceil(L / page_size)``) is attended densely whatever the
        valid lengths: every row has at most :attr:`n_dense_pages` valid pages. Decided from the shapes alone."""
        return cache_pages <= self.n_dense_pages

    def for_cache(self, length: int) -> "SelectionSpec":
        """This spec with its sizes bounded by a cache of ``length`` tokens, selecting the same.

        A spec whose dense rule covers every page of the cache (:meth:`dense_cache`) attends every row densely;
        it becomes the smallest spec with that rule (a budget of the whole cache, no extra candidates), so that
        no size that follows from the options (kept pages, candidates, their buffers) exceeds the cache. Any
        other spec already keeps fewer pages than the cache holds and is returned as it is. Every implementation
        runs the spec this returns.

        Parameters
        ----------
        length : int
            Tokens of the cache (``L``; a paged cache: its pages per row times ``page_size``).
        """
        P = max(1, -(-int(length) // self.page_size))
        if not self.dense_cache(P) or (self.n_pages, self.n_candidates) == (P, P):
            return self
        return self.dense_for(length)

    def dense_for(self, length: int) -> "SelectionSpec":
        """The smallest spec of this page size that attends every row of a cache of ``length`` tokens densely
        (:meth:`dense_cache`): a budget of the whole cache, no extra candidates, the sink pages that fit. What a
        site attended densely from its shapes runs (:func:`tinyserve_compile.cost.selection_pays`)."""
        P = max(1, -(-int(length) // self.page_size))
        return self.replace(token_budget=P * self.page_size, sink_pages=min(self.sink_pages, P - 1),
                            candidate_factor=1, candidate_extra=0)

    # ---- checks --------------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise ``ValueError`` naming the first bad field: every integer field is an int in its range, at most
        :data:`MAX_INDEX` (the kernels' index type)."""

        def bad(name, msg):
            raise ValueError(f"selection spec: argument '{name}' {msg}")

        def check_int(name, lo, hi=MAX_INDEX, what=""):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                bad(name, f"must be an int in [{lo}, {hi}]{what}, got {v!r}")

        check_int("page_size", 1, MAX_PAGE_SIZE)
        check_int("token_budget", self.page_size if isinstance(self.page_size, int) else 1,
                  what=" (at least one page)")
        check_int("sink_pages", 0, self.token_budget // self.page_size - 1,
                  what=" (fewer than the pages in the budget)")
        check_int("candidate_factor", 1)
        check_int("candidate_extra", 0, what=" (tokens)")
        if not isinstance(self.keep_tokens, bool):
            bad("keep_tokens", f"must be a bool, got {self.keep_tokens!r}")
        if self.bounds_dtype not in BOUNDS_CODES:
            bad("bounds_dtype", f"must be one of {BOUNDS_CODES}, got {self.bounds_dtype!r}")
