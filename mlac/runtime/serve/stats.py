"""What the engine thread logs besides the start-up line: the periodic stats line (StatsLog) and,
with --enable-log-requests, one line per request at arrival and one at its end.

    INFO ... stats: prompt 812.4 tok/s, generation 1,733.0 tok/s, running 32, waiting 4,
             KV cache 41.2%, prefix-cache hit rate 37.5%
    INFO ... request 3f2a...: arrived, 25 prompt tokens, max_tokens=64 temperature=0.6 top_p=0.95 ...
    INFO ... request 3f2a...: finished (length), 25 prompt + 64 generated tokens, 1.204 s

A request is named by its X-Request-Id (request_id.py; choice j of n > 1 as "<id>-j"), or by its
engine id when it came another way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mlac.runtime.engine.params import SamplingParams

log = logging.getLogger("mlac.server")


@dataclass(frozen=True, slots=True)
class Gauges:
    """The scheduler's state when a stats line is written."""

    running: int
    waiting: int
    kv_usage: float  # 0..1


class StatsLog:
    """Counts one interval's tokens and writes the stats line every `interval` seconds while the
    engine is busy (requests in, or tokens counted since the last line): `due` says when. An idle
    server writes nothing; the interval in which work ended gets its line when it is due."""

    def __init__(self, interval: float, now: float):
        self.interval = interval
        self._start = now
        self._prompt = self._generation = self._hits = self._queries = 0

    def count(self, prompt: int = 0, generation: int = 0, hits: int = 0, queries: int = 0) -> None:
        self._prompt += prompt
        self._generation += generation
        self._hits += hits
        self._queries += queries

    @property
    def pending(self) -> bool:
        """Something was counted since the last line."""
        return bool(self._prompt or self._generation or self._queries)

    def resume(self, now: float) -> None:
        """Work came after an idle spell: with nothing pending, the interval starts now (an idle
        spell is not averaged into the next line)."""
        if not self.pending:
            self._start = now

    def due(self, now: float) -> float:
        """Seconds until the next line is due (0: now)."""
        return max(0.0, self._start + self.interval - now)

    def write(self, now: float, gauges: Gauges) -> None:
        """Log the line of the interval that ends `now` and start the next one."""
        log.info(self.line(now - self._start, gauges))
        self._start = now
        self._prompt = self._generation = self._hits = self._queries = 0

    def line(self, seconds: float, g: Gauges) -> str:
        secs = max(seconds, 1e-9)
        hit_rate = self._hits / self._queries if self._queries else 0.0
        return (
            f"stats: prompt {self._prompt / secs:,.1f} tok/s, generation {self._generation / secs:,.1f} tok/s, "
            f"running {g.running}, waiting {g.waiting}, KV cache {g.kv_usage:.1%}, "
            f"prefix-cache hit rate {hit_rate:.1%}"
        )


def log_arrival(name: str | int, num_prompt: int, params: SamplingParams) -> None:
    """--enable-log-requests: a request came in (its name, prompt length and sampling parameters)."""
    p = params
    log.info(
        "request %s: arrived, %d prompt tokens, max_tokens=%d temperature=%g top_p=%g top_k=%d min_p=%g "
        "seed=%s stop=%r stop_token_ids=%r ignore_eos=%s logprobs=%s",
        name, num_prompt, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed, list(p.stop),
        list(p.stop_token_ids), p.ignore_eos, p.logprobs,
    )  # fmt: skip


def log_finish(name: str | int, reason: str, num_prompt: int, num_generated: int, seconds: float) -> None:
    """--enable-log-requests: a request ended (reason: stop, length, abort or error)."""
    log.info(
        "request %s: finished (%s), %d prompt + %d generated tokens, %.3f s",
        name, reason, num_prompt, num_generated, seconds,
    )  # fmt: skip
