"""The HTTP server's per-token CPU overhead, on CPU with a tiny artifact (where a model step is cheap).

    OMP_NUM_THREADS=1 python benchmarks/e2e/serve_overhead.py --json out.json --label LABEL \
        [--artifact ART] [--streams 256] [--prompt-len 16] [--max-tokens 64] [--client-procs 1]

Two measurements of the same engine, the same N requests (N random prompts of `--prompt-len` ids,
`--max-tokens` tokens each, temperature 0, ignore_eos, logprobs 0, as benchmarks/e2e/serve_http.py sends):

1. in process: one Scheduler steps the N sequences to the end (what `mlac bench` measures);
   tokens/s, and CPU microseconds of this process per generated token.
2. over HTTP: `mlac serve` in a process of its own (serve_http.py's ServerProcess and
   client processes), N concurrent streaming /v1/completions; tokens/s and the server process's
   CPU microseconds per generated token (psutil, over the phase; the engine's own process
   included: the default, else --engine-thread).

overhead_us_per_token = (2) - (1): the CPU time the server spends on each token beyond the engine
step; on a GPU server this is host time the model step waits for. CPU time, not wall
time, is the figure to compare: on a machine of few cores the client processes compete with the
server for the CPU, which moves the wall-clock rates, not the server's CPU seconds per token.

--gpu-step-ms S emulates a GPU server instead: the model forward becomes a wait of S ms that
releases the GIL (as a GPU step does) and returns fixed logits, while everything else (the step's
inputs, sampling, logprobs, detokenizing, the scheduler, the server) runs for real. The server then
runs in this process (ServerThread, the same uvicorn server; the engine in its own process unless
--engine-thread, its forward the same wait); step_ms over HTTP - step_ms in process
is the host time the server adds to each step (on the H200 at batch 256: 47.9 - 16.4 ms).
Without --artifact a tiny-v3 synthetic artifact is built in a temporary directory. The result is
merged into --json under `label` (e.g. "before", "after"), so one file can hold both.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import http_load  # noqa: E402  (sibling scripts, not a package)
import serve_http  # noqa: E402


def tiny_artifact(root: Path) -> Path:
    """Synthesize and compile the tiny-v3 preset under `root`."""
    from mlac.compiler.pipeline import compile_checkpoint
    from mlac.core.artifact import CompileOptions
    from mlac.synth import synthesize

    ckpt = synthesize(root / "ckpt", preset="tiny-v3", seed=0)
    compile_checkpoint(ckpt, root / "art", CompileOptions())
    return root / "art"


class WaitRunner:
    """A runner whose forward is a GIL-free wait of `step_s` and fixed random logits [B, V] (a GPU
    step as the host sees it); the step's inputs are still built on the host, as the real one does."""

    def __init__(self, runner, step_s: float, vocab: int, max_batch: int):
        import torch

        self.runner, self.step_s = runner, step_s
        self.cache, self.device = runner.cache, runner.device
        self.logits = torch.randn(max_batch, vocab, generator=torch.Generator().manual_seed(0))

    def run(self, step):
        step.to_device(self.cache.block_size, self.device)
        time.sleep(self.step_s)
        return self.logits[: step.num_seqs]

    def close(self) -> None:
        self.runner.close()


def load(art: Path, max_batch: int, gpu_step_ms: float):
    """The engine over `art` (float32, CPU); its forward a WaitRunner's when gpu_step_ms > 0."""
    import torch

    from mlac.runtime.engine.engine import Engine
    from mlac.runtime.engine.scheduler import SchedulerConfig

    config = SchedulerConfig(max_running_requests=max_batch)
    engine = Engine.from_artifact(art, dtype=torch.float32, verify=False, scheduler=config)
    if gpu_step_ms > 0:
        engine.runner = WaitRunner(engine.runner, gpu_step_ms / 1000, engine.config.vocab_size, max_batch)
    return engine


def in_process(art: Path, ids: list[list[int]], max_tokens: int, gpu_step_ms: float = 0.0) -> dict:
    """The N requests stepped by one Scheduler in this process: tokens/s and CPU us per token."""
    from mlac.runtime.engine.params import SamplingParams

    engine = load(art, len(ids), gpu_step_ms)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    try:
        sched = engine.scheduler()
        for p in ids:
            sched.add(engine.new_sequence(p, params))
        wall0, cpu0, tokens, steps = time.perf_counter(), time.process_time(), 0, 0
        while sched.has_unfinished:
            tokens += len(sched.step())
            steps += 1
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    finally:
        engine.close()
    return {"tokens": tokens, "steps": steps, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
            "step_ms": round(1000 * wall / steps, 2), "cpu_us_per_token": round(1e6 * cpu / tokens, 1)}  # fmt: skip


