"""The server's /metrics (vLLM's names under `mlac:`, `model_name` on each, outcomes counted when a
request ends) and its logs (the periodic stats line while busy, --enable-log-requests, the handler
--log-level sets), on a live tiny-v3 server in this process; and docs/serving.md against both (every
`mlac serve` flag and every metric of its vLLM table is there)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from pathlib import Path

import httpx
import pytest
from _paths import REPO
from prometheus_client.parser import text_string_to_metric_families

from mlac.core.errors import MlacError
from mlac.runtime.serve import ServerConfig, ServerThread
from mlac.runtime.serve.launch import log_to_stderr
from mlac.runtime.serve.metrics import buckets_1_2_5
from mlac.runtime.serve.stats import Gauges, StatsLog

MODEL = "tiny"
DOC = REPO / "docs" / "serving.md"
DASHBOARD = REPO / "docs" / "grafana_dashboard.json"
INTERVAL = 0.2  # seconds between stats lines in these tests (10 by default)


@pytest.fixture(scope="module")
def server(artifact):
    cfg = ServerConfig.of(artifact=artifact("tiny-v3"), dtype="float32", verify=False, served_model_name=MODEL,
                       log_requests=True, log_stats_interval=INTERVAL)  # fmt: skip
    with ServerThread(cfg) as srv:
        yield srv


def scrape(srv: ServerThread) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of /metrics."""
    text = httpx.get(f"{srv.url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def complete(srv: ServerThread, timeout: float = 60, **body) -> httpx.Response:
    body = {"model": MODEL, "prompt": list(range(5, 17)), "ignore_eos": True, **body}
    return httpx.post(f"{srv.url}/v1/completions", json=body, timeout=timeout)


def wait_idle(srv: ServerThread, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while srv.state.loop.num_unfinished or srv.state.loop.scheduler.has_unfinished:
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.02)


class Delta:
    """Differences of /metrics samples between construction and `take()`, by name and labels."""

    def __init__(self, srv: ServerThread):
        self.srv, self.before = srv, scrape(srv)

    def take(self) -> None:
        self.after = scrape(self.srv)

    def __call__(self, name: str, **labels: str) -> float:
        key = (name, tuple(sorted({"model_name": MODEL, **labels}.items())))
        return self.after.get(key, 0) - self.before.get(key, 0)


# ---- /metrics -------------------------------------------------------------------------------------


PROCESS_METRICS = ("process_", "python_info")  # prometheus_client's collectors, unprefixed as vLLM's


def test_every_metric_is_mlac_prefixed_and_carries_model_name(server):
    assert complete(server, max_tokens=3).status_code == 200
    wait_idle(server)
    samples = scrape(server)
    names = {name for name, _ in samples}
    for name, labels in samples:
        if name.startswith(PROCESS_METRICS):
            continue
        assert name.startswith("mlac:"), name
        assert dict(labels).get("model_name") == MODEL, (name, labels)
    for want in ("mlac:num_requests_running", "mlac:num_requests_waiting", "mlac:kv_cache_usage_perc",
                 "mlac:prompt_tokens_total", "mlac:generation_tokens_total", "mlac:request_success_total",
                 "mlac:time_to_first_token_seconds_bucket", "mlac:inter_token_latency_seconds_bucket",
                 "mlac:e2e_request_latency_seconds_bucket", "mlac:request_queue_time_seconds_bucket",
                 "mlac:request_prefill_time_seconds_bucket", "mlac:request_decode_time_seconds_bucket",
                 "mlac:request_inference_time_seconds_bucket", "mlac:prefix_cache_queries_total",
                 "mlac:prefix_cache_hits_total", "mlac:iteration_tokens_total_bucket",
                 "process_cpu_seconds_total", "process_resident_memory_bytes", "python_info"):  # fmt: skip
        assert want in names, want
    reasons = {
        dict(labels)["finished_reason"] for name, labels in samples if name == "mlac:request_success_total"
    }
    assert reasons == {"stop", "length", "abort", "error"}  # every outcome exported, 0 until it happens


def test_a_requests_phases_add_up(server):
    wait_idle(server)
    before = scrape(server)
    assert complete(server, max_tokens=6).status_code == 200
    wait_idle(server)
    after = scrape(server)

    def delta(metric: str) -> float:
        key = (f"mlac:{metric}", (("model_name", MODEL),))
        return after[key] - before.get(key, 0.0)

    kinds = ("queue", "prefill", "decode", "inference")
    phases = {m: delta(f"request_{m}_time_seconds_sum") for m in kinds}
    counts = {m: delta(f"request_{m}_time_seconds_count") for m in kinds}
    assert counts == {"queue": 1, "prefill": 1, "decode": 1, "inference": 1}
    assert phases["decode"] > 0 and phases["prefill"] > 0
    assert phases["inference"] == pytest.approx(phases["prefill"] + phases["decode"], rel=1e-6)
    assert phases["queue"] + phases["inference"] <= delta("e2e_request_latency_seconds_sum") + 1e-6


def test_buckets_are_vllms():
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)
    text = DOC.read_text()
    assert "0.001, 0.005, 0.01, 0.02" in text  # the TTFT buckets are documented as they are


