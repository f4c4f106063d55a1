"""Sparse decode for transformers' continuous batching (CB), on the engine's own paged cache.

``tinyserve_compile.enable_continuous_batching(model, options)`` makes ``model.generate_batch``,
``model.init_continuous_batching`` and ``transformers serve --continuous-batching`` decode each request by the
bound over the pages of its own history, and attend exactly over what it selects
(:mod:`tinyserve_compile.kernels.paged_sparse_decode`). ``disable_continuous_batching(model)`` undoes it.

What enabling does, and why each piece is needed (transformers 5.19 to 5.25; older versions lay out CB's cache
differently and are refused):

* **The attention function.** ``"tinyserve_paged"`` is registered in transformers' ``AttentionInterface`` and set
  as the model's attention implementation. CB then builds no block-diagonal mask (it builds one only for ``sdpa``
  and ``paged|eager``), and each layer's attention receives the query of every request packed in one row with the
  per-request lengths (``cu_seq_lens_q``, ``cu_seq_lens_k``) and read indices. Decode rows (one generated token)
  go sparse; prefill rows (prompt chunks, one token long or more) attend densely and causally over their own
  history. Which rows decode is recorded when CB prepares the batch (``ContinuousBatchingIOs.prepare_batch_tensors``
  is wrapped for that). Every row reads
  only its own request's pages: nothing gathers every request's history.
* **The cache write.** ``PagedAttentionCache.update`` writes the new keys and values and then gathers every
  request's whole history with ``index_select`` (5.24 and later call it from the model before attention; 5.19 to
  5.23 hand the cache to the attention function, which calls it). For models that are enabled, it is replaced by
  a write that also rebuilds the bounds of the pages it touches, and no gather. Bounds live with the paged buffer,
  one set per layer, keyed by physical page id; they are allocated at the first write. CB's ``page_size`` must be
  a multiple of tinyserve's ``page_size`` (each CB page holds several tinyserve pages).
* **Writes that are not ours.** Block copies on fork, CPU offload and restore write the cache tensor outside this
  write. They are seen through the tensor's version counter: every bound is then marked stale, and a stale page is
  rebuilt from its valid slots when a decode row next reads it.
* **The attention implementation check.** CB's manager switches any implementation other than ``sdpa``,
  ``paged|eager`` and flash back to a supported one; for enabled models it keeps ``tinyserve_paged``.

Nothing is patched at import. The patches are installed by the first ``enable_continuous_batching`` and removed
with the last ``disable_continuous_batching``; models that are not enabled run stock CB code while they are in.
Installed transformers versions other than :data:`SUPPORTED_TRANSFORMERS` are refused with a clear error.

What CB + tinyserve does not cover (each raises a clear error at :func:`enable_continuous_batching`): sliding-
window layers, policies other than ``query_aware``, the CUDA block-table decode path. On CPU the paged op, the
write's bounds and the stale-page rebuild run the native kernel (``kernels/csrc/paged.cpp``) when it builds, else
their PyTorch paths (option ``kernel="torch"`` forces those). Counters (``tinyserve_compile.counters``): ``cb_sparse_rows``,
``cb_dense_rows`` with ``cb_dense:<reason>``, ``cb_prefill_rows``, ``cb_mixed_steps``, ``cb_stale``, ``cb_rebuilt_pages``,
``cb_kv_bytes`` (key, value and bound bytes the attention reads), ``cb_dense_kv_bytes`` (what a dense read of the
same rows reads: stock CB's gather), ``cb_steps`` (forward steps).
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F

from .config import TinyServeConfig
from .explain import counters
from .kernels.paged_sparse_decode import paged_sparse_decode, paged_write_, rebuild_pages_
from .kernels.reference import PageBounds, bounds_itemsize, store_bounds
from .kernels.spec import SelectionSpec
from .runtime import tensor_version

__all__ = [
    "ATTENTION_NAME",
    "SUPPORTED_TRANSFORMERS",
    "enable_continuous_batching",
    "disable_continuous_batching",
    "continuous_batching_enabled",
]

#: the attention implementation name registered in transformers' ``AttentionInterface``
ATTENTION_NAME = "tinyserve_paged"
#: ``major.minor`` versions of transformers whose CB internals this module was written and tested against
SUPPORTED_TRANSFORMERS = ("5.19", "5.20", "5.21", "5.22", "5.23", "5.24", "5.25")


@dataclass
class _Enabled:
    config: TinyServeConfig
    previous_attn: Any


#: id(text config) -> (weakref to the config, settings); the text config is what CB's cache and every layer hold
_ENABLED: Dict[int, tuple] = {}
#: the original transformers callables while the patches are installed
_ORIGINAL: Dict[str, Any] = {}
#: per cache allocator (weakly held): its pages' bounds
_STATES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: address of a batch's ``cu_seq_lens_q`` storage -> which of its rows decode a generated token
_DECODE_ROWS: Dict[int, list] = {}


def _check_transformers(supported=SUPPORTED_TRANSFORMERS, who="tinyserve continuous batching",
                        why="it replaces PagedAttentionCache.update, whose internals change between versions",
                        after=""):
    """RuntimeError unless the installed transformers' ``major.minor`` is in ``supported``: ``who`` supports them
    (``why``), the installed version, then ``after``."""
    import transformers

    v = transformers.__version__
    if ".".join(v.split(".")[:2]) not in supported:
        raise RuntimeError(f"{who} supports transformers {', '.join(s + '.x' for s in supported)} ({why}); "
                           f"installed: {v}{after}")


def _settings(config) -> Optional[_Enabled]:
    entry = _ENABLED.get(id(config))
    if entry is None or entry[0]() is not config:
        return None
    return entry[1]


def continuous_batching_enabled(model) -> bool:
    """Whether :func:`enable_continuous_batching` is in effect for ``model``."""
    return _settings(model.config.get_text_config()) is not None


def enable_continuous_batching(model, options=None) -> TinyServeConfig:
    """Make transformers' continuous batching decode ``model`` through tinyserve's paged sparse attention.

    Call it before ``model.generate_batch`` / ``model.init_continuous_batching`` (a manager already cached on the
    model keeps the mask buffers it was built with: destroy it first). Reversible with
    :func:`disable_continuous_batching`.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A decoder whose attention goes through ``AttentionInterface`` and whose layers are all full attention.
    options : dict or TinyServeConfig, optional
        As ``torch.compile(..., options=...)`` (``page_size``, ``token_budget``, ``dense_layers``, ``sink_pages``,
        ``candidate_factor``, ``candidate_extra``, ``keep_tokens``, ``bounds_dtype``). ``policy`` must be
        ``query_aware``; ``lower`` does not apply; ``kernel="torch"`` runs the paged op's PyTorch path, any other
        choice the native CPU kernel where it builds.

    Returns
    -------
    TinyServeConfig
        The parsed settings.
    """
    _check_transformers()
    cfg = TinyServeConfig.from_options(options)
    if cfg.policy != "query_aware":
        raise ValueError(f"tinyserve option 'policy' must be 'query_aware' for continuous batching, got {cfg.policy!r}")
    text = model.config.get_text_config()
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

    groups = group_layers_by_attn_type(text)
    if set(groups) != {"full_attention"}:
        raise ValueError(f"argument 'model': continuous batching through tinyserve needs full-attention layers only; "
                         f"this model has {sorted(groups)} layers")
    if getattr(text, "kv_lora_rank", None) is not None:
        # multi-head latent attention (DeepSeek-style): transformers >= 5.25 caches its compressed latents, not
        # per-head keys, so there are no key pages to bound
        raise ValueError(f"argument 'model': continuous batching through tinyserve needs per-head keys in the cache; "
                         f"{type(model).__name__} uses multi-head latent attention (kv_lora_rank="
                         f"{text.kv_lora_rank})")
    if not getattr(model, "_can_set_attn_implementation", lambda: False)():
        raise ValueError(f"argument 'model': {type(model).__name__} does not dispatch attention through "
                         f"transformers' AttentionInterface, so its attention cannot be replaced")
    if getattr(model, "_cached_continuous_batching_manager", None) is not None:
        raise ValueError("argument 'model' holds a cached continuous batching manager built for stock attention; "
                         "call model.destroy_cached_continuous_batching_manager() first")
    previous = _settings(text)
    _install()
    prev_attn = previous.previous_attn if previous is not None else text._attn_implementation
    _ENABLED[id(text)] = (weakref.ref(text), _Enabled(cfg, prev_attn))
    model.set_attn_implementation(ATTENTION_NAME)
    return cfg


def disable_continuous_batching(model) -> None:
    """Undo :func:`enable_continuous_batching`: the model's previous attention implementation comes back, and the
    patches leave transformers when no model is enabled any more. A no-op for a model that is not enabled; refused
    while the model holds a cached CB manager (built without the mask stock attention needs)."""
    text = model.config.get_text_config()
    st = _settings(text)
    if st is None:
        return
    if getattr(model, "_cached_continuous_batching_manager", None) is not None:
        raise ValueError("argument 'model' holds a cached continuous batching manager built for tinyserve (no "
                         "attention mask); call model.destroy_cached_continuous_batching_manager() first")
    del _ENABLED[id(text)]
    model.set_attn_implementation(st.previous_attn)
    for key in [k for k, (ref, _) in _ENABLED.items() if ref() is None]:
        del _ENABLED[key]
    if not _ENABLED:
        _uninstall()


# ---------------------------------------------------------------------------------------------------------------------
# patches


def _install():
    if _ORIGINAL:
        return
    from transformers import AttentionInterface
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

    _ORIGINAL["update"] = PagedAttentionCache.update
    _ORIGINAL["switch"] = ContinuousBatchingManager.switch_to_cb_friendly_attn
    _ORIGINAL["prepare"] = ContinuousBatchingIOs.prepare_batch_tensors
    ContinuousBatchingIOs.prepare_batch_tensors = _prepare
    _ORIGINAL["had_name"] = ATTENTION_NAME in AttentionInterface._global_mapping
    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    PagedAttentionCache.update = _update
    ContinuousBatchingManager.switch_to_cb_friendly_attn = _switch


def _uninstall():
    if not _ORIGINAL:
        return
    from transformers import AttentionInterface
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

    PagedAttentionCache.update = _ORIGINAL["update"]
    ContinuousBatchingManager.switch_to_cb_friendly_attn = _ORIGINAL["switch"]
    ContinuousBatchingIOs.prepare_batch_tensors = _ORIGINAL["prepare"]
    _DECODE_ROWS.clear()
    if not _ORIGINAL["had_name"]:
        AttentionInterface._global_mapping.pop(ATTENTION_NAME, None)
    _ORIGINAL.clear()


def _switch(self, model, auto_switch_to_flash: bool = True):
    """CB's attention check, keeping ``tinyserve_paged`` for enabled models."""
    if _settings(model.config.get_text_config()) is not None:
        return None
    return _ORIGINAL["switch"](self, model, auto_switch_to_flash)


