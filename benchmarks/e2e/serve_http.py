"""`mlac serve` measured over HTTP: start-up, decode tokens/s at batch B, peak output throughput.

    python benchmarks/e2e/serve_http.py ART --device cuda --json serve.json \
        [--batches 1,32,256 --prompt-len 64 --max-tokens 64] \
        [--peak-requests 1024 --peak-prompt-len 128 --peak-max-tokens 128 --peak-concurrency 0] \
        [--budget-s 200] [--serve-args "--kv-cache-bytes 17179869184"]

The ceiling of the decode rates is the same artifact in process (`mlac bench`, which reports its
fraction of the bandwidth roofline): over HTTP a server should add little to it. The start-up's
floor is the load phase alone (load.py) plus the imports. The end-to-end yardstick
(yardstick.sh) runs this script on a prepared artifact.

Phases, each written into the JSON as soon as it ends (a kill leaves what was measured):

1. start-up: `python -m mlac.cli serve ART` starts in a process group of its own (log: --log);
   seconds from Popen to the first answer of GET /health (port open) and to its first 200
   (model loaded: files hashed, every rank up). Polled every 50 ms.
2. warm-up: each batch once with a few tokens (Triton compiles its kernels on first use).
3. decode at batch B: B concurrent streaming /v1/completions, each a prompt of `--prompt-len`
   random token ids, `max_tokens` tokens, ignore_eos, temperature 0. The arrival of every
   streamed token is timed. decode_tokens_per_s = tokens received in [the last request's first
   token, the first request's last token] / that window: all B requests are decoding then.
   Also: output tokens / wall time, TTFT and inter-token latency p50 / p99.
4. peak: `--peak-requests` requests sent at once (or at most `--peak-concurrency` in flight);
   output tokens/s = completion tokens / wall time, requests/s.

Every request must end with finish_reason "length" and exactly max_tokens tokens; failures are
listed under "errors". Requests ask for `logprobs: 0`: the stream then carries one entry per
token, so every token is seen as it arrives (a synthetic checkpoint's tokenizer decodes most ids
to no text, and a chunk is sent only for new text otherwise). The requests are shared by
`--client-procs` client processes (one Python process parses only a few thousand chunks a
second). Server-side counters from /metrics (generated tokens, preemptions) and the busiest
client process's CPU use are recorded per phase: a client near 1.0 CPU is measuring itself.

The artifact may be an oci:// reference: the server then pulls it inside its start-up (the
`startup` phase includes the pull; the server's log line gives its GB/s).

The server always stops at the end (SIGTERM: it drains and stops its ranks; SIGKILL to its
process group after 15 s), also on an error or a SIGTERM to this script; `--pgid-file` names the
group for a caller that has to SIGKILL this script. The server log's tail goes into the JSON.

On CPU (`--device cpu`, a tiny artifact, small sizes) it checks itself; on a machine of few
cores set OMP_NUM_THREADS=1 (torch's threads and the server's starve each other: 50x slower).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import multiprocessing
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import httpx

CLEANUP_S = 20.0  # kept back from --budget-s for stopping the server and writing the JSON


# ---- the result file ----------------------------------------------------------------------------


class Record:
    """The JSON result, rewritten whole (atomically) after every change."""

    def __init__(self, path: Path, data: dict):
        self.path, self.data = path, data
        self.save()

    def set(self, key: str, value) -> None:
        self.data[key] = value
        self.save()

    def error(self, msg: str) -> None:
        print(f"error: {msg}", flush=True)
        self.data["errors"].append(msg)
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2) + "\n")
        os.replace(tmp, self.path)


def environment(device: str) -> dict:
    """Machine and versions, without importing torch (this process must not touch the GPU)."""
    gpus: list[str] = []
    if device.startswith("cuda"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30).stdout  # fmt: skip
            gpus = [line.strip() for line in out.splitlines() if line.strip()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    versions = {"python": platform.python_version()}
    for pkg in ("mlac", "torch", "triton", "fastapi", "uvicorn", "httpx", "uvloop"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[pkg] = importlib.metadata.version(pkg)
    return {
        "device": gpus[0].split(",")[0] if gpus else platform.processor() or platform.machine(),
        "gpus": gpus,
        "cuda_visible_devices": visible,
        "cpus": os.cpu_count(),
        "versions": versions,
    }


def artifact_info(path: str) -> dict:
    """The artifact's shape, from its folder, or (oci://...) from the registry's copy of its manifest
    (no weight is downloaded: the server pulls them, inside its start-up)."""
    from mlac.core.artifact import Manifest

    if path.startswith("oci://"):
        from mlac.ship.pull import resolve
        from mlac.ship.reference import parse
        from mlac.ship.registry import Registry

        m = resolve(Registry(parse(path))).manifest  # plain HTTP: MLAC_INSECURE_REGISTRIES
    else:
        m = Manifest.load(path)
    return {"path": path, "tp": m.plan.tp, "ep": m.plan.ep, "fp8": m.options.fp8,
            "kv_cache_dtype": m.options.kv_cache_dtype, "bytes": sum(f.size for f in m.files),
            "layers": m.model.num_hidden_layers, "routed_experts": m.model.n_routed_experts,
            "vocab_size": m.model.vocab_size}  # fmt: skip


# ---- the server process ---------------------------------------------------------------------------


def get(url: str) -> httpx.Response:
    return httpx.get(url, timeout=10, trust_env=False)  # trust_env: no HTTP_PROXY for 127.0.0.1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`mlac serve` in its own process group (the ranks it spawns join the group)."""

    def __init__(self, cmd: list[str], log_path: Path, pgid_file: Path | None):
        self.cmd, self.log_path, self.pgid_file = cmd, log_path, pgid_file
        self.log = open(log_path, "wb")  # noqa: SIM115  (closed in stop)
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, process_group=0)
        if pgid_file is not None:
            pgid_file.write_text(f"{self.proc.pid}\n")

    def tail(self, lines: int = 40) -> list[str]:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return []

    def wait_healthy(self, url: str, timeout: float) -> dict:
        """Poll GET /health every 50 ms: seconds from Popen to the port answering and to 200."""
        port_open = None
        deadline = self.started + timeout
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                now = time.perf_counter()
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"the server exited with code {self.proc.returncode} before /health was ok"
                    )
                if now > deadline:
                    raise RuntimeError(f"/health not ok after {timeout:.0f} s")
                with contextlib.suppress(httpx.TransportError):
                    r = client.get(url + "/health")
                    port_open = port_open or time.perf_counter() - self.started
                    if r.status_code == 200:
                        ready = time.perf_counter() - self.started
                        return {
                            "seconds_to_port_open": round(port_open, 3),
                            "seconds_to_ready": round(ready, 3),
                            "phases": r.json().get("startup"),  # the server's own: import, load, graphs, ...
                        }
                    body = r.json() if r.headers.get("content-type") == "application/json" else {}
                    if body.get("status") == "failed":
                        raise RuntimeError(f"loading failed: {body.get('error')}")
                time.sleep(0.05)

    def stop(self, grace: float = 15.0) -> dict:
        """SIGTERM to the server (it drains, then stops its ranks), SIGKILL to the whole group
        after `grace` s or whatever happened; the exit code (None: killed) and seconds taken."""
        code, start = None, time.perf_counter()
        try:
            if self.proc.poll() is None:
                self.proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = self.proc.wait(grace)
            else:
                code = self.proc.returncode
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the ranks too, whatever the server did
            self.proc.wait()
            self.log.close()
            if self.pgid_file is not None:
                self.pgid_file.unlink(missing_ok=True)
        return {"exit_code": code, "seconds": round(time.perf_counter() - start, 2)}


