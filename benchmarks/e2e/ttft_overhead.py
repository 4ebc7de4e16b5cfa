"""The fixed host and HTTP cost of one request's time to first token, on CPU with a tiny artifact.

    OMP_NUM_THREADS=1 python benchmarks/e2e/ttft_overhead.py --json out.json --label LABEL \
        [--artifact ART] [--requests 200] [--prompt-len 16] [--prefix-len 0] [--trace]

One request at a time, each a prompt of `--prompt-len` random token ids never sent before (every
one is a cold prefill of the same length) after `--prefix-len` ids that every prompt shares (the
prefix cache serves them from the second request on: cached requests, whose long prompts the
server handles per id), `max_tokens` 1, temperature 0:

1. in process: the same engine as the server's (serve.load_engine over the same ServerConfig), one
   Scheduler; per request the wall time of `new_sequence` + `add` + the steps until its token.
2. over HTTP: `mlac serve` in its own process (the engine in a process of its own, as in
   production), a raw-socket HTTP/1.1 client on one kept-alive connection: non-streaming
   /v1/completions (latency to the whole answer), then streaming (latency to the first SSE event
   that carries the token).

overhead_ms = HTTP TTFT p50 - in-process step p50: what the server adds to every request.

--trace runs the HTTP phase a second time with timestamps along the path (time.monotonic, one clock
for every process): this script serves as `mlac serve` itself (`--serve-traced`), wraps the server's
functions and, in the engine's process (which spawn starts by importing this script as
`__mp_main__`), the engine's; each process appends its stamps to a file. The breakdown is the p50
of each hop between consecutive stamps (STAMPS, in path order), and `fixed_p50_ms`, the p50 of
each traced request's TTFT less its own step (on a loaded machine the step time drifts between
phases, and the difference of two phases' p50s with it; this one does not).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRACE_ENV = "MLAC_TTFT_TRACE"  # the stamp file's prefix: a process appends to PREFIX.<pid>

# the path of one request, in order: (stamp, the hop that ends at it)
STAMPS = [
    ("client_send", ""),
    ("asgi_in", "client -> uvicorn -> ASGI app (HTTP parse)"),
    ("body_read", "FastAPI routing, auth dependency, body read + json.loads"),
    ("submit", "pydantic parse, tokenize + build Request (inline, or a worker thread), Submission"),
    ("child_add", "pickle + pipe to the engine process, its receiving thread"),
    ("step_start", "receiving thread -> engine thread (inbox), scheduler.add"),
    ("step_end", "scheduler.step (the model step: prefill + sample + detokenize)"),
    ("child_send", "deliver the Delta, metrics"),
    ("reader_got", "pickle + pipe -> the server's reader thread"),
    ("loop_got", "reader thread -> event loop (call_soon_threadsafe)"),
    ("body_out", "render the answer, JSON encode, Response"),
    ("client_recv", "uvicorn write -> client read"),
]


# ---- stamps (both server processes) ----------------------------------------------------------


class Stamps:
    """Appends `name time` lines to PREFIX.<pid> (line-buffered: a killed process keeps them)."""

    def __init__(self, prefix: str):
        self.file = open(f"{prefix}.{os.getpid()}", "a", buffering=1)  # noqa: SIM115  (lives with the process)

    def __call__(self, name: str) -> None:
        self.file.write(f"{name} {time.monotonic():.7f}\n")


def stamped(stamp: Stamps, name: str, fn, after: bool = False):
    """fn, stamping `name` when it is called (after=True: when it returns)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not after:
            stamp(name)
        out = fn(*args, **kwargs)
        if after:
            stamp(name)
        return out

    return wrapper


def stamped_async(stamp: Stamps, name: str, fn):
    """An async fn, stamping `name` when it returns."""

    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        out = await fn(*args, **kwargs)
        stamp(name)
        return out

    return wrapper


def trace_server(stamp: Stamps) -> None:
    """Wrap the server process's path: the ASGI app, body read, submit, the reader, the event loop."""
    from mlac.runtime.serve import app, engine_client, launch, loop

    make = launch.create_app

    def create_app(*args, **kwargs):
        return AsgiStamps(make(*args, **kwargs), stamp)

    launch.create_app = create_app
    app.read_body = stamped_async(stamp, "body_read", app.read_body)
    client = engine_client.EngineClient
    client.submit = stamped(stamp, "submit", client.submit)
    client._on_step = stamped(stamp, "reader_got", client._on_step)
    loop._put_all = stamped(stamp, "loop_got", loop._put_all)


class AsgiStamps:
    """An ASGI app around the FastAPI app: `asgi_in` when a POST arrives, `body_out` at its
    answer's first non-empty body; attribute access goes to the app (launch reads app.state)."""

    def __init__(self, app, stamp: Stamps):
        self.app, self.stamp = app, stamp

    def __getattr__(self, name: str):
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        self.stamp("asgi_in")
        first = [True]

        async def stamping_send(message):
            if first[0] and message["type"] == "http.response.body" and message.get("body"):
                first[0] = False
                self.stamp("body_out")
            await send(message)

        await self.app(scope, receive, stamping_send)