def _prepare(self, requests_in_batch, *args, **kwargs):
    """CB's batch preparation, recording which rows decode: one query token at or past the end of the prompt.
    A prompt chunk of one token is prefill (dense, as the static path prefills it), not decode."""
    if _settings(self.config) is not None:
        rows = [fs.query_length == 1 and fs.state.position_offset >= len(fs.state.initial_tokens)
                for fs in requests_in_batch]
        _DECODE_ROWS[self.cumulative_seqlens_q.data_ptr()] = rows
    return _ORIGINAL["prepare"](self, requests_in_batch, *args, **kwargs)


class _PagedState:
    """Bounds of one allocator's pages, per layer, keyed by physical page id.

    ``bounds[layer]``: ``kmax``/``kmin`` ``[NP, Hkv, D]``, ``kabs`` ``[NP, Hkv]``; ``fresh[layer]``: bool ``[NP]``;
    ``version``: the cache tensor's version counter after our last write (any other value: someone else wrote).
    """

    def __init__(self, allocator, cfg: TinyServeConfig):
        S_cb = allocator.tokens_per_page
        if S_cb % cfg.page_size:
            raise ValueError(f"tinyserve option 'page_size' ({cfg.page_size}) must divide continuous batching's "
                             f"page_size ({S_cb})")
        self.cfg = cfg
        self.page_size = cfg.page_size
        self.pages_per_block = S_cb // cfg.page_size
        self.rows_per_block = allocator.block_physical_stride
        self.allocator = weakref.ref(allocator)
        self.bounds: Dict[int, PageBounds] = {}
        self.fresh: Dict[int, torch.Tensor] = {}
        self.version = None

    def layer(self, layer_idx: int, k_view: torch.Tensor):
        if layer_idx not in self.bounds:
            NP = -(-k_view.shape[0] // self.rows_per_block) * self.pages_per_block
            Hkv, D = k_view.shape[1], k_view.shape[2]
            z = store_bounds(torch.zeros(NP, Hkv, D, device=k_view.device),
                             torch.zeros(NP, Hkv, D, device=k_view.device), self.cfg.bounds_torch_dtype)
            self.bounds[layer_idx] = PageBounds(z.kmax.clone(), z.kmin.clone(), z.kabs.clone())
            self.fresh[layer_idx] = torch.zeros(NP, dtype=torch.bool, device=k_view.device)
        return self.bounds[layer_idx], self.fresh[layer_idx]

    def check(self, cache_tensor: torch.Tensor):
        """Mark every bound stale when the cache tensor was written by anyone but us since our last write."""
        version = tensor_version(cache_tensor)  # None for an inference tensor: every bound is stale each call
        if version is None or (self.version is not None and version != self.version):
            for f in self.fresh.values():
                f.zero_()
            counters["cb_stale"] += 1
        self.version = version


@dataclass
class _LayerCall:
    """What the write hands the attention of the same layer and step."""

    state: _PagedState
    layer_idx: int
    k_view: torch.Tensor
    v_view: torch.Tensor
    read_index: torch.Tensor


@torch.compiler.disable
def _update(self, key_states, value_states, layer_idx, kwargs):
    """``PagedAttentionCache.update`` for enabled models: write new keys and values (with the bounds of the pages
    they touch), gather nothing. Other models go to the original."""
    st = _settings(self.config)
    if st is None:
        return _ORIGINAL["update"](self, key_states, value_states, layer_idx, kwargs)
    allocator = self.layer_to_allocator[layer_idx]
    kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][allocator.layer_type].to(torch.int32)
    kwargs["max_length_k"] = kwargs["max_length_k"][allocator.layer_type]
    if kwargs.get("block_table") is not None:
        raise RuntimeError("tinyserve continuous batching does not support CB's block-table decode path (CUDA flash "
                           "kernels); it runs the index path")
    state = _STATES.get(allocator)
    if state is None:
        state = _STATES[allocator] = _PagedState(allocator, st.config)
    k_view, v_view = allocator._kv_token_views[layer_idx]
    write_index = kwargs["write_index"][allocator.index]  # [T] int64 buffer rows
    k_new = key_states.squeeze(0).transpose(0, 1)  # [1,Hkv,T,D] -> [T,Hkv,D]
    v_new = value_states.squeeze(0).transpose(0, 1)
    state.check(allocator.cache_tensor)
    if layer_idx < st.config.dense_layers:
        k_view.index_copy_(0, write_index, k_new)
        v_view.index_copy_(0, write_index, v_new)
    else:
        bounds, fresh = state.layer(layer_idx, k_view)
        paged_write_(k_view, v_view, k_new, v_new, write_index, bounds, fresh, state.page_size,
                     state.rows_per_block, state.pages_per_block, _paged_kernel(st.config))
    state.version = tensor_version(allocator.cache_tensor)
    kwargs["tinyserve_paged"] = _LayerCall(state, layer_idx, k_view, v_view, kwargs["read_index"][allocator.index])
    return key_states, value_states


