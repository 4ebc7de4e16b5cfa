"""The absorbed extend's attention (MQA over the cached latents, 576 / 512) at a cached burst's
shapes, under a sweep of launch configs: B sequences of `--q-len` new tokens after a `--prefix`-token
cached prefix (issue 15's workload: 64 after 2,000), 16 heads (V2-Lite).

    python3 benchmarks/bench_extend_absorbed.py --json out.json [--seqs 1,4,16,32]

Per shape and config: the median ms (triton.testing.do_bench), TFLOP/s, and the error against the
float32 reference (a config whose error is above 2e-2 is marked bad, whatever its time). The
default config (extend_attention.default_config) is marked; the fastest good one is reported.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mlac.kernels.attention.extend import default_config, extend_attention_ref, extend_attention_triton  # noqa: E402

LATENT, ROPE = 512, 64
SWEEP = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
         for m, n, w, s in itertools.product((32, 64), (16, 32, 64), (4, 8), (1, 2, 3))]  # fmt: skip


def shape_inputs(n_seq: int, q_len: int, prefix: int, heads: int):
    kv_len = prefix + q_len
    q = torch.randn(n_seq * q_len, heads, LATENT + ROPE, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(n_seq * kv_len, 1, LATENT + ROPE, device="cuda", dtype=torch.bfloat16)
    v = k[:, :, :LATENT]  # the latent: a view, as extend_absorbed passes it
    cu_q = torch.arange(n_seq + 1, device="cuda", dtype=torch.int32) * q_len
    cu_kv = torch.arange(n_seq + 1, device="cuda", dtype=torch.int32) * kv_len
    pairs = n_seq * (q_len * prefix + q_len * (q_len + 1) // 2)
    return q, k, v, cu_q, cu_kv, 2 * heads * pairs * (2 * LATENT + ROPE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--seqs", default="1,4,16,32")
    ap.add_argument("--q-len", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=2000)
    ap.add_argument("--heads", type=int, default=16)
    args = ap.parse_args()
    scale = 1 / math.sqrt(192)
    default = default_config(LATENT + ROPE, LATENT, torch.device("cuda"))
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "default": default,
        "shapes": [],
    }
    for n_seq in (int(x) for x in args.seqs.split(",")):
        q, k, v, cu_q, cu_kv, flops = shape_inputs(n_seq, args.q_len, args.prefix, args.heads)
        ref, _ = extend_attention_ref(q, k, v, cu_q, cu_kv, scale)
        rows = []
        inputs = (q, k, v, cu_q, cu_kv, args.q_len, scale)
        for cfg in SWEEP:
            row = dict(cfg, default=cfg == default)
            try:
                o = extend_attention_triton(*inputs, config=cfg)
                row["rel_err"] = float(((o.float() - ref.float()).norm() / ref.float().norm()).item())
                ms = do_bench(
                    lambda cfg=cfg, inputs=inputs: extend_attention_triton(*inputs, config=cfg), rep=100
                )
                row.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1), good=row["rel_err"] < 2e-2)
            except Exception as e:  # noqa: BLE001  (a config that does not fit is skipped, with its reason)
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
        good = [r for r in rows if r.get("good")]
        best = min(good, key=lambda r: r["ms"]) if good else None
        base = next((r for r in rows if r["default"]), None)
        out["shapes"].append(dict(n_seq=n_seq, q_len=args.q_len, prefix=args.prefix, heads=args.heads, flops=flops,
                                  best=best, default=base, configs=rows))  # fmt: skip
        print(f"{n_seq} x {args.q_len} after {args.prefix}: default {base and base.get('ms')} ms, best {best}",
              flush=True)  # fmt: skip
    args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