# ---- the client -----------------------------------------------------------------------------------


@dataclass
class Trace:
    """One streamed request as this client saw it (perf_counter seconds)."""

    sent: float = 0.0
    times: list[float] = field(default_factory=list)  # arrival of each chunk with tokens
    counts: list[int] = field(default_factory=list)  # tokens in that chunk
    finish: str | None = None
    completion_tokens: int | None = None  # from the final usage chunk
    error: str | None = None

    @property
    def tokens(self) -> int:
        return sum(self.counts)


async def stream_one(client: httpx.AsyncClient, url: str, body: dict, trace: Trace) -> None:
    """POST one streaming completion; fill `trace` as the chunks arrive."""
    trace.sent = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                trace.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                if line == "data: [DONE]":
                    return
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    trace.error = str(chunk["error"])[:300]
                    return
                for choice in chunk.get("choices") or ():
                    lps = choice.get("logprobs") or {}
                    n = len(lps.get("token_logprobs") or ())
                    if n:
                        trace.times.append(now)
                        trace.counts.append(n)
                    trace.finish = choice.get("finish_reason") or trace.finish
                if chunk.get("usage"):
                    trace.completion_tokens = chunk["usage"]["completion_tokens"]
    except (httpx.HTTPError, ValueError) as e:
        trace.error = f"{type(e).__name__}: {e}"[:300]


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


