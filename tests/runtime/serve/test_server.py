"""The OpenAI-compatible server (mlac/runtime/serve/) driven over HTTP: the official `openai` client, raw
httpx for malformed requests and disconnects, Prometheus metrics, and `mlac serve` / `mlac demo`
as subprocess / CLI.

Servers run in-process (ServerThread: the same uvicorn server `mlac serve` runs) on a free port,
CPU, float32, the tiny-v3 artifact.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import mlac
from mlac.runtime.engine.engine import Engine
from mlac.runtime.serve import ServerConfig, ServerThread, load_engine

KEY = "sk-test"
MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}


def config(art: Path, **kw) -> ServerConfig:
    base = dict(
        artifact=art,
        api_key=KEY,
        dtype="float32",
        verify=False,
        served_model_name=MODEL,
        max_body_bytes=1 << 16,
        drain_timeout=5.0,
    )
    return ServerConfig.of(**{**base, **kw})


@pytest.fixture(scope="module")
def server(art):
    with ServerThread(config(art)) as srv:
        yield srv


def client(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def wait_idle(srv: ServerThread, timeout: float = 30.0) -> None:
    """Until no request is queued or running (the engine frees blocks at its next step)."""
    deadline = time.monotonic() + timeout
    while srv.state.loop.num_unfinished or srv.state.loop.scheduler.has_unfinished:
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.02)


def all_free(srv: ServerThread) -> bool:
    engine = srv.state.loop.engine
    return engine.pool.allocator.num_free == engine.cache.num_blocks


def metrics(srv: ServerThread) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of /metrics, parsed by prometheus_client."""
    text = httpx.get(f"{srv.url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def chat_ids(ref: Engine, content: str) -> list[int]:
    return ref.tokenizer.encode_chat([{"role": "user", "content": content}])


# ---- the API through the openai client ----------------------------------------------------------


def test_chat_and_completions_with_the_openai_client(server, ref):
    c = client(server)
    assert [m.id for m in c.models.list().data] == [MODEL]

    msg = "What is the capital of France?"
    want = ref.generate(chat_ids(ref, msg), max_tokens=6, ignore_eos=True)
    r = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": msg}],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(chat_ids(ref, msg)),
        6,
        len(chat_ids(ref, msg)) + 6,
    )

    prompt = "The morning train left the station"
    want = ref.generate(prompt, max_tokens=5, ignore_eos=True)
    r = c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion" and r.choices[0].text == want.text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want.prompt_tokens, 5)


