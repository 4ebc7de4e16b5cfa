"""The grammar-constrained sampler's overhead per decode step (structured output, constrain.py).

    python benchmarks/e2e/constrained_overhead.py ART --out constrained_overhead.json \
        [--batches 1,32] [--steps 64] [--warmup 8] [--prompt-len 16] [--device cuda]

For each batch size B, the same B requests (random prompts of --prompt-len ids, temperature 1,
seeded) decode --steps steps through the engine's Scheduler, once free and once every request
constrained by a JSON schema (an array of at least MIN_ITEMS objects with string, integer, enum and
boolean fields: the grammar cannot complete within the run, so every step masks every row).
Reported per B and mode: median and mean ms of a decode step (the forward, the mask, sampling and
the bookkeeping, synchronized), and for the constrained runs the mask alone: `mask_logits` (CPU
bitmask of every row, its copy to the device, the -inf fill; synchronized) and its CPU part
`token_bitmask`. overhead = constrained - free step (median). The first --warmup decode steps of
each run are not timed (CUDA graphs, caches). The grammar is compiled once before timing (its
compile time and llguidance's tokenizer set-up are reported apart). The baseline is the free step of the
same run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import mlac.runtime.engine.sequence as sequence_mod
from mlac.runtime.engine import constrain
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.params import GrammarSpec, SamplingParams

MIN_ITEMS = 1000  # items the array must hold: far more than --steps tokens can write
ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "active"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": ITEM, "minItems": MIN_ITEMS}


class Timed:
    """Wraps a function; records its wall ms per call, synchronizing `device` around it."""

    def __init__(self, fn, device: torch.device):
        self.fn, self.device, self.ms = fn, device, []

    def __call__(self, *args):
        sync(self.device)
        t = time.perf_counter()
        out = self.fn(*args)
        sync(self.device)
        self.ms.append((time.perf_counter() - t) * 1e3)
        return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(engine: Engine, batch: int, args, grammar: GrammarSpec | None) -> dict:
    """Decode `args.steps` timed steps of `batch` requests; ms per step (and per mask)."""
    vocab, dev = engine.config.vocab_size, engine.device
    total = args.warmup + args.steps + 2
    gen = torch.Generator().manual_seed(batch)
    sched = engine.scheduler()
    for i in range(batch):
        prompt = torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
        sp = SamplingParams(max_tokens=total, temperature=1.0, seed=i, ignore_eos=True, grammar=grammar)
        sched.add(engine.new_sequence(prompt, sp))
    while any(not s.decoding for s in sched.running) or sched.waiting:  # prefill
        sched.step()
    mask, bitmask = Timed(constrain.mask_logits, dev), Timed(constrain.token_bitmask, torch.device("cpu"))
    sequence_mod.mask_logits, constrain.token_bitmask = mask, bitmask
    steps = []
    try:
        for i in range(args.warmup + args.steps):
            sync(dev)
            t = time.perf_counter()
            sched.step()
            sync(dev)
            if i >= args.warmup:
                steps.append((time.perf_counter() - t) * 1e3)
        if len(sched.running) != batch:
            raise RuntimeError(f"{batch - len(sched.running)} requests finished before the end of the run")
    finally:
        sequence_mod.mask_logits, constrain.token_bitmask = mask.fn, bitmask.fn
        sched.abort_all()
    out = {"step_ms_median": statistics.median(steps), "step_ms_mean": statistics.mean(steps)}
    if grammar is not None:
        timed = slice(-args.steps, None)  # the mask calls of the timed steps
        out["mask_ms_median"] = statistics.median(mask.ms[timed])
        out["bitmask_cpu_ms_median"] = statistics.median(bitmask.ms[timed])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    engine = Engine.from_artifact(
        args.artifact, device=args.device, dtype=getattr(torch, args.dtype), verify=False
    )
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    t = time.perf_counter()
    engine.grammars.matcher(GrammarSpec("json_object", ""))  # llguidance's tokenizer, first use
    setup_ms = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    engine.grammars.matcher(spec)
    compile_ms = (time.perf_counter() - t) * 1e3
    results = {}
    for b in [int(x) for x in args.batches.split(",")]:
        free, constrained = run(engine, b, args, None), run(engine, b, args, spec)
        overhead = constrained["step_ms_median"] - free["step_ms_median"]
        results[str(b)] = {"free": free, "constrained": constrained, "overhead_ms": overhead,
                           "overhead_pct": 100 * overhead / free["step_ms_median"]}  # fmt: skip
        print(f"batch {b}: free {free['step_ms_median']:.3f} ms/step, constrained "
              f"{constrained['step_ms_median']:.3f} (mask {constrained['mask_ms_median']:.3f}, cpu bitmask "
              f"{constrained['bitmask_cpu_ms_median']:.3f}): +{overhead:.3f} ms")  # fmt: skip
    device = torch.cuda.get_device_name() if engine.device.type == "cuda" else platform.processor() or "cpu"
    record = {
        "artifact": str(args.artifact),
        "model_vocab": engine.config.vocab_size,
        "tokenizer_vocab": engine.tokenizer.vocab_size,
        "device": device,
        "torch": torch.__version__,
        "llguidance": __import__("llguidance").__version__,
        "schema": SCHEMA,
        "steps": args.steps,
        "llguidance_tokenizer_ms": setup_ms,
        "schema_compile_ms": compile_ms,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