async def run_requests(
    url: str, model: str, ids: list[list[int]], max_tokens: int, concurrency: int, timeout: float
) -> tuple[list[Trace], bool]:
    """Send one streaming request per prompt (all at once, or at most `concurrency` in flight);
    requests still running after `timeout` s are cancelled (their traces keep what arrived).
    Returns the traces and whether the timeout cut the run off."""
    traces = [Trace() for _ in ids]
    gate = asyncio.Semaphore(concurrency) if concurrency > 0 else contextlib.nullcontext()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeouts = httpx.Timeout(connect=60.0, read=None, write=60.0, pool=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeouts, trust_env=False) as client:

        async def one(prompt: list[int], trace: Trace) -> None:
            async with gate:
                await stream_one(
                    client, url + "/v1/completions", completion_body(model, prompt, max_tokens), trace
                )

        tasks = [asyncio.create_task(one(p, t)) for p, t in zip(ids, traces, strict=True)]
        _, pending = await asyncio.wait(tasks, timeout=max(timeout, 1.0))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for t in traces:
        if t.error is None and t.finish is None:
            t.error = "cut off by the phase timeout" if pending else "stream ended without finish_reason"
    return traces, bool(pending)


def event_loop_run(coro):
    """uvloop where installed (less client overhead per streamed chunk), else asyncio."""
    try:
        import uvloop
    except ImportError:
        uvloop = None
    return (getattr(uvloop, "run", None) or asyncio.run)(coro)


def client_init() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # `timeout` ends the client processes at once


def client_run(url: str, model: str, ids: list[list[int]], max_tokens: int, concurrency: int, timeout: float,
               start_at: float) -> tuple[list[Trace], float, float, bool]:  # fmt: skip
    """In a client process: wait until `start_at` (perf_counter is CLOCK_MONOTONIC, one clock for
    every process), run the requests; (traces, end time, CPU seconds, cut off)."""
    time.sleep(max(0.0, start_at - time.perf_counter()))
    cpu0 = time.process_time()
    traces, cut_off = event_loop_run(run_requests(url, model, ids, max_tokens, concurrency, timeout))
    return traces, time.perf_counter(), time.process_time() - cpu0, cut_off


@dataclass
class Run:
    traces: list[Trace]
    start: float
    wall: float  # start -> the last client process done (its requests finished or cut off)
    cut_off: bool  # the phase's timeout ended it
    client_cpu: float  # the busiest client process's CPU seconds / wall (near 1: client-bound)


