"""``python -m tinyserve_compile.serve MODEL [--options JSON] [transformers serve flags]``.

A thin layer over ``transformers serve --continuous-batching`` (its OpenAI-compatible HTTP API: ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``): ``transformers serve`` has no flag to pick an attention backend, so this
entry point loads ``MODEL`` through transformers' own model manager and calls
:func:`tinyserve_compile.enable_continuous_batching` on it before the server accepts a request. Continuous batching
is always on; the server listens on 127.0.0.1 unless ``--host`` says otherwise. Every other flag goes to
``transformers serve`` unchanged (``--port``, ``--cb-num-blocks``, ``--cb-max-batch-tokens``, ``--cb-block-size``
(CB's page size: a multiple of tinyserve's ``page_size``), ``--dtype``, ``--log-level``...).

Requests are checked before they reach the engine (:class:`RequestChecks`): an empty prompt (which kills stock
CB's worker and every request in it), a field of the wrong type, or a prompt that with ``max_tokens`` exceeds the
model's context gets 400 with the reason.

Examples::

    python -m tinyserve_compile.serve path/to/model --options '{"token_budget": 1024}' --port 8000
    python -m tinyserve_compile.serve /path/to/folder:smollm2.gguf   # GGUF weights: folder:file.gguf
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Optional, Sequence

__all__ = ["main", "serve_args", "check_request", "RequestChecks", "SUPPORTED_SERVE_TRANSFORMERS"]

#: ``major.minor`` versions of transformers whose ``transformers serve`` this entry point hooks (its model manager
#: and server builder; 5.25 moved each model into a process of its own behind an engine client, not yet followed)
SUPPORTED_SERVE_TRANSFORMERS = ("5.24",)

#: the request fields checked before a request reaches the engine
_INT_FIELDS = ("max_tokens", "max_completion_tokens", "n", "seed", "top_k")
_NUM_FIELDS = ("temperature", "top_p", "frequency_penalty", "presence_penalty", "repetition_penalty")


def check_request(path: str, body, tokenizer=None, context: int = 0):
    """Why a completion request must be refused, or None.

    Stock CB's worker dies on an empty prompt (a batch of 0 tokens), taking every other request with it, and
    ``transformers serve`` answers a field of the wrong type with a bare 500; these checks answer 400 first.

    Parameters
    ----------
    path : str
        ``/v1/completions`` or ``/v1/chat/completions``.
    body : object
        The decoded JSON body.
    tokenizer : optional
        Counts prompt tokens for the length check.
    context : int
        The model's context length (0: no length check).
    """
    if not isinstance(body, dict):
        return "the request body must be a JSON object"
    for k in _INT_FIELDS:
        v = body.get(k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < (0 if k == "seed" else 1)):
            return f"'{k}' must be a positive integer, got {v!r}"
    for k in _NUM_FIELDS:
        v = body.get(k)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)):
            return f"'{k}' must be a number, got {v!r}"
    if path.endswith("/chat/completions"):
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return "'messages' must be a non-empty list"
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            return "'prompt' must not be empty"
        n = len(tokenizer(prompt).input_ids) if tokenizer is not None else 0
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        n = len(prompt)
    else:
        return "'prompt' must be a non-empty string or a non-empty list of token ids"
    new = body.get("max_tokens") or 0
    if context and n + new > context:
        return f"the prompt has {n} tokens; with max_tokens={new} that exceeds the model's context of {context} tokens"
    return None


class RequestChecks:
    """ASGI middleware: :func:`check_request` on every POST to the completion routes; a refused request gets
    400 ``{"error": ...}`` and never reaches the engine."""

    ROUTES = ("/v1/completions", "/v1/chat/completions")

    def __init__(self, app, tokenizer=lambda: None, context=lambda: 0):
        self.app, self.tokenizer, self.context = app, tokenizer, context

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in self.ROUTES:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        raw = b"".join(chunks)
        try:
            why = check_request(scope["path"], json.loads(raw or b"null"), self.tokenizer(), self.context())
        except json.JSONDecodeError as e:
            why = f"the request body is not JSON ({e})"
        if why is not None:
            data = json.dumps({"error": why}).encode()
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
            return await send({"type": "http.response.body", "body": data})
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def serve_args(model: str, rest: Sequence[str]) -> list:
    """The ``transformers serve`` command line: continuous batching on, 127.0.0.1 unless a host is given."""
    args = ["serve", model, "--continuous-batching", *rest]
    if not any(a == "--host" or a.startswith("--host=") for a in rest):
        args += ["--host", "127.0.0.1"]
    return args


@contextlib.contextmanager
def _gguf_architecture():
    """While ``transformers serve`` loads the model: give a config read from a GGUF file the causal-LM class of
    its model type as ``architectures``. transformers' GGUF loader leaves it ``None`` and the server then fails
    on ``config.architectures[0]`` (TypeError); only the configs of GGUF files are touched."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    original = AutoConfig.__dict__["from_pretrained"]

    def from_pretrained(cls, *args, **kwargs):
        out = original.__func__(cls, *args, **kwargs)
        config = out[0] if isinstance(out, tuple) else out  # (config, unused kwargs) with return_unused_kwargs
        if kwargs.get("gguf_file") and not getattr(config, "architectures", None):
            name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
            if name:
                config.architectures = [name]
        return out

    AutoConfig.from_pretrained = classmethod(from_pretrained)
    try:
        yield
    finally:
        AutoConfig.from_pretrained = original


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tinyserve_compile.serve", description=__doc__.split("\n\n")[1],
                                 epilog="Any other flag is passed to `transformers serve`.")
    ap.add_argument("model", help="model folder or hub id (GGUF: folder:file.gguf), preloaded and served alone")
    ap.add_argument("--options", default="{}", help="tinyserve options as JSON (token_budget, page_size, ...)")
    a, rest = ap.parse_known_args(argv)
    try:
        options = json.loads(a.options)
    except json.JSONDecodeError as e:
        ap.error(f"argument --options: not JSON ({e})")
    from . import continuous_batching as cbm
    from .config import TinyServeConfig

    try:
        TinyServeConfig.from_options(options)  # a bad option fails here, before the model loads
        cbm._check_transformers()
        cbm._check_transformers(SUPPORTED_SERVE_TRANSFORMERS, "python -m tinyserve_compile.serve",
                                "it hooks transformers serve's model manager, which 5.25 redesigned",
                                ". Continuous batching itself (tinyserve_compile.enable_continuous_batching with "
                                "generate_batch) works with it.")
    except (ValueError, RuntimeError) as e:
        ap.error(str(e))
    from transformers.cli.serving import server as server_mod
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.transformers import app

    load, load_proc, build = ModelManager._load_model, ModelManager._load_processor, server_mod.build_server
    served = {}

    def load_enabled(self, *args, **kwargs):
        with _gguf_architecture():
            model = load(self, *args, **kwargs)
        cbm.enable_continuous_batching(model, options)
        served["context"] = getattr(model.config.get_text_config(), "max_position_embeddings", 0) or 0
        print(f"tinyserve: continuous batching through tinyserve for {type(model).__name__} "
              f"(options {options})", file=sys.stderr, flush=True)
        return model

    def load_processor(self, *args, **kwargs):
        served["tokenizer"] = proc = load_proc(self, *args, **kwargs)
        return proc

    def build_checked(*args, **kwargs):
        srv = build(*args, **kwargs)
        srv.add_middleware(RequestChecks, tokenizer=lambda: served.get("tokenizer"),
                           context=lambda: served.get("context", 0))
        return srv

    # this process serves tinyserve-enabled models only, behind the request checks
    ModelManager._load_model, ModelManager._load_processor = load_enabled, load_processor
    server_mod.build_server = build_checked
    try:
        app(serve_args(a.model, rest), standalone_mode=False)
    finally:
        ModelManager._load_model, ModelManager._load_processor = load, load_proc
        server_mod.build_server = build
    return 0


if __name__ == "__main__":
    sys.exit(main())
