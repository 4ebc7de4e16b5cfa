"""OpenAI-compatible HTTP server over one Engine (FastAPI + uvicorn).

    GET  /health                  200 once the model is loaded (and warmed up); 503 while loading or draining
    GET  /metrics                 Prometheus text format (metrics.py)
    GET  /v1/models               the served model
    POST /v1/completions          prompt (string, token ids, or a list of those) -> text
    POST /v1/chat/completions     messages (rendered with the artifact's chat template) -> reply

Threads. uvicorn's event loop runs the HTTP handlers and never runs torch. ONE engine thread
(EngineLoop) loads the model, then runs scheduler steps for as long as there is work. A handler
tokenizes in a worker thread, submits its Sequences through the loop's inbox (a queue.Queue), and
awaits their Deltas on an asyncio.Queue that the engine thread fills through
`call_soon_threadsafe`. A handler whose client disconnects puts a cancel into the same inbox; the
scheduler frees the request's blocks at its next step.

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 invalid parameter
or a prompt too long for the context, 401 missing or wrong API key, 404 unknown model or route,
413 body too large, 503 loading, draining or queue full.

SIGTERM (or Ctrl-C): /health turns 503, the listening socket closes, running requests get up to
`drain_timeout` seconds to finish; then the rest are cancelled and the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import queue
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlac.errors import MlacError
from mlac.runtime.metrics import Metrics
from mlac.runtime.sampling import MAX_LOGPROBS, InvalidSamplingParams, SamplingParams, TokenLogprob
from mlac.runtime.scheduler import Delta, SchedulerConfig, Sequence

if TYPE_CHECKING:
    from mlac.runtime.runner import LaunchSpec

log = logging.getLogger("mlac.server")

DEFAULT_MAX_BODY_BYTES = 4 << 20


@dataclass(frozen=True)
class ServerConfig:
    """Everything `mlac serve` is told. `api_key` None: no auth (the default bind is 127.0.0.1)."""

    artifact: Path
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    device: str = "cpu"
    dtype: str = "bfloat16"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    max_queue: int = 256  # requests waiting beyond max_running_requests before 503
    drain_timeout: float = 30.0
    served_model_name: str | None = None  # default: the artifact directory's name
    launch: LaunchSpec | None = None  # how the ranks of a multi-node artifact meet
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    verify: bool = True
    warmup: bool = True  # run the step shapes once before /health turns ready (CUDA: Triton JIT)

    def __post_init__(self) -> None:
        for name, low in (("max_queue", 0), ("drain_timeout", 0), ("max_body_bytes", 1), ("port", 0)):
            if getattr(self, name) < low:
                raise MlacError(f"{name}={getattr(self, name)!r}: must be >= {low}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.artifact).resolve().name


# ---- errors ------------------------------------------------------------------------------------


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class QueueFull(MlacError):
    pass


# ---- the engine thread ---------------------------------------------------------------------------

Sink = Callable[[Delta | BaseException], None]


class EngineLoop:
    """The engine's one thread: loads the model, then runs scheduler steps. Other threads
    `submit` Sequences and `cancel` them through a thread-safe inbox; each Delta (or an
    exception, if a step fails) goes to the request's sink, called on the engine thread."""

    def __init__(self, load: Callable[[], Any], metrics: Metrics, max_unfinished: int):
        self._load = load
        self.metrics = metrics
        self.max_unfinished = max_unfinished
        self.engine = None
        self.scheduler = None
        self.load_error: BaseException | None = None
        self.on_load_error: Callable[[], None] | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._unfinished = 0  # submitted, not yet finished (guarded by _lock)
        self._sinks: dict[int, Sink] = {}
        self._last_token: dict[int, float] = {}
        self._thread = threading.Thread(target=self._main, name="mlac-engine", daemon=True)

    # ---- any thread ----

    def start(self) -> None:
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def num_unfinished(self) -> int:
        return self._unfinished

    def submit(self, seqs: list[Sequence], sinks: list[Sink]) -> None:
        """Queue requests for the engine (all or none); QueueFull past max_unfinished."""
        with self._lock:
            if self._unfinished + len(seqs) > self.max_unfinished:
                raise QueueFull(f"server busy: {self._unfinished} requests queued or running; retry later")
            self._unfinished += len(seqs)
        for seq, sink in zip(seqs, sinks, strict=True):
            self.metrics.prompt_tokens.inc(len(seq.prompt_ids))
            self._inbox.put(("add", seq, sink))

    def cancel(self, seq_id: int) -> None:
        self._inbox.put(("cancel", seq_id))

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is left, close the engine, end the thread."""
        self._inbox.put(("stop",))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the engine thread ----

    def _main(self) -> None:
        try:
            self.engine = self._load()
            self.scheduler = self.engine.scheduler()
        except BaseException as e:  # noqa: BLE001  (reported by /health and by serve())
            log.error("loading the model failed: %s", e)
            self.load_error = e
            if self.on_load_error is not None:
                self.on_load_error()
            return
        self.metrics.kv_blocks.set(self.engine.cache.num_blocks)
        self._ready.set()
        log.info("model loaded: ready")
        try:
            while self._take_inbox(block=not self.scheduler.has_unfinished):
                if self.scheduler.has_unfinished:
                    self._step()
        finally:
            for seq in self.scheduler.abort_all():
                self._deliver(seq, time.monotonic())
            self._refuse_inbox()
            self.engine.close()

    def _refuse_inbox(self) -> None:
        """At shutdown: requests submitted but never added get an error instead of silence."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "add":
                self._sinks[item[1].seq_id] = item[2]
                self._finish(item[1].seq_id, MlacError("server shutting down"))

    def _take_inbox(self, block: bool) -> bool:
        """Apply queued submissions and cancellations; False once asked to stop."""
        item = self._inbox.get() if block else None
        while True:
            if item is not None:
                if item[0] == "stop":
                    return False
                self._apply(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, item: tuple) -> None:
        if item[0] == "add":
            _, seq, sink = item
            self._sinks[seq.seq_id] = sink
            try:
                self.scheduler.add(seq)
            except MlacError as e:
                self._finish(seq.seq_id, e)
        elif item[0] == "cancel" and item[1] in self._sinks:
            self.scheduler.abort(item[1])

    def _step(self) -> None:
        preempted = self.scheduler.num_preemptions
        try:
            news = self.scheduler.step()
        except Exception as e:  # a failed step fails its requests, not the server
            log.exception("engine step failed")
            for seq in self.scheduler.abort_all():
                self._finish(seq.seq_id, MlacError(f"engine step failed: {e}"))
            return
        now = time.monotonic()
        for seq in news:
            self._deliver(seq, now)
        m, s = self.metrics, self.scheduler
        m.preemptions.inc(s.num_preemptions - preempted)
        m.running.set(s.num_running)
        m.waiting.set(s.num_waiting)
        m.kv_usage.set(self.engine.cache.usage)

    def _deliver(self, seq: Sequence, now: float) -> None:
        delta = seq.take_delta()
        if delta.token_ids:
            self.metrics.generation_tokens.inc(len(delta.token_ids))
            prev = self._last_token.get(seq.seq_id)
            if prev is None:
                self.metrics.ttft.observe(now - seq.arrival)
            else:
                self.metrics.itl.observe((now - prev) / len(delta.token_ids))
            self._last_token[seq.seq_id] = now
        sink = self._sinks.get(seq.seq_id)
        if sink is not None and (delta.text or delta.token_ids or delta.finish_reason):
            _call(sink, delta)
        if seq.finished:
            self.metrics.finished.labels(seq.finish_reason).inc()
            self.metrics.e2e.observe(now - seq.arrival)
            self._finish(seq.seq_id, None)

    def _finish(self, seq_id: int, error: BaseException | None) -> None:
        sink = self._sinks.pop(seq_id, None)
        self._last_token.pop(seq_id, None)
        if sink is None:
            return
        if error is not None:
            _call(sink, error)
        with self._lock:
            self._unfinished -= 1


