"""mlac's fused MoE against DeepGEMM's grouped GEMMs, side by side on one GPU, FP8 experts at prefill sizes.

    . benchmarks/kernels/deepgemm_env.sh    # DeepGEMM from its sources (see that script)
    python benchmarks/kernels/moe_peers.py --json kernels_moe_peers_deepgemm_h200.json

Shapes: V2-Lite's routed experts (64 of width 1,408 over 2,048, top 6) and a V3 expert-parallel slice
(64 of V3's 256 experts, width 2,048 over 7,168, top 8: one rank of EP 4), T = 512 and 4,096 tokens,
each token's experts drawn uniformly (balanced on average). Block-FP8 weights (e4m3, 128x128 float32
scales), bf16 activations. Timed, in CUDA graphs (timing.graph_us):

  mlac_moe       fused_moe: the whole routed MoE (align, act_quant, GEMM1 with SiLU*up and the FP8
                 re-quantization in its epilogue, GEMM2, the weighted top-k sum)
  mlac_gemms     moe_grouped_gemms: the same without the top-k sum
  deepgemm       DeepGEMM's m_grouped_gemm_fp8_fp8_bf16_nt_contiguous for GEMM1 and GEMM2 on rows already
                 permuted by expert and padded to its 128-row alignment, with mlac's silu_mul_quant between
                 them and the scales' layout for GEMM2 (get_col_major_tma_aligned_tensor); the permutation,
                 the first quantization and the top-k sum are left out (an expert-parallel dispatch does them)

So `deepgemm` does less than `mlac_gemms` (no align, no act_quant): its time is a lower bound of that
pipeline's. Each row: microseconds, mlac over DeepGEMM, the fraction of the ceiling (the expert weights
the tokens touch, read once, over the device-copy bandwidth; the FLOPs over the fp8 rate), and the
relative error of DeepGEMM's pair outputs against mlac's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from timing import copy_gbps, graph_us  # noqa: E402

from mlac.core.fp8 import BLOCK, FP8  # noqa: E402
from mlac.kernels.activation import silu_mul_quant  # noqa: E402
from mlac.kernels.fp8_quant import act_quant  # noqa: E402
from mlac.kernels.moe.fused import fused_moe  # noqa: E402
from mlac.kernels.moe.grouped import moe_grouped_gemms, pick_moe_config  # noqa: E402

DEV = "cuda"
# name: (experts, top_k, hidden D, expert width I)
SHAPES = {"v2-lite": (64, 6, 2048, 1408), "v3 ep4 slice": (64, 8, 7168, 2048)}
TOKENS = (512, 4096)


def experts(e: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 weights [E, N, K] and 128x128 block scales [E, N/128, K/128] (about unit-RMS products)."""
    w = torch.empty(e, n, k, dtype=FP8, device=DEV)
    for j in range(e):  # one expert at a time: a float32 [E, N, K] would not fit beside the rest
        w[j] = (torch.randn(n, k, device=DEV) * 0.5).to(FP8)
    s = torch.full((e, -(-n // BLOCK), -(-k // BLOCK)), 2.0 / k**0.5, device=DEV)
    return w, s


def deepgemm_pipeline(dg, x, ids, w13, s13, w2, s2):
    """(the timed call, the pair -> row map [T * top_k], its output [rows, D]): rows grouped by expert,
    each expert's rows padded to DeepGEMM's alignment."""
    e, align = w13.shape[0], dg.get_m_alignment_for_contiguous_layout()
    flat = ids.flatten().long()  # pair p = t * top_k + j
    counts = torch.bincount(flat, minlength=e)
    padded = (counts + align - 1) // align * align
    starts = torch.cumsum(padded, 0) - padded
    order = torch.argsort(flat, stable=True)  # pairs by expert
    rank = torch.arange(flat.numel(), device=DEV) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    row_of_pair = torch.empty_like(flat)
    row_of_pair[order] = starts[flat[order]] + rank
    rows = int(padded.sum())
    m_indices = torch.repeat_interleave(torch.arange(e, device=DEV, dtype=torch.int32), padded)
    xp = torch.zeros(rows, x.shape[1], dtype=x.dtype, device=DEV)
    xp[row_of_pair] = x[torch.arange(flat.numel(), device=DEV) // ids.shape[1]]
    a, a_s = act_quant(xp)
    a_s = dg.get_col_major_tma_aligned_tensor(a_s)
    h = torch.empty(rows, w13.shape[1], dtype=torch.bfloat16, device=DEV)
    y = torch.empty(rows, w2.shape[1], dtype=torch.bfloat16, device=DEV)

    def call():
        dg.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous((a, a_s), (w13, s13), h, m_indices)
        act = silu_mul_quant(h)
        hs = dg.get_col_major_tma_aligned_tensor(act.scale)
        dg.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous((act.q, hs), (w2, s2), y, m_indices)

    return call, row_of_pair, y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="T values, comma-separated")
    ap.add_argument(
        "--fp8-tflops", type=float, default=1223.0, help="the fp8 ceiling (DESIGN's measured rate)"
    )
    args = ap.parse_args()
    import deep_gemm as dg

    torch.manual_seed(0)
    bw, rows = copy_gbps(), []
    for name, (e, top_k, d, i) in SHAPES.items():
        w13, s13 = experts(e, 2 * i, d)
        w2, s2 = experts(e, d, i)
        for t in map(int, args.tokens.split(",")):
            x = torch.randn(t, d, device=DEV, dtype=torch.bfloat16)
            ids = torch.rand(t, e, device=DEV).topk(top_k, dim=1).indices.to(torch.int32).contiguous()
            weights = torch.rand(t, top_k, device=DEV).softmax(dim=1)
            cfg = pick_moe_config(t * top_k, e, fp8=True)
            mlac_moe = graph_us([partial(fused_moe, x, w13, w2, weights, ids, s13, s2, use_triton=True)])
            gemms = partial(moe_grouped_gemms, x, w13, w2, ids, s13, s2, None, cfg)
            mlac_gemms = graph_us([gemms])
            call, row_of_pair, y_dg = deepgemm_pipeline(dg, x, ids, w13, s13, w2, s2)
            deepgemm = graph_us([call])
            call()
            y_mlac = gemms().float()
            err = ((y_dg[row_of_pair].float() - y_mlac).norm() / y_mlac.norm()).item()
            touched = int(torch.unique(ids).numel())
            nbytes = touched * 3 * i * d + t * d * 2 * 2
            floor_us = max(nbytes / (bw * 1e3), 2 * t * top_k * 3 * i * d / (args.fp8_tflops * 1e6))
            rows.append(dict(shape=name, experts=e, top_k=top_k, hidden=d, width=i, tokens=t,
                             mlac_moe_us=round(mlac_moe, 1), mlac_gemms_us=round(mlac_gemms, 1),
                             deepgemm_us=round(deepgemm, 1), ratio=round(mlac_gemms / deepgemm, 3),
                             mlac_fraction=round(floor_us / mlac_gemms, 3), deepgemm_fraction=round(floor_us / deepgemm, 3),
                             rel_err=round(err, 4)))  # fmt: skip
            r = rows[-1]
            print(f"{name:13} T={t:5}  mlac moe {r['mlac_moe_us']:8.1f} us  gemms {r['mlac_gemms_us']:8.1f} us  "
                  f"DeepGEMM {r['deepgemm_us']:8.1f} us  mlac/DeepGEMM {r['ratio']:.2f}  "
                  f"{r['mlac_fraction']:.0%} / {r['deepgemm_fraction']:.0%} of ceiling  rel err {err:.4f}", flush=True)  # fmt: skip
            record = dict(benchmark="fused MoE (block FP8): mlac against DeepGEMM's grouped GEMMs",
                          device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                          python=platform.python_version(), deepgemm=os.environ.get("DEEPGEMM_SOURCE", "installed"),
                          copy_gb_per_s=round(bw, 1), fp8_tflops_ceiling=args.fp8_tflops, rows=rows,
                          command=f"python benchmarks/kernels/moe_peers.py --tokens {args.tokens} --json RECORD")  # fmt: skip
            if args.json:
                args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