class Clients:
    """Client processes (forked before the server starts): request i goes to process i % n, all
    start at the same instant. One Python process parses a few thousand streamed chunks a second,
    fewer than a GPU server at batch 256 sends."""

    def __init__(self, n: int):
        self.n = n
        self.pool = multiprocessing.get_context("fork").Pool(n, initializer=client_init)

    def run(self, url: str, model: str, ids: list[list[int]], max_tokens: int, concurrency: int,
            timeout: float) -> Run:  # fmt: skip
        n = min(self.n, len(ids))
        per = -(-concurrency // n) if concurrency > 0 else 0
        start_at = time.perf_counter() + 0.2
        jobs = [self.pool.apply_async(client_run, (url, model, ids[i::n], max_tokens, per, timeout, start_at))
                for i in range(n)]  # fmt: skip
        parts = [job.get(timeout + 120) for job in jobs]
        traces: list[Trace] = [Trace()] * len(ids)
        for i, part in enumerate(parts):
            traces[i::n] = part[0]
        wall = max(part[1] for part in parts) - start_at
        cpu = max(part[2] for part in parts)
        return Run(traces, start_at, wall, any(part[3] for part in parts), round(cpu / wall, 3))

    def close(self) -> None:
        self.pool.terminate()
        self.pool.join()


# ---- statistics ---------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation; None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 2)


def check(run: Run, max_tokens: int) -> list[str]:
    """Every request: no error, finish_reason "length", max_tokens tokens streamed and counted."""
    bad = []
    for i, t in enumerate(run.traces):
        if t.error is not None:
            bad.append(f"request {i}: {t.error}")
        elif t.finish != "length" or t.tokens != max_tokens or t.completion_tokens != max_tokens:
            bad.append(f"request {i}: finish {t.finish}, {t.tokens} tokens streamed, "
                       f"usage {t.completion_tokens}; expected length / {max_tokens}")  # fmt: skip
    return bad


def token_gaps(t: Trace) -> list[float]:
    """Seconds between consecutive tokens of one request (a chunk of n tokens: n equal gaps)."""
    gaps = []
    for i in range(1, len(t.times)):
        gaps += [(t.times[i] - t.times[i - 1]) / t.counts[i]] * t.counts[i]
    return gaps


def decode_stats(run: Run, max_tokens: int) -> dict:
    """Steady-state decode rate over the window where every request is decoding, plus TTFT/ITL."""
    started = [t for t in run.traces if t.times]
    total = sum(t.tokens for t in run.traces)
    out: dict = {"requests": len(run.traces), "requests_ok": len(run.traces) - len(check(run, max_tokens)),
                 "output_tokens": total, "wall_s": round(run.wall, 3), "cut_off": run.cut_off,
                 "output_tokens_per_s": round(total / run.wall, 1) if run.wall > 0 else None}  # fmt: skip
    if len(started) == len(run.traces) and started:
        w0 = max(t.times[0] for t in started)  # the last request's first token
        w1 = min(t.times[-1] for t in started)  # the first request's last token
        in_window = sum(n for t in started for x, n in zip(t.times, t.counts, strict=True) if w0 < x <= w1)
        if w1 > w0 and in_window:
            rate = in_window / (w1 - w0)
            out.update(decode_window_s=round(w1 - w0, 3), decode_window_tokens=in_window,
                       decode_tokens_per_s=round(rate, 1),
                       decode_step_ms=round(1000 * len(started) / rate, 2))  # fmt: skip
    if "decode_tokens_per_s" not in out:
        out["decode_tokens_per_s"] = None  # no window where every request was decoding
    ttft = [t.times[0] - t.sent for t in started]
    itl = [gap for t in started for gap in token_gaps(t)]
    out.update(ttft_ms_p50=ms(pct(ttft, 0.5)), ttft_ms_p99=ms(pct(ttft, 0.99)),
               itl_ms_p50=ms(pct(itl, 0.5)), itl_ms_p99=ms(pct(itl, 0.99)),
               client_cpu_fraction=run.client_cpu)  # fmt: skip
    return out


def peak_stats(run: Run, max_tokens: int) -> dict:
    total = sum(t.tokens for t in run.traces)
    finished = sum(1 for t in run.traces if t.finish is not None and t.error is None)
    last = max((t.times[-1] for t in run.traces if t.times), default=run.start)
    span = last - run.start  # first request sent -> last token received
    e2e = [t.times[-1] - t.sent for t in run.traces if t.times and t.finish]
    ttft = [t.times[0] - t.sent for t in run.traces if t.times]
    return {
        "requests": len(run.traces),
        "requests_finished": finished,
        "output_tokens": total,
        "wall_s": round(span, 3),
        "cut_off": run.cut_off,
        "output_tokens_per_s": round(total / span, 1) if span > 0 else None,
        "requests_per_s": round(finished / span, 3) if span > 0 else None,
        "ttft_ms_p50": ms(pct(ttft, 0.5)),
        "ttft_ms_p99": ms(pct(ttft, 0.99)),
        "latency_ms_p50": ms(pct(e2e, 0.5)),
        "latency_ms_p99": ms(pct(e2e, 0.99)),
        "client_cpu_fraction": run.client_cpu,
    }


def server_counters(url: str) -> dict[str, float]:
    """Totals from GET /metrics (generated tokens, preemptions, prompt tokens, Triton JIT compiles)."""
    want = ("mlac:generation_tokens_total", "mlac:num_preemptions_total", "mlac:prompt_tokens_total",
            "mlac:triton_jit_compiles_total")  # fmt: skip
    out: dict[str, float] = {}
    with contextlib.suppress(httpx.HTTPError):
        for line in get(url + "/metrics").text.splitlines():
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0]  # every mlac metric carries a model_name label
            if name in want:
                out[name.removeprefix("mlac:").removesuffix("_total")] = float(value)
    return out


