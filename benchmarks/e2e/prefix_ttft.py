"""Time to first token with a shared system prompt: cold, then served from the radix prefix cache.

    python benchmarks/e2e/prefix_ttft.py ART --device cuda --json prefix.json \
        [--system-len 2000 --suffix-len 64 --requests 8 --burst 32] [--suffix-lens 8,16,64] \
        [--dtype bfloat16] [--no-in-process] [--serve-args "..."]

One `mlac serve` process (the radix cache on, its default). Two workloads, each run twice over
prompts that share a `--system-len`-token system prompt and end in a `--suffix-len`-token suffix
of their own (random token ids, fixed seeds):

1. sequential: `--requests` requests one after another, each with a system prompt never sent
   before (cold: the whole prompt is prefilled); then the same system prompts again with new
   suffixes (cached: only the suffix is prefilled). TTFT p50 / mean of each pass. With
   `--suffix-lens`, once per suffix length (new system prompts each time): `suffix_sweep`.
2. burst: `--burst` requests at once that share one new system prompt (cold: all miss, the cache
   fills as they finish), then `--burst` more with the same system prompt (cached). Prompt
   throughput = prompt tokens of the burst / seconds from the first send to the last first token.

Each request asks for one token (`max_tokens` 1): TTFT is its whole latency. The server's
`usage.prompt_tokens_details.cached_tokens` is recorded per pass, so a "cached" pass that missed
shows as such. The JSON also holds the device, versions and the server's start-up.

The least a cached request can take against a cold one, from the model and the device's ceilings:
prefix_bound.py.

3. in process (unless --no-in-process), once the server has stopped: the same sequential requests
   (the same ids, cold then cached, every suffix length) on an engine of this process
   (serve.load_engine, `--dtype`, the serve defaults otherwise), one Scheduler: per request the
   wall time of new_sequence + add + the step to its token. `in_process_ms_p50` next to each
   HTTP pass, and `http_overhead_ms_p50` = HTTP TTFT - in-process step: what serving adds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_http  # noqa: E402  (a sibling script, not a package)


async def first_token(client: httpx.AsyncClient, url: str, model: str, prompt: list[int]) -> dict:
    """One non-streaming request of one token: its latency and the usage the server reports."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    r = await client.post(url + "/v1/completions", json=body)
    dt = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
    usage = r.json()["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "ttft_s": dt,
        "end": time.perf_counter(),
        "prompt_tokens": usage["prompt_tokens"],
        "cached": cached,
    }


def summary(results: list[dict], wall: float | None = None) -> dict:
    ttft = [r["ttft_s"] * 1000 for r in results]
    out = {
        "requests": len(results),
        "ttft_ms_p50": round(statistics.median(ttft), 2),
        "ttft_ms_mean": round(statistics.fmean(ttft), 2),
        "ttft_ms_max": round(max(ttft), 2),
        "prompt_tokens": sum(r["prompt_tokens"] for r in results),
        "cached_tokens": sum(r["cached"] for r in results),
    }
    if wall is not None:
        out["wall_s"] = round(wall, 4)
        out["prompt_tokens_per_s"] = round(out["prompt_tokens"] / wall, 1)
    return out


def suffix_plan(vocab: int, args) -> dict[int, dict[str, list[list[int]]]]:
    """Per suffix length: the sequential cold pass's prompts, then the cached pass's (the same
    `--requests` system prompts, never sent before, with new suffixes)."""
    rng = random.Random(args.seed + 1)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    plan = {}
    for n in args.suffix_lens:
        systems = [ids(args.system_len) for _ in range(args.requests)]
        plan[n] = {name: [s + ids(n) for s in systems] for name in ("cold", "cached")}
    return plan


async def workloads(url: str, model: str, vocab: int, args, plan: dict) -> dict:
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    timeouts = httpx.Timeout(connect=60.0, read=300.0, write=60.0, pool=None)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeouts, limits=limits, trust_env=False) as client:
        await first_token(client, url, model, ids(args.system_len + args.suffix_len))  # warm-up shapes
        sweep = {}
        for n, passes in plan.items():
            sweep[n] = {f"sequential_{k}": summary([await first_token(client, url, model, p) for p in prompts])
                        for k, prompts in passes.items()}  # fmt: skip
            sweep[n]["ttft_speedup_p50"] = speedup(sweep[n], "ttft_ms_p50")
        out = {k: v for k, v in sweep[args.suffix_len].items() if k.startswith("sequential_")}
        system = ids(args.system_len)
        for name in ("cold", "cached"):
            t0 = time.perf_counter()
            burst = [
                first_token(client, url, model, system + ids(args.suffix_len)) for _ in range(args.burst)
            ]
            results = await asyncio.gather(*burst)
            out[f"burst_{name}"] = summary(results, max(r["end"] for r in results) - t0)
    out["ttft_speedup_p50"] = sweep[args.suffix_len]["ttft_speedup_p50"]
    out["burst_prompt_throughput_speedup"] = round(
        out["burst_cached"]["prompt_tokens_per_s"] / out["burst_cold"]["prompt_tokens_per_s"], 2
    )
    if len(plan) > 1:
        out["suffix_sweep"] = sweep
    return out


