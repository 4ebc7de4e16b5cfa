"""The server's side of the process split: EngineClient offers the routes and the launcher what
EngineLoop offers them (submit, cancel, fail_all, stop, ready, load_error, failure, engine), over an engine
in its own process (engine_process.py, engine_child.py has the messages).

The server's process holds the artifact's tokenizer and manifest, no weights and no device:
FrontEngine tokenizes and validates requests as Engine.new_sequence does (so a bad request is a
400 before it is accepted), and a Request crosses as plain data. One reader thread takes the
engine's messages, one per step: it replays their metric ops into the server's Metrics and hands
each event loop its deltas in one `call_soon_threadsafe` (outlet.hand_over); and the engine's
heartbeats (heartbeat.py), by which /health knows within a second that the engine's process is
frozen or a rank is gone.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlac.core.artifact import TOKENIZER_DIR, Manifest
from mlac.core.config import ModelConfig
from mlac.core.errors import MlacError
from mlac.runtime.engine.constrain import Grammars
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.engine.penalties import check_logit_bias
from mlac.runtime.engine.prompt_logprobs import check_prompt_logprobs
from mlac.runtime.engine.tokenizer import Tokenizer
from mlac.runtime.serve.config import ServerConfig
from mlac.runtime.serve.engine_errors import EngineDead, ShuttingDown, check_room, decode_error
from mlac.runtime.serve.engine_process import EngineProcess
from mlac.runtime.serve.heartbeat import BEAT_DEADLINE_S
from mlac.runtime.serve.metrics import Metrics, replay
from mlac.runtime.serve.outlet import Outbox, Sink, hand_over

log = logging.getLogger("mlac.server")


@dataclass(frozen=True, slots=True)
class Request:
    """One engine request as the server's process knows it (what a Sequence is built from)."""

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float  # time.monotonic(): one clock for both processes
    request_id: str | None = None  # the server's name of it (X-Request-Id), for its log lines


class RemoteError(Exception):
    """A load error of the engine's process that is not an MlacError: its str and its repr."""

    def __init__(self, text: str, representation: str):
        super().__init__(text)
        self._repr = representation

    def __repr__(self) -> str:
        return self._repr


