"""``python -m tinyserve_compile.serve MODEL [--options JSON] [--drain-timeout S] [transformers serve flags]``.

A thin layer over ``transformers serve --continuous-batching`` (its OpenAI-compatible HTTP API: ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``): ``transformers serve`` has no flag to pick an attention backend, so this
entry point loads ``MODEL`` through transformers' own model manager and calls
:func:`tinyserve_compile.enable_continuous_batching` on it before the server accepts a request. Continuous batching
is always on; the server listens on 127.0.0.1 unless ``--host`` says otherwise. Every other flag goes to
``transformers serve`` unchanged (``--port``, ``--cb-num-blocks``, ``--cb-max-batch-tokens``, ``--cb-block-size``
(CB's page size: a multiple of tinyserve's ``page_size``), ``--dtype``, ``--log-level``...).

What this layer adds to ``transformers serve``, so that no request can take the server down for the others:

* **One request validator for both completion routes** (:func:`validate_request`, in the ASGI middleware
  :class:`RequestChecks`): fields of the wrong type, an empty prompt (which kills stock CB's worker and every request
  in it), chat messages the chat template cannot render, and a prompt (for chat: the messages rendered by the model's
  chat template) that with ``max_tokens`` / ``max_completion_tokens`` exceeds the model's context get 400 with the
  reason. A request without a token limit gets ``context - prompt`` tokens at most (as vLLM does; stock
  ``transformers serve`` gives it 1024 whatever the context).
* **A request whose client leaves is cancelled** (streaming or not), and its pages go back to the cache.
* **A request that runs the paged cache out fails alone** (400, or an error event when it streams): stock CB's
  worker dies there and answers every later request 503.
* **SIGTERM/SIGINT drain the server**: no new request is taken (503), those in flight get ``--drain-timeout``
  seconds (default 5) to finish, the rest are cancelled (503, or an error event when they stream), then the engine
  stops and the process exits.

Examples::

    python -m tinyserve_compile.serve path/to/model --options '{"token_budget": 1024}' --port 8000
    python -m tinyserve_compile.serve /path/to/folder:smollm2.gguf   # GGUF weights: folder:file.gguf
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import uuid
from typing import Callable, Optional, Sequence, Tuple

__all__ = ["main", "serve_args", "check_request", "validate_request", "RequestChecks", "InFlightRequests",
           "SUPPORTED_SERVE_TRANSFORMERS", "CACHE_FULL"]

#: ``major.minor`` versions of transformers whose ``transformers serve`` this entry point hooks (its model manager
#: and server builder; 5.25 moved each model into a process of its own behind an engine client, not yet followed)
SUPPORTED_SERVE_TRANSFORMERS = ("5.24",)

#: the request fields checked before a request reaches the engine
_INT_FIELDS = ("max_tokens", "max_completion_tokens", "n", "seed", "top_k")
_NUM_FIELDS = ("temperature", "top_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
_BOOL_FIELDS = ("stream",)
#: the content part types whose text transformers' chat handler passes to a text model's chat template
_TEXT_PARTS = ("text", "input_text", "output_text")

#: the words that mark a request failed because the paged cache cannot hold it (see :func:`_prepare_or_fail`); the
#: middleware answers such a failure 400 (the request asks for more than the server can hold: a retry fails alike)
CACHE_FULL = "needs more of the KV cache than the server has"
#: seconds a cancelled request's result handler is kept as a sink, for the outputs of the step in flight
_SINK_S = 30.0


def _log(message: str) -> None:
    """One line on stderr, in one write (the event loop and CB's worker thread both report)."""
    sys.stderr.write(f"tinyserve: {message}\n")
    sys.stderr.flush()


def _message_error(i: int, m) -> Optional[str]:
    """Why chat message ``i`` is malformed for transformers' chat handler (which indexes these fields), or None."""
    if not isinstance(m, dict):
        return f"'messages[{i}]' must be an object"
    if not isinstance(m.get("role"), str):
        return f"'messages[{i}].role' must be a string"
    content = m.get("content")
    if content is None or isinstance(content, str) or m.get("tool_calls"):
        return None
    if not isinstance(content, list):
        return f"'messages[{i}].content' must be a string or a list of content parts"
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            return f"'messages[{i}].content[{j}]' must be an object with a string 'type'"
        if part["type"] in _TEXT_PARTS and not isinstance(part.get("text"), str):
            return f"'messages[{i}].content[{j}].text' must be a string"
    return None


def _chat_prompt_length(tokenizer, body: dict, template_kwargs: Optional[dict] = None) -> int:
    """Tokens of the prompt transformers' chat handler builds from ``body``: the messages converted as it converts
    them for a text model, rendered by the tokenizer's chat template with the generation prompt, the request's tools
    and chat-template arguments over the server's (``template_kwargs``)."""
    from transformers.cli.serving.utils import BaseHandler, Modality

    messages = BaseHandler.get_processor_inputs_from_messages(body["messages"], Modality.LLM)
    kwargs = {**(template_kwargs or {}), **(body.get("chat_template_kwargs") or {})}
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=body.get("tools"), tokenize=True,
                                        return_dict=True, **kwargs)
    return len(out["input_ids"])


