"""The routes (Api) and `create_app`, which wires them into a FastAPI app.

Each handler: read and validate the body (body.py, protocol.py), check the server may take it
(`_admit`), tokenize and build Sequences (on the event loop when that is cheap, else in a worker
thread: `_build`), submit them (submission.Submission), and answer with one JSON body or a stream of
server-sent events (render.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlac.core.errors import MlacError
from mlac.core.version import __version__
from mlac.runtime.engine.generation_config import sampling_defaults
from mlac.runtime.engine.params import GrammarSpec
from mlac.runtime.engine.sequence import Sequence
from mlac.runtime.engine.tokenizer import FinalMessageNotFound
from mlac.runtime.serve.body import read_body
from mlac.runtime.serve.config import ServerConfig
from mlac.runtime.serve.engine_client import EngineClient, start_engine
from mlac.runtime.serve.loop import EngineLoop
from mlac.runtime.serve.metrics import Metrics
from mlac.runtime.serve.protocol import (
    ApiError,
    Body,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    TokenizeBody,
    chat_messages,
    check_choices,
    generation_prompt,
    grammar_spec,
    new_sequences,
    prompt_list,
    truncate_prompt,
)
from mlac.runtime.serve.reasoning import prompt_opens_think, splits
from mlac.runtime.serve.render import ChatRender, CompletionRender, Render, sse
from mlac.runtime.serve.request_id import RequestIdMiddleware, request_id
from mlac.runtime.serve.submission import Submission
from mlac.runtime.serve.tool_choice import plan_tools
from mlac.runtime.serve.tools import TOOL_FORMATS

# Text of at most this many characters is tokenized on the event loop (well under 1 ms); more, in a
# worker thread (the hand-offs to it and back cost ~0.1 ms of every request's TTFT: see _build)
INLINE_TEXT_CHARS = 8192


@dataclass
class ServerState:
    """What the routes and the launcher share. `draining` turns /health 503 and refuses requests."""

    config: ServerConfig
    loop: EngineLoop | EngineClient
    metrics: Metrics
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(
    config: ServerConfig, load: Callable[[], Any] | None, process: Any = None, log_level: str = "info"
) -> FastAPI:
    """The FastAPI app over the engine that `load()` returns: on an engine thread, or with
    `config.engine_process` in its own process (`process`, an engine_process.EngineProcess, or one
    started now; `load` must then pickle, None: launch.load_engine). Its lifespan starts the
    engine (the model loads in the background: /health says when it is ready) and stops it."""
    metrics = Metrics(config.model_name)
    stats_interval = config.log_stats_interval if config.log_stats else None
    if config.engine_process:
        loop = start_engine(config, metrics, log_level, process, load)
    else:
        loop = EngineLoop(load, metrics, config.max_unfinished, config.log_requests, stats_interval)
    state = ServerState(config, loop, metrics)
    api = Api(state)
    app = FastAPI(
        title="mlac", lifespan=_lifespan(state.loop), docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.mlac = state
    app.add_middleware(RequestIdMiddleware)  # X-Request-Id on every answer
    app.add_exception_handler(ApiError, api.api_error)
    app.add_exception_handler(StarletteHTTPException, api.http_error)
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/ping", api.ping, methods=["GET", "POST"])
    app.add_api_route("/version", api.version, methods=["GET"])
    app.add_api_route("/metrics", api.metrics, methods=["GET"])
    keyed = [Depends(api.check_key)]
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"], dependencies=keyed)
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"], dependencies=keyed)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(api.check_key)])
    v1.add_api_route("/models", api.models, methods=["GET"])
    v1.add_api_route("/models/{model_id:path}", api.model, methods=["GET"])
    v1.add_api_route("/completions", api.completions, methods=["POST"])
    v1.add_api_route("/chat/completions", api.chat, methods=["POST"])
    app.include_router(v1)
    return app


def _lifespan(loop: EngineLoop | EngineClient):
    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        yield
        await asyncio.to_thread(loop.stop)

    return lifespan


class Api:
    """The route handlers over one ServerState."""

    def __init__(self, state: ServerState):
        self.state, self.config, self.loop = state, state.config, state.loop
        self.defaults = sampling_defaults(state.config.artifact, state.config.generation_config)

    # ---- errors and auth ----

    async def api_error(self, request: Request, e: ApiError):
        self._count(request, e.status)
        headers = {**e.headers, **({"Retry-After": "1"} if e.status == 503 else {})}
        return JSONResponse(e.body(), status_code=e.status, headers=headers or None)

    async def http_error(self, request: Request, e: StarletteHTTPException):
        err = ApiError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=e.status_code)

    async def check_key(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        if not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise ApiError(401, "incorrect API key provided", code="invalid_api_key")

    def _count(self, request: Request, code: int) -> None:
        """Count one answer of a keyed route, once, with the status it was answered with."""
        route = request.scope.get("route")
        self.state.metrics.http(getattr(route, "path", "other"), code).inc()

    # ---- open routes ----

    async def health(self):
        loop, draining = self.loop, self.state.draining
        error = loop.load_error or loop.failure  # failed to load, or died since (engine_errors.EngineDead)
        if error is not None:
            return JSONResponse({"status": "failed", "error": str(error)}, status_code=503)
        trouble = loop.trouble  # a rank stopped, or the engine's process froze (heartbeat.py)
        if trouble is not None:
            return JSONResponse({"status": "unresponsive", "error": trouble}, status_code=503)
        if not loop.ready or draining:
            return JSONResponse({"status": "draining" if draining else "loading"}, status_code=503)
        return {"status": "ok", "startup": getattr(loop.engine, "startup", None)}  # launch.record_startup

    async def ping(self):
        """vLLM's /ping: 200 with an empty body when /health is ok, else /health's answer."""
        health = await self.health()
        return Response(status_code=200) if isinstance(health, dict) else health

    async def version(self):
        return {"version": __version__}

    async def metrics(self):
        m = self.state.metrics
        return Response(m.render(), media_type=m.content_type)

    # ---- /v1 ----

    def _card(self) -> dict:
        card = {
            "id": self.config.model_name,
            "object": "model",
            "created": self.state.created,
            "owned_by": "mlac",
        }
        if self.loop.engine is not None:
            card["max_model_len"] = self.loop.engine.max_context
        return card

    async def models(self, request: Request):
        self._count(request, 200)
        return {"object": "list", "data": [self._card()]}

    async def model(self, request: Request, model_id: str):
        """GET /v1/models/{id}: the served model's card; another id is a 404 (model_not_found)."""
        if model_id != self.config.model_name:
            raise ApiError(
                404, f"the model '{model_id}' does not exist", param="model", code="model_not_found"
            )
        self._count(request, 200)
        return self._card()

    async def completions(self, request: Request):
        body: CompletionBody = await self._read(request, CompletionBody)
        engine = self._admit(body)
        prompts = prompt_list(body.prompt, self.config.max_unfinished, body.n)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # 0: echo only (one token runs it)
        rid = request_id(request)

        def make() -> list[Sequence]:  # choice p * n + j: prompt p's j-th
            ids = [
                truncate_prompt(_encode_prompt(engine, p, body), body, engine.max_context) for p in prompts
            ]
            names = [rid if len(ids) == 1 else f"{rid}-{p}" for p in range(len(ids))]
            return [s for i, name in zip(ids, names, strict=True)
                    for s in new_sequences(engine, i, body, max(1, max_tokens), body.logprobs, "prompt",
                                           self.defaults, request_id=name)]  # fmt: skip

        text = sum(len(p) for p in prompts if isinstance(p, str))  # token ids cost next to nothing
        seqs = await _build(make, _cheap(body, text))
        sub = Submission(self.loop, seqs)
        # the echo of choice k: its prompt as given; with truncate_prompt_tokens, the tokens that ran
        cut = body.truncate_prompt_tokens is not None
        echoed = [s.prompt_ids if cut else prompts[k // body.n] for k, s in enumerate(seqs)]
        echo = [_echo_text(engine, p) for p in echoed] if body.echo else None
        render = CompletionRender(engine.tokenizer, self.config.model_name, len(seqs), body.logprobs is not None,
                                  echo, [s.prompt_ids for s in seqs], body.prompt_logprobs is not None,
                                  echo_only=max_tokens == 0)  # fmt: skip
        render.choices_per_prompt = body.n
        return await _respond(request, body, sub, render, lambda: self._count(request, 200))

    async def chat(self, request: Request):
        body: ChatBody = await self._read(request, ChatBody)
        engine = self._admit(body)
        if engine.tokenizer is None or engine.tokenizer.chat_template is None:
            raise ApiError(400, "this model has no chat template: use /v1/completions", param="messages")
        check_choices(1, body.n, self.config.max_unfinished, "messages")
        if body.stream and body.prompt_logprobs is not None:
            raise ApiError(
                400, "prompt_logprobs: not with stream on chat completions", param="prompt_logprobs"
            )
        messages = chat_messages(body)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        # the tool-call format: the parser's (a call forced without a parser: V3's)
        fmt = TOOL_FORMATS[self.config.tool_call_parser or "deepseek_v3"]
        tools = plan_tools(body.tools, body.tool_choice, self.config.enable_auto_tool_choice,
                           body.parallel_tool_calls is not False, fmt)  # fmt: skip
        grammar = GrammarSpec("lark", tools.grammar) if tools.grammar is not None else None  # forced calls

        def make() -> list[Sequence]:
            ids = truncate_prompt(_encode_chat(engine, messages, body), body, engine.max_context)
            max_tokens = (
                body.max_completion_tokens or body.max_tokens or max(1, engine.max_context - len(ids))
            )
            return new_sequences(engine, ids, body, max_tokens, logprobs, "messages", self.defaults, grammar,
                                 request_id(request))  # fmt: skip

        inline = grammar is None and _cheap(body, _body_bytes(request))  # the body: about its text
        seqs = await _build(make, inline)
        sub = Submission(self.loop, seqs)
        tail = engine.tokenizer.decode(seqs[0].prompt_ids[-8:], skip_special_tokens=False)  # template's end
        reasoning = splits(self.config.reasoning_parser, body.chat_template_kwargs)
        render = ChatRender(engine.tokenizer, self.config.model_name, body.logprobs, body.n, reasoning,
                            prompt_opens_think(tail), fmt if tools.parse else None,
                            body.prompt_logprobs is not None, _chat_echo(messages, body))  # fmt: skip
        render.choices_per_prompt = body.n
        return await _respond(request, body, sub, render, lambda: self._count(request, 200))

    async def tokenize(self, request: Request):
        """vLLM's /tokenize: {"model", "prompt" | "messages", "add_special_tokens"} -> {"count",
        "max_model_len", "tokens", "token_strs"}. Messages go through the chat template (no bos
        added by default: the template writes it); a prompt gets bos unless add_special_tokens=false."""
        body: TokenizeBody = await self._read(request, TokenizeBody)
        engine = self._admit(body)
        tok = engine.tokenizer
        if tok is None:
            raise ApiError(400, "this model has no tokenizer", param="prompt")
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give one of prompt and messages", param="prompt")

        def make() -> list[int]:
            if body.messages is None:
                return tok.encode(body.prompt or "", add_bos=body.add_special_tokens is not False)
            return _encode_chat(engine, chat_messages(body), body)

        ids = await asyncio.to_thread(make)
        strs = [tok.token_text(i) for i in ids] if body.return_token_strs else None
        self._count(request, 200)
        return {"count": len(ids), "max_model_len": engine.max_context, "tokens": ids, "token_strs": strs}

    async def detokenize(self, request: Request):
        """vLLM's /detokenize: {"model", "tokens"} -> {"prompt"} (special tokens kept, as vLLM)."""
        body: DetokenizeBody = await self._read(request, DetokenizeBody)
        engine = self._admit(body)
        if engine.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer", param="tokens")
        vocab = engine.tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(
                400, f"tokens: {bad} is not a token id (the vocabulary has {vocab})", param="tokens"
            )
        self._count(request, 200)
        return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    async def _read(self, request: Request, model: type):
        """The body as `model`, read and parsed within body.py's limits (a large one off the loop)."""
        return await read_body(request, model, self.config.max_body_bytes, self.config.request_body_timeout)

    def _admit(self, body: Body):
        """The engine, once the request may run: the model is loaded, not draining, model matches."""
        if body.model != self.config.model_name:
            raise ApiError(
                404, f"the model '{body.model}' does not exist", param="model", code="model_not_found"
            )
        if self.state.draining:
            raise ApiError(503, "server is shutting down", type="server_error", code="draining")
        if not self.loop.ready:
            raise ApiError(
                503, "model is loading; retry when /health is ok", type="server_error", code="loading"
            )
        return self.loop.engine


def _encode_chat(engine, messages: list[dict], body: ChatBody | TokenizeBody) -> list[int]:
    """The chat prompt's ids: the template over messages, tools, documents and chat_template_kwargs,
    the final message left open with continue_final_message, bos prepended only when
    add_special_tokens asks (the template writes its own); 400 when the template refuses them,
    or fails on them (vLLM's R1 tool template: `'</think>' in None`), or when the final message
    cannot be continued (its content is not in the rendered chat)."""
    from jinja2.exceptions import TemplateError

    tok = engine.tokenizer
    documents = getattr(body, "documents", None)
    kwargs = {
        **({"documents": documents} if documents is not None else {}),
        **(body.chat_template_kwargs or {}),
    }
    try:
        ids = tok.encode_chat(
            messages, generation_prompt(body), body.tools, body.continue_final_message, **kwargs
        )
    except FinalMessageNotFound as e:
        raise ApiError(400, f"continue_final_message: {e}", param="continue_final_message") from None
    except (TemplateError, TypeError) as e:
        raise ApiError(400, f"chat template refused the messages: {e}", param="messages") from None
    bos = body.add_special_tokens and tok.bos_token_id is not None
    return [tok.bos_token_id, *ids] if bos else ids


def _encode_prompt(engine, prompt: str | list[int], body: CompletionBody) -> list[int]:
    """A completion prompt's ids: text with bos unless add_special_tokens is false; ids as given."""
    if isinstance(prompt, str) and body.add_special_tokens is False and engine.tokenizer is not None:
        return engine.tokenizer.encode(prompt, add_bos=False)
    return engine.encode_prompt(prompt)


def _chat_echo(messages: list[dict], body: ChatBody) -> str | None:
    """What `echo` puts before each chat answer: the final message's content when that message is
    an assistant's (the answer's role), as vLLM; else nothing."""
    last = messages[-1]
    return (last.get("content") or "") if body.echo and last["role"] == "assistant" else None


def _echo_text(engine, prompt: str | list[int]) -> str:
    """What `echo` puts before a completion: a text prompt as given, token ids decoded."""
    if isinstance(prompt, str):
        return prompt
    return engine.tokenizer.decode(prompt, skip_special_tokens=False) if engine.tokenizer is not None else ""


def _cheap(body: Body, text: int | None) -> bool:
    """Whether a request's Sequences are cheap enough to build on the event loop: at most
    INLINE_TEXT_CHARS characters to tokenize (`text`; None: unknown) and no grammar to compile
    (compiled once per schema, which may take seconds)."""
    return text is not None and text <= INLINE_TEXT_CHARS and grammar_spec(body) is None


def _body_bytes(request: Request) -> int | None:
    length = request.headers.get("content-length", "")
    return int(length) if length.isdigit() else None


async def _build(fn: Callable[[], list[Sequence]], inline: bool) -> list[Sequence]:
    """Tokenize and build Sequences: here when `inline` (cheap), else off the event loop in a worker
    thread; engine refusals become 400s."""
    try:
        return fn() if inline else await asyncio.to_thread(fn)
    except MlacError as e:
        raise ApiError(400, str(e), param=getattr(e, "param", None)) from None


async def _respond(request: Request, body: Body, sub: Submission, render: Render, ok: Callable[[], None]):
    """A stream of server-sent events, or (not streaming) one JSON body once every choice finished.
    `ok()` counts the 200: when the stream starts (its status is sent then), or once the body is
    complete (an engine failure before that answers, and is counted as, an error instead)."""
    if body.stream:
        ok()
        return StreamingResponse(sse(sub, render, body.include_usage), media_type="text/event-stream")
    watcher = asyncio.create_task(_watch_disconnect(request, sub))
    try:
        async for index, delta in sub.deltas():
            render.add(index, delta)
    finally:
        watcher.cancel()
        sub.cancel_unfinished()
    ok()
    return JSONResponse(render.body())


async def _watch_disconnect(request: Request, sub: Submission) -> None:
    """Cancel the submission's requests when the client goes away (non-streaming responses)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            sub.cancel_unfinished()
            return
