"""The server's Prometheus metrics (prometheus_client), in a registry of their own per server.

Names, types, labels and buckets follow vLLM's (vllm/v1/metrics/loggers.py) with the prefix
`mlac:` instead of `vllm:`, so a vLLM Grafana dashboard reads them after a prefix change; the
one-to-one table is in docs/serving.md. Every metric carries the label `model_name` (the served
model name). A few have no vLLM counterpart (KV_BLOCKS, JIT_COMPILES, HTTP_REQUESTS). The registry
also holds prometheus_client's process and platform collectors (`process_*`, `python_info`: the
server's process, unprefixed, as vLLM's server exports them).

Counters and histograms are updated from two threads (HTTP handlers count HTTP requests; the
engine thread counts tokens, latencies and outcomes); prometheus_client's metrics are thread-safe.
When the engine runs in its own process, it counts into a MetricsRecorder whose ops travel with each
step's deltas and are replayed here, in the server's process (`replay`).
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

PREFIX = "mlac:"

# Seconds, as vLLM's. TTFT from a few ms to 40 min; inter-token 10 ms to 80 s; whole requests 0.3 s to 2 h.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
MAX_TOKEN_BUCKET = 1_000_000  # vLLM stops its 1-2-5 token buckets at max_model_len; mlac at a fixed bound

# How an engine request ended: vLLM's finished_reason values; `error` is a failed step or a
# request the engine refused after it was submitted.
FINISH_REASONS = ("stop", "length", "abort", "error")


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class Metrics:
    """Everything /metrics exports, each bound to `model_name`. Attributes are children ready to
    `inc` / `set` / `observe`; `finished(reason)` and `http(route, code)` add their own label."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes
        PlatformCollector(registry=self.registry)  # python_info
        self._finished = self._counter("request_success", "Engine requests finished, by finished_reason "
                                       "(stop, length, abort, error), counted when they end", "finished_reason")  # fmt: skip
        for reason in FINISH_REASONS:  # every outcome is exported from the start, at 0
            self._finished.labels(model_name, reason)
        self._http = self._counter("http_requests", "HTTP requests to /v1 and the tokenizer routes, "
                                   "by route and the status code answered", "route", "code")  # fmt: skip
        self._add_gauges()
        self._add_counters()
        self._add_histograms()

    def _add_gauges(self) -> None:
        self.running = self._gauge("num_requests_running", "Requests in the running batch")
        self.waiting = self._gauge("num_requests_waiting", "Requests waiting for admission")
        self.kv_usage = self._gauge(
            "kv_cache_usage_perc", "KV-cache usage: the fraction of blocks in use (1 = 100%)"
        )
        self.kv_blocks = self._gauge("kv_cache_blocks", "KV cache blocks in the pool (mlac only)")

    def _add_counters(self) -> None:
        c = self._counter
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens of requests that reached their first token")
        self.generation_tokens = c("generation_tokens", "Generated tokens")
        self.preemptions = c("num_preemptions", "Requests preempted for lack of KV blocks")
        self.prefix_queries = c("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = c("prefix_cache_hits", "Prompt tokens served from the prefix cache")
        self.jit_compiles = c("triton_jit_compiles", "Triton kernels compiled since the process started "
                              "(none for an artifact prepared for this GPU; mlac only)")  # fmt: skip
        # speculative decoding, vLLM's spec_decode_* counters: accepted tokens per step =
        # (num_accepted_tokens + num_drafts) / num_drafts
        self.spec_drafts = c("spec_decode_num_drafts", "Sequence-steps that verified MTP drafts")
        self.spec_draft_tokens = c("spec_decode_num_draft_tokens", "MTP draft tokens verified")
        self.spec_accepted_tokens = c("spec_decode_num_accepted_tokens", "MTP draft tokens accepted")
        self._spec_seen = (0, 0, 0)

    def _add_histograms(self) -> None:
        h, tokens = self._histogram, buckets_1_2_5(MAX_TOKEN_BUCKET)
        self.ttft = h("time_to_first_token_seconds", "Arrival to first generated token", TTFT_BUCKETS)
        self.itl = h(
            "inter_token_latency_seconds", "Between two generated tokens of one request", ITL_BUCKETS
        )
        self.e2e = h("e2e_request_latency_seconds", "Arrival to the request's end", REQUEST_LATENCY_BUCKETS)
        self.queue_time = h("request_queue_time_seconds", "Arrival to the step that first runs the request",
                            REQUEST_LATENCY_BUCKETS)  # fmt: skip
        # a request's phases, as vLLM splits them: queue | prefill | decode; inference = prefill + decode
        self.prefill_time = h("request_prefill_time_seconds", "The step that first runs the request to its "
                              "first token", REQUEST_LATENCY_BUCKETS)  # fmt: skip
        self.decode_time = h("request_decode_time_seconds", "The request's first token to its last",
                             REQUEST_LATENCY_BUCKETS)  # fmt: skip
        self.inference_time = h("request_inference_time_seconds", "The step that first runs the request to "
                                "its last token", REQUEST_LATENCY_BUCKETS)  # fmt: skip
        self.request_prompt_tokens = h("request_prompt_tokens", "Prompt tokens of a finished request", tokens)
        self.request_generation_tokens = h("request_generation_tokens", "Generated tokens of a finished request",
                                           tokens)  # fmt: skip
        self.request_max_tokens = h("request_params_max_tokens", "max_tokens of a finished request", tokens)
        self.iteration_tokens = h("iteration_tokens_total", "Tokens of one engine step (prompt chunks and "
                                  "decode rows, speculative drafts included)", tokens)  # fmt: skip

    def finished(self, reason: str) -> Counter:
        """The request_success counter of one finished_reason (one of FINISH_REASONS)."""
        return self._finished.labels(self.model_name, reason)

    def http(self, route: str, code: int) -> Counter:
        """The HTTP request counter of one route and status code."""
        return self._http.labels(self.model_name, route, str(code))

    def count_spec(self, stats) -> None:
        """Advance the spec_decode counters to a scheduler's cumulative SpecStats."""
        self._spec_seen = advance_spec(self, self._spec_seen, stats)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def _counter(self, name: str, doc: str, *labels: str) -> Counter:
        counter = Counter(PREFIX + name, doc, ["model_name", *labels], registry=self.registry)
        return counter if labels else counter.labels(self.model_name)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        hist = Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=self.registry)
        return hist.labels(self.model_name)