def test_iteration_tokens_count_each_steps_tokens(server):
    wait_idle(server)
    d = Delta(server)
    prompt = list(range(300, 331))  # 31 ids no other test sends: no prefix-cache hit
    assert complete(server, max_tokens=4, prompt=prompt).status_code == 200
    wait_idle(server)
    d.take()
    assert d("mlac:iteration_tokens_total_count") == 4  # the prompt's step, then a decode row per token
    assert d("mlac:iteration_tokens_total_sum") == 31 + 3


def test_outcomes_are_counted_when_requests_end(server):
    d = Delta(server)
    ok = [complete(server, max_tokens=4), complete(server, max_tokens=2, stream=True)]
    assert [r.status_code for r in ok] == [200, 200]
    vocab = server.state.loop.engine.tokenizer.vocab_size
    stopped = complete(server, max_tokens=8, stop_token_ids=list(range(vocab)))  # its first token stops it
    assert stopped.json()["choices"][0]["finish_reason"] == "stop"
    with pytest.raises(httpx.ReadTimeout):  # a client that gives up: its request is aborted
        complete(server, max_tokens=3000, timeout=0.5)
    wait_idle(server, timeout=20)
    d.take()
    assert d("mlac:request_success_total", finished_reason="length") == 2
    assert d("mlac:request_success_total", finished_reason="stop") == 1
    assert d("mlac:request_success_total", finished_reason="abort") == 1
    assert d("mlac:request_success_total", finished_reason="error") == 0
    assert d("mlac:generation_tokens_total") >= 4 + 2 + 1
    assert d("mlac:prompt_tokens_total") == 4 * 12  # the aborted request reached its first token too
    assert d("mlac:e2e_request_latency_seconds_count") == 4
    assert d("mlac:request_generation_tokens_sum") == d("mlac:generation_tokens_total")
    assert d("mlac:request_params_max_tokens_sum") == 4 + 2 + 8 + 3000


def test_a_failed_request_counts_as_error_not_as_success(server):
    wait_idle(server)
    sched, d = server.state.loop.scheduler, Delta(server)

    def boom():
        del sched.step  # fail once, then the scheduler's own step again
        raise RuntimeError("injected failure")

    sched.step = boom
    r = complete(server, max_tokens=4)
    assert r.status_code == 500, r.text
    wait_idle(server)
    d.take()
    assert d("mlac:request_success_total", finished_reason="error") == 1
    assert sum(d("mlac:request_success_total", finished_reason=x) for x in ("stop", "length", "abort")) == 0
    assert d("mlac:http_requests_total", route="/v1/completions", code="500") == 1
    assert d("mlac:http_requests_total", route="/v1/completions", code="200") == 0
    assert complete(server, max_tokens=2).status_code == 200  # the server keeps serving


# ---- logs -----------------------------------------------------------------------------------------


def stats_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("stats: ")]


async def _stream_all(url: str, n: int, max_tokens: int) -> None:
    body = {"model": MODEL, "prompt": "Tell me", "max_tokens": max_tokens, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=120) as c:
        await asyncio.gather(*(c.post(f"{url}/v1/completions", json=body) for _ in range(n)))


def test_the_stats_line_appears_while_busy_and_not_while_idle(server, caplog):
    wait_idle(server)
    time.sleep(3 * INTERVAL)  # the line of earlier tests' work is written by now
    with caplog.at_level(logging.INFO, logger="mlac.server"):
        caplog.clear()
        time.sleep(5 * INTERVAL)
        assert stats_lines(caplog) == []  # idle: nothing
        start = time.monotonic()
        asyncio.run(_stream_all(server.url, 4, 200))
        busy = time.monotonic() - start
        time.sleep(2 * INTERVAL)  # the interval in which the work ended gets its line
        lines = stats_lines(caplog)
        time.sleep(5 * INTERVAL)
        assert stats_lines(caplog) == lines  # idle again: nothing more
    assert 1 <= len(lines) <= busy / INTERVAL + 2, (busy, lines)
    pattern = (r"stats: prompt [\d,.]+ tok/s, generation [\d,.]+ tok/s, running \d+, waiting \d+, "
               r"KV cache [\d.]+%, prefix-cache hit rate [\d.]+%")  # fmt: skip
    assert all(re.fullmatch(pattern, line) for line in lines), lines
    generated = [float(re.search(r"generation ([\d,.]+)", x)[1].replace(",", "")) for x in lines]
    assert max(generated) > 0