# ---------------------------------------------------------------------------------------------------------------------
# the attention function


def _dense_row(q, k, v, scale):
    """Causal attention of ``q`` ``[1, Hq, Tq, D]`` over ``k``/``v`` ``[1, Hkv, Lk, D]`` whose last ``Tq`` tokens are
    the queries' own: ``[Tq, Hq, D]``."""
    Tq, Lk = q.shape[2], k.shape[2]
    allowed = torch.arange(Lk, device=q.device)[None, :] <= (Lk - Tq) + torch.arange(Tq, device=q.device)[:, None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1)


def _paged_kernel(cfg: TinyServeConfig) -> str:
    """The paged ops' ``kernel``: ``torch`` when the options ask for it, else ``auto`` (native on CPU)."""
    return "torch" if cfg.kernel == "torch" else "auto"


def _kv_bytes_sparse(lens: torch.Tensor, cfg: TinyServeConfig, Hkv: int, D: int, itemsize: int) -> int:
    """K, V and bound bytes a sparse decode row reads, by construction of the selection."""
    S, K = cfg.page_size, cfg.token_budget // cfg.page_size
    n1 = max(K, SelectionSpec.from_config(cfg).n_candidates)
    total = 0
    for L in lens.tolist():
        P = -(-L // S)
        if P <= K:
            total += 2 * L * Hkv * D * itemsize
        else:
            bound = P * Hkv * (2 * D * bounds_itemsize(cfg.bounds_torch_dtype) + 4)
            total += bound + (min(n1 * S, L) + K * S) * Hkv * D * itemsize
    return total


def paged_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Attention of one layer over CB's paged cache: decode rows sparse, prefill rows dense, each over its own pages.

    Parameters
    ----------
    module : torch.nn.Module
        The attention layer (its ``layer_idx`` decides the dense first layers).
    query : torch.Tensor
        ``[1, Hq, T, D]`` every request's query tokens, packed.
    key, value : torch.Tensor
        ``[1, Hkv, T, D]`` the new keys and values (already in the cache; read here only when the batch has no
        cache to read).
    attention_mask : None
        CB builds none for this implementation.
    scaling : float
        Softmax scale.
    **kwargs
        CB's ``cu_seq_lens_q``/``cu_seq_lens_k`` (int ``[n + 1]``) and what the cache write left
        (``tinyserve_paged``).

    Returns
    -------
    (torch.Tensor, None)
        ``[1, T, Hq, D]``, dtype of ``query``.
    """
    call: Optional[_LayerCall] = kwargs.get("tinyserve_paged")
    cache = kwargs.get("cache")
    if call is None and cache is not None and hasattr(cache, "layer_to_allocator"):
        # transformers 5.19-5.23: the model hands CB's cache to the attention function, which writes it (5.24 and
        # later: the model writes it first, and the write left ``tinyserve_paged`` in these kwargs)
        cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs)
        call = kwargs.get("tinyserve_paged")
    if call is None:
        raise RuntimeError("the 'tinyserve_paged' attention runs only under continuous batching with "
                           "tinyserve_compile.enable_continuous_batching(model)")
    return _paged_attention(query, key, value, scaling, kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], call)


@torch.compiler.disable
def _paged_attention(query, key, value, scaling, cu_q, cu_k, call: _LayerCall):
    cfg, S = call.state.cfg, call.state.page_size
    _, Hq, T, D = query.shape
    Hkv = call.k_view.shape[1]
    scale = 1.0 / math.sqrt(D) if scaling is None else scaling
    out = query.new_zeros(1, T, Hq, D)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    n = len(cq) - 1
    q_len = [cq[i + 1] - cq[i] for i in range(n)]
    k_len = [ck[i + 1] - ck[i] for i in range(n)]
    has_reads = call.read_index.numel() > 0
    sparse_layer = call.layer_idx >= cfg.dense_layers
    itemsize = call.k_view.element_size()
    is_decode = _DECODE_ROWS.get(cu_q.data_ptr())
    if is_decode is None:
        raise RuntimeError("tinyserve continuous batching found no record of this batch's decode rows (asynchronous "
                           "batching is not supported: set ContinuousBatchingConfig(use_async_batching=False))")
    decode = [i for i in range(min(n, len(is_decode))) if is_decode[i] and has_reads and sparse_layer]
    sparse_rows = set(decode)
    if call.layer_idx == 0:
        counters["cb_steps"] += 1
    counters["cb_dense_kv_bytes"] += 2 * sum(k_len) * Hkv * D * itemsize  # a dense read of the same rows
    # ---- prefill rows (and decode rows of the dense first layers): dense, each over its own history
    for i in range(n):
        if q_len[i] == 0 or i in sparse_rows:
            continue
        q = query[:, :, cq[i]:cq[i + 1]]  # [1,Hq,Tq,D]
        if has_reads:
            rows = call.read_index[ck[i]:ck[i + 1]]  # [Lk]
            k = call.k_view[rows].transpose(0, 1)[None]  # [1,Hkv,Lk,D]
            v = call.v_view[rows].transpose(0, 1)[None]
        else:  # nothing cached yet: the new keys are the whole history
            k, v = key[:, :, cq[i]:cq[i + 1]], value[:, :, cq[i]:cq[i + 1]]
        out[0, cq[i]:cq[i + 1]] = _dense_row(q, k, v, scale)
        counters["cb_kv_bytes"] += 2 * k.shape[2] * Hkv * D * itemsize
        if i >= len(is_decode) or not is_decode[i]:
            counters["cb_prefill_rows"] += 1
        else:
            counters["cb_dense_rows"] += 1
            counters["cb_dense:first dense_layers layers"] += 1
    if decode and any(q_len[i] > 0 and not (i < len(is_decode) and is_decode[i]) for i in range(n)):
        counters["cb_mixed_steps"] += 1  # a layer call with prefill rows (dense) next to decode rows (sparse)
    if not decode:
        return out, None
    # ---- decode rows: page tables from the page-aligned entries of the read index
    dev = query.device
    lens = torch.tensor([k_len[i] for i in decode], dtype=torch.int64, device=dev)  # [R]
    starts = torch.tensor([ck[i] for i in decode], dtype=torch.int64, device=dev)
    P = -(-int(lens.max()) // S)
    offs = torch.arange(P, device=dev) * S  # [P]
    valid = offs[None, :] < lens[:, None]  # [R,P]
    page_rows = torch.where(valid, call.read_index[(starts[:, None] + offs).clamp(max=call.read_index.numel() - 1)],
                            0)  # [R,P]
    st = call.state
    page_ids = (page_rows // st.rows_per_block) * st.pages_per_block + (page_rows % st.rows_per_block) // S
    bounds, fresh = st.layer(call.layer_idx, call.k_view)
    # ---- pages whose bound went stale (a write that was not ours): rebuild from their valid slots
    stale = valid & ~fresh[page_ids]
    if bool(stale.any()):
        slots = (lens[:, None] - offs[None, :]).clamp(max=S)[stale]
        ids = page_ids[stale]
        rebuild_pages_(call.k_view, bounds, fresh, page_rows[stale], slots, ids, S, _paged_kernel(cfg))
        counters["cb_rebuilt_pages"] += int(ids.numel())
    pos = torch.tensor([cq[i] for i in decode], dtype=torch.int64, device=dev)
    q = query[0][:, pos].transpose(0, 1).unsqueeze(2)  # [Hq,R,D] -> [R,Hq,1,D]
    o = paged_sparse_decode(q, call.k_view, call.v_view, page_rows, page_ids, lens, bounds, scale,
                            SelectionSpec.from_config(cfg), _paged_kernel(cfg))  # [R,Hq,1,D]
    out[0, pos] = o[:, :, 0]
    counters["cb_sparse_rows"] += len(decode)
    counters["cb_kv_bytes"] += _kv_bytes_sparse(lens, cfg, Hkv, D, itemsize)
    return out, None
