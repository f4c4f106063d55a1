"""Eager evaluation harness: SmolLM2 (or any HF Llama) with a static KV cache whose decode
attention goes through the selection policies of :mod:`tinyserve_compile.policies`.

It is the reference path of the compile backend: for a query of length 1 at layers
``>= dense_layers`` it builds a :class:`DecodeContext` over the layer's whole static
key/value cache (``valid_len = position + 1``), keeps per-layer page bounds
(``allocate_bounds`` + ``rebuild_bounds_`` after prefill, ``update_bounds_`` at the
written position every step) and calls ``get_policy(policy)(ctx)``; every other
attention call is stock SDPA.

One prefill is reused for many configurations: :meth:`EvalModel.reset` rolls the cache
back to the prefill (zeroing the decoded slots and rebuilding bounds), so only the decode
steps are paid per configuration.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from tinyserve_compile.config import TinyServeConfig
from tinyserve_compile.cost import sparse_site_bytes
from tinyserve_compile.kernels.bounds import allocate_bounds, rebuild_bounds_, update_bounds_
from tinyserve_compile.kernels.spec import SelectionSpec
from tinyserve_compile.kernels.reference import dropped_mass_bound, selected_token_mask
from tinyserve_compile.policies import DecodeContext, get_policy

ATTN_NAME = "tinyserve_eval"


def cache_kwarg(model) -> str:
    """The keyword under which ``model``'s forward takes its KV cache: ``cache`` (transformers >= 5.2x) or
    ``past_key_values`` (transformers 4.x and 5.x up to at least 5.17).

    transformers 5.17 has no ``cache`` parameter: a ``cache=`` keyword falls into the model's ``**kwargs`` and is
    ignored, so the model builds a ``DynamicCache`` of its own and the ``StaticCache`` handed in is never written
    (its layers keep ``keys = None``). 5.24 takes ``cache`` and still accepts ``past_key_values`` with a warning.
    """
    import inspect

    forward = getattr(model, "forward", model)
    params = inspect.signature(getattr(forward, "__wrapped__", forward)).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise TypeError(f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`")


def set_cache_length(layer, n: int) -> None:
    """Tell a static cache layer that its first ``n`` positions are written.

    Later transformers 5 releases keep a ``cumulative_length`` tensor; 4.57 and 5.0 have none and count the
    non-zero keys instead, so zeroed positions past ``n`` say it already.
    """
    length = getattr(layer, "cumulative_length", None)
    if length is not None:
        length.fill_(n)


@torch.no_grad()
def allocate_cache(model, cache, batch: int = 1) -> None:
    """Allocate the layers of a static ``cache`` (transformers creates them lazily, at the first update: ``keys``
    is None until then, in 5.17 as in 5.24) by one decode step of ``batch`` rows at position 0, then roll the
    cache back to empty. A no-op when every layer is allocated already."""
    if all(getattr(layer, "keys", None) is not None for layer in cache.layers):
        return
    device = next(model.parameters()).device
    model(input_ids=torch.zeros(batch, 1, dtype=torch.long, device=device), use_cache=True,
          **{cache_kwarg(model): cache})
    missing = [i for i, layer in enumerate(cache.layers) if getattr(layer, "keys", None) is None]
    if missing:
        raise RuntimeError(f"the static cache's layers {missing} were not allocated by a forward step: this "
                           f"transformers does not write the cache passed as `{cache_kwarg(model)}`")
    for layer in cache.layers:
        layer.keys.zero_()
        layer.values.zero_()
        set_cache_length(layer, 0)


@dataclass(frozen=True)
class Sparse(TinyServeConfig):
    """One decode configuration of the harness: the backend's options (:class:`TinyServeConfig`, its defaults and
    checks) and an optional per-layer budget. The study grids vary a preset of :data:`bench.cli.PRESETS`."""

    #: optional per-layer budget override ((layer, budget), ...)
    layer_budgets: Optional[tuple] = None

    def label(self) -> str:
        s = f"{self.policy}/B{self.token_budget}/S{self.page_size}/d{self.dense_layers}"
        if self.sink_pages:
            s += f"/sink{self.sink_pages}"
        if self.candidate_factor > 1:
            s += f"/c{self.candidate_factor}"
        if self.layer_budgets:
            s += "/lb"
        if self.bounds_dtype != "bfloat16":
            s += f"/{self.bounds_dtype}"
        if self.candidate_extra:
            s += f"/e{self.candidate_extra}"
        if self.keep_tokens:
            s += "/tok"
        return s

    def budget_for(self, layer: int) -> int:
        if self.layer_budgets:
            return dict(self.layer_budgets).get(layer, self.token_budget)
        return self.token_budget


FULL = Sparse(policy="full", dense_layers=0)

_ACTIVE: List["EvalModel"] = []


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """The registered attention function: dispatches to the active :class:`EvalModel`."""
    return _ACTIVE[-1].attend(module, query, key, value, attention_mask, scaling)


def _register():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, _attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


@dataclass
class StepStats:
    """Per-step statistics, averaged over sparse layers (and heads)."""

    kv_fraction: float  # attended K/V tokens / valid tokens
    bytes_fraction: float  # everything read (tinyserve_compile.cost for query_aware) / dense K+V bytes
    rho: float  # |S_t & S_{t-1}| / |S_t|, NaN on the first step
    dropped: float  # measured softmax mass left out (mean over heads)
    dropped_max: float
    bound: float  # certified upper bound on it (mean over heads); NaN for policies without bounds
    bound_max: float
    bound_violations: int


class EvalModel:
    """A causal LM with a static cache, decoded token by token through the policies."""

    def __init__(self, model, max_len: int):
        from transformers import StaticCache

        _register()
        self.model = model
        self.max_len = max_len
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.cache_kw = cache_kwarg(model)
        self.cfg: Sparse = FULL
        self.pos = 0
        self.n_prefill = 0
        self.bounds: Dict[int, object] = {}
        self.states: Dict[int, dict] = {}
        self.prev_sel: Dict[int, torch.Tensor] = {}
        self.collect = False
        self._step_rows: List[dict] = []
        self.stats: List[StepStats] = []

    # ---------------------------------------------------------------- attention
    def attend(self, module, query, key, value, attention_mask, scaling):
        q_len = query.shape[2]
        layer = module.layer_idx
        scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
        if q_len > 1:  # prefill from position 0: causal SDPA over the written prefix
            assert self.pos == 0, "prefill must start at position 0"
            n = q_len
            out = F.scaled_dot_product_attention(query, key[:, :, :n], value[:, :, :n], is_causal=True,
                                                 scale=scale, enable_gqa=True)
            return out.transpose(1, 2).contiguous(), None
        vl = self.pos + 1
        cfg = self.cfg
        if layer < cfg.dense_layers or cfg.policy == "full" and not self.collect:
            out = F.scaled_dot_product_attention(query, key[:, :, :vl], value[:, :, :vl], scale=scale,
                                                 enable_gqa=True)
            return out.transpose(1, 2).contiguous(), None
        S = cfg.page_size
        bounds = self.bounds.get(layer)
        if bounds is None:
            bounds = allocate_bounds(key, S, getattr(torch, cfg.bounds_dtype))
            bounds = self.bounds[layer] = rebuild_bounds_(key, bounds, S)
        update_bounds_(key, bounds, torch.tensor([self.pos]), S)
        spec = SelectionSpec(S, cfg.budget_for(layer), cfg.sink_pages, cfg.candidate_factor, cfg.candidate_extra,
                             cfg.keep_tokens, getattr(torch, cfg.bounds_dtype))
        ctx = DecodeContext(query, key, value, bounds, torch.tensor([vl]), None, float(scale), spec,
                            self.states.setdefault(layer, {}), "auto")
        pol = get_policy(cfg.policy)
        if self.collect:
            self._collect(layer, pol, ctx)
        out = pol(ctx)
        return out.transpose(1, 2).contiguous(), None

    def _collect(self, layer, pol, ctx: DecodeContext):
        S, L, D = ctx.page_size, ctx.k_cache.shape[2], ctx.q.shape[-1]
        vl = int(ctx.valid_len[0])
        sel, unit = pol.choose(ctx)
        Hkv = ctx.k_cache.shape[1]
        n_pages_valid = (vl + S - 1) // S
        if sel is None:
            kept = torch.zeros(1, Hkv, ctx.n_pages, dtype=torch.bool)
            kept[:, :, :n_pages_valid] = True
            frac, extra = 1.0, 0.0
        else:
            attended = selected_token_mask(sel, unit, L, ctx.valid_len)  # [1,Hkv,L]
            tok = attended[..., :vl]
            kept = torch.nn.functional.pad(attended, (0, ctx.n_pages * S - L)).reshape(1, Hkv, ctx.n_pages, S).any(-1)
            frac = float(tok.float().mean())
            extra = 0.0
            if self.cfg.policy == "query_aware":  # the backend's cost model, minus the attended K/V counted in frac
                it = ctx.k_cache.element_size()
                read = sparse_site_bytes(vl, Hkv, D, it, S, ctx.token_budget, ctx.candidate_factor,
                                         ctx.bounds.kmax.element_size(), ctx.candidate_extra)
                extra = read / (2 * Hkv * vl * D * it) - frac
            elif self.cfg.policy in ("oracle", "h2o"):
                extra += 0.5  # every key is read to score (an oracle, or the observed-mass update)
        prev = self.prev_sel.get(layer)
        rho = float("nan")
        if prev is not None and prev.shape == kept.shape:
            rho = float(((kept & prev).sum(-1).float() / kept.sum(-1).clamp(min=1).float()).mean())
        self.prev_sel[layer] = kept
        if unit == S:
            bound, measured = dropped_mass_bound(ctx.q, ctx.k_cache, ctx.bounds, sel, ctx.valid_len, None, ctx.scale, S)
        else:  # the certified bound is per page: not defined for a token selection
            bound = measured = torch.full((1, ctx.q.shape[1]), float("nan"))
        viol = int((bound < measured - 1e-6).sum())
        self._step_rows.append(dict(kv=frac, bytes=frac + extra, rho=rho, dropped=float(measured.mean()),
                                    dropped_max=float(measured.max()), bound=float(bound.mean()),
                                    bound_max=float(bound.max()), viol=viol))

    # ---------------------------------------------------------------- driving
    @contextlib.contextmanager
    def active(self):
        old = self.model.config._attn_implementation
        self.model.config._attn_implementation = ATTN_NAME
        _ACTIVE.append(self)
        try:
            yield self
        finally:
            _ACTIVE.pop()
            self.model.config._attn_implementation = old

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Dense prefill of ``ids`` ``[1, n]``; returns the logits of the last position ``[V]``."""
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None:
                layer.keys.zero_()
                layer.values.zero_()
                set_cache_length(layer, 0)
        self.pos = 0
        n = ids.shape[1]
        with self.active():
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self.cache_kw: self.cache})
        self.pos = self.n_prefill = n
        self.bounds.clear()
        return out.logits[0, -1].float()

    def save_prefill(self, path: str):
        """Store the prefilled cache (reuse across processes: the prefill is the expensive part)."""
        n = self.n_prefill
        if any(getattr(layer, "keys", None) is None for layer in self.cache.layers):
            raise RuntimeError("save_prefill: the static cache was never written (its layers are allocated at the "
                               "first update); prefill() first")
        torch.save(dict(n=n, k=[l.keys[:, :, :n].clone() for l in self.cache.layers],
                        v=[l.values[:, :, :n].clone() for l in self.cache.layers]), path)

    @torch.no_grad()
    def load_prefill(self, path: str):
        d = torch.load(path)
        allocate_cache(self.model, self.cache)
        n = d["n"]
        for layer, k, v in zip(self.cache.layers, d["k"], d["v"]):
            layer.keys.zero_()
            layer.values.zero_()
            layer.keys[:, :, :n].copy_(k)
            layer.values[:, :, :n].copy_(v)
            set_cache_length(layer, n)
        self.pos = self.n_prefill = n
        self.bounds.clear()

    def reset(self, cfg: Sparse, collect: bool = False):
        """Roll back to the prefill and set the decode configuration."""
        n = self.n_prefill
        for layer in self.cache.layers:
            layer.keys[:, :, n:].zero_()
            layer.values[:, :, n:].zero_()
            set_cache_length(layer, n)
        self.pos = n
        self.cfg = cfg
        self.collect = collect
        self.bounds.clear()
        self.states.clear()
        self.prev_sel.clear()
        self.stats = []

    @torch.no_grad()
    def step(self, token: int) -> torch.Tensor:
        """Decode one token at the current position; returns its logits ``[V]``."""
        if self.pos >= self.max_len:
            raise ValueError("static cache is full")
        self._step_rows = []
        with self.active():
            out = self.model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[self.pos]]),
                             use_cache=True, **{self.cache_kw: self.cache})
        self.pos += 1
        if self.collect and self._step_rows:
            r = self._step_rows
            mean = lambda k: sum(x[k] for x in r) / len(r)  # noqa: E731
            rhos = [x["rho"] for x in r if not math.isnan(x["rho"])]
            self.stats.append(StepStats(mean("kv"), mean("bytes"), sum(rhos) / len(rhos) if rhos else float("nan"),
                                        mean("dropped"), max(x["dropped_max"] for x in r), mean("bound"),
                                        max(x["bound_max"] for x in r), sum(x["viol"] for x in r)))
        return out.logits[0, -1].float()

    def teacher_forced(self, tokens) -> torch.Tensor:
        """Feed ``tokens`` one by one; returns the logits after each ``[T, V]``."""
        return torch.stack([self.step(int(t)) for t in tokens])

    def generate(self, first_logits: torch.Tensor, n: int) -> List[int]:
        """Greedy: the first token from ``first_logits``, then ``n - 1`` decode steps."""
        out = [int(first_logits.argmax())]
        for _ in range(n - 1):
            out.append(int(self.step(out[-1]).argmax()))
        return out


def summarize_stats(stats: List[StepStats]) -> dict:
    """Means over steps (max for the *_max fields), NaN-safe."""
    if not stats:
        return {}
    out = {}
    for f in dataclasses.fields(StepStats):
        vals = [getattr(s, f.name) for s in stats]
        vals = [v for v in vals if not (isinstance(v, float) and math.isnan(v))]
        if not vals:
            out[f.name] = float("nan")
        elif f.name.endswith("_max"):
            out[f.name] = max(vals)
        elif f.name == "bound_violations":
            out[f.name] = int(sum(vals))
        else:
            out[f.name] = sum(vals) / len(vals)
    return out
