"""The sampler of a decode step (mlac.runtime.engine.sampling.sample), as the engine calls it: wall time per
call, host and device together (it runs eagerly, between the step's graph replay and the next step).

    python benchmarks/kernels/sampler.py --device cuda --json sampler_h100.json
    PYTHONPATH=OTHER_TREE python benchmarks/kernels/sampler.py ...   # another tree's sampler, same rows

Rows: the vocabulary of V2-Lite (102,400) and V3 (129,280), batches of 1, 32 and 256, every row sampling
with one of these parameter mixes (SamplingParams):

    default     temperature 1, no filter (OpenAI's defaults)
    top_k       temperature 0.7, top_k 50
    top_p       temperature 0.9, top_p 0.9
    top_k_p     temperature 1.2, top_k 20, top_p 0.8
    deepseek    temperature 0.6, top_p 0.95 (DeepSeek-V3's and R1's generation_config.json)
    seeded      as default, each row with its own seed (a torch.Generator per row)

Each row's time: the median over --reps calls after one warm call (the device synchronized around each).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.engine.sampling import sample

VOCABS = {"v2-lite": 102_400, "v3": 129_280}
MIXES = {
    "default": dict(temperature=1.0),
    "top_k": dict(temperature=0.7, top_k=50),
    "top_p": dict(temperature=0.9, top_p=0.9),
    "top_k_p": dict(temperature=1.2, top_k=20, top_p=0.8),
    "deepseek": dict(temperature=0.6, top_p=0.95),
    "seeded": dict(temperature=1.0),
}


def time_call(logits: torch.Tensor, mix: str, reps: int) -> float:
    """Median ms of sample() over `reps` calls on `logits` [B, V] with every row of `mix`."""
    b, dev = logits.shape[0], logits.device
    params = [SamplingParams(**MIXES[mix]) for _ in range(b)]
    times = []
    for i in range(reps + 1):
        gens = (
            [torch.Generator(device=dev).manual_seed(i * b + j) for j in range(b)]
            if mix == "seeded"
            else [None] * b
        )
        if dev.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        sample(logits, params, gens)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--models", nargs="+", choices=list(VOCABS), default=list(VOCABS))
    ap.add_argument("--mixes", nargs="+", choices=list(MIXES), default=list(MIXES))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    record = dict(
        benchmark="sampling.sample, ms per call (host and device), every row sampling",
        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({platform.processor() or 'x86_64'}, "
        f"{torch.get_num_threads()} threads)",
        torch=torch.__version__, python=platform.python_version(), reps=args.reps, rows=[],
    )  # fmt: skip
    for model in args.models:
        for b in map(int, args.batches.split(",")):
            logits = 4 * torch.randn(
                b, VOCABS[model], device=dev, generator=torch.Generator(dev).manual_seed(0)
            )
            for mix in args.mixes:
                ms = time_call(logits, mix, args.reps)
                record["rows"].append(
                    dict(model=model, vocab=VOCABS[model], batch=b, mix=mix, ms=round(ms, 3))
                )
                print(f"{model:8} batch {b:4} {mix:8} {ms:9.3f} ms", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
