"""The engine's side of the process split: EngineLoop in its own process (engine_process.py
starts it), talking to the server's process (engine_client.py) over one duplex pipe.

Messages, server -> engine:

    ("add", [(rid, prompt_ids, params, arrival, request_id), ...])   requests; Sequences are built here
    ("cancel", rid)    ("fail", message)    ("stop",)

engine -> server (`ops`: the metric ops recorded since the last message, metrics.MetricsRecorder):

    ("ready", info, ops)              info: the engine's `startup` dict and `max_context`
    ("failed", str, repr, is_mlac, ops)  loading failed: str(error), repr(error), an MlacError?
    ("step", items, ended, ops)       ONE per engine step: items [(rid, Delta | (kind, message))]
                                      in the order produced (kind: "shutdown", "dead" or "error"),
                                      ended the rids whose request is over (nothing more comes for them)
    ("dead", message)                 the engine died (an exception escaped its loop, a rank exited;
                                      every request ended with it already): the server stops this
                                      process, which then exits with code 1
    ("beat", trouble)                 every heartbeat.BEAT_S, from the start: what is wrong with the
                                      ranks (None: nothing); late beats mean a frozen engine process

A request id (rid) is the Sequence's seq_id on both sides.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

from mlac.core.errors import MlacError
from mlac.runtime.dist.node_ranks import NodeRanks
from mlac.runtime.dist.world import LaunchSpec
from mlac.runtime.engine.sequence import Delta
from mlac.runtime.serve.config import ServerConfig
from mlac.runtime.serve.engine_errors import encode_error
from mlac.runtime.serve.engine_start import GIL_SWITCH_INTERVAL_S, load_engine, log_to_stderr
from mlac.runtime.serve.loop import EngineLoop
from mlac.runtime.serve.metrics import MetricsRecorder

log = logging.getLogger("mlac.server")

Item = Delta | tuple[str, str]  # a Delta, or an error as (kind, message)


class Channel:
    """The engine's end of the pipe; `send` from any thread. Once the server process is gone,
    what is sent is dropped (the engine then stops on the closed pipe)."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: tuple) -> None:
        with self._lock:
            try:
                self.conn.send(message)
            except OSError:  # BrokenPipeError included
                log.debug("the server process is gone: dropped a %r message", message[0])


class PipeOutlet:
    """EngineLoop's outlet in the engine's process: a sink is a request id; each `send` is one
    ("step", items, ended, ops) message, or nothing when there is nothing to say."""

    def __init__(self, channel: Channel, metrics: MetricsRecorder):
        self.channel, self.metrics = channel, metrics
        self._items: list[tuple[int, Item]] = []
        self._ended: list[int] = []

    def post(self, sink: int, item: Delta | BaseException) -> None:
        self._items.append((sink, item if isinstance(item, Delta) else encode_error(item)))

    def end(self, sink: int) -> None:
        self._ended.append(sink)

    def send(self) -> None:
        ops = self.metrics.take()
        if not (self._items or self._ended or ops):
            return
        items, ended, self._items, self._ended = self._items, self._ended, [], []
        self.channel.send(("step", items, ended, ops))


def run(
    conn: Connection,
    config: ServerConfig,
    log_level: str,
    load: Callable[[], Any] | None = None,
    ranks: NodeRanks | None = None,
) -> None:
    """The engine process's life: load (`load()`, default engine_start.load_engine(config), on the engine
    thread), then apply the server's messages until it says stop or goes away; then stop the
    engine (what is left ends with an error). An engine that died exits the process with code 1. `ranks`: the artifact's other ranks on this node,
    spawned already (engine_process.py): the default load hands them their work; they are
    closed if it did not (the load failed first, or a custom `load`)."""
    log_to_stderr(log_level)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # the engine thread and this one (see launch.serve)
    channel, metrics = Channel(conn), MetricsRecorder()
    stats_interval = config.log_stats_interval if config.log_stats else None
    if ranks is not None:
        config = config.updated(launch=replace(config.engine.launch or LaunchSpec(), ranks=ranks))
    load = _closing(load or (lambda: load_engine(config)), ranks)
    loop = EngineLoop(load, metrics, config.max_unfinished, config.log_requests, stats_interval,
                      PipeOutlet(channel, metrics))  # fmt: skip
    loop.on_ready = lambda: channel.send(("ready", _ready_info(loop.engine), metrics.take()))
    loop.on_load_error = lambda: channel.send(_failed(loop.load_error, metrics))
    loop.on_failure = lambda: channel.send(("dead", str(loop.failure)))
    loop.on_beat = lambda trouble: channel.send(("beat", trouble))
    loop.start()
    try:
        _apply_messages(conn, loop, channel)
    finally:
        loop.stop()
    if loop.failure is not None:
        sys.exit(1)  # the engine died: not a clean stop


def _closing(load: Callable[[], Any], ranks: NodeRanks | None) -> Callable[[], Any]:
    """`load`, then close the early ranks it did not take (a no-op for those it took)."""
    if ranks is None:
        return load

    def run_load() -> Any:
        try:
            return load()
        finally:
            ranks.close()

    return run_load


def _ready_info(engine) -> dict:
    return {"startup": dict(getattr(engine, "startup", {})), "max_context": engine.max_context}


def _failed(error: BaseException | None, metrics: MetricsRecorder) -> tuple:
    """A load failure as plain data; an MlacError keeps its exit code (core/errors.py)."""
    code = error.exit_code if isinstance(error, MlacError) else None
    return ("failed", str(error), repr(error), code, metrics.take())


def _apply_messages(conn: Connection, loop: EngineLoop, channel: Channel) -> None:
    """Until ("stop",) or a closed pipe: each message of the server applied to the loop."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            log.info("the server process closed the pipe: stopping the engine")
            return
        kind = message[0]
        if kind == "add":
            _add(loop, message[1], channel)
        elif kind == "cancel":
            loop.cancel(message[1])
        elif kind == "fail":
            loop.fail_all(message[1])
        elif kind == "stop":
            return


def _add(loop: EngineLoop, requests: list[tuple], channel: Channel) -> None:
    """Build each request's Sequence (its detokenizer, its grammar's matcher) and submit it; one the
    engine refuses ends at once with its error (the server validated it already: rare)."""
    for rid, prompt_ids, params, arrival, request_id in requests:
        try:
            seq = loop.engine.new_sequence(prompt_ids, params, request_id)
            seq.seq_id, seq.arrival = rid, arrival  # the server's id and clock (CLOCK_MONOTONIC)
            loop.submit([seq], [rid])
        except MlacError as e:
            channel.send(("step", [(rid, encode_error(e))], [rid], []))
