"""An engine that dies after it loaded (an exception escapes EngineLoop's loop, or the engine's process
is killed), on the engine thread and in the engine's own process: the requests in flight get their
error at once (500; a stream: an error event, then [DONE]), later ones a 503, /health says failed,
and the server stops (`mlac serve` exits 1; the engine's process exits 1)."""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from _paths import REPO

from mlac.core.errors import MlacError
from mlac.runtime.serve import ServerConfig, ServerThread, load_engine
from mlac.runtime.serve.engine_errors import EngineDead, decode_error, encode_error
from mlac.runtime.serve.loop import EngineLoop
from mlac.runtime.serve.metrics import MetricsRecorder

MODEL = "tiny"
BUG = "'NoneType' object is not subscriptable"  # a bug in the loop's metrics code, say
CLIENT_TIMEOUT = 20.0  # an answer within this is "at once" on a loaded CPU; a hang would be 300 s


def config(art: Path, engine_process: bool, **kw) -> ServerConfig:
    base = dict(artifact=art, dtype="float32", verify=False, served_model_name=MODEL,
                engine_process=engine_process, drain_timeout=5.0)  # fmt: skip
    return ServerConfig.of(**{**base, **kw})


class CrashingScheduler:
    """A scheduler whose `last_step_tokens`, which EngineLoop._step reads after `step()` returned
    (outside the try that turns a failed step into request errors), raises after `steps` steps."""

    def __init__(self, scheduler, steps: int):
        self._scheduler, self._left = scheduler, steps

    def __getattr__(self, name: str):
        return getattr(self._scheduler, name)

    @property
    def last_step_tokens(self) -> int:
        self._left -= 1
        if self._left < 0:
            raise TypeError(BUG)  # (an AttributeError here would fall back to __getattr__)
        return self._scheduler.last_step_tokens


def crashing_engine(cfg: ServerConfig, steps: int, step_seconds: float = 0.0):
    """An engine whose loop dies after `steps` steps, each `step_seconds` slower (picklable: it
    loads in the engine's process)."""
    engine = load_engine(cfg)
    scheduler, run = engine.scheduler, engine.runner.run

    def slow(*args, **kwargs):
        time.sleep(step_seconds)
        return run(*args, **kwargs)

    engine.scheduler = lambda: CrashingScheduler(scheduler(), steps)
    engine.runner.run = slow
    return engine


def complete(url: str, **body) -> httpx.Response:
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=CLIENT_TIMEOUT)


