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
import contextlib
import importlib.metadata
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import httpx
from http_load import Clients, Run, check, decode_stats, peak_stats, prompts  # a sibling script

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
    peak_batch = max(args.batches, default=min(args.max_running_requests, max(args.peak_requests, 1)))
    shapes = [(b, args.prompt_len) for b in args.batches] + [(peak_batch, args.peak_prompt_len)]
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
    args.max_running_requests = args.max_running_requests or max(args.batches, default=args.peak_requests)
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