def _call(sink: Sink, item: Delta | BaseException) -> None:
    try:
        sink(item)
    except Exception:  # noqa: BLE001  (the handler's event loop is gone: nobody is listening)
        log.debug("dropped a delta for a request whose handler is gone")


class _Handle:
    """The engine requests of one HTTP call and their deltas, on the handler's event loop."""

    def __init__(self, loop: EngineLoop, seqs: list[Sequence]):
        self.loop, self.seqs = loop, seqs
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done: set[int] = set()
        aio = asyncio.get_running_loop()
        sinks = [self._sink(aio, i) for i in range(len(seqs))]
        loop.submit(seqs, sinks)

    def _sink(self, aio: asyncio.AbstractEventLoop, index: int) -> Sink:
        return lambda item: aio.call_soon_threadsafe(self.queue.put_nowait, (index, item))

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, Delta) until every request finished; an engine failure raises."""
        while len(self.done) < len(self.seqs):
            index, item = await self.queue.get()
            if isinstance(item, BaseException):
                self.done.add(index)
                raise ApiError(500, str(item), type="server_error", code="engine_error")
            if item.finish_reason is not None:
                self.done.add(index)
            yield index, item

    def cancel_unfinished(self) -> None:
        for i, seq in enumerate(self.seqs):
            if i not in self.done:
                self.loop.cancel(seq.seq_id)


# ---- request bodies ------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=None, ge=1, le=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=0, le=0)
    frequency_penalty: float | None = Field(default=None, ge=0, le=0)
    user: str | None = None
    # extensions, as vLLM names them
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(default=None, ge=0, le=1)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    best_of: int | None = Field(default=None, ge=1, le=1)
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


UNSUPPORTED = {
    "n": "only n=1 is supported",
    "presence_penalty": "presence_penalty is not supported (only 0)",
    "frequency_penalty": "frequency_penalty is not supported (only 0)",
    "echo": "echo is not supported",
    "best_of": "only best_of=1 is supported",
    "suffix": "suffix is not supported",
}


def parse_body(model: type[BaseModel], data: Any) -> Any:
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        top = str(err["loc"][0]) if err["loc"] else ""
        message = UNSUPPORTED.get(top) or (f"{param}: {err['msg']}" if param else err["msg"])
        raise ApiError(400, message, param=param) from None
    for name in ("echo", "suffix"):
        if getattr(body, name, None):
            raise ApiError(400, UNSUPPORTED[name], param=name)
    return body


def sampling_params(body: _Body, max_tokens: int, logprobs: int | None) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(0, body.top_k or 0),
            min_p=body.min_p or 0.0,
            seed=body.seed,
            stop=body.stop or (),
            stop_token_ids=body.stop_token_ids or (),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
        )
    except InvalidSamplingParams as e:
        raise ApiError(400, str(e), param=e.param) from None


def message_text(content: str | list[dict[str, Any]] | None) -> str:
    """A message's content as text: a string, or the text parts of a content list."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(
                400, f"unsupported content part of type {part.get('type')!r}: only text", "messages"
            )
        parts.append(part["text"])
    return "".join(parts)