def in_process(args, plan: dict) -> dict[int, dict[str, list[float]]]:
    """The plan's requests on an engine of this process (serve.load_engine), one at a time: per
    suffix length and pass, the wall seconds of new_sequence + add + the steps to its token."""
    from mlac.runtime.engine.params import SamplingParams
    from mlac.runtime.serve import ServerConfig, load_engine

    config = ServerConfig.of(artifact=args.artifact, device=args.device, dtype=args.dtype, verify=False)
    engine = load_engine(config)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    try:
        sched = engine.scheduler()

        def run(prompt: list[int]) -> float:
            t0 = time.perf_counter()
            sched.add(engine.new_sequence(prompt, params))
            while sched.has_unfinished:
                sched.step()
            return time.perf_counter() - t0

        run(plan[args.suffix_len]["cold"][0][::-1])  # warm-up shapes (a prompt never sent again)
        return {
            n: {k: [run(p) for p in prompts] for k, prompts in passes.items()} for n, passes in plan.items()
        }
    finally:
        engine.close()


def add_in_process(results: dict, times: dict, suffix_len: int) -> None:
    """Each sequential pass's in-process step p50 next to its HTTP TTFT, and their difference (the
    top level's passes are the sweep's entries of `suffix_len`: the same dicts)."""
    sweep = results.get("suffix_sweep", {suffix_len: results})
    for n, passes in times.items():
        for name, seconds in passes.items():
            entry = sweep[n][f"sequential_{name}"]
            entry["in_process_ms_p50"] = round(1000 * statistics.median(seconds), 2)
            entry["http_overhead_ms_p50"] = round(entry["ttft_ms_p50"] - entry["in_process_ms_p50"], 2)
        sweep[n]["in_process_speedup_p50"] = speedup(sweep[n], "in_process_ms_p50")
    results["in_process_speedup_p50"] = sweep[suffix_len]["in_process_speedup_p50"]


def speedup(passes: dict, key: str) -> float:
    """Cold p50 / cached p50 of one suffix length's sequential passes."""
    return round(passes["sequential_cold"][key] / passes["sequential_cached"][key], 2)


def lengths(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--log", type=Path, default=None, help="server log (default: JSON path with .log)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--system-len", type=int, default=2000)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--burst", type=int, default=32)
    ap.add_argument(
        "--suffix-lens",
        type=lengths,
        default=None,
        help="sequential passes for each of these suffix lengths, e.g. 8,16,64 (default: --suffix-len)",
    )
    ap.add_argument("--dtype", default="bfloat16", help="the in-process engine's (as serve's --dtype)")
    ap.add_argument("--no-in-process", action="store_true", help="skip the in-process step times")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-args", default="", help="more `mlac serve` flags, one string")
    args = ap.parse_args()
    args.suffix_lens = args.suffix_lens or [args.suffix_len]
    if args.suffix_len not in args.suffix_lens:
        args.suffix_lens.append(args.suffix_len)
    port = serve_http.free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mlac.cli", "serve", str(args.artifact), "--port", str(port),
           "--device", args.device, "--log-level", "warning", *args.serve_args.split()]  # fmt: skip
    print("+", " ".join(cmd), flush=True)
    record = {"benchmark": "prefix cache TTFT", **serve_http.environment(args.device),
              "artifact": serve_http.artifact_info(args.artifact), "config": {k: str(v) for k, v in vars(args).items()},
              "serve_command": " ".join(cmd)}  # fmt: skip
    server = serve_http.ServerProcess(cmd, args.log or args.json.with_suffix(".log"), None)
    try:
        record["startup"] = server.wait_healthy(url, 300)
        info = serve_http.get(url + "/v1/models").json()["data"][0]
        vocab = serve_http.artifact_info(args.artifact).get("vocab_size") or 1000
        plan = suffix_plan(vocab, args)
        record["results"] = asyncio.run(workloads(url, info["id"], vocab, args, plan))
        record["status"] = "done"
    except BaseException as e:
        record["status"] = f"failed: {type(e).__name__}: {e}"
        raise
    finally:
        record["server_stop"] = server.stop()
        record["server_log_tail"] = server.tail(15)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    if not args.no_in_process:  # the server has stopped: its device memory is free
        add_in_process(record["results"], in_process(args, plan), args.suffix_len)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
        print(json.dumps(record.get("results"), indent=1), flush=True)


if __name__ == "__main__":
    main()