def counter_delta(before: dict, after: dict, wall: float) -> dict:
    d = {f"server_{k}": after[k] - before.get(k, 0.0) for k in after}
    if wall > 0 and "server_generation_tokens" in d:
        d["server_generation_tokens_per_s"] = round(d["server_generation_tokens"] / wall, 1)
    return d


# ---- the phases ---------------------------------------------------------------------------------


class Budget:
    """Seconds left of --budget-s (CLEANUP_S kept back); a phase gets min(its cap, what is left)."""

    def __init__(self, total: float):
        self.end = time.perf_counter() + total - CLEANUP_S

    def left(self) -> float:
        return self.end - time.perf_counter()

    def give(self, cap: float) -> float:
        return min(cap, self.left())


def serve_command(args) -> list[str]:
    cmd = [sys.executable, "-m", "mlac.cli", "serve", str(args.artifact), "--port", str(args.port),
           "--device", args.device, "--dtype", args.dtype, "--drain-timeout", "2", "--log-level", "warning",
           "--max-running-requests", str(args.max_running_requests), "--max-queue", str(args.max_queue)]  # fmt: skip
    return cmd + shlex.split(args.serve_args)


@dataclass
class Target:
    """The ready server, as the phases drive it."""

    url: str
    model: str  # the id /v1/models answers
    vocab: int
    clients: Clients
    budget: Budget

    def phase(self, ids: list[list[int]], max_tokens: int, concurrency: int, cap: float) -> tuple[Run, dict]:
        """One run of requests (at most `cap` s, less if the budget is short); with the server's
        counters over it."""
        before = server_counters(self.url)
        run = self.clients.run(self.url, self.model, ids, max_tokens, concurrency, self.budget.give(cap))
        return run, counter_delta(before, server_counters(self.url), run.wall)


def warm_up(args, rec: Record, target: Target) -> None:
    """Each decode batch and the peak prompt length once, a few tokens each: Triton compiles a
    kernel on the first use of a shape, which must not land in the measured phases."""
    t0 = time.perf_counter()
    shapes = [(b, args.prompt_len) for b in args.batches] + [(max(args.batches), args.peak_prompt_len)]
    for i, (b, length) in enumerate(shapes):
        if target.budget.left() < 5:
            break
        ids = prompts(b, length, target.vocab, 100 + i)
        run, _ = target.phase(ids, args.warmup_tokens, 0, args.phase_timeout)
        for msg in check(run, args.warmup_tokens)[:3]:
            rec.error(f"warm-up batch {b}: {msg}")
    rec.set("warmup_s", round(time.perf_counter() - t0, 2))


def decode_phases(args, rec: Record, target: Target) -> None:
    decode = rec.data.setdefault("decode", {})
    for b in args.batches:
        if target.budget.left() < 5:
            rec.error(f"decode batch {b}: skipped (budget spent)")
            continue
        ids = prompts(b, args.prompt_len, target.vocab, b)
        run, server_side = target.phase(ids, args.max_tokens, 0, args.phase_timeout)
        decode[f"batch{b}"] = {**decode_stats(run, args.max_tokens), **server_side}
        for msg in check(run, args.max_tokens)[:5]:
            rec.error(f"decode batch {b}: {msg}")
        rec.save()
        print(f"decode batch {b}: {decode[f'batch{b}']}", flush=True)


