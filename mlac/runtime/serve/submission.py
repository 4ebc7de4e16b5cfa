"""Submission: the engine requests of one HTTP call and their deltas, on the handler's event loop
(the asyncio side of EngineLoop, or of engine_client.EngineClient)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from mlac.runtime.engine.sequence import Delta
from mlac.runtime.serve.engine_errors import EngineDead, QueueFull, ShuttingDown
from mlac.runtime.serve.outlet import Sink
from mlac.runtime.serve.protocol import ApiError

if TYPE_CHECKING:
    from mlac.runtime.serve.loop import EngineLoop


class Submission:
    """The engine requests of one HTTP call and their deltas, on the handler's event loop.
    Construct it inside the handler: it submits at once (ApiError 503 if the loop refuses).
    `loop` is an EngineLoop, or an engine_client.EngineClient (then `seqs` are its Requests)."""

    def __init__(self, loop: EngineLoop, seqs: list):
        self.loop, self.seqs = loop, seqs
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done: set[int] = set()
        aio = asyncio.get_running_loop()
        sinks = [Sink(aio, self.queue, i) for i in range(len(seqs))]
        try:
            loop.submit(seqs, sinks)
        except QueueFull as e:
            raise ApiError(503, str(e), type="server_error", code="queue_full") from None
        except ShuttingDown as e:
            raise ApiError(503, str(e), type="server_error", code="draining") from None
        except EngineDead as e:
            raise ApiError(503, str(e), type="server_error", code="engine_dead") from None

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, Delta) until every request finished; an engine failure raises ApiError
        (503 when the server is shutting down, 500 when a step failed or the engine died)."""
        async for batch in self.batches():
            for index, delta in batch:
                yield index, delta

    async def batches(self) -> AsyncIterator[list[tuple[int, Delta]]]:
        """As `deltas`, but every (index, Delta) that has arrived at once, in order, as one list
        (never empty): a consumer that falls behind the engine takes several steps' deltas in one
        go (one write to the client instead of one per step). An engine failure is raised after
        the deltas that came before it."""
        while len(self.done) < len(self.seqs):
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            batch = []
            for index, item in items:
                if isinstance(item, BaseException):
                    self.done.add(index)
                    if batch:
                        yield batch
                    raise _api_error(item)
                if item.finish_reason is not None:
                    self.done.add(index)
                batch.append((index, item))
            yield batch

    def cancel_unfinished(self) -> None:
        for i, seq in enumerate(self.seqs):
            if i not in self.done:
                self.loop.cancel(seq.seq_id)


def _api_error(e: BaseException) -> ApiError:
    """An engine failure as the handler answers it: 503 shutting down, 500 a failed step or a dead
    engine (the request was accepted: not to be retried blindly)."""
    if isinstance(e, ShuttingDown):
        return ApiError(503, str(e), type="server_error", code="draining")
    code = "engine_dead" if isinstance(e, EngineDead) else "engine_error"
    return ApiError(500, str(e), type="server_error", code=code)