def validate_request(path: str, body, tokenizer=None, context: int = 0,
                     template_kwargs: Optional[dict] = None) -> Tuple[Optional[str], Optional[int]]:
    """Check a completion request, and cap its new tokens by the context.

    One validator for ``/v1/completions`` and ``/v1/chat/completions``. Stock CB's worker dies on an empty prompt
    (a batch of 0 tokens), taking every other request with it; ``transformers serve`` answers a field of the wrong
    type with a bare 500 and takes any ``max_tokens``. The token limit of a request is ``max_tokens`` for
    completions, ``max_completion_tokens`` (else ``max_tokens``) for chat, as transformers reads them. As vLLM does,
    a request whose prompt plus token limit exceeds the context is refused, and a request without a limit may
    generate up to the context.

    Parameters
    ----------
    path : str
        ``/v1/completions`` or ``/v1/chat/completions``.
    body : object
        The decoded JSON body.
    tokenizer : optional
        Counts prompt tokens for the length checks: called on a completion prompt, ``apply_chat_template`` on chat
        messages. None: no length check.
    context : int
        The model's context length (0: no length check).
    template_kwargs : dict, optional
        The server's chat-template arguments (a request's ``chat_template_kwargs`` override them).

    Returns
    -------
    (str or None, int or None)
        Why the request must be refused (None: it may go on), and the token limit to give a request that has none
        (None: it has one, or the context is unknown).
    """
    if not isinstance(body, dict):
        return "the request body must be a JSON object", None
    for k in _INT_FIELDS:
        v = body.get(k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < (0 if k == "seed" else 1)):
            return f"'{k}' must be a positive integer, got {v!r}", None
    for k in _NUM_FIELDS:
        v = body.get(k)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)):
            return f"'{k}' must be a number, got {v!r}", None
    for k in _BOOL_FIELDS:
        v = body.get(k)
        if v is not None and not isinstance(v, bool):
            return f"'{k}' must be true or false, got {v!r}", None
    counting = tokenizer is not None and context > 0
    if path.endswith("/chat/completions"):
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return "'messages' must be a non-empty list", None
        for i, m in enumerate(msgs):
            why = _message_error(i, m)
            if why is not None:
                return why, None
        if body.get("chat_template_kwargs") is not None and not isinstance(body["chat_template_kwargs"], dict):
            return "'chat_template_kwargs' must be an object", None
        field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        n = 0
        if counting:
            try:
                n = _chat_prompt_length(tokenizer, body, template_kwargs)
            except Exception as e:  # a template error names what it needs: the client gets it with a 400
                return f"the model's chat template cannot render 'messages': {type(e).__name__}: {e}", None
            if n == 0:
                return "'messages' render to an empty prompt", None
    else:
        field = "max_tokens"
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            if not prompt:
                return "'prompt' must not be empty", None
            n = len(tokenizer(prompt).input_ids) if counting else 0
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            n = len(prompt)
        else:
            return "'prompt' must be a non-empty string or a non-empty list of token ids", None
    if context <= 0 or (n == 0 and not counting):
        return None, None
    new = body.get(field)
    if new is not None:
        if n + new > context:
            return (f"the prompt has {n} tokens; with {field}={new} that exceeds the model's context of {context} "
                    f"tokens"), None
        return None, None
    if n >= context:
        return (f"the prompt has {n} tokens, which leaves no room for a new token: it exceeds the model's context "
                f"of {context} tokens"), None
    return None, context - n