def test_streaming_chat_and_completions(server, ref):
    c = client(server)
    msg = [{"role": "user", "content": "Tell me a story"}]
    want = ref.generate(chat_ids(ref, msg[0]["content"]), max_tokens=8, ignore_eos=True)
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=msg,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == want.prompt_tokens

    want = ref.generate("Once upon a time", max_tokens=7, ignore_eos=True)
    chunks = list(
        c.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=7,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sse_ends_with_done(server):
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")


def test_logprobs_stop_and_seed(server, ref):
    c = client(server)
    r = c.completions.create(
        model=MODEL,
        prompt="Numbers:",
        max_tokens=4,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    r = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and len(content[0].top_logprobs) == 3

    full = ref.generate("A long road", max_tokens=16, ignore_eos=True).text
    stop = full[5:8]
    r = c.completions.create(
        model=MODEL,
        prompt="A long road",
        max_tokens=16,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == full[: full.find(stop)] and r.choices[0].finish_reason == "stop"

    def sampled(seed):
        return (
            c.completions.create(
                model=MODEL,
                prompt="Dice",
                max_tokens=8,
                temperature=1.0,
                seed=seed,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    assert sampled(3) == sampled(3) != sampled(4)


# ---- concurrency, cancellation, preemption ---------------------------------------------------------


async def stream_all(url: str, requests: list[dict]) -> list[tuple[str, str | None]]:
    """Run streaming completions concurrently; (text, finish_reason) of each."""
    c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)

    async def one(req: dict) -> tuple[str, str | None]:
        text, finish = "", None
        async for ch in await c.completions.create(model=MODEL, stream=True, temperature=0, **req):
            text += ch.choices[0].text
            finish = ch.choices[0].finish_reason or finish
        return text, finish

    try:
        return await asyncio.gather(*(one(r) for r in requests))
    finally:
        await c.close()


def test_32_concurrent_streams_complete_and_free_every_block(server, ref):
    before = metrics(server)
    reqs = [
        {
            "prompt": list(range(9 + i, 9 + 2 * i + 2)),
            "max_tokens": 2 + i % 7,
            "extra_body": {"ignore_eos": True},
        }
        for i in range(32)
    ]
    got = asyncio.run(stream_all(server.url, reqs))
    want = ref.generate(
        [r["prompt"] for r in reqs],
        [mlac.SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs],
    )
    assert got == [(w.text, "length") for w in want]
    wait_idle(server)
    assert all_free(server)

    after = metrics(server)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    m = {"model_name": MODEL}
    assert delta("mlac:http_requests_total", route="/v1/completions", code="200", **m) == 32
    assert delta("mlac:prompt_tokens_total", **m) == sum(len(r["prompt"]) for r in reqs)
    assert delta("mlac:generation_tokens_total", **m) == sum(r["max_tokens"] for r in reqs)
    assert delta("mlac:request_success_total", finished_reason="length", **m) == 32
    assert delta("mlac:time_to_first_token_seconds_count", **m) == 32
    assert delta("mlac:inter_token_latency_seconds_count", **m) == sum(r["max_tokens"] - 1 for r in reqs)
    assert delta("mlac:e2e_request_latency_seconds_count", **m) == 32
    assert delta("mlac:request_queue_time_seconds_count", **m) == 32
    labels = (("model_name", MODEL),)
    assert after[("mlac:num_requests_running", labels)] == after[("mlac:num_requests_waiting", labels)] == 0
    assert after[("mlac:kv_cache_usage_perc", labels)] == 0


def test_a_client_that_disconnects_frees_its_blocks(server):
    before = metrics(server)
    body = {"model": MODEL, "prompt": "Go on and on", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few events, then hang up mid-stream
    assert any(line.startswith("data: ") for line in got)
    # a non-streaming request whose client gives up
    body = {"model": MODEL, "prompt": "Wait for me", "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=0.5)
    wait_idle(server, timeout=20)  # 3000 tokens would take far longer than this
    assert all_free(server)
    after = metrics(server)
    key = ("mlac:request_success_total", (("finished_reason", "abort"), ("model_name", MODEL)))
    assert after[key] - before.get(key, 0) == 2


def test_preemption_in_a_small_pool_changes_no_output(art, ref):
    # each request needs 4..6 blocks of 16 tokens; the pool holds 10
    reqs = [
        {"prompt": list(range(20 + i, 44 + 4 * i)), "max_tokens": 24, "extra_body": {"ignore_eos": True}}
        for i in range(12)
    ]
    with ServerThread(config(art, num_blocks=10)) as srv:
        got = asyncio.run(stream_all(srv.url, reqs))
        wait_idle(srv)
        assert all_free(srv)
        preempted = metrics(srv)[("mlac:num_preemptions_total", (("model_name", MODEL),))]
    want = [ref.generate(r["prompt"], max_tokens=24, ignore_eos=True).text for r in reqs]
    assert preempted > 0
    assert got == [(w, "length") for w in want]


# ---- errors ---------------------------------------------------------------------------------------


BAD = [
    ("bad json", "/v1/completions", b'{"model": "tiny", "prompt": ', AUTH, 400, None, None),
    ("not an object", "/v1/completions", b"[1, 2]", AUTH, 400, None, None),
    (
        "unknown model",
        "/v1/completions",
        {"model": "gpt-4", "prompt": "hi"},
        AUTH,
        404,
        "model",
        "model_not_found",
    ),
    (
        "negative max_tokens",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": -1},
        AUTH,
        400,
        "max_tokens",
        None,
    ),
    (
        "temperature out of range",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 2.5},
        AUTH,
        400,
        "temperature",
        None,
    ),
    ("top_p zero", "/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, AUTH, 400, "top_p", None),
    (
        "min_p out of range",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "min_p": 3},
        AUTH,
        400,
        "min_p",
        None,
    ),
    ("n > 16", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 17}, AUTH, 400, "n", None),
    (
        "prompt too long",
        "/v1/completions",
        {"model": MODEL, "prompt": [5] * 4090, "max_tokens": 16},
        AUTH,
        400,
        "prompt",
        "context_length_exceeded",
    ),
    ("token out of range", "/v1/completions", {"model": MODEL, "prompt": [5, 10**6]}, AUTH, 400, None, None),
    ("no messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, AUTH, 400, "messages", None),
    (
        "bad role",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
        AUTH,
        400,
        "messages.0.role",
        None,
    ),
    ("missing key", "/v1/completions", {"model": MODEL, "prompt": "hi"}, {}, 401, None, "invalid_api_key"),
    ("wrong key", "/v1/models", None, {"Authorization": "Bearer nope"}, 401, None, "invalid_api_key"),
    ("body too large", "/v1/completions", {"model": MODEL, "prompt": "x" * 70000}, AUTH, 413, None, None),
    ("unknown route", "/v1/engines", None, AUTH, 404, None, "not_found"),
]


@pytest.mark.parametrize("what, route, body, headers, status, param, code", BAD, ids=[b[0] for b in BAD])
def test_malformed_requests_get_openai_errors(server, what, route, body, headers, status, param, code):
    url = f"{server.url}{route}"
    if body is None:
        r = httpx.get(url, headers=headers)
    elif isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={**headers, "Content-Type": "application/json"})
    else:
        r = httpx.post(url, json=body, headers=headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["param"], err["code"]) == (param, code)
    ok = httpx.post(
        f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}, headers=AUTH
    )
    assert ok.status_code == 200  # and the server keeps serving


def test_openai_client_sees_typed_errors(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.completions.create(model=MODEL, prompt="hi", temperature=-1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_queue_full_is_503(art):
    from mlac.runtime.engine.scheduler import SchedulerConfig

    cfg = config(art, scheduler=SchedulerConfig(max_running_requests=1), max_queue=0)
    with ServerThread(cfg) as srv:
        body = {"model": MODEL, "prompt": "hold", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            lines = r.iter_lines()  # NOTE: keep it referenced: a dropped iterator closes the stream
            next(lines)  # running: the queue is now full
            busy = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=AUTH)
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "queue_full"
        wait_idle(srv)


# ---- health, start-up, shutdown -----------------------------------------------------------------


def test_health_is_503_until_the_model_is_loaded(art):
    gate = threading.Event()
    cfg = config(art)

    def slow_load():
        gate.wait(60)
        return load_engine(cfg)

    srv = ServerThread(cfg, load=slow_load).start(wait_ready=False)
    try:
        r = httpx.get(f"{srv.url}/health")
        assert (r.status_code, r.json()["status"]) == (503, "loading")
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers=AUTH)
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        gate.set()
        deadline = time.monotonic() + 60
        while httpx.get(f"{srv.url}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert httpx.get(f"{srv.url}/health").json()["status"] == "ok"
    finally:
        gate.set()
        srv.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mlac_serve_drains_on_sigterm(art):
    """`mlac serve` as a subprocess: SIGTERM lets a short request finish, ends a long one at
    --drain-timeout with an error event and [DONE], refuses new connections, and exits 0."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(mlac.__file__).parents[1]), "MLAC_API_KEY": KEY}
    cmd = [
        sys.executable,
        "-m",
        "mlac.cli",
        "serve",
        str(art),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--served-model-name",
        MODEL,
        "--drain-timeout",
        "4",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        assert (
            c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            ).usage.completion_tokens
            <= 2
        )

        results: dict[str, tuple] = {}

        def stream(name: str, max_tokens: int) -> None:
            body = {
                "model": MODEL,
                "prompt": "Count",
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
            }
            events = []
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
                    for line in r.iter_lines():
                        if line:
                            events.append(line)
            except httpx.TransportError:
                pass
            results[name] = tuple(events)

        threads = [threading.Thread(target=stream, args=a) for a in (("short", 40), ("long", 4000))]
        for t in threads:
            t.start()
        time.sleep(1.0)  # both running
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        for t in threads:
            t.join(60)
        assert proc.wait(60) == 0
        assert time.monotonic() - t0 < 30  # bounded by --drain-timeout (4 s), not by the long request
        short = results["short"]
        assert (
            short[-1] == "data: [DONE]"
            and json.loads(short[-2][6:])["choices"][0]["finish_reason"] == "length"
        )
        # the long one is cut at --drain-timeout, far from its 4000 tokens: an error event, then [DONE]
        long = results["long"]
        assert long[-1] == "data: [DONE]" and len(long) < 4000
        err = json.loads(long[-2][6:])["error"]
        assert (err["code"], err["type"]) == ("draining", "server_error")
        assert "drain timeout" in err["message"]
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_refuses_a_bad_artifact(tmp_path):
    from click.testing import CliRunner

    from mlac.cli import main

    r = CliRunner().invoke(main, ["serve", str(tmp_path / "missing")])
    assert r.exit_code == 1 and r.output.startswith("error: ")


@pytest.mark.parametrize("tp", [1, 2])
def test_demo_end_to_end(tmp_path, tp):
    from click.testing import CliRunner

    from mlac.cli import main

    r = CliRunner().invoke(main, ["demo", "--tp", str(tp), "--work", str(tmp_path), "--max-tokens", "3"])
    assert r.exit_code == 0, r.output
    assert "assistant:" in r.output and "timings: compile" in r.output and "load to ready" in r.output
    call = next(x for x in r.output.splitlines() if x.startswith("forced tool call"))
    assert call.startswith('forced tool call (tool_choice get_weather): get_weather({"city": "')