class FrontEngine:
    """What the routes use of an Engine, in the server's process: `tokenizer`, `max_context`,
    `startup`, `encode_prompt` and `new_sequence` (the same checks; a Request instead of a
    Sequence: the grammar is compiled here to be checked, and again in the engine's process;
    `speculative_num_steps`: the engine's, under which prompt_logprobs are refused)."""

    def __init__(
        self, tokenizer: Tokenizer | None, model: ModelConfig, info: dict, speculative_num_steps: int = 0
    ):
        self.tokenizer = tokenizer
        self.vocab_size = model.vocab_size
        self.speculative_num_steps = speculative_num_steps
        self.max_context: int = info["max_context"]
        self.startup: dict = info["startup"]
        self.grammars = Grammars(tokenizer, model.vocab_size, model.eos_token_ids)
        self._seq_ids = itertools.count()

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """A string is encoded with bos prepended; token ids (ints: the routes' bodies are validated)
        are taken as they are, in a new list."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise MlacError("this engine has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)  # NOTE: not int() each: 0.1 ms per 2,000 ids, twice per request

    def new_sequence(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> Request:
        """A validated request (Engine.new_sequence's checks: MlacError, InvalidGrammar)."""
        ids = self.encode_prompt(prompt)
        self._check_prompt(ids)
        if params.stop and self.tokenizer is None:
            raise MlacError("stop strings need a tokenizer; this engine has none")
        check_logit_bias(params, self.vocab_size)
        check_prompt_logprobs(params, self.speculative_num_steps)
        if params.grammar is not None:
            self.grammars.matcher(params.grammar)  # compiles it (cached), or InvalidGrammar
        return Request(next(self._seq_ids), ids, params, time.monotonic(), request_id)

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise MlacError("empty prompt: at least one token is needed")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise MlacError(f"token id {bad} out of range for vocabulary size {self.vocab_size}")
        if len(ids) > self.max_context:
            raise MlacError(f"prompt of {len(ids)} tokens exceeds the context ({self.max_context} tokens)")


def load_tokenizer(config: ServerConfig) -> Tokenizer | None:
    """The artifact's tokenizer (None without one), with --chat-template applied, as the engine's."""
    tok_dir = Path(config.artifact) / TOKENIZER_DIR
    if not (tok_dir / "tokenizer.json").is_file():
        return None
    tokenizer = Tokenizer(tok_dir)
    if config.engine.chat_template is not None:
        tokenizer.use_chat_template(config.engine.chat_template)
    return tokenizer


class EngineClient:
    """EngineLoop's interface over the engine's process. Sends `config` (and `load`, see
    EngineProcess.configure) at once: the child starts loading; `start` starts the reader
    thread, which loads the tokenizer meanwhile. An engine that dies after it loaded (its loop
    failed, or its process is gone) ends every request with EngineDead and refuses later ones, as
    EngineLoop does: `failure` says why, `on_failure` is called on the reader thread. `trouble`
    says what the last heartbeat reported, or that none came for BEAT_DEADLINE_S."""

    def __init__(
        self,
        process: EngineProcess,
        config: ServerConfig,
        metrics: Metrics,
        log_level: str,
        load: Callable[[], Any] | None = None,
    ):
        self.process, self.config, self.metrics = process, config, metrics
        self.max_unfinished = config.max_unfinished
        self.engine: FrontEngine | None = None
        self.load_error: BaseException | None = None
        self.on_load_error = None  # called (on the reader thread) when loading fails
        self.failure: EngineDead | None = None
        self.on_failure = None  # called (on the reader thread) when the engine died after it loaded
        self._ready = threading.Event()
        self._lock = threading.Lock()  # guards _unfinished, _refusing, _sinks
        self._send_lock = threading.Lock()
        self._unfinished = 0
        self._refusing: MlacError | None = None
        self._stopping = False
        self._sinks: dict[int, Sink] = {}
        self._beat = time.monotonic()  # when the last message (a heartbeat at least) came
        self._beat_trouble: str | None = None  # what the last heartbeat said
        self._reader = threading.Thread(target=self._main, name="mlac-engine-client", daemon=True)
        if not process.configured:  # `mlac serve` configures it first (cli/serve.py)
            process.configure(config, log_level, load)

    # ---- any thread ----

    def start(self) -> None:
        self._reader.start()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def num_unfinished(self) -> int:
        return self._unfinished

    @property
    def trouble(self) -> str | None:
        """Once loaded and alive: a beat late by more than BEAT_DEADLINE_S (the engine's process is
        frozen, or stuck), else what the last beat reported about the ranks; None: all is well."""
        if not self.ready or self.failure is not None:
            return None
        late = time.monotonic() - self._beat
        if late > BEAT_DEADLINE_S:
            return f"the engine process has not answered for {late:.1f} s"
        return self._beat_trouble

    def submit(self, requests: list[Request], sinks: list[Sink]) -> None:
        """Send requests to the engine (all or none); QueueFull past max_unfinished, ShuttingDown
        after fail_all, EngineDead once the engine died."""
        with self._lock:
            check_room(self._unfinished, len(requests), self.max_unfinished, self._refusing)
            self._unfinished += len(requests)
            self._sinks.update((r.seq_id, sink) for r, sink in zip(requests, sinks, strict=True))
        self._send(("add", [(r.seq_id, r.prompt_ids, r.params, r.arrival, r.request_id) for r in requests]))

    def cancel(self, seq_id: int) -> None:
        self._send(("cancel", seq_id))

    def fail_all(self, message: str) -> None:
        """As EngineLoop.fail_all: the engine ends every request with ShuttingDown(message)."""
        with self._lock:
            if self.failure is None:
                self._refusing = ShuttingDown(message)
        self._send(("fail", message))

    def stop(self, timeout: float = 30.0) -> None:
        """Tell the engine to stop (what is left ends with an error), wait for its process."""
        self._stopping = True
        self._send(("stop",))
        self.process.process.join(timeout)
        if self._reader.is_alive():
            self._reader.join(timeout)
        self.process.close()

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            try:
                self.process.conn.send(message)
            except OSError:  # the engine's process is gone: the reader thread fails what is left
                log.debug("the engine process is gone: dropped a %r message", message[0])

    # ---- the reader thread ----

    def _main(self) -> None:
        try:
            tokenizer, model = load_tokenizer(self.config), Manifest.load(self.config.artifact).model
        except BaseException as e:  # noqa: BLE001  (reported as a load error, as the engine's)
            self._failed(e)
            return
        while True:
            try:
                message = self.process.conn.recv()
            except (EOFError, OSError):
                self._engine_gone()
                return
            kind, self._beat = message[0], time.monotonic()  # any message says the engine's process runs
            if kind == "step":
                self._on_step(*message[1:])
            elif kind == "beat":
                self._beat_trouble = message[1]
            elif kind == "ready":
                replay(self.metrics, message[2])
                spec = self.config.engine.scheduler.speculative_num_steps
                self.engine = FrontEngine(tokenizer, model, message[1], spec)
                self._ready.set()
            elif kind == "failed":
                replay(self.metrics, message[4])
                code = message[3]  # the exit code of an MlacError, None for any other exception
                error = (
                    RemoteError(message[1], message[2])
                    if code is None
                    else decode_error(f"error{code}", message[1])
                )
                self._failed(error, logged=True)  # the engine's process logged it
            elif kind == "dead":  # the engine's process logged it; it exits once told to stop
                self._die(EngineDead(message[1]))
                self._send(("stop",))

    def _on_step(self, items: list[tuple], ended: list[int], ops: list) -> None:
        """One engine step: metrics, then each event loop its items in one call, then the ends."""
        replay(self.metrics, ops)
        outbox: Outbox = {}
        for rid, item in items:
            sink = self._sinks.get(rid)
            if sink is not None:
                out = item if not isinstance(item, tuple) else decode_error(*item)
                outbox.setdefault(sink.aio, []).append((sink, out))
        hand_over(outbox)
        if ended:
            with self._lock:
                gone = [self._sinks.pop(rid, None) for rid in ended]
                self._unfinished -= sum(sink is not None for sink in gone)

    def _failed(self, error: BaseException, logged: bool = False) -> None:
        if not logged:
            log.error("loading the model failed: %s", error)
        self.load_error = error
        if self.on_load_error is not None:
            self.on_load_error()

    def _engine_gone(self) -> None:
        """The pipe closed: at stop, the end; before ready, a load failure; after a "dead" message,
        nothing more to do; else the process died (killed, a crash): the engine is dead."""
        self.process.process.join(5.0)
        code = self.process.process.exitcode
        if not self.ready and self.load_error is None and not self._stopping:
            self._failed(MlacError(f"the engine process exited (exit code {code}) before the model loaded"))
        elif self._stopping:
            self._end_all(ShuttingDown("server shutting down"))
        elif self.failure is None:
            error = EngineDead(f"the engine failed: its process exited unexpectedly (exit code {code})")
            log.error("%s", error)
            self._die(error)

    def _die(self, error: EngineDead) -> None:
        """The engine died: `failure`, every unfinished request ended with it, `on_failure`."""
        self.failure = error
        self._end_all(error)
        if self.on_failure is not None:
            self.on_failure()

    def _end_all(self, error: MlacError) -> None:
        """Refuse new requests with `error` and end every unfinished one with it."""
        with self._lock:
            self._refusing = error
            sinks, self._sinks, self._unfinished = list(self._sinks.values()), {}, 0
        outbox: Outbox = {}
        for sink in sinks:
            outbox.setdefault(sink.aio, []).append((sink, error))
        hand_over(outbox)


def start_engine(
    config: ServerConfig, metrics: Metrics, log_level: str, process: Any = None, load: Any = None
) -> EngineClient:
    """An EngineClient over `process` (an EngineProcess started early), or over one started now."""
    process = process or EngineProcess.start(config.artifact, config.engine.launch)
    return EngineClient(process, config, metrics, log_level, load)
