"""/health tells the truth within a second (heartbeat.py): an engine process that is frozen
(SIGSTOP) or a rank that is stopped turns it 503 until they run again; a rank that dies kills the
engine: /health 503, the streams in flight end with an error event and [DONE], and `mlac serve`
exits 1 instead of answering 500s forever.

CPU, float32: the tiny-v3 artifact, and tiny-v2-lite compiled for tp=2 (rank 1 is a process the
engine's process spawned). The engine runs in its own process, as `mlac serve` runs it.
"""

from __future__ import annotations

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
import psutil
import pytest
from _paths import REPO

from mlac.compiler.pipeline import compile_checkpoint
from mlac.core.artifact import CompileOptions
from mlac.runtime.serve import ServerConfig, ServerThread

MODEL = "tiny"
WITHIN_S = 1.0  # what /health promises


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, checkpoint) -> Path:
    out = tmp_path_factory.mktemp("tp2") / "tiny-v2-lite-tp2"
    compile_checkpoint(checkpoint("tiny-v2-lite"), out, CompileOptions(tp=2, accuracy_check=False))
    return out


def config(art: Path, **kw) -> ServerConfig:
    base = dict(artifact=art, dtype="float32", verify=False, served_model_name=MODEL, engine_process=True,
                drain_timeout=5.0, num_blocks=64)  # fmt: skip
    return ServerConfig.of(**{**base, **kw})


def health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=10)


def seconds_to_503(url: str, since: float, timeout: float = 10.0) -> tuple[float, dict]:
    """Poll /health until it answers 503: the seconds from `since`, and its body."""
    while time.monotonic() - since < timeout:
        r = health(url)
        if r.status_code == 503:
            return time.monotonic() - since, r.json()
        time.sleep(0.02)
    raise AssertionError(f"/health still {r.status_code} {timeout} s after")


def wait_ok(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while health(url).status_code != 200:
        assert time.monotonic() < deadline, health(url).text
        time.sleep(0.05)


def rank_1(engine_pid: int) -> psutil.Process:
    (rank,) = [p for p in psutil.Process(engine_pid).children() if "spawn_main" in " ".join(p.cmdline())]
    return rank


def names_the_kill(message: str) -> bool:
    """Seen by the heartbeat ("rank 1 exited ...") or by the step it broke ("rank 1 failed during
    a step: exited ...")."""
    return "rank 1 " in message and "exited unexpectedly (killed by SIGKILL)" in message


def complete(url: str, **body) -> httpx.Response:
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_a_frozen_engine_process_turns_health_503_until_it_runs_again(artifact):
    with ServerThread(config(artifact("tiny-v3"))) as srv:
        wait_ok(srv.url)
        pid = srv.state.loop.process.process.pid
        stopped = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            took, body = seconds_to_503(srv.url, stopped)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert took < WITHIN_S
        assert body["status"] == "unresponsive" and "the engine process has not answered for" in body["error"]
        wait_ok(srv.url, timeout=10)  # beats again: ok, and it serves
        assert complete(srv.url).status_code == 200


def test_a_stopped_rank_turns_health_503_and_a_dead_one_ends_the_streams_and_the_engine(tp2):
    with ServerThread(config(tp2)) as srv:
        wait_ok(srv.url)
        loop = srv.state.loop
        loop.on_failure = None  # the server would stop: kept up here to see what it answers
        rank = rank_1(loop.process.process.pid)

        stopped = time.monotonic()
        rank.send_signal(signal.SIGSTOP)
        try:
            took, body = seconds_to_503(srv.url, stopped)
        finally:
            rank.send_signal(signal.SIGCONT)
        assert took < WITHIN_S
        assert body == {
            "status": "unresponsive",
            "error": "rank 1 is stopped: it answers nothing until it runs again",
        }
        wait_ok(srv.url, timeout=10)
        assert complete(srv.url).status_code == 200

        events: list[str] = []
        body = {
            "model": MODEL,
            "prompt": [5],
            "max_tokens": 100_000 // 100,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            events += [next(lines) for _ in range(3)]  # streaming
            killed = time.monotonic()
            rank.kill()
            took, body = seconds_to_503(srv.url, killed)
            events += list(lines)
        assert (
            took < WITHIN_S and body["status"] in ("failed", "unresponsive") and names_the_kill(body["error"])
        )
        assert events[-1] == "data: [DONE]" and len(events) < 1000
        err = json.loads(events[-2].removeprefix("data: "))["error"]
        assert err["code"] == "engine_dead" and names_the_kill(err["message"])
        assert health(srv.url).json()["status"] == "failed"  # for good: no step runs again
        r = complete(srv.url)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_mlac_serve_exits_1_when_a_rank_dies(tp2):
    """`mlac serve` of a tp=2 artifact: SIGKILL rank 1 while idle. Within a second /health says 503
    (or the server is gone already); the server logs no traceback and exits 1 with one line."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "mlac.cli", "serve", str(tp2), "--port", str(port), "--dtype", "float32",
           "--served-model-name", MODEL, "--no-verify", "--num-blocks", "64", "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    out = ""
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                if health(url).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        (engine,) = [p for p in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]
        rank = rank_1(engine.pid)
        answers: list[int | str] = []
        poller = threading.Thread(target=poll_until_gone, args=(url, answers), daemon=True)
        killed = time.monotonic()
        rank.kill()
        poller.start()
        poller.join(WITHIN_S + 5)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    first_503 = next((t for t, a in answers if a == 503), None)
    gone = next((t for t, a in answers if a == "gone"), None)
    assert (first_503 or gone) is not None and min(t for t in (first_503, gone) if t) - killed < WITHIN_S, (
        answers
    )
    assert all(a in (200, 503, "gone") for _, a in answers) and proc.returncode == 1, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("error: the engine failed: ") and names_the_kill(last), out
    assert "Traceback" not in out


def poll_until_gone(url: str, answers: list) -> None:
    """(time, /health's status) every 20 ms, then (time, "gone") once the port is closed."""
    with httpx.Client(timeout=5) as client:
        while True:
            try:
                answers.append((time.monotonic(), client.get(f"{url}/health").status_code))
            except httpx.HTTPError:
                answers.append((time.monotonic(), "gone"))
                return
            time.sleep(0.02)