# The metrics that EngineLoop updates (the engine's side); the HTTP counters stay with the server.
ENGINE_METRICS = ("running", "waiting", "kv_usage", "kv_blocks", "prompt_tokens", "generation_tokens",
                  "preemptions", "prefix_queries", "prefix_hits", "jit_compiles", "ttft", "itl", "e2e",
                  "queue_time", "prefill_time", "decode_time", "inference_time", "request_prompt_tokens", "request_generation_tokens", "request_max_tokens",
                  "spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "iteration_tokens")  # fmt: skip

MetricOp = tuple[str, str, float]  # (metric: an ENGINE_METRICS name or "finished:<reason>", method, value)


class _Recorded:
    """One metric of a MetricsRecorder: each inc / set / observe becomes an op."""

    def __init__(self, ops: list[MetricOp], name: str):
        self._ops, self._name = ops, name

    def inc(self, value: float = 1) -> None:
        self._ops.append((self._name, "inc", value))

    def set(self, value: float) -> None:
        self._ops.append((self._name, "set", value))

    def observe(self, value: float) -> None:
        self._ops.append((self._name, "observe", value))


class MetricsRecorder:
    """Metrics' engine side in the engine's own process: the same attributes (ENGINE_METRICS and
    `finished`), recorded as ops that `take` hands over and `replay` applies to the server's
    Metrics. One thread records (the engine thread); `take` is called on it too."""

    def __init__(self):
        self._ops: list[MetricOp] = []
        self._spec_seen = (0, 0, 0)
        for name in ENGINE_METRICS:
            setattr(self, name, _Recorded(self._ops, name))

    def finished(self, reason: str) -> _Recorded:
        return _Recorded(self._ops, f"finished:{reason}")

    def count_spec(self, stats) -> None:
        """As Metrics.count_spec (this side keeps what it has counted so far)."""
        self._spec_seen = advance_spec(self, self._spec_seen, stats)

    def take(self) -> list[MetricOp]:
        """The ops recorded since the last take, oldest first."""
        ops = self._ops[:]
        self._ops.clear()
        return ops


def advance_spec(m: Metrics | MetricsRecorder, seen: tuple[int, int, int], stats) -> tuple[int, int, int]:
    """Increment m's spec_decode counters from `seen` to a scheduler's cumulative SpecStats; the
    new `seen`."""
    now = (stats.verifies, stats.drafted, stats.accepted)
    counters = (m.spec_drafts, m.spec_draft_tokens, m.spec_accepted_tokens)
    for counter, value, old in zip(counters, now, seen, strict=True):
        counter.inc(value - old)
    return now


def replay(metrics: Metrics, ops: list[MetricOp]) -> None:
    """Apply a MetricsRecorder's ops to `metrics` (in the server's process)."""
    for name, method, value in ops:
        _, _, reason = name.partition("finished:")
        target = metrics.finished(reason) if reason else getattr(metrics, name)
        getattr(target, method)(value)
