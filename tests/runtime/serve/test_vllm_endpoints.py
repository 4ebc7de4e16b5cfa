"""vLLM's small routes and headers: /version, /ping, GET /v1/models/{id} (the openai client's
models.retrieve), and X-Request-Id on every answer (the client's kept, else a fresh one)."""

from __future__ import annotations

import httpx
import openai
import pytest

from mlac import __version__
from mlac.runtime.serve import ServerConfig, ServerThread
from mlac.runtime.serve.request_id import given_id

KEY, MODEL = "sk-test", "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(artifact):
    cfg = ServerConfig.of(artifact=artifact("tiny-v3"), api_key=KEY, dtype="float32", verify=False,
                          served_model_name=MODEL)  # fmt: skip
    with ServerThread(cfg) as srv:
        yield srv


def test_version_and_ping(server):
    assert httpx.get(f"{server.url}/version").json() == {"version": __version__}
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{server.url}/ping")
        assert (r.status_code, r.content) == (200, b"")


def test_ping_follows_health(server):
    server.state.draining = True
    try:
        r = httpx.get(f"{server.url}/ping")
        assert r.status_code == 503 and r.json()["status"] == "draining"
    finally:
        server.state.draining = False


def test_retrieve_a_model(server):
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    card = c.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "mlac")
    assert card.model_extra["max_model_len"] == server.state.loop.engine.max_context
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("another")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert httpx.get(f"{server.url}/v1/models/{MODEL}").status_code == 401  # keyed like /v1/models


def test_every_answer_carries_a_request_id(server):
    mine = httpx.post(f"{server.url}/v1/completions", headers={**AUTH, "X-Request-Id": "trace-7"},
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 2})  # fmt: skip
    assert mine.status_code == 200 and mine.headers["x-request-id"] == "trace-7"
    fresh = [httpx.get(f"{server.url}/health").headers["x-request-id"] for _ in range(2)]
    assert fresh[0] != fresh[1] and all(len(x) == 32 for x in fresh)
    errors = [
        httpx.post(
            f"{server.url}/v1/completions", headers={**AUTH, "X-Request-Id": "bad-1"}, json={"model": MODEL}
        ),
        httpx.get(f"{server.url}/nowhere", headers={"X-Request-Id": "bad-2"}),
        httpx.get(f"{server.url}/v1/models", headers={"X-Request-Id": "bad-3"}),  # 401
    ]
    assert [(r.status_code, r.headers["x-request-id"]) for r in errors] == [(400, "bad-1"), (404, "bad-2"),
                                                                            (401, "bad-3")]  # fmt: skip
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers={**AUTH, "X-Request-Id": "s-1"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                            "stream": True}) as r:  # fmt: skip
        assert r.headers["x-request-id"] == "s-1" and "[DONE]" in r.read().decode()


def test_only_a_usable_client_id_is_kept():
    assert given_id([(b"x-request-id", b"abc-1")]) == "abc-1"
    assert given_id([(b"X-Request-ID", b"abc")]) == "abc"
    assert given_id([(b"x-request-id", b"a b")]) is None  # not printable without spaces
    assert given_id([(b"x-request-id", b"x" * 257)]) is None
    assert given_id([(b"x-request-id", b"")]) is None and given_id([]) is None
