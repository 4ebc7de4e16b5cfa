"""Where the engine thread's output goes (an Outlet): in the server's process, each request's
Sink, an asyncio.Queue of the handler's event loop, filled with ONE `call_soon_threadsafe` per
event loop per engine step (a self-pipe write and a wake-up of that loop per step, not per token
per request). The engine's own process has another Outlet (engine_child.PipeOutlet)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from mlac.runtime.engine.sequence import Delta

log = logging.getLogger("mlac.server")


@dataclass(frozen=True, slots=True)
class Sink:
    """Where one request's Deltas go: item `index` of `queue`, an asyncio.Queue of event loop `aio`."""

    aio: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int


Outbox = dict[asyncio.AbstractEventLoop, list[tuple[Sink, Delta | BaseException]]]


class Outlet(Protocol):
    """Where EngineLoop hands its requests' output, all on the engine thread: `post` an item for a
    sink, `end` a sink (its request is over: nothing more comes for it), `send` what was posted."""

    def post(self, sink: Any, item: Delta | BaseException) -> None: ...

    def end(self, sink: Any) -> None: ...

    def send(self) -> None: ...


class AsyncioOutlet:
    """Deltas to asyncio handlers of this process: each sink is a Sink; one
    `call_soon_threadsafe` per event loop per `send`, the items in the order posted."""

    def __init__(self):
        self._outbox: Outbox = {}

    def post(self, sink: Sink, item: Delta | BaseException) -> None:
        self._outbox.setdefault(sink.aio, []).append((sink, item))

    def end(self, sink: Sink) -> None:
        pass

    def send(self) -> None:
        outbox, self._outbox = self._outbox, {}
        hand_over(outbox)


def hand_over(outbox: Outbox) -> None:
    """Hand each event loop its items in one call (any thread)."""
    for aio, items in outbox.items():
        try:
            aio.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the handler's event loop is closed: nobody is listening
            log.debug("dropped %d deltas for requests whose handler is gone", len(items))


def _put_all(items: list[tuple[Sink, Delta | BaseException]]) -> None:
    """On the sinks' event loop: each item into its request's queue."""
    for sink, item in items:
        sink.queue.put_nowait((sink.index, item))
