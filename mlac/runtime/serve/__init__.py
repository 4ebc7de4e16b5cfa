"""OpenAI-compatible HTTP server over one Engine (FastAPI + uvicorn), one concern per module:

    config.py     ServerConfig: everything `mlac serve` is told (the HTTP side, and the engine's
                  EngineOptions passed down whole), and the request limits
    protocol.py   request bodies (pydantic, strict types), their validation, OpenAI's error shape
    body.py       reading a request body: size, read deadline, JSON nesting depth, valid UTF-8
    loop.py       the engine thread (EngineLoop): loads the model, runs scheduler steps
    outlet.py     where the engine thread's output goes: each request's Sink, one hand-over per step
    submission.py the handler's side of that bridge (Submission: submit, then await the deltas)
    engine_errors.py  QueueFull, ShuttingDown, EngineDead, and those errors as plain data
    engine_client.py  the engine in its own process, the server's side (EngineClient, FrontEngine)
    engine_child.py   the engine in its own process, the engine's side (the pipe's messages)
    engine_process.py the engine's process itself: started first, configured, closed (imports nothing heavy)
    engine_start.py   loading the engine (either process), the start-up record and line (no HTTP stack)
    render.py     OpenAI response bodies and server-sent events
    app.py        the routes; create_app wires them into a FastAPI app
    launch.py     uvicorn, signals and the drain; ServerThread for tests
    reasoning.py  --reasoning-parser deepseek_r1: <think> text split into reasoning_content
    tools.py      --tool-call-parser deepseek_v3: tool calls parsed out of chat answers
    tool_choice.py  tools and tool_choice resolved per request; the Lark grammar of a forced call
    metrics.py    the Prometheus metrics of /metrics (vLLM's names under mlac:, docs/serving.md)
    stats.py      the periodic stats line and the per-request log lines (--enable-log-requests)

Routes:

    GET  /health                  200 once the model is loaded (and warmed up); 503 while loading or draining
    GET  /metrics                 Prometheus text format (metrics.py)
    GET  /v1/models               the served model
    POST /v1/completions          prompt (string, token ids, or a list of those) -> text
    POST /v1/chat/completions     messages (rendered with the artifact's chat template) -> reply
    POST /tokenize, /detokenize   vLLM's: text or messages -> token ids, token ids -> text

Processes. `mlac serve` runs the engine in a process of its own (engine_process.py, engine_child.py):
the engine thread below runs there, and the server's process talks to it through EngineClient
(same interface as EngineLoop), one pipe message per engine step. Without it (--no-engine-process,
ServerThread by default) everything below runs in one process.

Threads. uvicorn's event loop runs the HTTP handlers and never runs torch. ONE engine thread
(EngineLoop) loads the model, then runs scheduler steps for as long as there is work. A handler
tokenizes in a worker thread, submits its Sequences through the loop's inbox (a queue.Queue), and
awaits their Deltas on an asyncio.Queue that the engine thread fills through
`call_soon_threadsafe`. A handler whose client disconnects puts a cancel into the same inbox; the
scheduler frees the request's blocks at its next step.

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 invalid parameter,
a prompt too long for the context or a request that can never fit; 401 missing or wrong API key;
404 unknown model or route; 408 a body not received within the read deadline; 413 body too large;
503 loading, draining or queue full.

SIGTERM (or Ctrl-C): /health turns 503, the listening socket closes, running requests get up to
`drain_timeout` seconds to finish; then the rest end with an error (a stream: an error event and
`data: [DONE]`) and the process exits.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlac.runtime.serve.config import ServerConfig, api_key_from_env
    from mlac.runtime.serve.engine_start import load_engine
    from mlac.runtime.serve.launch import ServerThread, serve

__all__ = ["ServerConfig", "ServerThread", "api_key_from_env", "load_engine", "serve"]

# The package's names are imported on first use: importing a module of this package (such as
# engine_process, which `mlac serve` imports before anything else to start the engine's process
# early) must not import torch and FastAPI through this file.
_HOME = {"ServerConfig": "config", "api_key_from_env": "config", "ServerThread": "launch",
         "load_engine": "engine_start", "serve": "launch"}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