def trace_engine(stamp: Stamps) -> None:
    """Wrap the engine process's path: the received add, the scheduler's step, the send back."""
    from mlac.runtime.engine.scheduler import Scheduler
    from mlac.runtime.serve import engine_child

    engine_child._add = stamped(stamp, "child_add", engine_child._add)
    Scheduler.step = stamped(stamp, "step_start", Scheduler.step)
    Scheduler.step = stamped(stamp, "step_end", Scheduler.step, after=True)
    engine_child.Channel.send = stamped(stamp, "child_send", engine_child.Channel.send)


if __name__ == "__mp_main__" and os.environ.get(TRACE_ENV):  # the engine's process of --serve-traced
    trace_engine(Stamps(os.environ[TRACE_ENV]))


def serve_traced(argv: list[str]) -> None:
    """`mlac serve ARGV`, its path stamped (this process and, through __mp_main__, the engine's)."""
    from mlac.cli import main

    trace_server(Stamps(os.environ[TRACE_ENV]))
    main(["serve", *argv], prog_name="mlac")


# ---- the client ------------------------------------------------------------------------------


class Connection:
    """One kept-alive HTTP/1.1 connection over a raw socket (no client library in the timing)."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def post(self, path: str, body: dict) -> bytes:
        data = json.dumps(body).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        self.sock.sendall(head.encode() + data)
        return data

    def read_until(self, marker: bytes) -> bytes:
        """Bytes up to and including `marker` (the rest stays buffered)."""
        while marker not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("server closed the connection")
            self.buf += chunk
        i = self.buf.index(marker) + len(marker)
        out, self.buf = self.buf[:i], self.buf[i:]
        return out

    def read_response(self) -> bytes:
        """A whole non-streaming response (Content-Length); its body."""
        head = self.read_until(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head.decode(errors="replace"))
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        while len(self.buf) < length:
            self.buf += self.sock.recv(65536)
        body, self.buf = self.buf[:length], self.buf[length:]
        return body

    def close(self) -> None:
        self.sock.close()


def completion(prompt: list[int], stream: bool) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "stream": stream}  # fmt: skip


def http_ttft(port: int, prompts: list[list[int]], stream: bool, stamp=None) -> list[float]:
    """Seconds to the answer (stream: to its first token event) of each prompt, one at a time."""
    conn, out = Connection(port), []
    try:
        for p in prompts:
            t0 = time.monotonic()
            if stamp:
                stamp("client_send")
            conn.post("/v1/completions", completion(p, stream))
            if stream:
                conn.read_until(b'"logprobs": {')  # the first event that carries the token
            else:
                conn.read_response()
            if stamp:
                stamp("client_recv")
            out.append(time.monotonic() - t0)
            if stream:
                conn.read_until(b"data: [DONE]\n\n")
                conn.read_until(b"0\r\n\r\n")  # the chunked body's end
    finally:
        conn.close()
    return out


# ---- the phases ------------------------------------------------------------------------------


def server_config(art: Path):
    from mlac.runtime.serve import ServerConfig

    return ServerConfig.of(
        artifact=art, dtype="float32", verify=False, served_model_name="tiny", engine_process=True
    )


def in_process(art: Path, prompts: list[list[int]], warm: int) -> dict:
    """Per prompt: wall seconds of new_sequence + add + the steps to its token, the engine alone."""
    from mlac.runtime.engine.params import SamplingParams
    from mlac.runtime.serve import load_engine

    engine = load_engine(server_config(art))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=0)
    times = []
    try:
        sched = engine.scheduler()
        for p in prompts:
            t0 = time.monotonic()
            sched.add(engine.new_sequence(p, params))
            while sched.has_unfinished:
                sched.step()
            times.append(time.monotonic() - t0)
    finally:
        engine.close()
    return stats(times[warm:])


def stats(seconds: list[float]) -> dict:
    ms = sorted(1000 * s for s in seconds)
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 3), "mean_ms": round(statistics.fmean(ms), 3),
            "p10_ms": round(ms[len(ms) // 10], 3), "p90_ms": round(ms[9 * len(ms) // 10], 3)}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(art: Path, port: int, log: Path, trace: str | None) -> subprocess.Popen:
    """`mlac serve` (or this script's --serve-traced) on `port`, once /health is ok."""
    args = [str(art), "--port", str(port), "--device", "cpu", "--dtype", "float32", "--no-verify",
            "--log-level", "warning", "--drain-timeout", "2", "--served-model-name", "tiny"]  # fmt: skip
    env = dict(os.environ)
    if trace:
        cmd, env[TRACE_ENV] = [sys.executable, __file__, "--serve-traced", *args], trace
    else:
        cmd = [sys.executable, "-m", "mlac.cli", "serve", *args]
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return proc
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the server did not become healthy in 180 s")


def over_http(art: Path, prompts: list[list[int]], warm: int, tmp: Path, trace: str | None = None) -> dict:
    """Non-streaming, then streaming TTFT of `prompts` (halves: each prompt sent once)."""
    port = free_port()
    proc = start_server(art, port, tmp / "server.log", trace)
    stamp = Stamps(trace) if trace else None
    half = len(prompts) // 2
    try:
        whole = http_ttft(port, prompts[:half], stream=False, stamp=stamp)
        first = http_ttft(port, prompts[half:], stream=True)
    finally:
        proc.terminate()
        proc.wait(30)
    return {"non_streaming": stats(whole[warm:]), "streaming_first_token": stats(first[warm:])}


def breakdown(prefix: str) -> dict:
    """Per hop (STAMPS), the p50 ms over the traced requests (the first few dropped: warm-up)."""
    events = []
    for path in Path(prefix).parent.glob(Path(prefix).name + ".*"):
        for line in path.read_text().splitlines():
            name, t = line.split()
            events.append((float(t), name))
    events.sort()
    starts = [i for i, (_, name) in enumerate(events) if name == "client_send"]
    # the requests are sequential: each one's stamps are the first of each name along its path
    paths = [p for p in (along_path(events[i:]) for i in starts) if p is not None][5:]
    hops = {}
    for (a, _), (b, what) in zip(STAMPS, STAMPS[1:], strict=False):
        hops[f"{a} -> {b}: {what}"] = round(statistics.median(1000 * (r[b] - r[a]) for r in paths), 3)
    total = statistics.median(1000 * (r["client_recv"] - r["client_send"]) for r in paths)
    # per request, its TTFT less its own step: robust to a step time that drifts with the machine's load
    fixed = statistics.median(
        1000 * (r["client_recv"] - r["client_send"] - r["step_end"] + r["step_start"]) for r in paths
    )
    return {
        "requests": len(paths),
        "total_p50_ms": round(total, 3),
        "fixed_p50_ms": round(fixed, 3),
        "hops_p50_ms": hops,
    }


def along_path(events: list[tuple[float, str]]) -> dict[str, float] | None:
    """Each STAMPS name's first time at or after the one before it on the path (None: one is missing).
    Every stamp is taken when its step begins, so each follows the one before it in time."""
    out, i = {}, 0
    for name, _ in STAMPS:
        while i < len(events) and events[i][1] != name:
            i += 1
        if i == len(events):
            return None
        out[name] = events[i][0]
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True, help="result file; this run merges in under --label")
    ap.add_argument("--label", default="run")
    ap.add_argument("--artifact", type=Path, default=None, help="default: a tiny-v3 artifact built now")
    ap.add_argument("--requests", type=int, default=200, help="per phase (HTTP: half streaming)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=0, help="ids every prompt starts with (cached)")
    ap.add_argument("--warm", type=int, default=10, help="first requests of a phase not counted")
    ap.add_argument("--trace", action="store_true", help="also the per-hop breakdown (a second server)")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if os.environ.get("OMP_NUM_THREADS") != "1":
        print("note: set OMP_NUM_THREADS=1 (torch's threads starve the server's on few cores)", flush=True)
    sys.path.insert(0, str(HERE))
    from serve_overhead import tiny_artifact  # a sibling script

    with tempfile.TemporaryDirectory() as tmp:
        art = args.artifact or tiny_artifact(Path(tmp))
        vocab = json.loads((art / "manifest.json").read_text())["model"]["vocab_size"]
        rng = random.Random(0)
        shared = [rng.randrange(3, vocab) for _ in range(args.prefix_len)]
        prompts = [
            shared + [rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)
        ]
        step = in_process(art, prompts, args.warm)
        print(f"in process: {step}", flush=True)
        http = over_http(art, prompts, args.warm, Path(tmp))
        print(f"over HTTP: {http}", flush=True)
        result = {"requests": args.requests, "prompt_len": args.prompt_len, "prefix_len": args.prefix_len,
                  "cpus": os.cpu_count(),
                  "in_process_step": step, "over_http": http,
                  "overhead_ms_p50": {k: round(v["p50_ms"] - step["p50_ms"], 3) for k, v in http.items()}}  # fmt: skip
        if args.trace:
            prefix = str(Path(tmp) / "stamps")
            over_http(art, prompts, args.warm, Path(tmp), trace=prefix)
            result["trace"] = breakdown(prefix)
            print(json.dumps(result["trace"], indent=1), flush=True)
    data = json.loads(args.json.read_text()) if args.json.is_file() else {}
    data[args.label] = result
    args.json.write_text(json.dumps(data, indent=2) + "\n")
    print(f"{args.label}: overhead p50 {result['overhead_ms_p50']} ms -> {args.json}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve-traced"]:
        serve_traced(sys.argv[2:])
    else:
        main()
