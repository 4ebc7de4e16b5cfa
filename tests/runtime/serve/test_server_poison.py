"""One request can never fail the others, over HTTP: a request whose row fails inside the engine
(here: its sampling raises, injected by monkeypatching the sampler) gets its own error (a 500 in
OpenAI's shape; a stream: an error event, then [DONE]) while the innocent requests of the same
steps get their 200s and the tokens they get alone. Parameters at the edge of the accepted range
(temperature 1e-300 and 5e-324, top_k 10**20) are served.

A server in-process (ServerThread, the engine on its thread: the monkeypatch reaches it), CPU,
float32, the tiny-v3 artifact, steps slowed so that the requests share steps.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time

import httpx
import pytest
from test_server_limits import no_tracebacks, openai_error

from mlac.runtime.engine import sampling
from mlac.runtime.serve import ServerConfig, ServerThread, load_engine

MODEL = "tiny"
POISON_SEEDS = (666, 667)  # the poisoned requests: their rows raise from their third draw on
BOOM = "poisoned row"
TIMEOUT = 120


def slow_engine(cfg: ServerConfig, step_seconds: float):
    """The server's engine, each forward `step_seconds` slower (the requests pile into shared steps)."""
    engine = load_engine(cfg)
    run = engine.runner.run

    def slow(*args, **kwargs):
        time.sleep(step_seconds)
        return run(*args, **kwargs)

    engine.runner.run = slow
    return engine


@pytest.fixture(scope="module")
def server(art):
    cfg = ServerConfig.of(
        artifact=art, dtype="float32", verify=False, served_model_name=MODEL, drain_timeout=5.0
    )
    with ServerThread(cfg, load=functools.partial(slow_engine, cfg, 0.05)) as srv:
        yield srv


def poison(monkeypatch) -> list[int]:
    """sampling.sample raises for a call holding a poisoned row, from that row's third call on.
    Returns the number of rows of each call that raised."""
    raised, calls = [], dict.fromkeys(POISON_SEEDS, 0)
    sample = sampling.sample

    def patched(logits, params, generators):
        seeds = [p.seed for p in params if p.seed in calls]
        for s in seeds:
            calls[s] += 1
        if any(calls[s] > 2 for s in seeds):
            raised.append(len(params))
            raise RuntimeError(BOOM)
        return sample(logits, params, generators)

    monkeypatch.setattr(sampling, "sample", patched)
    return raised


def complete(url: str, prompt: list[int], **body) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "ignore_eos": True, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)


def stream(url: str, prompt: list[int], **body) -> list[str]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "ignore_eos": True, "temperature": 0,
            "stream": True, **body}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        return [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]


def test_a_poisoned_request_fails_alone_and_the_innocents_of_its_steps_succeed(
    server, ref, monkeypatch, caplog
):
    raised = poison(monkeypatch)
    innocent = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    sampled = dict(temperature=1.0)  # a poisoned row samples (its seed marks it)
    jobs = {
        **{f"innocent{i}": functools.partial(complete, server.url, p) for i, p in enumerate(innocent)},
        "innocent stream": functools.partial(stream, server.url, [14, 15]),
        "poison": functools.partial(complete, server.url, [20, 21], seed=POISON_SEEDS[0], **sampled),
        "poison stream": functools.partial(stream, server.url, [22, 23], seed=POISON_SEEDS[1], **sampled),
    }
    got: dict = {}
    threads = [threading.Thread(target=lambda k=k, f=f: got.__setitem__(k, f())) for k, f in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert max(raised) > 1  # a poisoned row raised in a step shared with other rows
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert [r.getMessage().split(" ", 2)[2] for r in logged] == [
        f"failed in the engine: RuntimeError: {BOOM}"
    ] * 2
    assert not any(r.exc_info for r in logged)  # one line each, no traceback

    for i, p in enumerate(innocent):
        r = got[f"innocent{i}"]
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref.generate(p, max_tokens=12, ignore_eos=True).text
    events = got["innocent stream"]
    assert events[-1] == "[DONE]" and all("choices" in json.loads(e) for e in events[:-1])
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == ref.generate([14, 15], max_tokens=12, ignore_eos=True).text

    err = openai_error(got["poison"], 500)
    assert (err["type"], err["code"]) == ("server_error", "engine_error")
    assert err["message"] == f"the request failed in the engine: RuntimeError: {BOOM}"
    events = got["poison stream"]
    assert events[-1] == "[DONE]"
    assert (
        json.loads(events[-2])["error"]["message"]
        == f"the request failed in the engine: RuntimeError: {BOOM}"
    )
    assert server.state.loop.engine is not None and server.state.loop.failure is None  # the engine lives on
    assert complete(server.url, [5, 6, 7]).status_code == 200


EDGES = [dict(temperature=1e-300), dict(temperature=5e-324), dict(temperature=1.0, top_k=10**20)]


@pytest.mark.parametrize("edge", EDGES, ids=["temperature=1e-300", "temperature=5e-324", "top_k=10**20"])
def test_edge_sampling_parameters_are_served(server, ref, edge):
    with no_tracebacks():
        r = complete(server.url, [5, 6, 7], max_tokens=4, **edge)
        chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=TIMEOUT, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **edge})  # fmt: skip
    assert r.status_code == 200 and chat.status_code == 200, (r.text, chat.text)
    assert r.json()["choices"][0]["finish_reason"] == "length"
    if edge["temperature"] < 1e-5:  # greedy
        assert r.json()["choices"][0]["text"] == ref.generate([5, 6, 7], max_tokens=4, ignore_eos=True).text
