"""A shared-system-prompt workload under load, without and with the radix prefix cache.

    python benchmarks/e2e/prefix_workload.py ART --device cuda --json workload.json \
        [--system-len 2000 --question-len 64 --max-tokens 1 --concurrency 1,4,16,64 \
         --requests-per-level 16 --per-client 4] [--serve-args "..."]

Every request is one shared `--system-len`-token system prompt followed by a `--question-len`-token
question of its own (random token ids, fixed seed; no two questions alike), streamed, `max_tokens`
`--max-tokens`. For each concurrency C of `--concurrency`, C clients send requests back to back
(closed loop) until max(`--requests-per-level`, C * `--per-client`) have been sent; the clients are
spread over `--client-procs` processes (one event loop each), so that one Python process's
HTTP overhead does not bound a level.

The same workload runs against two `mlac serve` processes of the artifact, one after the other:
1. `--disable-radix-cache` ("cold"): every request prefills its whole prompt;
2. the radix cache on (its default, "cached"): one priming request puts the system prompt in the
   cache first (its TTFT is recorded as `priming_ttft_ms`: a cold request on that server), then
   every request prefills its question only.

Per level: TTFT p50 / p90 / mean (first streamed token, from the send), the prompt throughput
(prompt tokens, cached ones included, over the level's wall time), requests/s, and the prompt
tokens the server reports as cached (`usage.prompt_tokens_details.cached_tokens`), so a "cached"
level that missed shows as such. `speedup` holds cold / cached for each level's TTFT p50 and
prompt throughput. From the server's /metrics, per level: its own mean TTFT and queue time
(from the request's arrival at the server, after its body is parsed), its engine steps and their
mean tokens (`mlac:iteration_tokens_total`: how well the arrivals batch), its JIT compiles; and
the busiest client process's CPU seconds per wall second (near 1: the clients bound the level).
The bound of a lone request's cold / cached ratio: prefix_bound.py. Before the levels each server
gets two requests of another system prompt (shapes; a prepared
artifact compiles nothing). The JSON also holds the device, versions, the server commands and start-ups.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_http  # noqa: E402  (a sibling script, not a package)


async def stream_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int
) -> dict:
    """One streamed completion: seconds to its first token and to its end, its usage."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    sent, first, usage = time.perf_counter(), None, None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            tokens = (
                len((c.get("logprobs") or {}).get("token_logprobs") or ()) for c in chunk.get("choices") or ()
            )
            if first is None and any(tokens):  # the first chunk with a token (its text may be held back)
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    if first is None or usage is None:
        raise RuntimeError("the stream ended without a token or without usage")
    return {
        "ttft_s": first - sent,
        "latency_s": time.perf_counter() - sent,
        "prompt_tokens": usage["prompt_tokens"],
        "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    }


TIMEOUTS = httpx.Timeout(connect=60.0, read=300.0, write=60.0, pool=None)
LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=None)


async def closed_loop(url: str, model: str, prompts: list[list[int]], concurrency: int, max_tokens: int):
    """`concurrency` workers send `prompts` back to back over one client; results in prompt order."""
    queue = list(enumerate(prompts))
    results: list[dict | None] = [None] * len(prompts)
    async with httpx.AsyncClient(timeout=TIMEOUTS, limits=LIMITS, trust_env=False) as client:

        async def worker() -> None:
            while queue:
                i, prompt = queue.pop(0)
                results[i] = await stream_request(client, url, model, prompt, max_tokens)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def client_process(
    url: str, model: str, prompts: list[list[int]], workers: int, max_tokens: int, start_at: float
):
    """In a client process: wait until `start_at` (perf_counter is CLOCK_MONOTONIC, one clock for
    every process), run its share closed-loop; (results, end time, CPU seconds)."""
    time.sleep(max(0.0, start_at - time.perf_counter()))
    cpu = time.process_time()
    results = asyncio.run(closed_loop(url, model, prompts, workers, max_tokens))
    return results, time.perf_counter(), time.process_time() - cpu


