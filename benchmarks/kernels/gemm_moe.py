"""Benchmark: block-FP8 GEMM, fused MoE and MoE routing on one GPU, against ceilings measured
in the same run (copy bandwidth, bf16 matmul, rowwise-scaled FP8 matmul).

    python benchmarks/kernels/gemm_moe.py [--out results.json] [--quick] [--only gemm,moe,routing]

Also run by all.py, which records it in results/kernels_h200.json.

Timing: each measured call is captured in a CUDA graph together with calls over rotated copies of
its inputs (weights larger than L2 in total), the graph is replayed under triton.testing.do_bench
(median), and the time per call is reported. Several tile configurations are timed per shape; the
table shows the best and the default (`pick_*_config`). Full numbers go to the JSON file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mlac.core.fp8 import dequantize_blocks, expand_block_scale  # noqa: E402
from mlac.kernels.gemm import fp8_gemm as G  # noqa: E402
from mlac.kernels.moe import fused as M  # noqa: E402
from mlac.kernels.moe import routing as R  # noqa: E402
from mlac.kernels.moe.grouped import MoeConfig, pick_moe_config  # noqa: E402

DEV = "cuda"
L2_ROTATE_BYTES = 256 << 20  # rotate inputs until one pass over them is ~4x the 60 MB L2
LOG = []


def log(msg: str) -> None:
    LOG.append(msg)
    print(msg, file=sys.stderr, flush=True)


def time_graph(fns, rep_ms: int = 40) -> float:
    """Median microseconds per call of fns (each called once per graph replay, in order)."""
    for f in fns:  # compile / warm up outside the capture
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    ms = do_bench(g.replay, warmup=10, rep=rep_ms, return_mode="median")
    del g
    return ms * 1e3 / len(fns)


def time_eager(fn, rep_ms: int = 100) -> float:
    return do_bench(fn, warmup=10, rep=rep_ms, return_mode="median") * 1e3


# ---- ceilings ---------------------------------------------------------------------------------


def ceilings() -> dict:
    n = 1 << 30
    a = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    copy_us = time_eager(lambda: b.copy_(a))
    a = b = None  # free 2 GiB
    s = 8192
    x = torch.randn(s, s, device=DEV, dtype=torch.bfloat16)
    y = torch.randn(s, s, device=DEV, dtype=torch.bfloat16)
    mm_us = time_eager(lambda: x @ y)
    xq = (x.float() * 32).clamp(-448, 448).to(torch.float8_e4m3fn)
    yq = (y.float() * 32).clamp(-448, 448).to(torch.float8_e4m3fn)  # [N, K] row-major
    sa = torch.rand(s, 1, device=DEV) + 0.5
    sb = torch.rand(1, s, device=DEV) + 0.5
    try:
        fp8_us = time_eager(lambda: torch._scaled_mm(xq, yq.t(), sa, sb, out_dtype=torch.bfloat16))
    except Exception as exc:  # noqa: BLE001 - report the rest of the run
        log(f"_scaled_mm failed: {exc!r}")
        fp8_us = float("nan")
    flops = 2 * s**3
    return {
        "copy_GBps": 2 * n / copy_us / 1e3,
        "bf16_mm_TFLOPs": flops / mm_us / 1e6,
        "fp8_scaled_mm_rowwise_TFLOPs": flops / fp8_us / 1e6,
    }


# ---- block-FP8 GEMM ---------------------------------------------------------------------------

GEMM_NK = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]


def ref64(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """fp8_linear_ref with the product in float64 and the activations quantized on the CPU."""
    k, n = x.shape[-1], w.shape[0]
    xq, xs = (t.to(x.device) for t in G.quantize_act_ref(x.reshape(-1, k).cpu()))
    x_deq = xq.double() * xs.double().repeat_interleave(G.BLOCK, dim=-1)[:, :k]
    w_deq = w.double() * expand_block_scale(w_scale.double(), n, k)
    return (x_deq @ w_deq.t()).to(x.dtype)


def gemm_candidates(m: int, n: int, k: int) -> list[G.GemmConfig]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if m <= 64:
        bm = max(16, triton.next_power_of_2(m))
        out = []
        for bn, cps, fuse in [
            (32, 2, False),
            (64, 2, False),
            (64, 4, False),
            (128, 2, False),
            (128, 4, False),
            (64, 2, True),
        ]:
            tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
            split = G.split_k_for(tiles, k, sms, ctas_per_sm=cps)
            out.append(G.GemmConfig(bm, bn, split_k=split, num_warps=4, num_stages=4, fuse_quant=fuse))
        return out
    # 128x256 (and 256x128) tiles spill: the per-K-block scaling keeps the fresh dot result
    # next to the accumulator, twice the registers of a plain GEMM (seen in the SASS: STL/LDL).
    return [
        G.GemmConfig(128, 128, num_warps=8, num_stages=4),
        G.GemmConfig(128, 64, num_warps=4, num_stages=4),
        G.GemmConfig(128, 128, num_warps=8, num_stages=3, sub_k=2),
        G.GemmConfig(128, 128, num_warps=8, num_stages=3, sub_k=2, group_m=16),
    ]


def bench_gemm(m: int, n: int, k: int, ceil: dict, quick: bool) -> dict:
    wbytes = n * k
    rot = 1 if m > 64 else max(1, min(16, math.ceil(L2_ROTATE_BYTES / wbytes)))
    ws = [torch.randn(n, k, device=DEV).mul_(64).clamp_(-448, 448).to(G.FP8) for _ in range(rot)]
    ss = [torch.rand(triton.cdiv(n, 128), triton.cdiv(k, 128), device=DEV) * 1e-2 + 5e-3 for _ in range(rot)]
    xs = [torch.randn(m, k, device=DEV, dtype=torch.bfloat16) for _ in range(rot)]
    ref = ref64(xs[0], ws[0], ss[0])
    default = G.pick_gemm_config(m, n, k, torch.device(DEV))
    cands = [default] + [c for c in gemm_candidates(m, n, k) if c != default]
    if quick:
        cands = cands[:2]
    rows = []
    for cfg in cands:
        try:
            out = G.fp8_linear(xs[0], ws[0], ss[0], use_triton=True, config=cfg)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            fns = [lambda i=i, c=cfg: G.fp8_linear(xs[i], ws[i], ss[i], config=c) for i in range(rot)]
            us = time_graph(fns)
        except Exception as exc:  # noqa: BLE001 - one failing configuration must not end the run
            log(f"  gemm M={m} N={n} K={k} {cfg} FAILED {exc!r}"[:400])
            continue
        rows.append({"config": cfg.__dict__, "us": us, "rel_err": err})
        log(f"  gemm M={m} N={n} K={k} {cfg} {us:.1f} us err {err:.2e}")
    best = min(rows, key=lambda r: r["us"])
    # baseline: bf16 linear on the pre-dequantized weight (what a non-FP8 build would run)
    n_base = max(1, rot // 2)
    wb = [dequantize_blocks(ws[i], ss[i]).to(torch.bfloat16) for i in range(n_base)]
    base_us = time_graph([lambda i=i: torch.nn.functional.linear(xs[i], wb[i]) for i in range(len(wb))])
    res = {
        "kernel": "fp8_gemm",
        "M": m,
        "N": n,
        "K": k,
        "rotate": rot,
        "best": best,
        "default": rows[0],
        "sweep": rows,
        "baseline_bf16_linear_us": base_us,
    }
    if m <= 64:
        bw = wbytes / best["us"] / 1e3
        res.update(metric="weight GB/s", value=bw, fraction=bw / ceil["copy_GBps"], target=0.70)
    else:
        tf = 2 * m * n * k / best["us"] / 1e6
        res.update(
            metric="TFLOP/s",
            value=tf,
            fraction=tf / ceil["fp8_scaled_mm_rowwise_TFLOPs"],
            target_TFLOPs=900 if min(n, k) >= 4096 else None,
        )
    return res


# ---- fused MoE --------------------------------------------------------------------------------

MOE_CASES = [  # name, E, top_k, D, I, fp8, T, target fraction (copy BW on touched bytes) or TFLOP/s
    ("v2lite-bf16", 64, 6, 2048, 1408, False, 1, ("bw", 0.60)),
    ("v2lite-bf16", 64, 6, 2048, 1408, False, 64, ("bw", 0.80)),
    ("v2lite-bf16", 64, 6, 2048, 1408, False, 2048, ("tflops", 400.0)),
    ("v2lite-fp8", 64, 6, 2048, 1408, True, 1, ("bw", 0.60)),  # decode: split-K (MoeConfig.split_k)
    ("v3-tp8-fp8", 256, 8, 7168, 256, True, 1, ("bw", 0.60)),
    ("v3-tp8-fp8", 256, 8, 7168, 256, True, 64, ("bw", 0.80)),
    ("v3-tp8-fp8", 256, 8, 7168, 256, True, 256, ("bw", 0.80)),
]


def moe_candidates(t: int, top_k: int, e: int, fp8: bool) -> list[MoeConfig]:
    rows = t * top_k / e
    if rows <= 24:
        if fp8:
            return [
                MoeConfig(16, 128, bn2, 128, num_warps=4, num_stages=st, split_k=sk)
                for bn2, st, sk in [(64, 4, 1), (128, 4, 1), (128, 3, 1), (256, 4, 1), (128, 5, 1)]
                + [(128, 4, 0), (128, 4, 2), (128, 4, 4), (128, 4, 8)]  # split-K: 0 = split_k_for
            ]
        return [
            MoeConfig(16, bn1, bn2, 128, num_warps=4, num_stages=st)
            for bn1, bn2, st in [(64, 64, 4), (32, 32, 4), (64, 128, 4)]
        ]
    if fp8:
        return [
            MoeConfig(64, 128, 128, 128, num_warps=8, num_stages=3),
            MoeConfig(32, 128, 128, 128, num_warps=4, num_stages=3),
        ]
    return [
        MoeConfig(bm, bn1, bn2, bk, num_warps=w, num_stages=st)
        for bm, bn1, bn2, bk, w, st in [
            (128, 128, 128, 64, 8, 3),
            (64, 128, 128, 64, 8, 3),
            (128, 128, 128, 64, 8, 4),
            (128, 64, 128, 64, 4, 4),
            (128, 128, 256, 64, 8, 3),
        ]
    ]


def _random_routing(t: int, e: int, top_k: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    scores = torch.rand(t, e, device=DEV, generator=g)
    w, ids = scores.softmax(-1).topk(top_k, dim=-1)
    return w.float().contiguous(), ids.contiguous()


def bench_moe(case, ceil: dict, quick: bool) -> dict:
    name, e, top_k, d, i, fp8, t, (kind, target) = case
    n_copies = 1 if t >= 64 else 2
    n_routes = 1 if t >= 64 else 4
    experts = []
    for _ in range(n_copies):
        if fp8:
            w13 = torch.randn(e, 2 * i, d, device=DEV).mul_(64).clamp_(-448, 448).to(G.FP8)
            w2 = torch.randn(e, d, i, device=DEV).mul_(64).clamp_(-448, 448).to(G.FP8)
            s13 = torch.rand(e, triton.cdiv(2 * i, 128), triton.cdiv(d, 128), device=DEV) * 2e-4 + 1e-4
            s2 = torch.rand(e, triton.cdiv(d, 128), triton.cdiv(i, 128), device=DEV) * 2e-4 + 1e-4
        else:
            w13 = torch.randn(e, 2 * i, d, device=DEV, dtype=torch.bfloat16) / d**0.5
            w2 = torch.randn(e, d, i, device=DEV, dtype=torch.bfloat16) / i**0.5
            s13 = s2 = None
        experts.append((w13, w2, s13, s2))
    xs = [torch.randn(t, d, device=DEV, dtype=torch.bfloat16) for _ in range(n_routes * n_copies)]
    routes = [_random_routing(t, e, top_k, seed=r) for r in range(n_routes * n_copies)]
    calls = [
        (xs[j], *experts[j % n_copies][:2], *routes[j], *experts[j % n_copies][2:])
        for j in range(len(routes))
    ]
    distinct = [int(torch.unique(r[1]).numel()) for r in routes]
    per_expert = 3 * i * d * (1 if fp8 else 2)
    touched = sum(distinct) / len(distinct) * per_expert
    flops = 2 * t * top_k * 3 * i * d

    ref_linear, M.fp8_linear_ref = M.fp8_linear_ref, ref64  # exact expert products in the reference
    ref = M.fused_moe_ref(*calls[0])
    M.fp8_linear_ref = ref_linear
    default = pick_moe_config(t * top_k, e, fp8)
    cands = [default] + [c for c in moe_candidates(t, top_k, e, fp8) if c != default]
    if quick:
        cands = cands[:2]
    rows = []
    for cfg in cands:
        try:
            out = M.fused_moe(*calls[0], config=cfg)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            us = time_graph([lambda c=c, k=cfg: M.fused_moe(*c, config=k) for c in calls])
        except Exception as exc:  # noqa: BLE001 - one failing configuration must not end the run
            log(f"  moe {name} T={t} {cfg} FAILED {exc!r}"[:400])
            continue
        rows.append({"config": cfg.__dict__, "us": us, "rel_err": err})
        log(f"  moe {name} T={t} {cfg} {us:.1f} us err {err:.2e}")
    best = min(rows, key=lambda r: r["us"])
    base_us = time_eager(lambda: M.fused_moe_ref(*calls[0]), rep_ms=200)
    res = {
        "kernel": "fused_moe",
        "case": name,
        "E": e,
        "top_k": top_k,
        "D": d,
        "I": i,
        "fp8": fp8,
        "T": t,
        "distinct_experts_mean": sum(distinct) / len(distinct),
        "touched_bytes": touched,
        "best": best,
        "default": rows[0],
        "sweep": rows,
        "baseline_fused_moe_ref_us": base_us,
    }
    bw = touched / best["us"] / 1e3
    tf = flops / best["us"] / 1e6
    res.update(
        GBps_touched=bw,
        fraction_copy=bw / ceil["copy_GBps"],
        TFLOPs=tf,
        fraction_bf16_mm=tf / ceil["bf16_mm_TFLOPs"],
    )
    res.update(
        metric="touched GB/s" if kind == "bw" else "TFLOP/s",
        value=bw if kind == "bw" else tf,
        fraction=res["fraction_copy"] if kind == "bw" else res["fraction_bf16_mm"],
        target=target,
    )
    return res


def bench_routing() -> list[dict]:
    """route_ref (many small torch ops) against the fused Triton kernel, same inputs; the ids must
    match exactly and the weights to float32 roundings (tests/kernels/test_moe_routing.py)."""
    out = []
    for name, e, k, method, scoring, ng, tg, norm, rsf, t in [
        ("v2lite-greedy", 64, 6, "greedy", "softmax", 1, 1, False, 1.0, 1),
        ("v2lite-greedy", 64, 6, "greedy", "softmax", 1, 1, False, 1.0, 2048),
        ("v3-noaux_tc", 256, 8, "noaux_tc", "sigmoid", 8, 4, True, 2.5, 64),
        ("v3-noaux_tc", 256, 8, "noaux_tc", "sigmoid", 8, 4, True, 2.5, 256),
        ("v3-noaux_tc", 256, 8, "noaux_tc", "sigmoid", 8, 4, True, 2.5, 4096),
    ]:
        logits = torch.randn(t, e, device=DEV)
        bias = torch.randn(e, device=DEV) * 0.1 if method == "noaux_tc" else None
        args = (logits, R.RoutingSpec(e, k, method, scoring, ng, tg, norm, rsf), bias)

        def ref(args=args):
            return R.route_ref(*args)

        def fused(args=args):
            return R.route(*args, use_triton=True)

        (ref_w, ref_ids), (w, ids) = ref(), fused()
        row = {
            "kernel": "route",
            "case": name,
            "T": t,
            "ref_eager_us": time_eager(ref),
            "ref_graph_us": time_graph([ref]),
            "triton_eager_us": time_eager(fused),
            "triton_graph_us": time_graph([fused]),
            "ids_equal": bool(torch.equal(ids, ref_ids)),
            "max_weight_diff": (w - ref_w).abs().max().item(),
            "max_weight_rel_diff": ((w - ref_w).abs() / ref_w.abs()).max().item(),
        }
        row["speedup_graph"] = row["ref_graph_us"] / row["triton_graph_us"]
        row["speedup_eager"] = row["ref_eager_us"] / row["triton_eager_us"]
        out.append(row)
        log(f"  route {name} T={t}: {row}")
    return out


# ---- main -------------------------------------------------------------------------------------


def table(res: dict) -> str:
    c = res["ceilings"]
    lines = [
        f"device {res['device']}  torch {res['torch']}  triton {res['triton']}",
        f"ceilings: copy {c['copy_GBps']:.0f} GB/s | bf16 mm {c['bf16_mm_TFLOPs']:.0f} TFLOP/s | "
        f"fp8 rowwise _scaled_mm {c['fp8_scaled_mm_rowwise_TFLOPs']:.0f} TFLOP/s",
        f"{'kernel':<10}{'shape':<34}{'best us':>9}{'dflt us':>9}{'metric':>22}{'frac':>7}{'target':>9}"
        f"{'base us':>10}{'err':>9}",
    ]
    for r in res["gemm"]:
        tgt = f"{r['target']:.2f}" if r.get("target") else "-"
        tgt = f"{r['target_TFLOPs']}T" if r.get("target_TFLOPs") else tgt
        shape = f"M={r['M']} N={r['N']} K={r['K']}"
        value = f"{r['value']:.0f} {r['metric']}"
        lines.append(
            f"{'fp8_gemm':<10}{shape:<34}{r['best']['us']:>9.1f}{r['default']['us']:>9.1f}{value:>22}"
            f"{r['fraction']:>7.2f}{tgt:>9}{r['baseline_bf16_linear_us']:>10.1f}{r['best']['rel_err']:>9.1e}"
        )
    for r in res["moe"]:
        shape = f"{r['case']} T={r['T']} ({r['distinct_experts_mean']:.0f} exp)"
        tgt = f"{r['target']:.2f}" if r["metric"] != "TFLOP/s" else f"{r['target']:.0f}T"
        value = f"{r['value']:.0f} {r['metric']}"
        lines.append(
            f"{'moe':<10}{shape:<34}{r['best']['us']:>9.1f}{r['default']['us']:>9.1f}{value:>22}"
            f"{r['fraction']:>7.2f}{tgt:>9}{r['baseline_fused_moe_ref_us']:>10.0f}{r['best']['rel_err']:>9.1e}"
        )
    for r in res.get("bmm", []):  # older records hold these matmuls here; head_bmm.py measures them now
        shape = f"B={r['B']} {r['einsum']}"
        value = f"{r['GBps']:.0f} GB/s {r['TFLOPs']:.0f} TF"
        lines.append(
            f"{r['kernel']:<10}{shape:<34}{r['us']:>9.1f}{'':>9}{value:>22}{r['fraction_copy']:>7.2f}"
        )
    for r in res["routing"]:  # best us: Triton, base us: route_ref (CUDA graph); eager after
        shape = f"{r['case']} T={r['T']}"
        if "triton_graph_us" not in r:  # an older record: route_ref only
            lines.append(
                f"{'route_ref':<10}{shape:<34}{r['graph_us']:>9.1f}{'eager':>27} {r['eager_us']:.0f}"
            )
            continue
        value = f"{r['speedup_graph']:.1f}x ids {'equal' if r['ids_equal'] else 'DIFFER'}"
        eager = f"eager {r['triton_eager_us']:.0f} / ref {r['ref_eager_us']:.0f}"
        lines.append(
            f"{'route':<10}{shape:<34}{r['triton_graph_us']:>9.1f}{'':>9}{value:>22}{'':>16}"
            f"{r['ref_graph_us']:>10.1f}{r['max_weight_rel_diff']:>9.1e}  {eager}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    out_dir = os.environ.get("OUT", "benchmarks/results")
    ap.add_argument("--out", default=os.path.join(out_dir, "kernels_gemm_moe.json"))
    ap.add_argument("--quick", action="store_true", help="two configurations per shape")
    ap.add_argument("--only", default="", help="comma list of gemm,moe,routing (default all)")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else {"gemm", "moe", "routing"}
    res = run(args.quick, only)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    Path(args.out).with_suffix(".log").write_text("\n".join(LOG))
    print(table(res))


def run(quick: bool = False, only: set[str] | None = None) -> dict:
    """Ceilings, then the GEMM, MoE and routing cases; the result dict written as JSON."""
    only = only or {"gemm", "moe", "routing"}
    t0 = time.time()
    torch.manual_seed(0)
    res = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "timing": "CUDA graph of calls over rotated inputs, do_bench median per call",
    }
    res["ceilings"] = ceilings()
    log(f"ceilings {res['ceilings']}")
    res["gemm"], res["moe"], res["routing"] = [], [], []
    if "gemm" in only:
        for m in (1, 16, 4096):
            for n, k in GEMM_NK:
                res["gemm"].append(bench_gemm(m, n, k, res["ceilings"], quick))
                torch.cuda.empty_cache()
    if "moe" in only:
        for case in MOE_CASES:
            res["moe"].append(bench_moe(case, res["ceilings"], quick))
            torch.cuda.empty_cache()
    if "routing" in only:
        res["routing"] = bench_routing()
    res["wall_s"] = time.time() - t0
    return res


if __name__ == "__main__":
    main()