def check_request(path: str, body, tokenizer=None, context: int = 0, template_kwargs: Optional[dict] = None):
    """Why a completion request must be refused, or None: :func:`validate_request` without the token limit."""
    return validate_request(path, body, tokenizer, context, template_kwargs)[0]


class _Call:
    """One completion request being answered: its engine request id and the task that answers it."""

    __slots__ = ("request_id", "task", "reason")

    def __init__(self, request_id: str, task: "asyncio.Task"):
        self.request_id, self.task, self.reason = request_id, task, None


class InFlightRequests:
    """The completion requests a server is answering: one whose client left is cancelled, and at shutdown they are
    drained (no new request, a grace period, then the rest cancelled).

    Parameters
    ----------
    cancel_engine : callable, optional
        ``cancel_engine(request_id)`` cancels the request in the engine (CB frees its pages at its next step).
    """

    def __init__(self, cancel_engine: Callable[[str], None] = lambda request_id: None):
        self.cancel_engine = cancel_engine
        self.calls: set = set()
        self.draining = False

    def cancel(self, call: _Call, reason: str) -> None:
        """Cancel ``call`` in the engine and its answering task, for ``reason`` (what its client is told, if it is
        still there)."""
        if call.reason is not None:
            return
        call.reason = reason
        try:
            self.cancel_engine(call.request_id)
        finally:
            call.task.cancel()
        _log(f"request {call.request_id} cancelled: {reason}")

    async def drain(self, grace: float, force: Callable[[], bool] = lambda: False) -> int:
        """Refuse new requests, give those in flight ``grace`` seconds to finish (less if ``force()`` turns true),
        then cancel the others and wait (2 s at most) for them to answer.

        Returns
        -------
        int
            How many requests were cancelled.
        """
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.calls and loop.time() < deadline and not force():
            await asyncio.sleep(0.05)
        left = list(self.calls)
        for call in left:
            self.cancel(call, "the server is shutting down")
        deadline = loop.time() + 2.0
        while self.calls and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return len(left)