def peak_phase(args, rec: Record, target: Target) -> None:
    if target.budget.left() < 5:
        rec.error("peak: skipped (budget spent)")
        return
    ids = prompts(args.peak_requests, args.peak_prompt_len, target.vocab, 7)
    run, server_side = target.phase(ids, args.peak_max_tokens, args.peak_concurrency, args.peak_timeout)
    rec.set("peak", {**peak_stats(run, args.peak_max_tokens), **server_side})
    for msg in check(run, args.peak_max_tokens)[:5]:
        rec.error(f"peak: {msg}")
    print(f"peak: {rec.data['peak']}", flush=True)


def benchmark(args, rec: Record, server: ServerProcess, clients: Clients, budget: Budget) -> None:
    url = f"http://127.0.0.1:{args.port}"
    rec.set("startup", server.wait_healthy(url, budget.give(args.startup_timeout)))
    print(f"ready: {rec.data['startup']}", flush=True)
    model = get(url + "/v1/models").json()["data"][0]["id"]
    target = Target(url, model, rec.data["artifact"]["vocab_size"], clients, budget)
    warm_up(args, rec, target)
    decode_phases(args, rec, target)
    if args.peak_requests > 0:
        peak_phase(args, rec, target)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", help="an artifact folder, or oci://HOST/REPO:TAG (the server pulls it)")
    ap.add_argument("--json", type=Path, required=True, help="result file (rewritten after every phase)")
    ap.add_argument("--log", type=Path, default=None, help="server log (default: JSON path with .log)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--port", type=int, default=0, help="0: a free port")
    ap.add_argument("--serve-args", default="", help="more `mlac serve` flags, one string")
    ap.add_argument("--batches", default="1,32,256", help="decode batch sizes, comma-separated")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--warmup-tokens", type=int, default=8)
    ap.add_argument("--peak-requests", type=int, default=1024, help="0: no peak run")
    ap.add_argument("--peak-prompt-len", type=int, default=128)
    ap.add_argument("--peak-max-tokens", type=int, default=128)
    ap.add_argument(
        "--peak-concurrency", type=int, default=0, help="most requests in flight (0: all at once)"
    )
    ap.add_argument("--max-running-requests", type=int, default=None, help="default: the largest batch")
    ap.add_argument("--max-queue", type=int, default=None, help="default: enough for the peak run at once")
    ap.add_argument("--client-procs", type=int, default=max(1, min(8, (os.cpu_count() or 1) // 8)),
                    help="client processes sharing the requests (default: cores / 8, at most 8)")  # fmt: skip
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--phase-timeout", type=float, default=120.0, help="most seconds of one decode phase")
    ap.add_argument("--peak-timeout", type=float, default=180.0)
    ap.add_argument("--budget-s", type=float, default=1800.0, help="the whole run, stop included")
    ap.add_argument("--pgid-file", type=Path, default=None, help="write the server's process group id here")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.port = args.port or free_port()
    args.max_running_requests = args.max_running_requests or max(args.batches)
    args.max_queue = args.max_queue if args.max_queue is not None else max(256, args.peak_requests)
    args.log = args.log or args.json.with_suffix(".log")
    return args


def main() -> None:
    args = parse_args()
    budget = Budget(args.budget_s)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: stop the server on the way out
    with contextlib.suppress(ValueError, OSError):  # one socket per request in flight, both sides
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 65536 if hard == resource.RLIM_INFINITY else min(65536, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    rec = Record(args.json, {"benchmark": "mlac serve over HTTP", "date": date.today().isoformat(),
                             "status": "starting", **environment(args.device),
                             "artifact": artifact_info(args.artifact), "config": config,
                             "errors": []})  # fmt: skip
    clients = Clients(args.client_procs)  # forked now: not after the server and its threads exist
    cmd = serve_command(args)
    rec.set("serve_command", shlex.join(cmd))
    print("+", shlex.join(cmd), flush=True)
    server = ServerProcess(cmd, args.log, args.pgid_file)
    try:
        benchmark(args, rec, server, clients, budget)
        rec.data["status"] = "done"
    except BaseException as e:
        rec.set("status", f"failed: {type(e).__name__}: {e}")  # saved now: stopping can be cut short
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not skip the SIGKILL
        rec.data["server_stop"] = server.stop()
        clients.close()
        rec.data["server_log_tail"] = server.tail()
        rec.save()
        print(f"wrote {args.json} ({rec.data['status']}, {len(rec.data['errors'])} errors)", flush=True)


if __name__ == "__main__":
    main()
