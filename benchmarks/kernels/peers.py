"""mlac's block-FP8 GEMM against cuBLAS and DeepGEMM, side by side on one GPU, at DeepSeek's linear shapes.

    python benchmarks/kernels/peers.py --json kernels_peers_h200.json [--rows 1,32,64,128,256]

For each shape (V2-Lite's and V3's attention and dense-MLP projections, TP 1) and M rows (default
1, 32, 64, 128, 256):

  mlac       fp8_linear: bf16 activations quantized per token per 128 channels, e4m3 weights with
             128x128 float32 block scales (the artifact's format), bf16 out; at M <= 16 also the
             skinny decode GEMM (skinny_linear)
  route      mlac's cuBLAS route (kernels/gemm/fp8_cublas.py), end to end: a bf16 x quantized by
             act_quant's m_major launch, then cuBLAS (`mlac_cublas_us`); and from an Fp8Act its
             producer made (the scales relaid for cuBLAS, `mlac_cublas_act_us`) beside the Triton
             GEMM on the same Fp8Act (`mlac_act_gemm_us`), wherever cuBLAS takes the shape
             (fp8_cublas.cublas_shape), whatever the rule; `route` says which path the model takes
             (fp8_cublas.cublas_takes) and `mlac_us` is that path's time for a bf16 x
  cuBLAS     torch._scaled_mm with the same block scaling where this torch and cuBLAS have it
             (1x128 activation blocks, 128x128 weight blocks: the peer of mlac's exact format),
             else rowwise scaling (one scale per row and per column: a coarser format, the only one
             cuBLAS offers there; said in the record); the activations quantized beforehand (not timed)
  bf16       torch.nn.functional.linear on bf16 weights: what FP8 halves the bytes of
  DeepGEMM   where `deep_gemm` imports (not in the GPU image: its Python-JIT release built there from
             its sources and CUTLASS's headers, see benchmarks/README.md): gemm_fp8_fp8_bf16_nt on the
             same operands (1x128 activation scales, 128x128 weight scales: mlac's exact format), the
             activations quantized and their scales laid out beforehand (not timed), as for cuBLAS;
             `deepgemm_us` null with `deepgemm_error` where it refuses the shape

Times: the median of graph replays (timing.graph_us). Each row: microseconds, mlac (the path the model
takes) over cuBLAS (the ratio: < 1 is faster; cuBLAS's time leaves out the activation quantization, the
route's includes it), and the fraction of the ceiling: the bytes the call must read (weights, scales,
activations) over the device-copy bandwidth measured in this run (decode, memory-bound), and the FLOPs
over the fp8 rate (a large M). The record is written after every row (a run cut short keeps its rows).
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

from mlac.core.fp8 import FP8, dequantize_blocks, quantize_blocks  # noqa: E402
from mlac.kernels.fp8_quant import Fp8Act, act_quant  # noqa: E402
from mlac.kernels.gemm.fp8_cublas import (  # noqa: E402
    cublas_fp8_linear,
    cublas_shape,
    cublas_takes,
    cublas_unavailable,
)
from mlac.kernels.gemm.fp8_gemm import fp8_linear, quantize_act_ref  # noqa: E402
from mlac.kernels.gemm.gemv import skinny_linear  # noqa: E402

DEV = "cuda"
# (name, K, N): y [M, N] = x [M, K] @ W.T
SHAPES = [
    ("v2-lite q_proj", 2048, 3072),
    ("v2-lite o_proj", 2048, 2048),
    ("v2-lite dense w13", 2048, 2 * 10944),
    ("v2-lite dense w2", 10944, 2048),
    ("v3 qkv_a", 7168, 1536 + 576),
    ("v3 q_b", 1536, 128 * 192),
    ("v3 o_proj", 16384, 7168),
    ("v3 dense w13", 7168, 2 * 18432),
    ("v3 dense w2", 18432, 7168),
]
ROWS = (1, 32, 64, 128, 256)


def weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bf16 W [N, K], e4m3 W, its 128x128 float32 scales) from one random bf16 matrix."""
    w = torch.randn(n, k, device=DEV) * k**-0.5
    q, s = quantize_blocks(w)  # made on the host, as the compiler makes them
    return w.to(torch.bfloat16), q.to(DEV).contiguous(), s.float().to(DEV).contiguous()