async def _answer(send, status: int, error: str) -> None:
    """A JSON answer ``{"error": error}`` with ``status``."""
    data = json.dumps({"error": error}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


class RequestChecks:
    """ASGI middleware over the completion routes (POST ``/v1/completions``, ``/v1/chat/completions``).

    * :func:`validate_request` on every request: a refused one gets 400 ``{"error": ...}`` and never reaches the
      engine; one without a token limit gets ``context - prompt`` as its ``max_tokens``.
    * Every request carries an ``X-Request-ID`` (the client's, else a new one), which ``transformers serve`` uses as
      the engine's request id: when the client leaves before its answer is complete, the request is cancelled in
      the engine (``InFlightRequests.cancel_engine``) and its handler task is cancelled.
    * A request that failed because the paged cache cannot hold it (:data:`CACHE_FULL`) gets 400 with the reason.
    * While the server drains (:meth:`InFlightRequests.drain`), a new request gets 503, and one cancelled by the
      drain gets 503, or an error event if its stream had begun.

    Parameters
    ----------
    app : ASGI application
    tokenizer, context, template_kwargs : callable
        Return the served model's tokenizer (or None), context length (0: unknown) and the server's chat-template
        arguments, at request time.
    requests : InFlightRequests, optional
        The requests in flight (one is made if not given).
    """

    ROUTES = ("/v1/completions", "/v1/chat/completions")

    def __init__(self, app, tokenizer=lambda: None, context=lambda: 0, template_kwargs=lambda: {},
                 requests: Optional[InFlightRequests] = None):
        self.app, self.tokenizer, self.context, self.template_kwargs = app, tokenizer, context, template_kwargs
        self.requests = requests if requests is not None else InFlightRequests()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in self.ROUTES:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None  # the client left before it sent its request
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        raw = b"".join(chunks)
        if self.requests.draining:
            return await _answer(send, 503, "the server is shutting down")
        try:
            body = json.loads(raw or b"null")
        except json.JSONDecodeError as e:
            return await _answer(send, 400, f"the request body is not JSON ({e})")
        why, cap = validate_request(scope["path"], body, self.tokenizer(), self.context(), self.template_kwargs())
        if why is not None:
            return await _answer(send, 400, why)
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        if cap is not None:  # no token limit: the context's room, as the body's max_tokens
            body["max_tokens"] = cap
            raw = json.dumps(body).encode()
        request_id = next((v.decode("latin-1") for k, v in headers if k.lower() == b"x-request-id"), None)
        if not request_id:
            request_id = str(uuid.uuid4())
            headers.append((b"x-request-id", request_id.encode()))
        headers.append((b"content-length", str(len(raw)).encode()))
        await self._run(dict(scope, headers=headers), receive, send, raw, request_id)

    async def _run(self, scope, receive, send, raw: bytes, request_id: str) -> None:
        """Answer the request through the app in a task of its own, watching the connection: the client leaving
        cancels it."""
        left = asyncio.Event()
        replayed = False
        sent = {"start": False, "end": False}

        async def replay():
            # the body once, then (as an ASGI server does) a disconnect once the client has left
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await left.wait()
            return {"type": "http.disconnect"}

        async def send_tracked(msg):
            if msg["type"] == "http.response.start":
                sent["start"] = True
            elif msg["type"] == "http.response.body" and not msg.get("more_body", False):
                sent["end"] = True
            await send(msg)

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            left.set()

        call = _Call(request_id, asyncio.ensure_future(self.app(scope, replay, send_tracked)))
        watcher = asyncio.ensure_future(watch())
        self.requests.calls.add(call)
        try:
            await asyncio.wait({call.task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            # the server reports a disconnect once the answer is complete too: only one before it is a client leaving
            if not call.task.done() and not sent["end"]:
                self.requests.cancel(call, "the client disconnected")
            try:
                await call.task
            except asyncio.CancelledError:
                if call.reason is None or getattr(asyncio.current_task(), "cancelling", lambda: 0)():
                    raise  # this task itself is being cancelled (Python 3.10 cannot tell: taken as ours)
                if not left.is_set() and not sent["end"]:  # cancelled by the drain, the client still waits
                    if not sent["start"]:
                        await _answer(send, 503, call.reason)
                    else:
                        error = json.dumps({"error": call.reason})
                        await send({"type": "http.response.body", "body": f"data: {error}\n\n".encode()})
            except Exception as e:
                if CACHE_FULL not in str(e) or sent["start"]:
                    raise
                why = str(e)
                why = why[max(0, why.find(f"request {request_id} {CACHE_FULL}")):]  # less transformers' prefix
                _log(f"request {request_id} failed: {why}")
                await _answer(send, 400, why)
        finally:
            watcher.cancel()
            self.requests.calls.discard(call)
            if not call.task.done():  # this task was cancelled (the server gave up on it): so is the request
                self.requests.cancel(call, "the server cancelled it")


def _cancel_engine(generation_state) -> Callable[[str], None]:
    """``cancel_engine(request_id)`` for :class:`InFlightRequests`: cancel the request in the CB manager of
    ``transformers serve``'s ``generation_state`` (its worker drops it and frees its pages at its next step).

    CB delivers nothing for a cancelled request, so the result handler transformers registered for it would stay
    for good (a non-streaming handler awaits it forever); it is replaced by a sink for the outputs of the step in
    flight, removed a while later."""

    def cancel(request_id: str) -> None:
        manager = getattr(generation_state, "_cb_manager", None)
        cb = getattr(manager, "_cb", None)
        if cb is None:
            return
        cb.cancel_request(request_id)
        router = cb.output_router
        loop = asyncio.get_running_loop()

        def drop():
            with router._lock:
                if router.result_handlers.get(request_id, (None,))[0] is sink:
                    del router.result_handlers[request_id]

        def sink(output):
            return None

        with router._lock:
            if request_id in router.result_handlers:
                router.result_handlers[request_id] = (sink, loop)
                loop.call_later(_SINK_S, drop)

    return cancel


def _stop_engine(generation_state, timeout: float = 5.0) -> None:
    """Stop the CB worker of ``generation_state`` now: a hard stop (the requests it still holds fail), its thread
    joined (it ends after the step it is in). Not CB's ``stop()``, whose garbage collection takes seconds on a busy
    machine and frees nothing the exit does not."""
    from transformers.generation.continuous_batching.continuous_api import BackgroundThreadStatus

    manager = getattr(generation_state, "_cb_manager", None)
    cb = getattr(manager, "_cb", None)
    if cb is None or not cb.is_running():
        return
    cb.background_thread_status.request_stop(BackgroundThreadStatus.HARD_STOP, cb.distributed_helper.global_rank)
    cb._wake_up_loop.set()
    cb._generation_thread.join(timeout)


def _prepare_or_fail(original):
    """``ContinuousBatchProcessor.prepare_next_batch`` that fails one request instead of the worker when the paged
    cache runs out.

    Stock CB raises when no request can be scheduled and none can be offloaded: one request needs more pages than
    the cache has free with every other request offloaded (it grew past the cache, or its prompt alone does not
    fit), and the worker dies with every request. Here that request fails alone, with :data:`CACHE_FULL` and the
    sizes in its error, its pages are freed, and scheduling is tried again. The request failed is the longest of the
    requests that could not grow (the scheduler's starved requests), else the longest active one, else the first
    waiting one (nothing runs, and the head of the queue cannot start).
    """

    def prepare_next_batch(self):
        for _ in range(len(self.scheduler.active_requests) + len(self.scheduler.waiting_requests) + 1):
            try:
                return original(self)
            except RuntimeError as e:
                if "No requests can be scheduled" not in str(e):
                    raise
                sched = self.scheduler
                starved = [s for s, _ in sched.starved_requests if s.request_id in sched.active_requests]
                pool = starved or list(sched.active_requests.values())
                if pool:
                    state = max(pool, key=lambda s: s.current_len())
                elif sched.waiting_requests_order:
                    state = sched.waiting_requests[sched.waiting_requests_order[0]]
                else:
                    raise
                rid = state.request_id
                prompt, now = state._true_initial_tokens or len(state.initial_tokens), state.current_len()
                if now < prompt:
                    where = f"its prompt of {prompt} tokens does not fit (it stopped at {now})"
                else:
                    where = f"it cannot grow past {now} tokens ({prompt} of prompt, {now - prompt} generated)"
                error = RuntimeError(
                    f"request {rid} {CACHE_FULL}: {where} in a cache of {self.cache.max_tokens_read} tokens; ask "
                    f"for fewer tokens (max_tokens) or serve with more cache blocks (--cb-num-blocks)")
                self._handle_request_error(error, state)
                sched.finish_request(rid)
                sched.waiting_requests.pop(rid, None)
                if rid in sched.waiting_requests_order:
                    sched.waiting_requests_order.remove(rid)
                self.offloading_manager.free_request_cpu_cache(state)
                sched.starved_requests = []
                sched.block_new_requests = False
        return original(self)

    return prepare_next_batch


def _dropping_cancelled(original):
    """``Scheduler.clear_cancelled_requests`` that reports each request the worker drops with the cache blocks it
    gives back (a block shared with another request stays), and lets waiting requests in again once one is dropped.

    After it offloads a request CB admits no new one until a request finishes (``block_new_requests``); a cancelled
    request never finishes, so when the requests left running were all cancelled, the offloaded one and every later
    one waited for good. A dropped request frees its pages as a finished one does, and lifts the block the same way.
    """

    def clear_cancelled_requests(self):
        with self._cancellation_lock:
            blocks = {rid: sum(len(a.block_table.get(rid, ())) for a in self.cache.cache_allocators.values())
                      for rid in self._requests_to_cancel}
        states = original(self)
        for state in states:
            _log(f"request {state.request_id} dropped by the engine, {blocks.get(state.request_id, 0)} cache blocks "
                 f"released")
        if states:
            self.block_new_requests = False
        return states

    return clear_cancelled_requests


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
    ap.add_argument("--drain-timeout", type=float, default=5.0, metavar="S",
                    help="on SIGTERM/SIGINT, seconds the requests in flight get to finish before they are cancelled "
                         "(default 5)")
    a, rest = ap.parse_known_args(argv)
    try:
        options = json.loads(a.options)
    except json.JSONDecodeError as e:
        ap.error(f"argument --options: not JSON ({e})")
    if not a.drain_timeout >= 0:
        ap.error(f"argument --drain-timeout: must be >= 0, got {a.drain_timeout}")
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
    import uvicorn
    from transformers.cli.serving import server as server_mod
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.transformers import app
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor
    from transformers.generation.continuous_batching.scheduler import Scheduler

    load, load_proc, build = ModelManager._load_model, ModelManager._load_processor, server_mod.build_server
    prepare, shutdown = ContinuousBatchProcessor.prepare_next_batch, uvicorn.Server.shutdown
    clear_cancelled = Scheduler.clear_cancelled_requests
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
        chat = kwargs.get("chat_handler", args[1] if len(args) > 1 else None)
        served["state"] = state = kwargs.get("generation_state")
        served["requests"] = requests = InFlightRequests(_cancel_engine(state))
        srv.add_middleware(RequestChecks, tokenizer=lambda: served.get("tokenizer"),
                           context=lambda: served.get("context", 0),
                           template_kwargs=lambda: getattr(chat, "chat_template_kwargs", None) or {},
                           requests=requests)
        return srv

    async def drain_then_shutdown(server, *args, **kwargs):
        # uvicorn waits, unbounded, for every request in flight: stop listening, drain (bounded), stop the engine,
        # then uvicorn's own shutdown finds nothing left to wait for
        requests = served.get("requests")
        if requests is not None:
            for listener in server.servers:
                listener.close()
            n = await requests.drain(a.drain_timeout, lambda: server.force_exit)
            _log(f"shutting down ({n} requests cancelled)")
            await asyncio.to_thread(_stop_engine, served.get("state"))
        return await shutdown(server, *args, **kwargs)

    # this process serves tinyserve-enabled models only, behind the request checks, with a worker that a request
    # cannot take down, and a bounded shutdown
    ModelManager._load_model, ModelManager._load_processor = load_enabled, load_processor
    server_mod.build_server = build_checked
    ContinuousBatchProcessor.prepare_next_batch = _prepare_or_fail(prepare)
    Scheduler.clear_cancelled_requests = _dropping_cancelled(clear_cancelled)
    uvicorn.Server.shutdown = drain_then_shutdown
    try:
        app(serve_args(a.model, rest), standalone_mode=False)
    finally:
        ModelManager._load_model, ModelManager._load_processor = load, load_proc
        server_mod.build_server = build
        ContinuousBatchProcessor.prepare_next_batch = prepare
        Scheduler.clear_cancelled_requests = clear_cancelled
        uvicorn.Server.shutdown = shutdown
    return 0


if __name__ == "__main__":
    sys.exit(main())