# ---- the app -------------------------------------------------------------------------------------


@dataclass
class ServerState:
    config: ServerConfig
    loop: EngineLoop
    metrics: Metrics
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(config: ServerConfig, load: Callable[[], Any] | None = None):
    """The FastAPI app. Its lifespan starts the engine thread (the model loads in the background:
    /health says when it is ready) and stops it at shutdown."""
    metrics = Metrics()
    loop = EngineLoop(load or (lambda: load_engine(config)), metrics, _max_unfinished(config))
    state = ServerState(config, loop, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        yield
        await asyncio.to_thread(loop.stop)

    app = FastAPI(title="mlac", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.mlac = state

    def count(request: Request, code: int) -> None:
        route = request.scope.get("route")
        metrics.requests.labels(getattr(route, "path", "other"), str(code)).inc()

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        if request.url.path.startswith("/v1"):
            count(request, e.status)
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        err = ApiError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=e.status_code)

    async def check_key(request: Request) -> None:
        key = config.api_key
        if key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, given = auth.partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        if not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise ApiError(401, "incorrect API key provided", code="invalid_api_key")

    @app.get("/health")
    async def health():
        if loop.load_error is not None:
            return JSONResponse({"status": "failed", "error": str(loop.load_error)}, status_code=503)
        if not loop.ready or state.draining:
            return JSONResponse({"status": "draining" if state.draining else "loading"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_route():
        return Response(metrics.render(), media_type=metrics.content_type)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @v1.get("/models")
    async def models(request: Request):
        engine = loop.engine
        card = {"id": config.model_name, "object": "model", "created": state.created, "owned_by": "mlac"}
        if engine is not None:
            card["max_model_len"] = engine.max_context
        count(request, 200)
        return {"object": "list", "data": [card]}

    @v1.post("/completions")
    async def completions(request: Request):
        body = parse_body(CompletionBody, await read_json(request, config.max_body_bytes))
        engine = await admit(body)
        prompts = _prompt_list(body.prompt)

        def make() -> list[Sequence]:
            ids = [engine.encode_prompt(p) for p in prompts]
            return [
                _new_sequence(engine, i, body, body.max_tokens or 16, body.logprobs, "prompt") for i in ids
            ]

        handle = submit(await _in_thread(make))
        count(request, 200)
        render = _CompletionRender(
            engine.tokenizer, config.model_name, len(prompts), body.logprobs is not None
        )
        return await respond(request, body, handle, render)

    @v1.post("/chat/completions")
    async def chat(request: Request):
        body = parse_body(ChatBody, await read_json(request, config.max_body_bytes))
        engine = await admit(body)
        if engine.tokenizer is None or engine.tokenizer.chat_template is None:
            raise ApiError(400, "this model has no chat template: use /v1/completions", param="messages")
        messages = [
            {**m.model_dump(exclude_none=True), "content": message_text(m.content)} for m in body.messages
        ]
        logprobs = (body.top_logprobs or 0) if body.logprobs else None

        def make() -> list[Sequence]:
            from jinja2.exceptions import TemplateError

            try:
                ids = engine.tokenizer.encode_chat(messages)
            except TemplateError as e:
                raise ApiError(400, f"chat template refused the messages: {e}", param="messages") from None
            max_tokens = (
                body.max_completion_tokens or body.max_tokens or max(1, engine.max_context - len(ids))
            )
            return [_new_sequence(engine, ids, body, max_tokens, logprobs, "messages")]

        handle = submit(await _in_thread(make))
        count(request, 200)
        render = _ChatRender(engine.tokenizer, config.model_name, body.logprobs)
        return await respond(request, body, handle, render)

    async def admit(body: _Body):
        """The engine, once the request may run: the model is loaded, not draining, model matches."""
        if body.model != config.model_name:
            raise ApiError(
                404, f"the model '{body.model}' does not exist", param="model", code="model_not_found"
            )
        if state.draining:
            raise ApiError(503, "server is shutting down", type="server_error", code="draining")
        if not loop.ready:
            raise ApiError(
                503, "model is loading; retry when /health is ok", type="server_error", code="loading"
            )
        return loop.engine

    def submit(seqs: list[Sequence]) -> _Handle:
        try:
            return _Handle(loop, seqs)
        except QueueFull as e:
            raise ApiError(503, str(e), type="server_error", code="queue_full") from None

    async def respond(request: Request, body: _Body, handle: _Handle, render):
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(_sse(handle, render, usage), media_type="text/event-stream")
        watcher = asyncio.create_task(_watch_disconnect(request, handle))
        try:
            async for index, delta in handle.deltas():
                render.add(index, delta)
        finally:
            watcher.cancel()
            handle.cancel_unfinished()
        return JSONResponse(render.body())

    app.include_router(v1)
    return app


async def _in_thread(fn: Callable[[], list[Sequence]]) -> list[Sequence]:
    """Tokenize and build Sequences off the event loop; engine refusals become 400s."""
    try:
        return await asyncio.to_thread(fn)
    except MlacError as e:
        raise ApiError(400, str(e), param=getattr(e, "param", None)) from None


def _new_sequence(
    engine, ids: list[int], body: _Body, max_tokens: int, logprobs: int | None, what: str
) -> Sequence:
    ctx = engine.max_context
    if len(ids) + max_tokens > ctx:
        raise ApiError(
            400,
            f"this model's maximum context length is {ctx} tokens; you requested {len(ids) + max_tokens} "
            f"({len(ids)} in the {what}, {max_tokens} for the completion): shorten the {what} or max_tokens",
            param=what,
            code="context_length_exceeded",
        )
    return engine.new_sequence(ids, sampling_params(body, max_tokens, logprobs))


def _prompt_list(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt: must not be empty", param="prompt")
    return list(prompt)


async def read_json(request, limit: int) -> Any:
    """The request body as JSON, at most `limit` bytes (413 past it, 400 if not JSON)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"request body of {length} bytes exceeds the limit of {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    return data


async def _watch_disconnect(request, handle: _Handle) -> None:
    """Cancel the handle's requests when the client goes away (non-streaming responses)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.cancel_unfinished()
            return


async def _sse(handle: _Handle, render, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per delta, usage when asked, then [DONE]. A client that
    disconnects cancels the generator (starlette), and with it the requests."""
    try:
        for chunk in render.start():
            yield _event(chunk)
        async for index, delta in handle.deltas():
            if delta.text or delta.finish_reason or (render.want_logprobs and delta.logprobs):
                yield _event(render.chunk(index, delta, include_usage))
            else:
                render.add(index, delta)  # a token whose text is held back: nothing to send yet
        if include_usage:
            yield _event(render.usage_chunk())
    except ApiError as e:
        yield _event(e.body())
    finally:
        handle.cancel_unfinished()
    yield "data: [DONE]\n\n"


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _lp(x: float) -> float:
    return max(x, -9999.0)  # JSON has no -inf


class _Render:
    """Accumulates the choices of one response; renders chunks and the final body."""

    object = ""
    id_prefix = ""

    def __init__(self, tokenizer, model: str, n: int = 1):
        self.tok, self.model = tokenizer, model
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.text = [""] * n
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.prompt_tokens = [0] * n
        self.completion_tokens = [0] * n

    def add(self, i: int, d: Delta) -> None:
        self.text[i] += d.text
        self.logprobs[i] += d.logprobs
        self.finish[i] = d.finish_reason
        self.prompt_tokens[i], self.completion_tokens[i] = d.prompt_tokens, d.completion_tokens

    def usage(self) -> dict:
        p, c = sum(self.prompt_tokens), sum(self.completion_tokens)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def envelope(self, choices: list, object: str | None = None) -> dict:
        return {"id": self.id, "object": object or self.object, "created": self.created, "model": self.model,
                "choices": choices}  # fmt: skip

    def start(self) -> list[dict]:
        return []

    def usage_chunk(self) -> dict:
        return {**self.envelope([], self.chunk_object), "usage": self.usage()}

    def token_text(self, token_id: int) -> str:
        return self.tok.token_text(token_id) if self.tok is not None else ""


class _CompletionRender(_Render):
    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, tokenizer, model: str, n: int, logprobs: bool):
        super().__init__(tokenizer, model, n)
        self.want_logprobs = logprobs
        self.offset = [0] * n

    def _logprobs(self, i: int, lps: list[TokenLogprob]) -> dict | None:
        if not self.want_logprobs:
            return None
        tokens = [self.token_text(lp.token_id) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(self.offset[i])
            self.offset[i] += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [_lp(lp.logprob) for lp in lps],
            "top_logprobs": [{self.token_text(t): _lp(v) for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }

    def chunk(self, i: int, d: Delta, include_usage: bool) -> dict:
        self.add(i, d)
        choice = {
            "index": i,
            "text": d.text,
            "logprobs": self._logprobs(i, d.logprobs),
            "finish_reason": d.finish_reason,
        }
        return {**self.envelope([choice]), **({"usage": None} if include_usage else {})}

    def body(self) -> dict:
        choices = [
            {"index": i, "text": self.text[i], "logprobs": self._logprobs(i, self.logprobs[i]),
             "finish_reason": self.finish[i]}
            for i in range(len(self.text))
        ]  # fmt: skip
        return {**self.envelope(choices), "usage": self.usage()}


class _ChatRender(_Render):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, tokenizer, model: str, logprobs: bool):
        super().__init__(tokenizer, model, 1)
        self.want_logprobs = logprobs

    def _entry(self, token_id: int, logprob: float) -> dict:
        t = self.token_text(token_id)
        return {"token": t, "logprob": _lp(logprob), "bytes": list(t.encode("utf-8"))}

    def _logprobs(self, lps: list[TokenLogprob]) -> dict | None:
        if not self.want_logprobs:
            return None
        content = []
        for lp in lps:
            top = [self._entry(t, v) for t, v in lp.top]
            content.append({**self._entry(lp.token_id, lp.logprob), "top_logprobs": top})
        return {"content": content}

    def start(self) -> list[dict]:
        first = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return [self.envelope([first], self.chunk_object)]

    def chunk(self, i: int, d: Delta, include_usage: bool) -> dict:
        self.add(i, d)
        delta = {"content": d.text} if d.text else {}
        choice = {
            "index": i,
            "delta": delta,
            "logprobs": self._logprobs(d.logprobs),
            "finish_reason": d.finish_reason,
        }
        return {**self.envelope([choice], self.chunk_object), **({"usage": None} if include_usage else {})}

    def body(self) -> dict:
        message = {"role": "assistant", "content": self.text[0]}
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(self.logprobs[0]),
                  "finish_reason": self.finish[0]}  # fmt: skip
        return {**self.envelope([choice]), "usage": self.usage()}


# ---- running it ----------------------------------------------------------------------------------


def _max_unfinished(config: ServerConfig) -> int:
    return config.scheduler.max_running_requests + config.max_queue


def load_engine(config: ServerConfig):
    """Engine.from_artifact as the config says (runs on the engine thread)."""
    import torch

    from mlac.runtime.engine import Engine

    engine = Engine.from_artifact(
        config.artifact, device=config.device, dtype=getattr(torch, config.dtype), verify=config.verify,
        num_blocks=config.num_blocks, kv_cache_bytes=config.kv_cache_bytes, launch=config.launch,
        scheduler_config=config.scheduler,
    )  # fmt: skip
    if config.warmup:  # Triton's JIT compiles now, while /health still says 503, not in the first requests
        start = time.monotonic()
        try:
            shapes = engine.warmup()
        except BaseException:
            engine.close()
            raise
        if shapes:
            log.info("warm-up: %d batch shapes in %.1f s", len(shapes), time.monotonic() - start)
    return engine


def make_server(config: ServerConfig, log_level: str = "info", load: Callable[[], Any] | None = None):
    """A uvicorn Server for the app; SIGTERM / SIGINT start the drain. The engine thread's load
    failure stops the server (serve() then reports it)."""
    import uvicorn

    app = create_app(config, load)
    state: ServerState = app.state.mlac

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not state.draining:
                log.info("draining: up to %.0f s for %d running requests", config.drain_timeout,
                         state.loop.num_unfinished)  # fmt: skip
            state.draining = True
            super().handle_exit(sig, frame)

    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level, lifespan="on",
                               timeout_graceful_shutdown=max(0.1, config.drain_timeout))  # fmt: skip
    server = Server(uv_config)

    def stop_on_load_error() -> None:
        server.should_exit = True

    state.loop.on_load_error = stop_on_load_error
    return server


def serve(config: ServerConfig, log_level: str = "info") -> None:
    """Run the server until SIGTERM / Ctrl-C (blocking). A model that fails to load is an MlacError."""
    from mlac.artifact import Manifest

    Manifest.load(config.artifact)  # a bad artifact fails here, before the port is opened
    server = make_server(config, log_level)
    # uvicorn re-raises the signal that stopped it once it has drained; a drained server exits 0
    drained = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in drained.items():
            signal.signal(sig, handler)
    error = server.config.app.state.mlac.loop.load_error
    if isinstance(error, MlacError):
        raise error
    if error is not None:
        raise MlacError(f"loading {config.artifact} failed: {error!r}")


class ServerThread:
    """A server in a background thread on a free port of `config.host` (tests, the demo).

    with ServerThread(config) as srv:   # returns once /health is ok
        httpx.get(srv.url + "/health")
    """

    def __init__(
        self, config: ServerConfig, log_level: str = "warning", load: Callable[[], Any] | None = None
    ):
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((config.host, 0))
        self.port = self._sock.getsockname()[1]
        self.server = make_server(config, log_level, load)
        self.state: ServerState = self.server.config.app.state.mlac
        self.url = f"http://{config.host}:{self.port}"
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self, timeout: float = 300.0, wait_ready: bool = True) -> ServerThread:
        """Start, and wait until the port answers and (wait_ready) the model is loaded; MlacError
        if loading fails or takes longer than `timeout`."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while wait_ready and not self.state.loop.ready:
            if self.state.loop.load_error is not None:
                self.stop()
                raise MlacError(f"loading failed: {self.state.loop.load_error}")
            if time.monotonic() > deadline or not self._thread.is_alive():
                self.stop()
                raise MlacError("server did not become ready")
            time.sleep(0.05)
        while not self.server.started and self._thread.is_alive():
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self.state.draining = True
        self.server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def api_key_from_env(given: str | None) -> str | None:
    return given if given is not None else (os.environ.get("MLAC_API_KEY") or None)