def stream_events(url: str, max_tokens: int) -> list[str]:
    """The `data:` payloads of one streamed completion."""
    body = {"model": MODEL, "prompt": [5], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=CLIENT_TIMEOUT) as r:
        assert r.status_code == 200
        return [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def server_stopped(srv: ServerThread) -> bool:
    return not srv._thread.is_alive()


# ---- the pieces --------------------------------------------------------------------------------


def test_a_dead_engine_crosses_the_pipe_as_itself():
    again = decode_error(*encode_error(EngineDead("the engine failed: x")))
    assert isinstance(again, EngineDead) and str(again) == "the engine failed: x"


class RecordingOutlet:
    """An Outlet that keeps what the loop posts and ends."""

    def __init__(self):
        self.posted: list[tuple] = []
        self.ended: list = []

    def post(self, sink, item) -> None:
        self.posted.append((sink, item))

    def end(self, sink) -> None:
        self.ended.append(sink)

    def send(self) -> None:
        pass


class BrokenAddEngine:
    """An engine whose scheduler's `add` raises what no step turns into a request error."""

    runner = SimpleNamespace(kv_pools=[])
    closed = False

    def scheduler(self):
        return SimpleNamespace(has_unfinished=False, add=self._add)

    def _add(self, seq) -> None:
        raise KeyError("no such block")

    def close(self) -> None:
        self.closed = True


def test_a_dead_loop_ends_every_request_it_took_even_those_not_yet_added():
    """Two requests in one submit: the first kills the loop as it is added, the second is still in
    the inbox; both end with EngineDead, the engine is closed, later submits are refused."""
    engine, outlet, died = BrokenAddEngine(), RecordingOutlet(), threading.Event()
    loop = EngineLoop(lambda: engine, MetricsRecorder(), 8, stats_interval=None, outlet=outlet)
    loop.on_failure = died.set
    loop.start()
    wait_for(lambda: loop.ready)
    loop.submit([SimpleNamespace(seq_id=0), SimpleNamespace(seq_id=1)], ["a", "b"])
    assert died.wait(CLIENT_TIMEOUT)
    assert [sink for sink, _ in outlet.posted] == ["a", "b"] and outlet.ended == ["a", "b"]
    assert all(isinstance(e, EngineDead) and "KeyError" in str(e) for _, e in outlet.posted)
    assert engine.closed and loop.num_unfinished == 0 and loop.failure is outlet.posted[0][1]
    with pytest.raises(EngineDead, match="the engine failed: KeyError"):
        loop.submit([SimpleNamespace(seq_id=2)], ["c"])
    loop.stop()


# ---- end to end, both modes --------------------------------------------------------------------


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
def test_a_dead_engine_ends_its_stream_refuses_requests_and_fails_health(art, engine_process):
    cfg = config(art, engine_process)
    with ServerThread(cfg, load=functools.partial(crashing_engine, cfg, 3)) as srv:
        loop = srv.state.loop
        loop.on_failure = None  # the server would stop: kept up here to see what it answers meanwhile
        events = stream_events(srv.url, max_tokens=50)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_dead" and f"TypeError: {BUG}" in error["message"]
        assert len(events) < 50  # cut short: some tokens, then the error

        r = complete(srv.url)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        # the refusal above can reach the server before the engine's "dead" message (engine_child.run:
        # a request added while the engine thread dies): /health says failed once that arrives
        wait_for(lambda: httpx.get(f"{srv.url}/health", timeout=CLIENT_TIMEOUT).json()["status"] == "failed",
                 timeout=CLIENT_TIMEOUT)  # fmt: skip
        health = httpx.get(f"{srv.url}/health", timeout=CLIENT_TIMEOUT)
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert BUG in health.json()["error"]
        assert loop.num_unfinished == 0
        if engine_process:  # told to stop by the server, it exits 1 (its engine thread joined within 30 s)
            # NOTE: not process.join here: the client's reader thread joins it too, and of two threads
            # that join one process, the one whose waitpid loses (ECHILD) returns at once with None
            wait_for(lambda: not loop.process.process.is_alive(), timeout=60)
            assert loop.process.process.exitcode == 1


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
def test_a_dead_engine_answers_its_request_and_stops_the_server(art, engine_process):
    cfg = config(art, engine_process)
    with ServerThread(cfg, load=functools.partial(crashing_engine, cfg, 2)) as srv:
        r = complete(srv.url, max_tokens=20)
        assert r.status_code == 500, r.text
        assert r.json()["error"]["code"] == "engine_dead" and BUG in r.json()["error"]["message"]
        wait_for(lambda: server_stopped(srv))
        assert isinstance(srv.state.loop.failure, EngineDead)
        if engine_process:
            wait_for(lambda: not srv.state.loop.process.process.is_alive())
            assert srv.state.loop.process.process.exitcode == 1


def test_a_killed_engine_process_answers_its_request_and_stops_the_server(art):
    cfg = config(art, True)
    load = functools.partial(crashing_engine, cfg, 10**9, 0.05)  # never crashes; slow steps
    with ServerThread(cfg, load=load) as srv:
        loop = srv.state.loop
        body = {"model": MODEL, "prompt": [5], "max_tokens": 200, "ignore_eos": True}
        kill = threading.Timer(1.0, os.kill, args=(loop.process.process.pid, signal.SIGKILL))
        kill.start()  # mid-request: 200 steps of 50 ms
        sent = time.monotonic()
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=CLIENT_TIMEOUT)
        kill.join()
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead"
        assert "exited unexpectedly (exit code -9)" in r.json()["error"]["message"]
        assert time.monotonic() - sent < 9  # the kill at 1 s; not the 10 s of the whole request
        assert "exit code -9" in str(srv.state.loop.failure)
        wait_for(lambda: server_stopped(srv))


def test_mlac_serve_raises_the_engines_failure(art, monkeypatch):
    """serve() (what `mlac serve` runs; its MlacError is `error: ...` and exit code 1) on an
    engine thread that dies: the request in flight is answered, then serve raises EngineDead."""
    import socket

    import mlac.runtime.serve.launch as launch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = config(art, False, port=port)
    monkeypatch.setattr(launch, "load_engine", functools.partial(crashing_engine, steps=1))
    answers: list[httpx.Response] = []

    def client() -> None:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    answers.append(complete(url))
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    with pytest.raises(MlacError, match=f"the engine failed: TypeError: {BUG}") as raised:
        launch.serve(cfg, "warning")
    thread.join(CLIENT_TIMEOUT)
    assert isinstance(raised.value, EngineDead)
    assert answers and answers[0].status_code == 500


def test_mlac_serve_exits_1_when_its_engine_process_is_killed(art):
    """`mlac serve` (the engine in its own process): SIGKILL the engine's process; the server logs
    one error line and exits 1 with `error: the engine failed: ...`."""
    import socket
    import subprocess
    import sys

    import psutil

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "mlac.cli", "serve", str(art), "--port", str(port), "--dtype", "float32",
           "--served-model-name", MODEL, "--no-verify", "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert proc.poll() is None
            try:
                return httpx.get(f"{url}/health").status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout=120)
        (child,) = [k for k in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(k.cmdline())]
        child.kill()
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, out
    lines = out.strip().splitlines()
    assert lines[-1] == "error: the engine failed: its process exited unexpectedly (exit code -9)", out
    assert sum("the engine failed" in line for line in lines) == 2  # the log line and the exit's