def cublas_call(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor):
    """The cuBLAS call and the scaling it uses: block (1x128 / 128x128) where supported, else rowwise."""
    xq, xs = quantize_act_ref(x)  # [M, K] e4m3, [M, K/128] float32
    wt = q.t()  # [K, N], column-major as cuBLAS wants
    wf = dequantize_blocks(q, s)  # [N, K] float32 (K need not be a multiple of 128)
    ref = x.float() @ wf.t()
    # cuBLAS's block scaling wants the scales outer-dim-major: try both layouts of each
    for sa in (xs.contiguous(), xs.t().contiguous().t()):
        for sb in (s.t().contiguous(), s.contiguous().t()):
            try:
                out = torch._scaled_mm(xq, wt, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
                torch.cuda.synchronize()
            except (RuntimeError, TypeError, ValueError):
                continue
            if (out.float() - ref).norm() / ref.norm() < 0.05:
                return "block 1x128 / 128x128", partial(
                    torch._scaled_mm, xq, wt, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16
                )
    rs_x = (x.float().abs().amax(dim=1, keepdim=True) / 448).clamp(min=1e-12)  # [M, 1]
    xr = (x.float() / rs_x).to(FP8)
    rs_w = (wf.abs().amax(dim=1, keepdim=True) / 448).clamp(min=1e-12)  # [N, 1]
    wr = (wf / rs_w).to(FP8).t()
    return "rowwise", lambda: torch._scaled_mm(
        xr, wr, scale_a=rs_x, scale_b=rs_w.t(), out_dtype=torch.bfloat16
    )


def deepgemm_call(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor):
    """(DeepGEMM's call on x's quantized rows and the e4m3 W, None) where it takes the shape and gives
    the right product; (None, why) where it is not installed, refuses or is wrong."""
    try:
        import deep_gemm
    except ImportError as e:
        return None, f"not installed: {e}"
    xq, xs = quantize_act_ref(x)  # [M, K] e4m3, [M, K/128] float32
    out = torch.empty(x.shape[0], q.shape[0], device=DEV, dtype=torch.bfloat16)
    try:
        xs_t = deep_gemm.get_col_major_tma_aligned_tensor(xs)  # the layout its TMA loads want
        call = partial(deep_gemm.gemm_fp8_fp8_bf16_nt, (xq, xs_t), (q, s), out)
        call()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001  (a peer's refusal: recorded, the row goes on)
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    ref = x.float() @ dequantize_blocks(q, s).t()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    return (call, None) if err < 0.05 else (None, f"wrong product: relative error {err:.3f}")


def route_times(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> dict[str, float | None]:
    """mlac's cuBLAS route end to end (from a bf16 x; from its Fp8Act) and the Triton GEMM on that
    Fp8Act, where cuBLAS takes the shape and this GPU has block scaling; None elsewhere."""
    n, k = q.shape
    act = Fp8Act(*act_quant(x), x.dtype)  # as a quantizing norm hands it over: token-major scales
    routed = cublas_shape(n, k) and cublas_unavailable(x.device) is None
    return {
        "mlac_cublas_us": graph_us([partial(cublas_fp8_linear, x, q, s)]) if routed else None,
        "mlac_cublas_act_us": graph_us([partial(cublas_fp8_linear, act, q, s)]) if routed else None,
        "mlac_act_gemm_us": graph_us([partial(fp8_linear, act, q, s)]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--fp8-tflops", type=float, default=1223.0, help="the fp8 ceiling (DESIGN's measured rate)"
    )
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="M values, comma-separated")
    ap.add_argument("--shapes", default="", help="only the shapes whose name starts so (v2-lite, v3)")
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_gbps()
    why = cublas_unavailable(torch.device(DEV))
    print(f"mlac's cuBLAS route: {'available' if why is None else why}", flush=True)
    rows, scaling = [], None
    for name, k, n in (shape for shape in SHAPES if shape[0].startswith(args.shapes)):
        wb, q, s = weight(n, k)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            scaling, peer = cublas_call(x, q, s)
            t_mlac = graph_us([partial(fp8_linear, x, q, s)])
            t_skinny = graph_us([partial(skinny_linear, x, q, s)]) if m <= 16 else None
            t_peer = graph_us([peer])
            t_bf16 = graph_us([partial(torch.nn.functional.linear, x, wb)])
            route = route_times(x, q, s)
            dg, dg_error = deepgemm_call(x, q, s)
            t_dg = graph_us([dg]) if dg is not None else None
            cublas = why is None and cublas_takes(m, n, k)
            best = route["mlac_cublas_us"] if cublas else min(t for t in (t_mlac, t_skinny) if t is not None)
            nbytes = n * k + s.numel() * 4 + m * k * 2 + m * n * 2
            floor_us = max(nbytes / (bw * 1e3), 2 * m * n * k / (args.fp8_tflops * 1e6))
            rows.append({"shape": name, "M": m, "N": n, "K": k, "route": "cublas" if cublas else "triton",
                         "mlac_us": round(best, 2), "mlac_fp8_gemm_us": round(t_mlac, 2),
                         "mlac_skinny_us": t_skinny and round(t_skinny, 2),
                         **{key: t and round(t, 2) for key, t in route.items()},
                         "cublas_us": round(t_peer, 2), "cublas_scaling": scaling, "bf16_us": round(t_bf16, 2),
                         "ratio": round(best / t_peer, 3), "fraction_of_ceiling": round(floor_us / best, 3),
                         "deepgemm_us": t_dg and round(t_dg, 2), "ratio_deepgemm": t_dg and round(best / t_dg, 3),
                         "deepgemm_fraction_of_ceiling": t_dg and round(floor_us / t_dg, 3), "deepgemm_error": dg_error})  # fmt: skip
            r = rows[-1]
            via = f"route {r['mlac_cublas_us']:8.2f} us" if r["mlac_cublas_us"] else "route      n/a   "
            print(f"{name:18} M={m:4} mlac({r['route']}) {r['mlac_us']:8.2f} us  Triton {r['mlac_fp8_gemm_us']:8.2f} us  "
                  f"{via}  cuBLAS({scaling}) {r['cublas_us']:8.2f} us  ratio {r['ratio']:.2f}  "
                  f"bf16 {r['bf16_us']:8.2f} us  {100 * r['fraction_of_ceiling']:.0f}% of ceiling  "
                  f"DeepGEMM {r['deepgemm_us'] or r['deepgemm_error']}", flush=True)  # fmt: skip
            write(args, bw, why, rows)


def write(args: argparse.Namespace, bw: float, why: str | None, rows: list[dict]) -> None:
    """The record so far, to --json (after every row)."""
    try:
        import deep_gemm

        deepgemm = os.environ.get("DEEPGEMM_SOURCE") or getattr(deep_gemm, "__version__", "installed")
    except ImportError:
        deepgemm = "not installed"
    record = {"benchmark": "block-FP8 GEMM: mlac vs cuBLAS and DeepGEMM", "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
              "copy_gb_per_s": round(bw, 1), "fp8_tflops_ceiling": args.fp8_tflops,
              "cublas_route": why or "available", "deepgemm": deepgemm, "rows": rows,
              "command": f"python benchmarks/kernels/peers.py --json RECORD --rows {args.rows} --shapes '{args.shapes}'"}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
