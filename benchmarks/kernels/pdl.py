"""Programmatic dependent launch (PDL) on a chain of small dependent mlac kernels, on one GPU.

    python benchmarks/kernels/pdl.py [--kernels 500] [--out results.json]

A batch-1 decode step is hundreds of latency-bound kernels, each depending on the one before.
Two such chains, each captured in one CUDA graph and replayed:
  norm: `rms_norm` with a residual on [1, 2048], every call reading the one before (the smallest
        kernel mlac has: what a launch costs at all);
  mlp:  the dense MLP of a decode layer at V2-Lite's width, block after block: rms_norm_quant ->
        fp8 w13 GEMM [2816, 2048] -> silu_mul_quant -> fp8 w2 GEMM [2048, 1408] (4 kernels a block).
The switch is read once per process (mlac.kernels._triton), so the chains run in two child
processes, MLAC_PDL=1 and MLAC_PDL=0. Each prints us per replay and per kernel (median of timed
replays); the parent prints the saving. The floor, measured in the same children: a graph of as
many one-element `add_` kernels (no PDL): the per-node cost of a graph replay. Under 60 s on an H200.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
from timing import graph_us

ROOT = Path(__file__).resolve().parents[2]
D, INTER = 2048, 1408  # V2-Lite hidden size and expert width
REPLAYS = 30


def norm_chain(n: int, device: str = "cuda"):
    """n dependent rms_norm launches on [1, D] (each reads the previous one's outputs)."""
    from mlac.kernels.norm_rope import rms_norm

    x = torch.randn(1, D, device=device, dtype=torch.bfloat16)
    w = torch.rand(D, device=device, dtype=torch.bfloat16) + 0.5

    def step():
        h, r = x, x
        for _ in range(n):
            h, r = rms_norm(h, w, 1e-6, residual=r)

    return step, n


def _fp8_weight(n: int, k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-FP8 weight [n, k] and its scales (random: only the time counts)."""
    w = (torch.randn(n, k, device=device) * 0.5).to(torch.float8_e4m3fn)
    return w, torch.full((-(-n // 128), -(-k // 128)), 0.02, device=device)


def mlp_chain(n: int, device: str = "cuda"):
    """n // 4 dense FP8 MLP blocks at batch 1, the output of each the input of the next."""
    from mlac.kernels.activation import silu_mul_quant
    from mlac.kernels.gemm.fp8_gemm import fp8_linear
    from mlac.kernels.norm_rope import rms_norm_quant

    x = torch.randn(1, D, device=device, dtype=torch.bfloat16)
    norm = torch.rand(D, device=device, dtype=torch.bfloat16) + 0.5
    w13, s13 = _fp8_weight(2 * INTER, D, device)
    w2, s2 = _fp8_weight(D, INTER, device)

    def step():
        h, r = x, x
        for _ in range(n // 4):
            act, r = rms_norm_quant(h, norm, 1e-6, residual=r)  # [1, D] e4m3 + scales
            h = fp8_linear(silu_mul_quant(fp8_linear(act, w13, s13)), w2, s2)  # [1, D] bf16

    return step, n // 4 * 4


def floor_chain(n: int, device: str = "cuda"):
    """n one-element add_ kernels: what one graph node costs without any work or PDL."""
    x = torch.zeros(1, device=device)

    def step():
        for _ in range(n):
            x.add_(1.0)

    return step, n


def child(n: int) -> dict:
    from mlac.kernels import _triton

    out = {"pdl": None}
    for name, build in (("floor", floor_chain), ("norm", norm_chain), ("mlp", mlp_chain)):
        step, kernels = build(n)
        us = graph_us([step], replays=REPLAYS)
        out[name] = {
            "kernels": kernels,
            "us_per_replay": round(us, 1),
            "us_per_kernel": round(us / kernels, 3),
        }
    out["pdl"], out["triton"] = _triton.pdl_on(), _triton.triton.__version__
    return out


def run_child(n: int, pdl: bool) -> dict:
    env = {
        **os.environ,
        "MLAC_PDL": "1" if pdl else "0",
        "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
    }
    cmd = [sys.executable, __file__, "--child", "--kernels", str(n)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise SystemExit(f"error: the MLAC_PDL={int(pdl)} child failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", type=int, default=500, help="kernels per chain (about)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: pdl.py needs a CUDA GPU")
    if args.child:
        print(json.dumps(child(args.kernels)))
        return
    on, off = run_child(args.kernels, True), run_child(args.kernels, False)
    if not on["pdl"]:
        print("NOTE: PDL is not supported here (needs sm >= 90): both runs launched without it")
    rows = {}
    for name in ("norm", "mlp"):
        a, b = on[name], off[name]
        rows[name] = {
            "kernels": a["kernels"],
            "us_per_kernel_pdl": a["us_per_kernel"],
            "us_per_kernel_plain": b["us_per_kernel"],
            "saved_us_per_kernel": round(b["us_per_kernel"] - a["us_per_kernel"], 3),
            "speedup": round(b["us_per_replay"] / a["us_per_replay"], 3),
            "floor_over_pdl": round(on["floor"]["us_per_kernel"] / a["us_per_kernel"], 3),
        }
        print(f"{name:5s} {a['kernels']} kernels: {a['us_per_kernel']:.2f} us/kernel with PDL, "
              f"{b['us_per_kernel']:.2f} without ({rows[name]['speedup']:.2f}x); "
              f"graph-node floor {on['floor']['us_per_kernel']:.2f} us")  # fmt: skip
    if args.out:
        record = {
            "bench": "pdl",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": on["triton"],
            "python": platform.python_version(),
            "pdl_supported": on["pdl"],
            "floor_us_per_kernel": on["floor"]["us_per_kernel"],
            "chains": rows,
            "raw": {"pdl": on, "plain": off},
        }
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
