"""Host work of a speculative decode step against a plain one, on CPU (no GPU needed).

    python benchmarks/e2e/spec_host.py ART [--batch 1] [--k 3] [--steps 12]

ART: a compiled artifact with an MTP layer (e.g. `mlac synth --preset tiny-v3` then `mlac compile`).
The runner gets DecodeGraphs / DraftGraphs / ChainGraphs objects without captured graphs, so every
"replay" runs its padded body eagerly, as on a GPU bucket that was not captured. Per decode step it
reports the torch ops launched from Python OUTSIDE the graph bodies (on a GPU each of those is a
launch or a copy from the host; the bodies are one replay each), the graph replays, the host syncs
(spec_exec.to_host), the wall ms per step with and without the bodies' time, and the ms of as many
more steps whose bodies do nothing (the host's work alone, less noisy on a shared CPU). Modes: plain
(K = 0), spec (the per-replay path: DecodeGraphs + DraftGraphs), chain (one ChainGraphs replay).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mlac.runtime.worker.spec_exec as spec_exec
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.engine.scheduler import SchedulerConfig
from mlac.runtime.worker.graphs import DecodeGraphs
from mlac.runtime.worker.spec_chain import ChainGraphs
from mlac.runtime.worker.spec_graphs import DraftGraphs

BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128]


class Counter(TorchDispatchMode):
    """Counts aten ops, except while `inside` (a graph body)."""

    def __init__(self):
        super().__init__()
        self.ops, self.inside, self.replays, self.body_s = 0, 0, 0, 0.0
        self.skip = False  # bodies do nothing (their outputs stay stale): the host's time alone

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def wrap_body(obj, counter: Counter) -> None:
    step = obj._step

    def body(bs):
        counter.inside += 1
        counter.replays += 1
        start = time.perf_counter()
        try:
            if not counter.skip:
                step(bs)
        finally:
            counter.inside -= 1
            counter.body_s += time.perf_counter() - start

    obj._step = body


def measure(path: str, batch: int, k: int, chain: bool, steps: int) -> dict:
    config = SchedulerConfig(speculative_num_steps=k, overlap=False)
    eng = Engine.from_artifact(path, dtype=torch.float32, verify=False, scheduler=config)
    r, counter = eng.runner, Counter()
    r.graphs = DecodeGraphs(r.model, r.cache, BUCKETS, eng.max_context, keep_hidden=k > 0)
    wrap_body(r.graphs, counter)
    if k:
        r.draft_graphs = DraftGraphs(r.model, r.cache, BUCKETS, eng.max_context)
        wrap_body(r.draft_graphs, counter)
        ex = r.spec_executor()
        if chain:  # the executor would make it at the scheduler's start: made here to count its body apart
            chains = ChainGraphs(r.model, r.cache, [1, 2, 4, 8, 16, 32], r.graphs.inputs.max_blocks * 16, k)
            wrap_body(chains, counter)
            ex.chains[k] = chains
        else:  # the per-replay path
            ex._make_chain = lambda k: None
    syncs = [0]
    to_host = spec_exec.to_host

    def counted(x):
        syncs[0] += 1
        return to_host(x)

    spec_exec.to_host = counted
    import mlac.runtime.engine.spec.decode as spec_decode

    spec_decode.to_host = counted
    sched = eng.scheduler()
    params = SamplingParams(max_tokens=12 * steps + 16, ignore_eos=True)
    seqs = [eng.new_sequence(list(range(5 + i, 37 + i)), params) for i in range(batch)]
    for s in seqs:
        sched.add(s)
    while not all(s.decoding for s in seqs):
        sched.step()
    for _ in range(2):
        sched.step()
    tokens0 = sum(len(s.output_ids) for s in seqs)
    counter.ops = counter.replays = syncs[0] = 0
    counter.body_s = 0.0
    start = time.perf_counter()
    with counter:
        for _ in range(steps):
            sched.step()
    wall = time.perf_counter() - start
    tokens = sum(len(s.output_ids) for s in seqs) - tokens0
    replays, synced = counter.replays, syncs[0]
    counter.skip = True
    start = time.perf_counter()
    for _ in range(steps):
        sched.step()
    host_only = time.perf_counter() - start
    sched.abort_all()
    spec_exec.to_host = spec_decode.to_host = to_host
    return {
        "mode": "plain" if not k else ("chain" if chain else "spec"),
        "batch": batch,
        "k": k,
        "ops_per_step": counter.ops / steps,
        "replays_per_step": replays / steps,
        "syncs_per_step": synced / steps,
        "tokens_per_step": tokens / steps,
        "wall_ms_per_step": 1e3 * wall / steps,
        "host_ms_per_step": 1e3 * (wall - counter.body_s) / steps,
        "host_only_ms_per_step": 1e3 * host_only / steps,  # the same steps with bodies that do nothing
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    torch.set_num_threads(1)
    for b in a.batch:
        for k, chain in ((0, False), (a.k, False), (a.k, True)):
            m = measure(a.artifact, b, k, chain, a.steps)
            print(
                "  ".join(f"{key}={v:.2f}" if isinstance(v, float) else f"{key}={v}" for key, v in m.items())
            )


if __name__ == "__main__":
    main()
