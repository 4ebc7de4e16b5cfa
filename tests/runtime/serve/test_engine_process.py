"""The engine in its own process (engine_process.py, serve/engine_client.py, serve/engine_child.py):
the pieces alone (metric ops, the outlet's one message per step, the server-side checks), then
ServerThread with `engine_process=True` end to end on CPU: the same answers as the engine thread,
metrics, 400s before acceptance, a failed step, a load failure, an engine process that dies.
(`mlac serve` runs this mode by default: tests/runtime/serve/test_server.py's subprocess tests cover it too.)"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from _paths import REPO
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from mlac.core.errors import MlacError
from mlac.runtime.engine.params import GrammarSpec, InvalidGrammar, SamplingParams
from mlac.runtime.engine.sequence import Delta
from mlac.runtime.engine.spec.decode import SpecStats
from mlac.runtime.serve import ServerConfig, ServerThread, load_engine
from mlac.runtime.serve.engine_child import PipeOutlet
from mlac.runtime.serve.engine_client import EngineClient, FrontEngine, Request
from mlac.runtime.serve.engine_errors import ShuttingDown, decode_error, encode_error
from mlac.runtime.serve.metrics import ENGINE_METRICS, Metrics, MetricsRecorder, replay

MODEL = "tiny"


def config(art: Path, **kw) -> ServerConfig:
    base = dict(artifact=art, dtype="float32", verify=False, served_model_name=MODEL, engine_process=True,
                drain_timeout=5.0)  # fmt: skip
    return ServerConfig.of(**{**base, **kw})


def samples(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {
        s.name + str(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def value(s: dict[str, float], name: str, **labels) -> float:
    return s[f"mlac:{name}" + str(sorted({"model_name": MODEL, **labels}.items()))]


def complete(url: str, **body) -> httpx.Response:
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


# ---- the pieces --------------------------------------------------------------------------------


def test_recorded_metric_ops_replay_into_the_servers_metrics():
    rec, metrics = MetricsRecorder(), Metrics(MODEL)
    rec.generation_tokens.inc(5)
    rec.running.set(3)
    rec.ttft.observe(0.5)
    rec.finished("length").inc()
    ops = rec.take()
    assert len(ops) == 4 and rec.take() == []
    rec.count_spec(SpecStats(verifies=2, drafted=6, accepted=4))
    rec.count_spec(SpecStats(verifies=3, drafted=9, accepted=5))  # cumulative: counted once
    ops += rec.take()
    replay(metrics, ops)
    text = metrics.render().decode()
    assert 'mlac:generation_tokens_total{model_name="tiny"} 5.0' in text
    assert 'mlac:num_requests_running{model_name="tiny"} 3.0' in text
    assert 'mlac:time_to_first_token_seconds_count{model_name="tiny"} 1.0' in text
    assert 'mlac:request_success_total{finished_reason="length",model_name="tiny"} 1.0' in text
    for name, n in (("num_drafts", 3), ("num_draft_tokens", 9), ("num_accepted_tokens", 5)):
        assert f'mlac:spec_decode_{name}_total{{model_name="tiny"}} {n}.0' in text


def test_the_recorder_has_every_metric_the_engine_side_updates():
    """The engine's loop updates the same attributes on Metrics (a server thread) and on a
    MetricsRecorder (the engine's process): one missing there kills the engine thread."""
    metrics = Metrics(MODEL)
    public = {
        k
        for k, v in vars(metrics).items()
        if not k.startswith("_") and isinstance(v, (Counter, Gauge, Histogram))
    }
    assert public == set(ENGINE_METRICS)
    rec = MetricsRecorder()
    assert all(hasattr(rec, name) for name in public)


class FakeChannel:
    def __init__(self):
        self.sent: list[tuple] = []

    def send(self, message: tuple) -> None:
        self.sent.append(message)


def test_the_outlet_sends_one_message_per_step_with_errors_as_data():
    channel, rec = FakeChannel(), MetricsRecorder()
    outlet = PipeOutlet(channel, rec)
    outlet.send()
    assert channel.sent == []  # nothing to say: nothing sent
    d1, d2 = (Delta(i, "x", [1], [], None, 3, 1) for i in (7, 8))
    outlet.post(7, d1)
    outlet.post(8, d2)
    outlet.post(9, ShuttingDown("bye"))
    outlet.end(9)
    rec.prompt_tokens.inc(3)
    outlet.send()
    assert channel.sent == [
        ("step", [(7, d1), (8, d2), (9, ("shutdown", "bye"))], [9], [("prompt_tokens", "inc", 3)])
    ]
    outlet.send()
    assert len(channel.sent) == 1


def test_errors_cross_as_the_same_kind():
    again = decode_error(*encode_error(ShuttingDown("draining")))
    assert isinstance(again, ShuttingDown) and str(again) == "draining"
    failed = decode_error(*encode_error(MlacError("engine step failed: x")))
    assert type(failed) is MlacError and str(failed) == "engine step failed: x"


def test_the_front_engine_checks_as_the_engine_does(art):
    from mlac.core.artifact import Manifest
    from mlac.runtime.serve.engine_client import load_tokenizer

    model = Manifest.load(art).model
    front = FrontEngine(load_tokenizer(config(art)), model, {"max_context": 64, "startup": {}})
    req = front.new_sequence("hello", SamplingParams(max_tokens=4))
    assert isinstance(req, Request) and req.prompt_ids == front.tokenizer.encode("hello")
    assert front.new_sequence([1, 2], SamplingParams()).seq_id == req.seq_id + 1
    with pytest.raises(MlacError, match="empty prompt"):
        front.new_sequence([], SamplingParams())
    with pytest.raises(MlacError, match=f"token id {model.vocab_size} out of range"):
        front.new_sequence([1, model.vocab_size], SamplingParams())
    with pytest.raises(MlacError, match="exceeds the context"):
        front.new_sequence([1] * 65, SamplingParams())
    with pytest.raises(InvalidGrammar):
        front.new_sequence([1], SamplingParams(grammar=GrammarSpec("json_schema", '{"type": "nope"}')))
    bare = FrontEngine(None, model, {"max_context": 64, "startup": {}})
    with pytest.raises(MlacError, match="stop strings need a tokenizer"):
        bare.new_sequence([1], SamplingParams(stop=("x",)))


# ---- end to end --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(art):
    with ServerThread(config(art)) as srv:
        yield srv


def test_the_engine_runs_in_another_process(server):
    loop = server.state.loop
    assert isinstance(loop, EngineClient) and loop.process.process.pid != os.getpid()
    assert loop.process.process.is_alive()
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["startup"]["max_context"] == loop.engine.max_context


def test_answers_are_the_engine_threads(server, art):
    bodies = [dict(stream=False), dict(n=2, logprobs=2), dict(prompt="hello there", stop=["zz"])]
    got = [complete(server.url, **b).json() for b in bodies]
    with ServerThread(config(art, engine_process=False)) as threaded:
        want = [complete(threaded.url, **b).json() for b in bodies]
    for g, w in zip(got, want, strict=True):
        assert g["choices"] == w["choices"] and g["usage"] == w["usage"]


def test_streams_and_metrics_come_through(server):
    before = samples(server.url)
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": [5, 6], "max_tokens": 5, "stream": True,
                            "ignore_eos": True}) as r:  # fmt: skip
        chunks = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "data: [DONE]" and len(chunks) >= 3
    after = samples(server.url)
    assert value(after, "generation_tokens_total") - value(before, "generation_tokens_total") == 5
    done = value(after, "request_success_total", finished_reason="length")
    assert done - value(before, "request_success_total", finished_reason="length") == 1
    assert value(after, "kv_cache_blocks") > 0
    assert server.state.loop.num_unfinished == 0


