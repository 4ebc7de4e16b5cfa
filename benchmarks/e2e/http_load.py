"""The HTTP load of the serving benchmarks: streaming /v1/completions from client processes, each
request timed token by token (`Trace`), and the statistics of a run (decode window, TTFT, ITL,
peak throughput). serve_http.py and serve_overhead.py drive it against a server they start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import random
import signal
import time
from dataclasses import dataclass, field

import httpx

# ---- the client -----------------------------------------------------------------------------------


@dataclass
class Trace:
    """One streamed request as this client saw it (perf_counter seconds)."""

    sent: float = 0.0
    times: list[float] = field(default_factory=list)  # arrival of each chunk with tokens
    counts: list[int] = field(default_factory=list)  # tokens in that chunk
    finish: str | None = None
    completion_tokens: int | None = None  # from the final usage chunk
    error: str | None = None

    @property
    def tokens(self) -> int:
        return sum(self.counts)


async def stream_one(client: httpx.AsyncClient, url: str, body: dict, trace: Trace) -> None:
    """POST one streaming completion; fill `trace` as the chunks arrive."""
    trace.sent = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                trace.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                if line == "data: [DONE]":
                    return
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    trace.error = str(chunk["error"])[:300]
                    return
                for choice in chunk.get("choices") or ():
                    lps = choice.get("logprobs") or {}
                    n = len(lps.get("token_logprobs") or ())
                    if n:
                        trace.times.append(now)
                        trace.counts.append(n)
                    trace.finish = choice.get("finish_reason") or trace.finish
                if chunk.get("usage"):
                    trace.completion_tokens = chunk["usage"]["completion_tokens"]
    except (httpx.HTTPError, ValueError) as e:
        trace.error = f"{type(e).__name__}: {e}"[:300]


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


async def run_requests(
    url: str, model: str, ids: list[list[int]], max_tokens: int, concurrency: int, timeout: float
) -> tuple[list[Trace], bool]:
    """Send one streaming request per prompt (all at once, or at most `concurrency` in flight);
    requests still running after `timeout` s are cancelled (their traces keep what arrived).
    Returns the traces and whether the timeout cut the run off."""
    traces = [Trace() for _ in ids]
    gate = asyncio.Semaphore(concurrency) if concurrency > 0 else contextlib.nullcontext()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeouts = httpx.Timeout(connect=60.0, read=None, write=60.0, pool=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeouts, trust_env=False) as client:

        async def one(prompt: list[int], trace: Trace) -> None:
            async with gate:
                await stream_one(
                    client, url + "/v1/completions", completion_body(model, prompt, max_tokens), trace
                )

        tasks = [asyncio.create_task(one(p, t)) for p, t in zip(ids, traces, strict=True)]
        _, pending = await asyncio.wait(tasks, timeout=max(timeout, 1.0))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for t in traces:
        if t.error is None and t.finish is None:
            t.error = "cut off by the phase timeout" if pending else "stream ended without finish_reason"
    return traces, bool(pending)


def event_loop_run(coro):
    """uvloop where installed (less client overhead per streamed chunk), else asyncio."""
    try:
        import uvloop
    except ImportError:
        uvloop = None
    return (getattr(uvloop, "run", None) or asyncio.run)(coro)


def client_init() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # `timeout` ends the client processes at once


def client_run(url: str, model: str, ids: list[list[int]], max_tokens: int, concurrency: int, timeout: float,
               start_at: float) -> tuple[list[Trace], float, float, bool]:  # fmt: skip
    """In a client process: wait until `start_at` (perf_counter is CLOCK_MONOTONIC, one clock for
    every process), run the requests; (traces, end time, CPU seconds, cut off)."""
    time.sleep(max(0.0, start_at - time.perf_counter()))
    cpu0 = time.process_time()
    traces, cut_off = event_loop_run(run_requests(url, model, ids, max_tokens, concurrency, timeout))
    return traces, time.perf_counter(), time.process_time() - cpu0, cut_off


@dataclass
class Run:
    traces: list[Trace]
    start: float
    wall: float  # start -> the last client process done (its requests finished or cut off)
    cut_off: bool  # the phase's timeout ended it
    client_cpu: float  # the busiest client process's CPU seconds / wall (near 1: client-bound)


class Clients:
    """Client processes (forked before the server starts): request i goes to process i % n, all
    start at the same instant. One Python process parses a few thousand streamed chunks a second,
    fewer than a GPU server at batch 256 sends."""

    def __init__(self, n: int):
        self.n = n
        self.pool = multiprocessing.get_context("fork").Pool(n, initializer=client_init)

    def run(self, url: str, model: str, ids: list[list[int]], max_tokens: int, concurrency: int,
            timeout: float) -> Run:  # fmt: skip
        n = min(self.n, len(ids))
        per = -(-concurrency // n) if concurrency > 0 else 0
        start_at = time.perf_counter() + 0.2
        jobs = [self.pool.apply_async(client_run, (url, model, ids[i::n], max_tokens, per, timeout, start_at))
                for i in range(n)]  # fmt: skip
        parts = [job.get(timeout + 120) for job in jobs]
        traces: list[Trace] = [Trace()] * len(ids)
        for i, part in enumerate(parts):
            traces[i::n] = part[0]
        wall = max(part[1] for part in parts) - start_at
        cpu = max(part[2] for part in parts)
        return Run(traces, start_at, wall, any(part[3] for part in parts), round(cpu / wall, 3))

    def close(self) -> None:
        self.pool.terminate()
        self.pool.join()


# ---- statistics ---------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation; None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 2)


def check(run: Run, max_tokens: int) -> list[str]:
    """Every request: no error, finish_reason "length", max_tokens tokens streamed and counted."""
    bad = []
    for i, t in enumerate(run.traces):
        if t.error is not None:
            bad.append(f"request {i}: {t.error}")
        elif t.finish != "length" or t.tokens != max_tokens or t.completion_tokens != max_tokens:
            bad.append(f"request {i}: finish {t.finish}, {t.tokens} tokens streamed, "
                       f"usage {t.completion_tokens}; expected length / {max_tokens}")  # fmt: skip
    return bad


def token_gaps(t: Trace) -> list[float]:
    """Seconds between consecutive tokens of one request (a chunk of n tokens: n equal gaps)."""
    gaps = []
    for i in range(1, len(t.times)):
        gaps += [(t.times[i] - t.times[i - 1]) / t.counts[i]] * t.counts[i]
    return gaps


def decode_stats(run: Run, max_tokens: int) -> dict:
    """Steady-state decode rate over the window where every request is decoding, plus TTFT/ITL."""
    started = [t for t in run.traces if t.times]
    total = sum(t.tokens for t in run.traces)
    out: dict = {"requests": len(run.traces), "requests_ok": len(run.traces) - len(check(run, max_tokens)),
                 "output_tokens": total, "wall_s": round(run.wall, 3), "cut_off": run.cut_off,
                 "output_tokens_per_s": round(total / run.wall, 1) if run.wall > 0 else None}  # fmt: skip
    if len(started) == len(run.traces) and started:
        w0 = max(t.times[0] for t in started)  # the last request's first token
        w1 = min(t.times[-1] for t in started)  # the first request's last token
        in_window = sum(n for t in started for x, n in zip(t.times, t.counts, strict=True) if w0 < x <= w1)
        if w1 > w0 and in_window:
            rate = in_window / (w1 - w0)
            out.update(decode_window_s=round(w1 - w0, 3), decode_window_tokens=in_window,
                       decode_tokens_per_s=round(rate, 1),
                       decode_step_ms=round(1000 * len(started) / rate, 2))  # fmt: skip
    if "decode_tokens_per_s" not in out:
        out["decode_tokens_per_s"] = None  # no window where every request was decoding
    ttft = [t.times[0] - t.sent for t in started]
    itl = [gap for t in started for gap in token_gaps(t)]
    out.update(ttft_ms_p50=ms(pct(ttft, 0.5)), ttft_ms_p99=ms(pct(ttft, 0.99)),
               itl_ms_p50=ms(pct(itl, 0.5)), itl_ms_p99=ms(pct(itl, 0.99)),
               client_cpu_fraction=run.client_cpu)  # fmt: skip
    return out


def peak_stats(run: Run, max_tokens: int) -> dict:
    total = sum(t.tokens for t in run.traces)
    finished = sum(1 for t in run.traces if t.finish is not None and t.error is None)
    last = max((t.times[-1] for t in run.traces if t.times), default=run.start)
    span = last - run.start  # first request sent -> last token received
    e2e = [t.times[-1] - t.sent for t in run.traces if t.times and t.finish]
    ttft = [t.times[0] - t.sent for t in run.traces if t.times]
    return {
        "requests": len(run.traces),
        "requests_finished": finished,
        "output_tokens": total,
        "wall_s": round(span, 3),
        "cut_off": run.cut_off,
        "output_tokens_per_s": round(total / span, 1) if span > 0 else None,
        "requests_per_s": round(finished / span, 3) if span > 0 else None,
        "ttft_ms_p50": ms(pct(ttft, 0.5)),
        "ttft_ms_p99": ms(pct(ttft, 0.99)),
        "latency_ms_p50": ms(pct(e2e, 0.5)),
        "latency_ms_p99": ms(pct(e2e, 0.99)),
        "client_cpu_fraction": run.client_cpu,
    }
