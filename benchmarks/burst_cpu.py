"""Issue 15's burst on CPU: per-request latency of a burst sharing one system prompt, cold then cached.

    python benchmarks/burst_cpu.py ART [--system-len 256 --suffix-len 64 --burst 32 --gap-ms 1]
        [--overlap] [--no-graphs] [--trace]

The engine as `mlac serve` runs it on a GPU, in this process and on the CPU: EngineLoop (the
engine's thread, its inbox) over a Scheduler whose runner has DecodeGraphs (not captured on CPU:
each bucket runs eagerly, padded and flattened as a replay would), the overlap scheduler when
`--overlap`. A feeder thread submits `--burst` requests `--gap-ms` apart (as HTTP requests reach
the engine one by one), each asking for one token; the latency of each is submit to its finished
Delta. Then the same burst again with new suffixes (cached: each prefills only its suffix).
`--trace` prints each engine step: the plan's sequences and tokens, and its seconds.

The engine is warmed up first as a server on CUDA is (Engine.warmup, forced): every grouped-MoE
tile config (moe.pick_moe_config) that a step meets while serving and the warm-up did not is a
Triton JIT compile on a GPU, in the middle of the burst, prepared artifact or not (`mlac prepare`
compiles what the warm-up meets): the script counts them per burst and marks their steps (`JIT`).
Synthesize the artifact with the real model's experts and top-k for its configs (V2-Lite: 64 and 6,
`mlac synth --from-config` of tiny-v2-lite's config.json with those two changed): issue 15's
cached burst split into steps of 257-1,365 tokens, whose two MoE configs the warm-up never met.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

import torch

from mlac.kernels.moe.grouped import pick_moe_config
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.sampling import SamplingParams
from mlac.runtime.engine.scheduler import Scheduler, SchedulerConfig
from mlac.runtime.model import model as model_module
from mlac.runtime.serve.loop import EngineLoop
from mlac.runtime.serve.metrics import MetricsRecorder
from mlac.runtime.worker.graphs import DecodeGraphs


class Clock:
    """EngineLoop's outlet: the time each request's final Delta was posted."""

    def __init__(self):
        self.done: dict[int, float] = {}
        self.event = threading.Event()
        self.expect = 0

    def post(self, sink, item) -> None:
        if getattr(item, "finish_reason", None) is not None or isinstance(item, BaseException):
            self.done[sink] = time.perf_counter()
            if len(self.done) >= self.expect:
                self.event.set()

    def end(self, sink) -> None:
        pass

    def send(self) -> None:
        pass


class MoeConfigs:
    """The grouped-MoE tile configs met (model.fused_moe wrapped): `warm` those of the warm-up,
    `new` those met after it that it had not met (a JIT compile each on a GPU)."""

    def __init__(self):
        self.warm: set = set()
        self.new: set = set()
        self.serving = False
        self.step_new = False
        fused_moe = model_module.fused_moe

        def spy(x, w13, w2, weights, ids, *args, **kwargs):
            config = pick_moe_config(ids.numel(), w13.shape[0], kwargs.get("w13_scale", args[0]) is not None)
            if not self.serving:
                self.warm.add(config)
            elif config not in self.warm and config not in self.new:
                self.new.add(config)
                self.step_new = True
            return fused_moe(x, w13, w2, weights, ids, *args, **kwargs)

        model_module.fused_moe = spy


def build(args, configs: MoeConfigs) -> Engine:
    sched = SchedulerConfig(overlap=args.overlap)
    engine = Engine.from_artifact(args.artifact, dtype=torch.float32, verify=False, scheduler=sched)
    if not args.no_graphs:
        buckets = [b for b in (1, 2, 4, 8, 16, 32, 48, 64, 128, 256)]
        engine.runner.graphs = DecodeGraphs(engine.runner.model, engine.cache, buckets, engine.max_context)
    engine.warmup(force=True)  # as a server on CUDA (and `mlac prepare`) does
    configs.serving = True
    return engine


def traced(trace: list, configs: MoeConfigs) -> None:
    """Scheduler.step wrapped: (seconds, plan as (sequences, tokens), news, waiting, whether it
    met a MoE config the warm-up did not) per step."""
    step, schedule = Scheduler.step, Scheduler._schedule

    def plan_of(self):
        plan = schedule(self)
        self._last_plan = (len(plan), sum(n for _, n in plan))
        return plan

    def timed(self):
        self._last_plan, configs.step_new = (0, 0), False
        t0 = time.perf_counter()
        news = step(self)
        trace.append(
            (time.perf_counter() - t0, self._last_plan, len(news), self.num_waiting, configs.step_new)
        )
        return news

    Scheduler.step, Scheduler._schedule = timed, plan_of


def burst(loop: EngineLoop, clock: Clock, prompts: list[list[int]], gap_s: float) -> list[float]:
    """Submit `prompts` `gap_s` apart; each one's latency in ms (submit to finished)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    clock.done, clock.expect = {}, len(prompts)
    clock.event.clear()
    sent = {}
    for p in prompts:
        seq = loop.engine.new_sequence(p, params)
        sent[seq.seq_id] = time.perf_counter()
        loop.submit([seq], [seq.seq_id])
        time.sleep(gap_s)
    clock.event.wait(600)
    return [1000 * (clock.done[i] - t) for i, t in sent.items()]


def report(name: str, ms: list[float]) -> None:
    ms = sorted(ms)
    print(f"{name}: p50 {statistics.median(ms):.1f} mean {statistics.fmean(ms):.1f} max {ms[-1]:.1f} ms;"
          f" sorted: {' '.join(f'{x:.0f}' for x in ms)}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("--system-len", type=int, default=256)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--burst", type=int, default=32)
    ap.add_argument("--gap-ms", type=float, default=1.0)
    ap.add_argument("--overlap", action="store_true")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--trace", action="store_true")
    args = ap.parse_args()
    trace: list = []
    configs = MoeConfigs()
    traced(trace, configs)
    clock = Clock()
    loop = EngineLoop(
        lambda: build(args, configs), MetricsRecorder(), 1024, stats_interval=None, outlet=clock
    )
    loop.start()
    while not loop.ready:
        time.sleep(0.05)
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(3, loop.engine.config.vocab_size) for _ in range(n)]  # noqa: E731
    burst(loop, clock, [ids(args.system_len + args.suffix_len)], 0)  # warm-up
    system = ids(args.system_len)
    for name in ("cold", "cached"):
        trace.clear()
        configs.new = set()
        ms = burst(
            loop, clock, [system + ids(args.suffix_len) for _ in range(args.burst)], args.gap_ms / 1000
        )
        report(name, ms)
        steps = [n_tok for _, (_, n_tok), *_ in trace if n_tok]
        print(
            f"  {len(steps)} steps of {steps} tokens; MoE configs the warm-up did not meet: {len(configs.new)}"
        )
        if args.trace:
            for sec, (n_seq, n_tok), news, waiting, new in trace:
                jit = "  JIT" if new else ""
                print(
                    f"  step {1000 * sec:7.1f} ms: {n_seq} seqs {n_tok} tokens, {news} news, {waiting} waiting{jit}"
                )
    loop.stop()


if __name__ == "__main__":
    main()