def test_bad_requests_are_400s_before_they_are_accepted(server):
    vocab = server.state.loop.engine.vocab_size
    r = complete(server.url, prompt=[1, vocab])
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"]
    r = complete(server.url, max_tokens=10**6)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                         "response_format": schema})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert server.state.loop.num_unfinished == 0


def slow_step_engine(cfg: ServerConfig, seconds: float):
    """An engine whose every step takes `seconds` more (picklable: it loads in the engine's process)."""
    engine = load_engine(cfg)
    run = engine.runner.run

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return run(*args, **kwargs)

    engine.runner.run = slow
    return engine


def test_a_full_queue_is_a_503(art):
    import functools

    cfg = config(art, max_queue=0, scheduler=_sched(1))
    with ServerThread(cfg, load=functools.partial(slow_step_engine, cfg, 0.05)) as srv:
        body = {"model": MODEL, "prompt": [5], "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=120) as first:
            assert first.status_code == 200
            next(first.iter_lines())  # running: 100 steps of 50 ms to go
            r = complete(srv.url)
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
        deadline = time.monotonic() + 30  # the first's client went away: cancelled
        while srv.state.loop.num_unfinished:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert complete(srv.url, max_tokens=2).status_code == 200


def _sched(max_running: int):
    from mlac.runtime.engine.scheduler import SchedulerConfig

    return SchedulerConfig(max_running_requests=max_running)


def failing_step_engine(cfg: ServerConfig):
    """An engine whose every step fails (runs in the engine's process: module level, picklable)."""
    engine = load_engine(cfg)

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    engine.runner.run = broken
    return engine


def test_a_failed_step_is_a_500_and_the_server_goes_on(art):
    import functools

    cfg = config(art)
    with ServerThread(cfg, load=functools.partial(failing_step_engine, cfg)) as srv:
        r = complete(srv.url)
        assert r.status_code == 500 and "engine step failed: boom" in r.json()["error"]["message"]
        assert httpx.get(f"{srv.url}/health").status_code == 200
        assert value(samples(srv.url), "request_success_total", finished_reason="error") == 1
        assert srv.state.loop.num_unfinished == 0


def failing_load():
    raise MlacError("no such model here")


def test_a_load_failure_stops_the_server_with_its_error(art):
    srv = ServerThread(config(art), load=failing_load)
    with pytest.raises(MlacError, match="loading failed: no such model here"):
        srv.start(timeout=120)
    assert isinstance(srv.state.loop.load_error, MlacError)
    assert not srv.state.loop.process.process.is_alive()


def test_an_engine_process_that_dies_fails_its_requests(art):
    with ServerThread(config(art)) as srv:
        loop = srv.state.loop
        loop.on_failure = (
            None  # the server would stop (tests/runtime/serve/test_engine_crash.py): kept up here
        )
        os.kill(loop.process.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while loop._refusing is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = complete(srv.url)
        assert r.status_code == 503 and "exited unexpectedly" in r.json()["error"]["message"]


def test_mlac_serve_runs_the_engine_in_a_child_that_logs_and_stops(art):
    """`mlac serve` (its default: the engine's own process) with --enable-log-requests: the
    start-up and request lines come from the engine's process; SIGTERM stops both processes."""
    import socket
    import subprocess
    import sys

    import psutil

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "mlac.cli", "serve", str(art), "--port", str(port), "--dtype", "float32",
           "--served-model-name", MODEL, "--enable-log-requests", "--no-verify"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        kids = psutil.Process(proc.pid).children()  # the engine's, and multiprocessing's resource tracker
        (child,) = [k for k in kids if "spawn_main" in " ".join(k.cmdline())]
        assert complete(url, max_tokens=3).json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    assert "ready in " in out and ": arrived, 3 prompt tokens, max_tokens=3" in out
    assert "finished (length), 3 prompt + 3 generated tokens" in out


def test_a_two_rank_artifact_runs_its_ranks_under_the_engine_process(art, tmp_path):
    """Rank 0 is the engine's process; it spawns rank 1 as it does on a thread. Same tokens as one
    rank; nothing outlives the server."""
    import psutil
    from _procs import spawned

    from mlac.compiler.pipeline import compile_checkpoint
    from mlac.core.artifact import CompileOptions
    from mlac.synth import synthesize

    ckpt = synthesize(tmp_path / "ckpt", preset="tiny-v2-lite", seed=0)
    tp2, tp1 = tmp_path / "tp2", tmp_path / "tp1"
    compile_checkpoint(ckpt, tp2, CompileOptions(tp=2, accuracy_check=False))
    compile_checkpoint(ckpt, tp1, CompileOptions(accuracy_check=False))

    before = spawned()
    with ServerThread(config(tp2, num_blocks=64)) as srv:
        engine_pid = srv.state.loop.process.process.pid
        ranks = [p for p in psutil.Process(engine_pid).children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(ranks) == 1  # rank 1
        got = complete(srv.url, max_tokens=4).json()["choices"]
    with ServerThread(config(tp1, num_blocks=64, engine_process=False)) as srv:
        want = complete(srv.url, max_tokens=4).json()["choices"]
    assert got == want
    deadline = time.monotonic() + 10
    while spawned() - before:
        assert time.monotonic() < deadline, "processes outlived the server"
        time.sleep(0.1)


def test_mlac_serve_stops_on_the_engine_processs_load_error(art):
    """A load that fails in the engine's process: `mlac serve` exits 1 with its one-line error."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "mlac.cli", "serve", str(art), "--port", str(port), "--dtype", "float32",
           "--max-model-len", "100000000", "--log-level", "error"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: --max-model-len 100000000: must be in 1..")
    assert sum("loading the model failed" in line for line in lines) == 1  # logged once, by the engine
    assert "Traceback" not in proc.stderr