def test_request_lines_at_arrival_and_end(server, caplog):
    wait_idle(server)
    with caplog.at_level(logging.INFO, logger="mlac.server"):
        r = complete(server, max_tokens=3, temperature=0.5, seed=7)
        named = httpx.post(f"{server.url}/v1/completions", headers={"X-Request-Id": "job-42"},
                           json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "n": 2, "ignore_eos": True})  # fmt: skip
        wait_idle(server)
    text = "\n".join(r.getMessage() for r in caplog.records if r.getMessage().startswith("request "))
    arrived = re.search(
        r"request ([0-9a-f]{32}): arrived, 12 prompt tokens, max_tokens=3 temperature=0.5 .*seed=7", text
    )
    assert arrived, text
    assert arrived[1] == r.headers["x-request-id"]  # the id the server gave the request
    assert f"request {arrived[1]}: finished (length), 12 prompt + 3 generated tokens, " in text
    assert named.headers["x-request-id"] == "job-42"  # the client's id, choice j of n named <id>-j
    for j in (0, 1):
        assert f"request job-42-{j}: arrived, 3 prompt tokens" in text
        assert f"request job-42-{j}: finished (length), 3 prompt + 2 generated tokens" in text


def test_logs_are_off_as_told(artifact, server, caplog):
    wait_idle(server)
    time.sleep(3 * INTERVAL)  # the module's server (it logs both) has written its last line
    cfg = ServerConfig.of(artifact=artifact("tiny-v3"), dtype="float32", verify=False, served_model_name=MODEL,
                       log_stats=False, log_stats_interval=INTERVAL)  # fmt: skip
    assert not cfg.log_requests  # --enable-log-requests is off by default
    with caplog.at_level(logging.INFO, logger="mlac.server"), ServerThread(cfg) as srv:
        asyncio.run(_stream_all(srv.url, 2, 100))
        time.sleep(3 * INTERVAL)
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if m.startswith(("stats: ", "request "))], messages


def test_stats_log_rates_and_timing(caplog):
    stats = StatsLog(10.0, now=100.0)
    assert not stats.pending and stats.due(104.0) == 6.0
    stats.resume(150.0)  # idle until 150: the interval starts there
    stats.count(prompt=300, generation=50, hits=40, queries=160)
    assert stats.pending and stats.due(155.0) == 5.0 and stats.due(170.0) == 0
    with caplog.at_level(logging.INFO, logger="mlac.server"):
        stats.write(160.0, Gauges(running=3, waiting=1, kv_usage=0.125))
    assert caplog.messages == [
        "stats: prompt 30.0 tok/s, generation 5.0 tok/s, running 3, waiting 1, KV cache 12.5%, "
        "prefix-cache hit rate 25.0%"
    ]
    assert not stats.pending and stats.due(160.0) == 10.0


def test_a_stats_interval_must_be_positive():
    with pytest.raises(MlacError, match="--log-stats-interval"):
        ServerConfig.of(artifact=Path("x"), log_stats_interval=0)


def test_log_level_gives_mlac_loggers_a_handler(capsys):
    root = logging.getLogger("mlac")
    handlers, level = root.handlers, root.level
    root.handlers = []
    try:
        log_to_stderr("debug")
        logging.getLogger("mlac.server").debug("a debug line")
        logging.getLogger("mlac.runtime").info("an info line")
    finally:
        root.handlers = handlers
        root.setLevel(level)
    err = capsys.readouterr().err
    assert "DEBUG:" in err and "a debug line" in err and "an info line" in err


# ---- docs/serving.md stays true -------------------------------------------------------------------


def test_every_serve_flag_is_documented():
    from mlac.cli.serve import serve

    text = DOC.read_text()
    flags = [o for p in serve.params if p.param_type_name == "option" for o in (*p.opts, *p.secondary_opts)]
    assert len(flags) > 30
    missing = [f for f in flags if f != "--help" and not re.search(re.escape(f) + r"(?![\w-])", text)]
    assert missing == []


def test_the_vllm_mapping_table_names_metrics_that_exist(server):
    rows = re.findall(r"^\| `vllm:([a-z_]+)` \| `mlac:([a-z_]+)` \|", DOC.read_text(), re.M)
    assert len(rows) >= 12
    assert all(v == m for v, m in rows if v not in ("time_per_output_token_seconds", "gpu_cache_usage_perc"))
    families = list(text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text))
    names = {f.name for f in families} | {s.name for f in families for s in f.samples}
    assert {f"mlac:{m}" for _, m in rows} - names == set()


def test_the_dashboard_queries_metrics_that_exist(server):
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    used = {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"mlac:\w+", e)}
    assert all('model_name="$model_name"' in e for e in exprs)
    families = list(text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text))
    names = {f.name for f in families} | {s.name for f in families for s in f.samples}
    assert len(used) >= 12 and used - names == set()
    assert {"mlac:spec_decode_num_drafts_total", "mlac:spec_decode_num_draft_tokens_total",
            "mlac:spec_decode_num_accepted_tokens_total", "mlac:triton_jit_compiles_total",
            "mlac:request_prefill_time_seconds", "mlac:request_decode_time_seconds"} <= used  # fmt: skip
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