def run_level(
    clients: tuple, url: str, model: str, prompts: list[list[int]], concurrency: int, max_tokens: int
):
    """The level over `clients` = (a process pool, its size): P = min(size, concurrency) processes,
    process p sending prompts p, p + P, ... with its share of the workers. (results in prompt order,
    wall seconds, the busiest process's CPU seconds per wall second: near 1, the clients bound it)."""
    pool, size = clients
    procs = min(size, concurrency)
    workers = [concurrency // procs + (p < concurrency % procs) for p in range(procs)]
    start_at = time.perf_counter() + 0.2
    jobs = [pool.apply_async(client_process, (url, model, prompts[p::procs], workers[p], max_tokens, start_at))
            for p in range(procs)]  # fmt: skip
    parts = [job.get() for job in jobs]
    results: list[dict] = [{}] * len(prompts)
    for p, part in enumerate(parts):
        results[p::procs] = part[0]
    wall = max(part[1] for part in parts) - start_at
    return results, wall, round(max(part[2] for part in parts) / wall, 3)


SERVER_SAMPLES = (
    "mlac:time_to_first_token_seconds_sum", "mlac:time_to_first_token_seconds_count",
    "mlac:request_queue_time_seconds_sum", "mlac:request_queue_time_seconds_count",
    "mlac:iteration_tokens_total_sum", "mlac:iteration_tokens_total_count", "mlac:triton_jit_compiles_total",
)  # fmt: skip


def server_samples(url: str) -> dict[str, float]:
    """SERVER_SAMPLES' values from GET /metrics (every mlac metric carries one model_name label)."""
    out = {}
    for line in serve_http.get(url + "/metrics").text.splitlines():
        name, _, value = line.rpartition(" ")
        name = name.split("{", 1)[0]
        if name in SERVER_SAMPLES:
            out[name.removeprefix("mlac:")] = float(value)
    return out


def server_view(before: dict, after: dict) -> dict:
    """What the engine saw over a level: its mean TTFT (arrival at the engine to the first token)
    and queue time, its steps and their mean tokens, the JIT compiles."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}

    def mean(name: str, scale: float = 1.0) -> float | None:
        n = d.get(f"{name}_count", 0)
        return round(scale * d[f"{name}_sum"] / n, 2) if n else None

    return {
        "server_ttft_ms_mean": mean("time_to_first_token_seconds", 1000),
        "server_queue_ms_mean": mean("request_queue_time_seconds", 1000),
        "engine_steps": int(d.get("iteration_tokens_total_count", 0)),
        "tokens_per_step_mean": mean("iteration_tokens_total"),
        "jit_compiles": int(d.get("triton_jit_compiles_total", 0)),
    }


def level_summary(results: list[dict], wall: float) -> dict:
    ttft = sorted(r["ttft_s"] * 1000 for r in results)
    prompt = sum(r["prompt_tokens"] for r in results)
    return {
        "requests": len(results),
        "ttft_ms_p50": round(statistics.median(ttft), 2),
        "ttft_ms_p90": round(ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))], 2),
        "ttft_ms_mean": round(statistics.fmean(ttft), 2),
        "latency_ms_p50": round(statistics.median(r["latency_s"] * 1000 for r in results), 2),
        "wall_s": round(wall, 4),
        "requests_per_s": round(len(results) / wall, 2),
        "prompt_tokens": prompt,
        "cached_tokens": sum(r["cached"] for r in results),
        "prompt_tokens_per_s": round(prompt / wall, 1),
    }


class Prompts:
    """The workload's token ids: one system prompt, questions never repeated."""

    def __init__(self, vocab: int, seed: int, system_len: int, question_len: int):
        self.rng, self.vocab, self.question_len = random.Random(seed), vocab, question_len
        self.system = self.ids(system_len)

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    def requests(self, n: int) -> list[list[int]]:
        return [self.system + self.ids(self.question_len) for _ in range(n)]


def workload(clients: tuple, url: str, model: str, prompts: Prompts, args, prime: bool) -> dict:
    out: dict = {"levels": {}}
    other = prompts.ids(len(prompts.system))  # warm-up: a system prompt the workload never sends
    warm = [other + prompts.ids(prompts.question_len) for _ in range(2)]
    asyncio.run(closed_loop(url, model, warm, 1, args.max_tokens))
    if prime:
        first = asyncio.run(closed_loop(url, model, prompts.requests(1), 1, args.max_tokens))[0]
        out["priming_ttft_ms"] = round(first["ttft_s"] * 1000, 2)
    for c in args.concurrency:
        n = max(args.requests_per_level, c * args.per_client)
        before, sent = server_samples(url), prompts.requests(n)
        results, wall, client_cpu = run_level(clients, url, model, sent, c, args.max_tokens)
        out["levels"][str(c)] = {
            **level_summary(results, wall),
            **server_view(before, server_samples(url)),
            "client_cpu_per_wall": client_cpu,
        }
        print(f"concurrency {c}: {out['levels'][str(c)]}", flush=True)
    return out


def run_server(clients: tuple, args, name: str, extra: list[str], vocab: int) -> dict:
    """One server of the artifact with `extra` flags: start-up, then the workload (primed when the
    radix cache is on); a fresh Prompts of the same seed, so both servers see the same ids."""
    port = serve_http.free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mlac.cli", "serve", str(args.artifact), "--port", str(port), "--device",
           args.device, "--log-level", "warning", *args.serve_args.split(), *extra]  # fmt: skip
    print("+", " ".join(cmd), flush=True)
    record: dict = {"serve_command": " ".join(cmd)}
    log = args.json.with_name(f"{args.json.stem}_{name}.log")
    server = serve_http.ServerProcess(cmd, log, None)
    try:
        record["startup"] = server.wait_healthy(url, 300)
        model = serve_http.get(url + "/v1/models").json()["data"][0]["id"]
        prompts = Prompts(vocab, args.seed, args.system_len, args.question_len)
        record.update(
            workload(clients, url, model, prompts, args, prime="--disable-radix-cache" not in extra)
        )
    finally:
        record["server_stop"] = server.stop()
        record["server_log_tail"] = server.tail(10)
    return record


