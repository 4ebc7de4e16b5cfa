"""Multi-rank on GPUs: a tp=N artifact against the 1-GPU artifact of the same checkpoint.

    python benchmarks/multirank_gpu.py --one out-tp1/ --many out-tp2/ --json result.json

For each artifact: load time (Engine.from_artifact to ready; sizes checked, sha256 not
re-hashed: `mlac verify` does that), logits on probe prompts, and decode tokens/s at batch 1 and 32
(greedy, EOS ignored; decode time = time(prefill + N steps) - time(prefill + 1 step)).
The tp=N logits are compared with the 1-GPU logits (max relative error, rel_l2, top-1).
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import date

import torch

from mlac.artifact import Manifest
from mlac.runtime.engine import Engine

PROMPT_LEN = 64
DECODE_STEPS = 64


def prompts(vocab: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (PROMPT_LEN,), generator=g).tolist() for _ in range(n)]


def timed_generate(engine: Engine, batch: int, steps: int) -> float:
    ids = prompts(engine.config.vocab_size, batch)
    from mlac.runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate_batch(ids, params)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(path: str, dtype: torch.dtype) -> tuple[dict, torch.Tensor]:
    m = Manifest.load(path)
    out: dict = {"artifact": path, "tp": m.plan.tp, "ep": m.plan.ep, "fp8": m.options.fp8,
                 "bytes": sum(f.size for f in m.files)}  # fmt: skip
    start = time.perf_counter()
    engine = Engine.from_artifact(path, device="cuda", dtype=dtype, verify=False, kv_cache_bytes=8 << 30)
    out["load_seconds_no_hash"] = round(time.perf_counter() - start, 2)
    logits = torch.cat([engine.score(p).cpu() for p in prompts(engine.config.vocab_size, 4)])
    timed_generate(engine, 1, 2)  # warm-up (Triton compiles)
    timed_generate(engine, 32, 2)
    for batch in (1, 32):
        t1 = timed_generate(engine, batch, 1)
        tn = timed_generate(engine, batch, DECODE_STEPS + 1)
        out[f"decode_tokens_per_s_batch{batch}"] = round(batch * DECODE_STEPS / (tn - t1), 1)
        out[f"decode_step_ms_batch{batch}"] = round(1000 * (tn - t1) / DECODE_STEPS, 2)
    engine.close()
    del engine
    torch.cuda.empty_cache()
    return out, logits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", required=True, help="the 1-GPU artifact")
    ap.add_argument("--many", required=True, help="the multi-rank artifact")
    ap.add_argument("--json", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    one, ref = measure(args.one, dtype)
    many, got = measure(args.many, dtype)
    got, ref = got.double(), ref.double()
    result = {
        "benchmark": "multi-rank vs 1-GPU artifact",
        "date": date.today().isoformat(),
        "device": torch.cuda.get_device_name(),
        "gpus": torch.cuda.device_count(),
        "versions": {"torch": torch.__version__, "triton": __import__("triton").__version__},
        "dtype": args.dtype,
        "prompt_len": PROMPT_LEN,
        "decode_steps": DECODE_STEPS,
        "one_gpu": one,
        "multi_rank": many,
        "logits_vs_one_gpu": {
            "max_rel": float((got - ref).abs().max() / ref.abs().max()),
            "rel_l2": float((got - ref).norm() / ref.norm()),
            "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).double().mean()),
        },
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
