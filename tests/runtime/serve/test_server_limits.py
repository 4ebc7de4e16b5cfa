"""The server against hostile clients: bodies it must refuse with an OpenAI-shaped 4xx (lone
surrogates in any encoding, deep nesting, too many arrays or items, strings for ints and bools, too
many prompts, messages or stop strings, an image content part, a schema that matches nothing), a
body that drips in over a raw socket (408, connection closed), and the drain timeout ending an open
stream with an error event and `data: [DONE]`. None of them may log a traceback.

Servers run in-process (ServerThread), CPU, float32, the tiny-v3 artifact.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from mlac.runtime.engine.scheduler import SchedulerConfig
from mlac.runtime.serve import ServerConfig, ServerThread
from mlac.runtime.serve.body import MAX_JSON_CONTAINERS, MAX_JSON_DEPTH, MAX_JSON_ITEMS
from mlac.runtime.serve.protocol import MAX_MESSAGES, MAX_STOP_CHARS, MAX_STOP_STRINGS

KEY = "sk-test"
MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_PROMPTS = 4 + 4  # max_running_requests + max_queue of the servers below


def config(art: Path, **kw) -> ServerConfig:
    base = dict(
        artifact=art,
        api_key=KEY,
        dtype="float32",
        verify=False,
        served_model_name=MODEL,
        max_body_bytes=1 << 20,
        drain_timeout=5.0,
        scheduler=SchedulerConfig(max_running_requests=4),
        max_queue=4,
    )
    return ServerConfig.of(**{**base, **kw})


@pytest.fixture(scope="module")
def server(art):
    with ServerThread(config(art, request_body_timeout=1.0)) as srv:
        yield srv


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def no_tracebacks():
    """Fails if the server logs an error or a traceback meanwhile. NOTE: attach it after the
    ServerThread is made: uvicorn's logging set-up removes the handlers of its loggers."""
    handler = _Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "mlac.server")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    bad = [r for r in handler.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, [r.getMessage() for r in bad]


def post_raw(srv: ServerThread, route: str, raw: bytes) -> httpx.Response:
    headers = {**AUTH, "Content-Type": "application/json"}
    return httpx.post(f"{srv.url}{route}", content=raw, headers=headers, timeout=60)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# ---- bodies refused with a 400 -------------------------------------------------------------------


def obj(*members: str) -> str:
    """A JSON object from raw members: what json.dumps cannot write (lone surrogates, deep nesting)."""
    return "{" + ", ".join(members) + "}"


M, P = '"model": "tiny"', '"prompt": "a"'
HI = '"messages": [{"role": "user", "content": "hi"}]'
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"

REFUSED = [
    ("lone surrogate in a prompt", CMPL, obj(M, r'"prompt": "a\ud800b"'), None),
    ("lone surrogate in chat", CHAT, obj(M, r'"messages": [{"role": "user", "content": "a\udfffb"}]'), None),
    ("lone surrogate in a key", CMPL, obj(M, P, r'"\ud800": 1'), None),
    ("nested 1,000 deep", CMPL, obj(M, P, f'"x": {nested(1000)}'), None),
    ("nested 100k deep", CMPL, obj(M, P, f'"x": {nested(10**5)}'), None),  # too many arrays, first
    ("300,000 empty arrays", CMPL, obj(M, f'"prompt": [{",".join(["[]"] * 300_000)}]'), None),  # 900 kB
    ("too many items", CMPL, obj(M, f'"prompt": [{",".join(["5"] * (MAX_JSON_ITEMS + 1))}]'), None),
    ("too many messages", CHAT, obj(M, f'"messages": {json.dumps([{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1))}'), "messages"),
    ("an image content part", CHAT, obj(M, '"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, '
                                           '{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]'),
     "messages[0].content[1].type"),
    ("a schema that matches nothing", CHAT, obj(M, HI, '"response_format": {"type": "json_schema", '
                                                      '"json_schema": {"name": "x", "schema": {"$ref": "#"}}}'), "response_format"),
    ("max_tokens as a string", CMPL, obj(M, P, '"max_tokens": "10"'), "max_tokens"),
    ("stream as a string", CMPL, obj(M, P, '"stream": "yes"'), "stream"),
    ("stream as an int", CHAT, obj(M, HI, '"stream": 1'), "stream"),
    ("too many stop strings", CMPL, obj(M, P, f'"stop": {json.dumps(["x"] * (MAX_STOP_STRINGS + 1))}'), "stop"),
    ("stop strings too long", CMPL, obj(M, P, f'"stop": {json.dumps(["y" * (MAX_STOP_CHARS // 2 + 1)] * 2)}'), "stop"),
    ("more prompts than can be queued", CMPL, obj(M, f'"prompt": {json.dumps([[5, 6]] * (MAX_PROMPTS + 1))}'), "prompt"),
]  # fmt: skip


@pytest.mark.parametrize("what, route, raw, param", REFUSED, ids=[r[0] for r in REFUSED])
def test_hostile_bodies_get_a_400_and_no_traceback(server, what, route, raw, param):
    with no_tracebacks():
        err = openai_error(post_raw(server, route, raw.encode()), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    if param == "prompt":
        assert f"at most {MAX_PROMPTS}" in err["message"] and "--max-queue" in err["message"]
    if what == "nested 1,000 deep":
        assert f"deeper than {MAX_JSON_DEPTH} levels" in err["message"]
    if what in ("nested 100k deep", "300,000 empty arrays"):
        assert err["message"].endswith(f"(arrays and objects); at most {MAX_JSON_CONTAINERS} are allowed")
    if what == "too many items":
        assert f"holds {MAX_JSON_ITEMS + 1} ','" in err["message"]
    if param == "messages[0].content[1].type":
        assert "'image_url' are not supported" in err["message"]
    if param == "response_format":
        assert "matches no output" in err["message"]
    ok = httpx.post(
        f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}, headers=AUTH
    )
    assert ok.status_code == 200  # and the server keeps serving


SURROGATE = json.dumps({"model": MODEL, "prompt": "a\ud800b", "max_tokens": 1}, ensure_ascii=False)
# utf-16 and utf-32 write a BOM, their -le and -be forms none
ENCODINGS = ["utf-8", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"]


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_lone_surrogate_is_a_400_in_any_encoding_and_valid_text_is_served(server, encoding):
    """json.loads detects UTF-16 and UTF-32 and lets an encoded lone surrogate through: the body is
    decoded strictly instead, and the same body without it is served."""
    with no_tracebacks():
        err = openai_error(post_raw(server, CMPL, SURROGATE.encode(encoding, "surrogatepass")), 400)
        assert err["message"].startswith(f"request body is not valid {encoding.upper()}: ")
        assert "\n" not in err["message"] and err["type"] == "invalid_request_error"
        valid = SURROGATE.replace("\ud800", "\u00e9").encode(encoding)
        assert post_raw(server, CMPL, valid).status_code == 200


def test_what_is_within_the_limits_is_served(server):
    body = {
        "model": MODEL,
        "prompt": [[5 + i, 6] for i in range(MAX_PROMPTS)],
        "max_tokens": 2,
        "stop": ["z" * (MAX_STOP_CHARS // MAX_STOP_STRINGS)] * MAX_STOP_STRINGS,
        "temperature": 0,  # an int where a float is expected is still fine
        "user": "é\U0001f600",  # valid non-ASCII text, astral plane included
        "metadata": json.loads(nested(MAX_JSON_DEPTH - 1)),  # an ignored field: the body is 64 deep
        "logit_bias": {},  # arrays and items, below the limits (an ignored, neutral field)
        "user_tags": [[]] * (MAX_JSON_CONTAINERS - 3 * MAX_PROMPTS - 200),
    }
    with no_tracebacks():
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == list(range(MAX_PROMPTS))


# ---- a body that drips in --------------------------------------------------------------------------


def test_a_dripping_body_gets_408_and_the_connection_closes(server):
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    with no_tracebacks(), socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(head.encode())
        t0 = time.monotonic()
        reply = b""
        s.settimeout(0.1)
        while b"\r\n\r\n" not in reply:  # one byte every 0.1 s: never done within the 1 s deadline
            assert time.monotonic() - t0 < 10, "no answer to a dripping body"
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                s.sendall(b" ")
                continue
            assert chunk, "closed without an answer"
            reply += chunk
        s.settimeout(10)
        while chunk := s.recv(65536):  # read to EOF: the server closes the connection
            reply += chunk
    elapsed = time.monotonic() - t0
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    err = json.loads(body)["error"]
    assert err["message"] == "request body not received within 1 s" and err["type"] == "invalid_request_error"
    assert 0.9 < elapsed < 8


# ---- the drain timeout ------------------------------------------------------------------------------


def test_drain_timeout_ends_open_streams_with_an_error_event_and_done(art):
    srv = ServerThread(config(art, drain_timeout=1.0)).start()
    long = {"model": MODEL, "prompt": "Go on", "max_tokens": 3000, "ignore_eos": True}
    events: list[str] = []
    answers: list[httpx.Response] = []

    def blocking() -> (
        None
    ):  # a non-streaming request cut by the drain timeout: a 503, not a dropped connection
        answers.append(httpx.post(f"{srv.url}/v1/completions", json=long, headers=AUTH, timeout=60))

    with no_tracebacks():
        waiter = threading.Thread(target=blocking)
        waiter.start()
        with httpx.stream(
            "POST", f"{srv.url}/v1/completions", json={**long, "stream": True}, headers=AUTH, timeout=60
        ) as r:
            lines = (line for line in r.iter_lines() if line)
            events += [next(lines) for _ in range(3)]  # streaming
            while srv.state.loop.num_unfinished < 2:  # and the other request running: now drain
                assert waiter.is_alive()
                time.sleep(0.01)
            stopper = threading.Thread(target=srv.stop)
            t0 = time.monotonic()
            stopper.start()
            events += list(lines)
        elapsed = time.monotonic() - t0
        stopper.join(60)
        waiter.join(60)
    assert 0.9 < elapsed < 5  # the drain timeout (1 s), not the 3000 tokens
    assert events[-1] == "data: [DONE]" and len(events) < 3000
    err = json.loads(events[-2].removeprefix("data: "))["error"]
    assert (err["type"], err["code"]) == ("server_error", "draining") and "drain timeout (1 s)" in err[
        "message"
    ]
    assert all("choices" in json.loads(e.removeprefix("data: ")) for e in events[:-2])
    assert openai_error(answers[0], 503)["code"] == "draining"
    assert not stopper.is_alive() and srv.state.loop.num_unfinished == 0