def speedups(cold: dict, cached: dict) -> dict:
    out = {}
    for c, a in cold["levels"].items():
        b = cached["levels"].get(c)
        if b:
            out[c] = {
                "ttft_p50": round(a["ttft_ms_p50"] / b["ttft_ms_p50"], 2),
                "ttft_mean": round(a["ttft_ms_mean"] / b["ttft_ms_mean"], 2),
                "prompt_throughput": round(b["prompt_tokens_per_s"] / a["prompt_tokens_per_s"], 2),
            }
    return out


def levels(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be positive integers, got {text!r}")
    return values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--system-len", type=int, default=2000)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--concurrency", type=levels, default=[1, 4, 16, 64])
    ap.add_argument("--requests-per-level", type=int, default=16)
    ap.add_argument("--per-client", type=int, default=4, help="requests per client at each level (at least)")
    ap.add_argument("--client-procs", type=int, default=4, help="client processes (each one event loop)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-args", default="", help="more `mlac serve` flags for both servers, one string")
    args = ap.parse_args()
    vocab = serve_http.artifact_info(args.artifact).get("vocab_size") or 1000
    # forked before any server, thread or event loop exists
    clients = (multiprocessing.get_context("fork").Pool(args.client_procs), args.client_procs)
    record = {"benchmark": "shared-system-prompt workload, radix cache off then on",
              **serve_http.environment(args.device), "artifact": serve_http.artifact_info(args.artifact),
              "config": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    try:
        record["cold"] = run_server(clients, args, "cold", ["--disable-radix-cache"], vocab)
        record["cached"] = run_server(clients, args, "cached", [], vocab)
        record["speedup"] = speedups(record["cold"], record["cached"])
        record["status"] = "done"
        print(json.dumps(record["speedup"], indent=1), flush=True)
    except BaseException as e:
        record["status"] = f"failed: {type(e).__name__}: {e}"
        raise
    finally:
        clients[0].terminate()
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
