"""Running the server: load the engine, run uvicorn, drain on SIGTERM / Ctrl-C.

The drain: /health turns 503 and new requests are refused; uvicorn closes the listening socket
and waits for open connections. Running requests get `drain_timeout` seconds to finish; then
`EngineLoop.fail_all` ends the rest with an error (a stream: an error event, then
`data: [DONE]`), and uvicorn waits DRAIN_GRACE more seconds for those answers to go out before
it cuts what is left. A Ctrl-C while draining (after SIGTERM or a first Ctrl-C) does not wait for
the drain timeout: the requests end with their error at once, and the server exits once those
answers went out, FORCE_GRACE seconds at most (another Ctrl-C: at once).

An engine that fails (to load, or after it loaded: engine_errors.EngineDead) stops the server at
once: the listening socket closes and uvicorn sends the answers in flight (each request already
has its error); `serve` then raises the failure (`mlac serve` exits 1), for an orchestrator to
restart it.
"""

from __future__ import annotations

import gc
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from mlac import settings
from mlac.core.errors import MlacError
from mlac.runtime.serve.app import ServerState, create_app
from mlac.runtime.serve.config import ServerConfig
from mlac.runtime.serve.engine_start import (  # noqa: F401  (load_engine, startup_line: re-exported)
    GIL_SWITCH_INTERVAL_S,
    load_engine,
    log_to_stderr,
    record_startup,
    startup_line,
)
from mlac.runtime.serve.head_limit import HeadLimitedHttpTools
from mlac.runtime.serve.preflight import refuse_before_load

log = logging.getLogger("mlac.server")

DRAIN_GRACE = 5.0  # seconds after the drain timeout for the error answers to be written
FORCE_GRACE = 2.0  # seconds after a Ctrl-C while draining for the error answers to be written


class DrainingServer(uvicorn.Server):
    """uvicorn's Server with mlac's drain (module docstring). SIGTERM / SIGINT start it; a Ctrl-C
    while draining ends the requests at once and exits once their answers went out."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self._cut: threading.Timer | None = None
        self._ending = False  # end_now was called

    def begin_drain(self) -> None:
        """Start draining (any thread, once); the caller then sets `should_exit`."""
        state = self.state
        if state.draining:
            return
        timeout = state.config.drain_timeout
        log.info("draining: up to %.0f s for %d running requests", timeout, state.loop.num_unfinished)
        state.draining = True
        message = f"server shutting down: the drain timeout ({timeout:g} s) expired"
        self._cut = threading.Timer(timeout, state.loop.fail_all, args=(message,))
        self._cut.daemon = True
        self._cut.start()

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGINT and self.state.draining:
            if self._ending:
                self.force_exit = True
            else:
                self.end_now()
            return
        self.begin_drain()
        super().handle_exit(sig, frame)

    def end_now(self) -> None:
        """End every request with an error now (a stream: an error event, then [DONE]), and force
        the exit FORCE_GRACE seconds later, if the connections have not closed by then. uvicorn's
        own force exit would cut the streams and cancel their handlers, which log tracebacks."""
        self._ending = True
        if self._cut is not None:
            self._cut.cancel()
        log.info("ending %d running requests now", self.state.loop.num_unfinished)
        self.state.loop.fail_all("server shutting down: interrupted (Ctrl-C) while draining")
        force = threading.Timer(FORCE_GRACE, setattr, args=(self, "force_exit", True))
        force.daemon = True
        force.start()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().shutdown(sockets)
        finally:
            if self._cut is not None:
                self._cut.cancel()


def make_server(
    config: ServerConfig,
    log_level: str = "info",
    load: Callable[[], Any] | None = None,
    process: Any = None,
) -> DrainingServer:
    """A uvicorn server for the app over `load()` (default: load_engine) on an engine thread, or,
    with `config.engine_process`, in the engine's own process (`process`, an EngineProcess started
    early, or one started now; `load` must then pickle). A load failure, or the engine's death
    after it loaded, stops the server (serve() then reports it)."""
    if load is None and not config.engine_process:
        load = lambda: load_engine(config)  # noqa: E731
    app = create_app(config, load, process, log_level)
    state: ServerState = app.state.mlac
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level, lifespan="on",
                               http=HeadLimitedHttpTools,
                               timeout_graceful_shutdown=config.drain_timeout + DRAIN_GRACE)  # fmt: skip
    server = DrainingServer(uv_config, state)

    def stop_on_engine_error() -> None:  # its requests got their errors already: uvicorn sends them
        server.should_exit = True

    state.loop.on_load_error = state.loop.on_failure = stop_on_engine_error
    return server


def close_engine(state: ServerState) -> None:
    """After the server ran (or failed to start): the engine is stopped (idempotent; uvicorn's
    lifespan stops it, unless the exit was forced)."""
    state.loop.stop()


def serve(config: ServerConfig, log_level: str = "info", process: Any = None) -> None:
    """Run the server until SIGTERM / Ctrl-C (blocking). A model that fails to load is an MlacError.
    `process`: the engine's process, started early (engine_process.EngineProcess.start)."""
    refuse_before_load(config)  # a bad artifact, --generation-config or busy port: before the model loads
    log_to_stderr(log_level)
    log.info(config.summary())
    if (changed := settings.summary()) is not None:  # the MLAC_* settings not at their default, masked
        log.info(changed)
    # The engine thread and the event loop share the GIL (in thread mode). With Python's default 5 ms switch
    # interval the engine thread, back from a GPU step, may wait that long for the loop to let go;
    # at 0.2 ms it launches the next step almost at once. Measured on one H200 (V2-Lite bf16, HTTP):
    # batch 256 decode 5,701 -> 7,190 tok/s, 1,024-request peak 4,487 -> 5,170 tok/s
    # (benchmarks/e2e/serve_http.py at either interval).
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    server = make_server(config, log_level, process=process)
    # What is imported by now (torch, triton, FastAPI: 200k objects) never becomes garbage: out of
    # the collector's way, a full collection costs ~1 ms instead of ~90 ms of the event loop.
    # NOTE: unfrozen at the end: triton's bindings report what exit finds uncollected as leaks
    gc.freeze()
    # uvicorn re-raises the signal that stopped it once it has drained; a drained server exits 0
    drained = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in drained.items():
            signal.signal(sig, handler)
        close_engine(server.state)
        gc.unfreeze()
    error = server.state.loop.load_error
    if isinstance(error, MlacError):
        raise error
    if error is not None:
        raise MlacError(f"loading {config.artifact} failed: {error!r}")
    if server.state.loop.failure is not None:
        raise server.state.loop.failure


class ServerThread:
    """A server in a background thread on a free port of `config.host` (tests, the demo); the
    engine on a thread too, or in its own process with `config.engine_process`.

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
        self.state: ServerState = self.server.state
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
        """Drain as SIGTERM does, and wait for the server thread to end."""
        self.server.begin_drain()
        self.server.should_exit = True
        self._thread.join(timeout)
        close_engine(self.state)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
