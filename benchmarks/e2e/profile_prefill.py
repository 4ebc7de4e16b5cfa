"""Where an eager prefill's wall time goes: one prompt of N tokens, cold and over a cached prefix.

    python benchmarks/e2e/profile_prefill.py ART --json prefill.json [--prompt-len 64] [--prefix-len 2000] \
        [--batches 4,16]

Loads the artifact (CUDA), then times, and profiles with the torch profiler, the step that
prefills one sequence of `--prompt-len` tokens: (1) cold, (2) after a sequence with a shared
`--prefix-len`-token prefix has finished (the radix cache then serves the prefix; only the
suffix is prefilled), (3) with `--batches`, B such sequences (the same cached prefix, suffixes of
their own) in one step: what a burst of cached requests costs the engine. For each: wall ms, GPU
kernel ms, kernel launches, host syncs, the operators with the most host (self CPU) time (what an
eager step spends launching) and those with the most GPU time; over the 5 timed runs, the caching
allocator's cudaMalloc / cudaFree calls and retries, and the Triton kernels compiled or loaded.
A profile, not a rate: the floors of a cold and a cached step are prefix_bound.py's.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.worker.jit_compiles import JitCompiles

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def prefill_once(engine: Engine, ids: list[int] | list[list[int]]) -> float:
    """Wall seconds of the scheduler steps that prefill `ids` (one prompt, or several in one step),
    one token sampled for each."""
    sched = engine.scheduler()
    prompts = ids if ids and isinstance(ids[0], list) else [ids]
    seqs = [engine.new_sequence(p, SamplingParams(max_tokens=1, ignore_eos=True)) for p in prompts]
    for seq in seqs:
        sched.add(seq)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while not all(seq.finished for seq in seqs):
        sched.step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def allocator_counts() -> dict[str, int]:
    """The caching allocator's cudaMalloc / cudaFree calls and its retries after a failed one
    (it frees its cached blocks and tries again: a device sync each time)."""
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")}


def summarize(prof, wall_s: float) -> dict:
    events = prof.events()
    gpu = [e for e in events if e.device_type == DeviceType.CUDA]
    kernels = [e for e in gpu if not e.name.startswith(("Memcpy", "Memset"))]
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    syncs: dict[str, int] = {}
    for e in cpu:
        if e.name.startswith(SYNC_OPS):
            syncs[e.name] = syncs.get(e.name, 0) + 1
    averages = prof.key_averages()
    table = averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
    by_gpu = averages.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60)
    return {
        "wall_ms": round(wall_s * 1e3, 2),
        "kernels": len(kernels),
        "gpu_kernel_ms": round(sum(e.device_time for e in kernels) / 1e3, 3),
        "host_syncs": syncs,
        "top_self_cpu": table.splitlines(),
        "top_gpu": by_gpu.splitlines(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--batches", default="", help="cached prompts per step, e.g. 4,16 (also timed)")
    args = ap.parse_args()
    engine = Engine.from_artifact(args.artifact, device="cuda", verify=False)
    rng = random.Random(0)
    vocab = engine.config.vocab_size

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    for _ in range(3):  # kernels compiled, allocator warm
        prefill_once(engine, ids(args.prompt_len))
        prefill_once(engine, ids(args.prefix_len + args.prompt_len))
    out = {"artifact": str(args.artifact), "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    cases = {
        "cold_short": lambda: ids(args.prompt_len),
        "cold_long": lambda: ids(args.prefix_len + args.prompt_len),
    }
    prefix = ids(args.prefix_len)
    prefill_once(engine, prefix + ids(args.prompt_len))  # the prefix into the radix cache
    cases["cached_prefix"] = lambda: prefix + ids(args.prompt_len)
    for b in (int(x) for x in args.batches.split(",") if x.strip()):
        cases[f"cached_prefix_x{b}"] = lambda b=b: [prefix + ids(args.prompt_len) for _ in range(b)]
    for name, make in cases.items():
        before = allocator_counts()
        with JitCompiles() as jit:
            walls = [prefill_once(engine, make()) for _ in range(5)]
        after = allocator_counts()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall = prefill_once(engine, make())
        out[name] = {"wall_ms_unprofiled": [round(w * 1e3, 2) for w in walls], **summarize(prof, wall)}
        out[name]["allocator"] = {k: after[k] - before[k] for k in after}  # over the 5 timed runs
        out[name]["jit"] = {"compiled": jit.compiled, "loaded": jit.loaded}
        print(name, {k: v for k, v in out[name].items() if not k.startswith("top_")}, flush=True)
        print("\n".join(out[name]["top_self_cpu"][:30] + out[name]["top_gpu"][:20]), flush=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    engine.close()


if __name__ == "__main__":
    main()