def over_http_here(args, art: Path, ids: list[list[int]], clients) -> dict:
    """The N requests as concurrent streams to a ServerThread in this process (--gpu-step-ms)."""
    from mlac.runtime.engine.scheduler import SchedulerConfig
    from mlac.runtime.serve import ServerConfig, ServerThread

    config = ServerConfig.of(artifact=art, dtype="float32", verify=False, served_model_name="tiny",
                          scheduler=SchedulerConfig(max_running_requests=len(ids)), max_queue=len(ids),
                          engine_process=not args.engine_thread)  # fmt: skip
    with ServerThread(config, load=functools.partial(load, art, len(ids), args.gpu_step_ms)) as srv:
        warm = clients.run(srv.url, "tiny", ids[:8], 4, 0, 60.0)
        assert not http_load.check(warm, 4), http_load.check(warm, 4)[:3]
        engine = getattr(srv.state.loop, "process", None)  # the engine's own process, if any
        procs = [psutil.Process()] + ([psutil.Process(engine.process.pid)] if engine is not None else [])
        cpu0 = cpu_seconds(procs)
        run = clients.run(srv.url, "tiny", ids, args.max_tokens, 0, args.timeout)
        cpu = cpu_seconds(procs) - cpu0
    return http_result(run, cpu, args.max_tokens, len(ids))


def over_http(args, art: Path, ids: list[list[int]], log: Path) -> dict:
    """The N requests as concurrent streams to `mlac serve` in its own process."""
    port = serve_http.free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mlac.cli", "serve", str(art), "--port", str(port), "--device", "cpu",
           "--dtype", "float32", "--no-verify", "--log-level", "warning", "--drain-timeout", "2",
           "--max-running-requests", str(len(ids)), "--max-queue", str(len(ids)),
           "--served-model-name", "tiny"] + (["--no-engine-process"] if args.engine_thread else [])  # fmt: skip
    clients = http_load.Clients(args.client_procs)  # forked before the server starts
    server = serve_http.ServerProcess(cmd, log, None)
    try:
        server.wait_healthy(url, 120.0)
        warm = clients.run(url, "tiny", ids[:8], 4, 0, 60.0)  # first requests: imports, lazy set-up
        assert not http_load.check(warm, 4), http_load.check(warm, 4)[:3]
        proc = psutil.Process(server.proc.pid)
        procs = [proc, *proc.children(recursive=True)]  # the engine's own process too, if any
        cpu0 = cpu_seconds(procs)
        run = clients.run(url, "tiny", ids, args.max_tokens, 0, args.timeout)
        cpu = cpu_seconds(procs) - cpu0
    finally:
        server.stop()
        clients.close()
    return http_result(run, cpu, args.max_tokens, len(ids))


def cpu_seconds(procs: list[psutil.Process]) -> float:
    """User + system CPU seconds of these processes, so far."""
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def http_result(run, cpu: float, max_tokens: int, streams: int) -> dict:
    errors = http_load.check(run, max_tokens)
    tokens = sum(t.tokens for t in run.traces)
    stats = http_load.decode_stats(run, max_tokens)
    return {"tokens": tokens, "wall_s": round(run.wall, 3), "tokens_per_s": round(tokens / run.wall, 1),
            "decode_tokens_per_s": stats["decode_tokens_per_s"], "step_ms": stats.get("decode_step_ms"),
            "itl_ms_p50": stats["itl_ms_p50"],
            "server_cpu_s": round(cpu, 3), "server_cpu_fraction": round(cpu / run.wall, 3),
            "cpu_us_per_token": round(1e6 * cpu / max(tokens, 1), 1),
            "client_cpu_fraction": run.client_cpu, "errors": errors[:5]}  # fmt: skip


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True, help="result file; this run merges in under --label")
    ap.add_argument("--label", default="run")
    ap.add_argument("--artifact", type=Path, default=None, help="default: a tiny-v3 artifact built now")
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--client-procs", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300.0, help="most seconds of the HTTP phase")
    ap.add_argument("--gpu-step-ms", type=float, default=0.0, help="emulate a GPU step of this many ms")
    ap.add_argument("--engine-thread", action="store_true",
                    help="the engine on a thread of the server's process (--no-engine-process), not its own")  # fmt: skip
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if os.environ.get("OMP_NUM_THREADS") != "1":
        print("note: set OMP_NUM_THREADS=1 (torch's threads starve the server's on few cores)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        art = args.artifact or tiny_artifact(Path(tmp))
        vocab = json.loads((art / "manifest.json").read_text())["model"]["vocab_size"]
        ids = http_load.prompts(args.streams, args.prompt_len, vocab, 0)
        if args.gpu_step_ms > 0:
            clients = http_load.Clients(args.client_procs)  # forked before any thread starts
            try:
                engine = in_process(art, ids, args.max_tokens, args.gpu_step_ms)
                print(f"in process: {engine}", flush=True)
                http = over_http_here(args, art, ids, clients)
            finally:
                clients.close()
        else:
            engine = in_process(art, ids, args.max_tokens)
            print(f"in process: {engine}", flush=True)
            http = over_http(args, art, ids, Path(tmp) / "server.log")
        print(f"over HTTP: {http}", flush=True)
    result = {"streams": args.streams, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
              "gpu_step_ms": args.gpu_step_ms,
              "client_procs": args.client_procs, "cpus": os.cpu_count(), "in_process": engine,
              "over_http": http,
              "overhead_us_per_token": round(http["cpu_us_per_token"] - engine["cpu_us_per_token"], 1)}  # fmt: skip
    data = json.loads(args.json.read_text()) if args.json.is_file() else {}
    data[args.label] = result
    args.json.write_text(json.dumps(data, indent=2) + "\n")
    print(f"{args.label}: overhead {result['overhead_us_per_token']} us/token -> {args.json}", flush=True)


if __name__ == "__main__":
    main()
