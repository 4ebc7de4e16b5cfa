"""Multi-rank artifacts against the 1-GPU artifact of the same checkpoint.

    python benchmarks/e2e/multirank.py --one out-tp1/ --many out-tp2/ [out-tp4/ ...] --json result.json
        [--skip-decode] [--device cuda|cpu]

For each artifact: load time (Engine.from_artifact to ready; sizes checked, sha256 not
re-hashed: `mlac verify` does that), logits on probe prompts, and (unless --skip-decode) decode
tokens/s at batch 1 and 32 (greedy, EOS ignored; decode time = time(prefill + N steps) -
time(prefill + 1 step)). Each --many artifact's logits are compared with --one's (max relative
error, rel_l2, top-1) under "multi_rank"[i]["logits_vs_one_gpu"]. The JSON is rewritten after
every artifact; one that fails to load or run is recorded with its error and the next one runs.
The baseline is the 1-GPU artifact: logits within bf16 rounding of the rank partial sums.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date

import torch

from mlac.core.artifact import Manifest
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.params import SamplingParams

PROMPT_LEN = 64
DECODE_STEPS = 64
PROBES = 4


def prompts(vocab: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (PROMPT_LEN,), generator=g).tolist() for _ in range(n)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_generate(engine: Engine, batch: int, steps: int) -> float:
    ids = prompts(engine.config.vocab_size, batch)
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    sync(engine.device.type)
    start = time.perf_counter()
    engine.generate(ids, params)
    sync(engine.device.type)
    return time.perf_counter() - start


def decode_rates(engine: Engine) -> dict:
    out = {}
    timed_generate(engine, 1, 2)  # warm-up (Triton compiles)
    timed_generate(engine, 32, 2)
    for batch in (1, 32):
        t1 = timed_generate(engine, batch, 1)
        tn = timed_generate(engine, batch, DECODE_STEPS + 1)
        out[f"decode_tokens_per_s_batch{batch}"] = round(batch * DECODE_STEPS / (tn - t1), 1)
        out[f"decode_step_ms_batch{batch}"] = round(1000 * (tn - t1) / DECODE_STEPS, 2)
    return out


def measure(path: str, args) -> tuple[dict, torch.Tensor]:
    """Load, score the probes (logits [PROBES * PROMPT_LEN, V] float32 on CPU), time decode."""
    m = Manifest.load(path)
    out: dict = {"artifact": path, "tp": m.plan.tp, "ep": m.plan.ep, "fp8": m.options.fp8,
                 "bytes": sum(f.size for f in m.files)}  # fmt: skip
    kv_bytes = 8 << 30 if args.device.startswith("cuda") else None  # CPU: the default budget
    start = time.perf_counter()
    engine = Engine.from_artifact(
        path, device=args.device, dtype=args.dtype, verify=False, kv_cache_bytes=kv_bytes
    )
    try:
        out["load_seconds_no_hash"] = round(time.perf_counter() - start, 2)
        logits = torch.cat([engine.score(p).cpu() for p in prompts(engine.config.vocab_size, PROBES)])
        if not args.skip_decode:
            out.update(decode_rates(engine))
    finally:
        engine.close()
        del engine
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out, logits


def compare(got: torch.Tensor, ref: torch.Tensor) -> dict:
    got, ref = got.double(), ref.double()
    return {
        "max_rel": float((got - ref).abs().max() / ref.abs().max()),
        "rel_l2": float((got - ref).norm() / ref.norm()),
        "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).double().mean()),
    }


def save(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", required=True, help="the 1-GPU artifact (the reference)")
    ap.add_argument("--many", required=True, nargs="+", help="multi-rank artifacts, each compared with --one")
    ap.add_argument("--json", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--skip-decode", action="store_true", help="load and logits only")
    args = ap.parse_args()
    dtype_name, args.dtype = args.dtype, getattr(torch, args.dtype)
    cuda = args.device.startswith("cuda")
    result = {
        "benchmark": "multi-rank vs 1-GPU artifact",
        "date": date.today().isoformat(),
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
        "gpus": torch.cuda.device_count() if cuda else 0,
        "versions": {"torch": torch.__version__, "triton": _version("triton")},
        "dtype": dtype_name,
        "prompt_len": PROMPT_LEN,
        "probes": PROBES,
        "decode_steps": None if args.skip_decode else DECODE_STEPS,
        "one_gpu": None,
        "multi_rank": [],
    }
    result["one_gpu"], ref = measure(args.one, args)
    save(args.json, result)
    print(json.dumps(result["one_gpu"]), flush=True)
    for path in args.many:
        try:
            many, got = measure(path, args)
            many["logits_vs_one_gpu"] = compare(got, ref)
        except Exception as e:  # noqa: BLE001  (recorded; the next artifact still runs)
            many = {"artifact": path, "error": f"{type(e).__name__}: {e}"}
        result["multi_rank"].append(many)
        save(args.json, result)
        print(json.dumps(many), flush=True)


def _version(pkg: str) -> str | None:
    try:
        return __import__(pkg).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    main()
