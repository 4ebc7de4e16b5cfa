"""The engine's one thread (EngineLoop): it loads the model, then runs scheduler steps.

Other threads never touch the scheduler: they put ("add", seq, sink), ("cancel", seq_id),
("fail", message), ("die", why) or ("stop",) into a queue.Queue, and the engine thread applies them
between steps; a heartbeat thread (heartbeat.py) watches the ranks meanwhile. Each Delta (or an
exception) goes to the request's sink through the loop's Outlet (outlet.py): the engine thread
collects what one step produced and sends it at once. In the server's process (AsyncioOutlet)
that is ONE `call_soon_threadsafe` per event loop per step; in the engine's own process
(engine_child.PipeOutlet) one message to the server process per step.
The handlers' side of the bridge is submission.py.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from mlac.core.errors import MlacError
from mlac.runtime.engine.sequence import Delta, Sequence
from mlac.runtime.serve.engine_errors import EngineDead, ShuttingDown, check_room
from mlac.runtime.serve.heartbeat import Heartbeat
from mlac.runtime.serve.metrics import Metrics, MetricsRecorder
from mlac.runtime.serve.outlet import AsyncioOutlet, Outlet
from mlac.runtime.serve.stats import Gauges, StatsLog, log_arrival, log_finish
from mlac.runtime.worker.jit_compiles import count_compiles

log = logging.getLogger("mlac.server")


class EngineLoop:
    """The engine's one thread: loads the model, then runs scheduler steps. Other threads
    `submit` Sequences and `cancel` them through a thread-safe inbox; each Delta (or an
    exception, if a step fails) goes to the request's sink, called on the engine thread.
    One request's failure inside a step (Sequence.fail, its delta) ends that request alone.
    An exception that escapes the loop itself (a bug outside the step), a step that stopped the
    ranks, or a rank that exited (`die`, from the heartbeat) kills the engine: every request it
    holds ends with EngineDead, later ones are refused with it, `failure` says why and
    `on_failure` is called (the launcher stops the server: launch.make_server). `trouble` says,
    every heartbeat, what is wrong with the ranks (None: nothing); `on_beat(trouble)` is called
    with it (in the engine's own process: a message to the server's).
    It counts each request's outcome in `metrics` when the request ends, writes the stats line
    every `stats_interval` seconds while busy (None: never) and, with `log_requests`, a line per
    request at arrival and at its end (stats.py)."""

    def __init__(
        self,
        load: Callable[[], Any],
        metrics: Metrics | MetricsRecorder,  # a recorder in the engine's own process (engine_child.py)
        max_unfinished: int,
        log_requests: bool = False,
        stats_interval: float | None = 10.0,
        outlet: Outlet | None = None,
    ):
        self._load = load
        self.metrics = metrics
        self.max_unfinished = max_unfinished
        self.log_requests = log_requests
        self._stats = None if stats_interval is None else StatsLog(stats_interval, time.monotonic())
        self.engine = None
        self.scheduler = None
        self.load_error: BaseException | None = None
        self.on_load_error: Callable[[], None] | None = None
        self.failure: EngineDead | None = None  # set when the engine died after it loaded
        self.on_failure: Callable[[], None] | None = None  # on the engine thread, after the ends
        self.on_ready: Callable[[], None] | None = None
        self.trouble: str | None = None  # a rank exited or is stopped (set by the heartbeat)
        self.on_beat: Callable[[str | None], None] | None = None  # called on the heartbeat thread
        self._outlet: Outlet = outlet or AsyncioOutlet()
        self._inbox: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._unfinished = 0  # submitted, not yet finished (guarded by _lock)
        self._refusing: MlacError | None = None  # set by fail_all or a failure: why new requests are refused
        self._sinks: dict[int, Any] = {}  # seq_id -> its sink (what the outlet takes)
        self._last_token: dict[int, float] = {}
        self._queued: set[int] = set()  # added, never run yet (for the queue-time histogram)
        self._started: dict[int, float] = {}  # seq_id -> the start of the step that first ran it
        self._thread = threading.Thread(target=self._main, name="mlac-engine", daemon=True)
        self._heartbeat = Heartbeat(self._beat)
        self._dying = False  # die() was called (once)

    # ---- any thread ----

    def start(self) -> None:
        self._thread.start()
        self._heartbeat.start()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def num_unfinished(self) -> int:
        return self._unfinished

    def submit(self, seqs: list[Sequence], sinks: list[Any]) -> None:
        """Queue requests for the engine (all or none); QueueFull past max_unfinished,
        ShuttingDown after fail_all, EngineDead once the engine failed."""
        with self._lock:  # NOTE: the puts too: a failing engine takes, under it, every one accepted
            check_room(self._unfinished, len(seqs), self.max_unfinished, self._refusing)
            self._unfinished += len(seqs)
            for seq, sink in zip(seqs, sinks, strict=True):
                if self.log_requests:
                    log_arrival(seq.request_id or seq.seq_id, len(seq.prompt_ids), seq.params)
                self._inbox.put(("add", seq, sink))

    def cancel(self, seq_id: int) -> None:
        self._inbox.put(("cancel", seq_id))

    def fail_all(self, message: str) -> None:
        """End every unfinished request with ShuttingDown(message) and refuse new ones (the
        drain timeout expired): each handler answers an error instead of being cut off."""
        with self._lock:
            if self.failure is None:
                self._refusing = ShuttingDown(message)
        self._inbox.put(("fail", message))

    def die(self, why: str) -> None:
        """Kill the engine (a rank exited): as if an exception with `why` escaped the loop."""
        self._dying = True
        self._inbox.put(("die", why))

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is left, close the engine, end the thread."""
        self._heartbeat.stop()
        self._inbox.put(("stop",))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the heartbeat thread ----

    def _beat(self) -> None:
        """What is wrong with the ranks (a multi-rank runner's `trouble`), told to `on_beat`; a
        rank that exited kills the engine. Reads the runner, never the scheduler."""
        runner = self.engine.runner if self.ready and self.failure is None else None
        found = runner.trouble() if hasattr(runner, "trouble") else None
        trouble, dead = found if found is not None else (None, False)
        if dead and not self._dying:
            log.error("%s: stopping the engine", trouble)
            self.die(trouble)
        self.trouble = trouble
        if self.on_beat is not None:
            self.on_beat(trouble)

    # ---- the engine thread ----

    def _on_compile(self, name: str) -> None:
        """A Triton JIT compile: counted; named in the log once serving (a request waits on it:
        the artifact was prepared without that kernel variant)."""
        self.metrics.jit_compiles.inc()
        if self.scheduler is not None:
            log.warning("Triton compiled %s while serving (not in the prepared kernel cache)", name)

    def _main(self) -> None:
        count_compiles(self._on_compile)  # start-up's and the requests'
        try:
            self.engine = self._load()
            self.scheduler = self.engine.scheduler()
        except BaseException as e:  # noqa: BLE001  (reported by /health and by serve())
            log.error("loading the model failed: %s", e)
            self.load_error = e
            if self.on_load_error is not None:
                self.on_load_error()
            return
        self.metrics.kv_blocks.set(sum(p.num_blocks for p in self.engine.runner.kv_pools))  # every DP rank's
        self._ready.set()
        log.info("model loaded: ready")
        if self.on_ready is not None:
            self.on_ready()
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001  (the engine is dead: see _die)
            self._die(e)
            return
        for seq in self.scheduler.abort_all():
            self._deliver(seq, time.monotonic())
        self._refuse_inbox()
        self._send()
        self.engine.close()

    def _serve(self) -> None:
        """Steps until asked to stop."""
        while self._take_inbox(block=not self.scheduler.has_unfinished):
            self._send()
            if self.scheduler.has_unfinished:
                self._step()
                self._send()
                self._log_stats()

    def _die(self, e: BaseException) -> None:
        """An exception escaped the loop: refuse new requests, end every one held (submitted ones
        still in the inbox included) with EngineDead, call `on_failure`, close the engine (which
        may wait for the ranks). Touches neither the scheduler nor the metrics (either may be what
        broke)."""
        why = str(e) if isinstance(e, MlacError) else f"{type(e).__name__}: {e}"
        error = EngineDead(f"the engine failed: {why}")
        bug = not isinstance(e, MlacError)  # a bug: its traceback goes to the log with it
        log.error("%s", error, exc_info=e if bug else None)
        with self._lock:
            self.failure = self._refusing = error
            sinks = [*self._sinks.values(), *(i[2] for i in _drain(self._inbox) if i[0] == "add")]
            self._sinks, self._unfinished = {}, 0
        for sink in sinks:
            self._post(sink, error)
            self._outlet.end(sink)
        _log_failure(self._send, "sending the requests' errors")
        if self.on_failure is not None:
            self.on_failure()
        _log_failure(self.engine.close, "closing the engine")

    def _refuse_inbox(self) -> None:
        """At shutdown: requests submitted but never added get an error instead of silence."""
        for item in _drain(self._inbox):
            if item[0] == "add":
                self._sinks[item[1].seq_id] = item[2]
                self._finish(item[1], ShuttingDown("server shutting down"))

    def _take_inbox(self, block: bool) -> bool:
        """Apply queued submissions and cancellations; False once asked to stop."""
        item = self._wait() if block else None
        while True:
            if item is not None:
                if item[0] == "stop":
                    return False
                self._apply(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _wait(self) -> tuple:
        """The next inbox item, blocking (the engine is idle). The stats line of the interval in
        which the work ended is written when it is due; then nothing until work comes again."""
        stats = self._stats
        if stats is not None and stats.pending:
            try:
                return self._inbox.get(timeout=stats.due(time.monotonic()))
            except queue.Empty:
                stats.write(time.monotonic(), self._gauges())
        item = self._inbox.get()
        if stats is not None:
            stats.resume(time.monotonic())
        return item

    def _apply(self, item: tuple) -> None:
        if item[0] == "add":
            _, seq, sink = item
            self._sinks[seq.seq_id] = sink
            self._queued.add(seq.seq_id)
            try:
                self.scheduler.add(seq)
            except MlacError as e:
                self._finish(seq, e)
        elif item[0] == "cancel" and item[1] in self._sinks:
            self.scheduler.abort(item[1])
        elif item[0] == "fail":
            for seq in self.scheduler.abort_all():
                self._finish(seq, ShuttingDown(item[1]))
        elif item[0] == "die":
            raise MlacError(item[1])  # escapes the loop: _die

    def _step(self) -> None:
        s = self.scheduler
        preempted, hits, queries = s.num_preemptions, s.prefix_hit_tokens, s.prefix_query_tokens
        start = time.monotonic()
        try:
            news = self.scheduler.step()
        except Exception as e:  # a failed step fails its requests, not the server
            if getattr(self.engine.runner, "failed", None) is not None:
                raise  # it stopped the ranks: no step runs again, the engine is dead (_die)
            log.exception("engine step failed")
            for seq in self.scheduler.abort_all():
                self._finish(seq, MlacError(f"engine step failed: {e}"))
            return
        self._observe_queue_time(news, start)
        if s.last_step_tokens:
            self.metrics.iteration_tokens.observe(s.last_step_tokens)
        now = time.monotonic()
        tokens = sum(self._deliver(seq, now) for seq in news)
        m, hits, queries = self.metrics, s.prefix_hit_tokens - hits, s.prefix_query_tokens - queries
        m.generation_tokens.inc(tokens)
        m.preemptions.inc(s.num_preemptions - preempted)
        m.prefix_hits.inc(hits)
        m.prefix_queries.inc(queries)
        g = self._gauges()
        m.running.set(g.running)
        m.waiting.set(g.waiting)
        m.kv_usage.set(g.kv_usage)
        if self._stats is not None:
            self._stats.count(generation=tokens, hits=hits, queries=queries)
        if s.spec is not None:
            m.count_spec(s.spec.stats)

    def _observe_queue_time(self, news: list[Sequence], start: float) -> None:
        """Arrival to the start of the step that first ran it, for each request run the first time."""
        if not self._queued:
            return
        for seq in (*news, *self.scheduler.running):
            if seq.seq_id in self._queued and (seq.output_ids or seq.num_computed):
                self._queued.discard(seq.seq_id)
                self._started[seq.seq_id] = start
                self.metrics.queue_time.observe(max(0.0, start - seq.arrival))

    def _gauges(self) -> Gauges:
        s = self.scheduler
        return Gauges(s.num_running, s.num_waiting, s.kv_usage)

    def _log_stats(self) -> None:
        """While busy: the stats line, when it is due."""
        now = time.monotonic()
        if self._stats is not None and self._stats.due(now) == 0:
            self._stats.write(now, self._gauges())

    def _deliver(self, seq: Sequence, now: float) -> int:
        """Queue seq's new Delta for its sink; the number of new tokens. A sequence that failed
        alone (Sequence.fail), or whose delta cannot be made, ends with its error (its request's
        alone: the others of the step are delivered as usual)."""
        sink = self._sinks.get(seq.seq_id)
        if sink is None:  # ended already (failed while running: the scheduler aborts it now)
            return 0
        if seq.error is not None:
            self._fail_one(seq, seq.error)
            return 0
        try:
            delta = seq.take_delta()
        except Exception as e:  # noqa: BLE001  (its detokenizer: this request's failure)
            self._fail_one(seq, f"{type(e).__name__}: {e}")
            return 0
        if delta.token_ids:
            prev = self._last_token.get(seq.seq_id)
            if prev is None:
                self._first_token(seq, now)
            else:
                self.metrics.itl.observe((now - prev) / len(delta.token_ids))
            self._last_token[seq.seq_id] = now
        if delta.text or delta.token_ids or delta.finish_reason:
            self._post(sink, delta)
        if seq.finished:
            self._finish(seq, None)
        return len(delta.token_ids)

    def _fail_one(self, seq: Sequence, why: str) -> None:
        """End one request with an engine error (500) and take it out of the scheduler if it is
        still there; the rest of the step goes on."""
        log.error("request %s failed in the engine: %s", seq.request_id or seq.seq_id, why)
        if not seq.finished:
            self.scheduler.abort(seq.seq_id)  # its blocks are freed at the next step
        self._finish(seq, MlacError(f"the request failed in the engine: {why}"))

    def _first_token(self, seq: Sequence, now: float) -> None:
        """TTFT, and the prompt counted as processed (as vLLM counts it: at its first token)."""
        self.metrics.ttft.observe(now - seq.arrival)
        self.metrics.prompt_tokens.inc(len(seq.prompt_ids))
        if self._stats is not None:
            self._stats.count(prompt=len(seq.prompt_ids))

    def _finish(self, seq: Sequence, error: BaseException | None) -> None:
        """seq has ended (finished, or `error`): count its outcome and release its sink."""
        sink = self._sinks.pop(seq.seq_id, None)
        self._last_token.pop(seq.seq_id, None)
        self._queued.discard(seq.seq_id)
        started = self._started.pop(seq.seq_id, None)
        if sink is None:
            return
        self._count_end(seq, error)
        self._count_phases(seq, started)
        if error is not None:
            self._post(sink, error)
        self._outlet.end(sink)
        with self._lock:
            self._unfinished -= 1

    def _count_end(self, seq: Sequence, error: BaseException | None) -> None:
        """request_success by outcome: its finish reason; `abort` when the server shut it down,
        `error` when a step failed or the engine refused it."""
        reason = _outcome(seq, error)
        seconds = time.monotonic() - seq.arrival
        m = self.metrics
        m.finished(reason).inc()
        m.e2e.observe(seconds)
        m.request_prompt_tokens.observe(len(seq.prompt_ids))
        m.request_generation_tokens.observe(len(seq.output_ids))
        m.request_max_tokens.observe(seq.params.max_tokens)
        if self.log_requests:
            log_finish(
                seq.request_id or seq.seq_id, reason, len(seq.prompt_ids), len(seq.output_ids), seconds
            )

    def _count_phases(self, seq: Sequence, started: float | None) -> None:
        """An ended request's prefill, decode and inference times (vLLM's split), from the step that
        first ran it (`started`; None: it never ran) and its first and last tokens."""
        first, last, m = seq.first_token_time, seq.last_token_time, self.metrics
        if started is None or first is None:
            return
        m.prefill_time.observe(max(0.0, first - started))
        m.decode_time.observe(max(0.0, last - first))
        m.inference_time.observe(max(0.0, last - started))

    def _post(self, sink: Any, item: Delta | BaseException) -> None:
        self._outlet.post(sink, item)

    def _send(self) -> None:
        """Hand over what was posted (one send per step, in the order posted)."""
        self._outlet.send()


def _drain(inbox: queue.Queue) -> list[tuple]:
    """Every item queued now, in order."""
    items = []
    while True:
        try:
            items.append(inbox.get_nowait())
        except queue.Empty:
            return items


def _log_failure(fn: Callable[[], None], what: str) -> None:
    """fn(), on a dead engine: what it raises is logged, not raised (the rest must still run)."""
    try:
        fn()
    except Exception:
        log.exception("%s failed too", what)


def _outcome(seq: Sequence, error: BaseException | None) -> str:
    """How a request ended, as a finished_reason (metrics.FINISH_REASONS)."""
    if error is None:
        return seq.finish_reason or "abort"
    return "abort" if isinstance(error, ShuttingDown) else "error"
