"""The host's work in a greedy speculative step, by function, on CPU (no GPU needed).

    python benchmarks/spec_host_profile_cpu.py ART [--batch 1 32] [--k 3] [--steps 10] [--overlap]

ART: a compiled artifact with an MTP layer (`mlac synth tiny-v3` then `mlac compile`). The runner
gets ChainGraphs (spec_chain.py) whose body does nothing once the sequences decode: what is left of a
step is the host's work alone (scheduling, the inputs, landing the results: acceptance, appends,
detokenizing, roll-back, the books). "reject" leaves the body's out as the last real step wrote it
(random weights: drafts rejected, 1 token per sequence per step); "accept" writes out with every
draft accepted (K + 1 tokens per sequence per step, the most host work). Per step it prints the
thread CPU microseconds (min over rounds: the machine is shared) and, from cProfile, the
microseconds under each of the functions below (cumulative; nested ones are counted in both).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.sampling import SamplingParams
from mlac.runtime.engine.scheduler import SchedulerConfig
from mlac.runtime.worker.graphs import DecodeGraphs
from mlac.runtime.worker.spec_chain import ChainGraphs
from mlac.runtime.worker.spec_graphs import DraftGraphs

BUCKETS = [1, 2, 4, 8, 16, 32]
WATCHED = (  # (file suffix, function): the parts of a step's host work
    ("scheduler.py", "step"),
    ("scheduler.py", "_schedule"),
    ("spec_decode.py", "_run_fast"),
    ("spec_exec.py", "chain"),
    ("spec_exec.py", "launch"),
    ("spec_chain.py", "fill"),
    ("spec_decode.py", "_land_chain"),
    ("spec_decode.py", "_finish"),
    ("spec_decode.py", "_verify"),
    ("scheduler.py", "append_token"),
    ("tokenizer.py", "add"),
    ("spec_decode.py", "_roll_back"),
    ("spec_decode.py", "_refresh"),
    ("spec_exec.py", "keep"),
    ("spec_overlap.py", "advance"),
)


def engine(path: str, k: int, overlap: bool, accept: bool) -> tuple[Engine, list[bool]]:
    """A speculative engine whose ChainGraphs body stops running once `idle[0]` is set."""
    config = SchedulerConfig(speculative_num_steps=k, overlap=overlap)
    eng = Engine.from_artifact(path, dtype=torch.float32, verify=False, scheduler=config)
    r = eng.runner
    r.graphs = DecodeGraphs(r.model, r.cache, BUCKETS, eng.max_context, keep_hidden=True)
    r.draft_graphs = DraftGraphs(r.model, r.cache, BUCKETS, eng.max_context)
    chains = ChainGraphs(r.model, r.cache, BUCKETS, r.graphs.inputs.max_blocks * r.cache.block_size, k)
    r.spec_executor().chains[k] = chains
    body, idle = chains._step, [False]

    def step(bs: int) -> None:
        if not idle[0]:
            body(bs)
        elif accept:
            chains.out[:bs] = 7  # drafts == the target's argmax: all accepted

    chains._step = step
    return eng, idle


def measure(path: str, batch: int, k: int, steps: int, overlap: bool, accept: bool, rounds: int = 5) -> dict:
    eng, idle = engine(path, k, overlap, accept)
    sched = eng.scheduler()
    params = SamplingParams(max_tokens=(k + 1) * (rounds + 2) * steps + 64, ignore_eos=True)
    seqs = [eng.new_sequence(list(range(5 + i, 37 + i)), params) for i in range(batch)]
    for s in seqs:
        sched.add(s)
    while not all(s.decoding for s in seqs):
        sched.step()
    for _ in range(2):
        sched.step()
    idle[0] = True
    for _ in range(3):
        sched.step()
    best = float("inf")
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(steps):
            sched.step()
        best = min(best, (time.thread_time() - start) / steps)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        sched.step()
    prof.disable()
    if any(s.finished for s in seqs) or sched.num_preemptions:
        raise SystemExit("a sequence finished or was preempted while measured: fewer --steps")
    sched.abort_all()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    parts = {f"{f}:{n}": 0.0 for f, n in WATCHED}
    for (file, _, name), (_, _, _, cum, _) in stats.items():
        for f, n in WATCHED:
            if file.endswith(f) and name == n:
                parts[f"{f}:{n}"] += 1e6 * cum / steps
    return {"us_per_step": 1e6 * best, "parts": {p: v for p, v in parts.items() if v}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--overlap", action="store_true", help="also with overlap scheduling (spec_overlap.py)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    for b in a.batch:
        for accept in (False, True):
            for overlap in (False, True) if a.overlap else (False,):
                m = measure(a.artifact, b, a.k, a.steps, overlap, accept)
                print(f"batch={b} k={a.k} {'accept' if accept else 'reject'} overlap={overlap}: "
                      f"{m['us_per_step']:.0f} us/step (thread CPU)")  # fmt: skip
                for p, v in sorted(m["parts"].items(), key=lambda x: -x[1]):
                    print(f"    {p:32s} {v:8.0f} us/step (profiled)")


if __name__ == "__main__":
    main()
