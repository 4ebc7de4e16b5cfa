"""Benchmark: the fused MoE at decode (few rows per expert), grouped GEMMs against the decode GEMVs.

    python benchmarks/bench_moe_decode.py [--out results.json] [--budget-s 140] [--quick]

Shapes: V2-Lite (E=64, top-6, H=2048, I=1408) and a 32-expert slice of V3 (H=7168, I=2048, top-8),
bf16 and block-FP8, T in {1, 4, 8, 32} tokens. Per shape it times the grouped-GEMM path (moe/grouped.py,
`pick_moe_config`), the decode kernel's default (`pick_moe_decode_config`) and a sweep of decode
configs, each as a whole `fused_moe` call (align/quant, GEMMs, top-k reduce).

Timing: CALLS calls per CUDA graph, each with its own routing and alternating between two copies
of the weights (so that a call does not find the previous call's experts in L2); CUDA events
around graph replays, median over replays, time per call. Reported: microseconds, GB/s of the
expert bytes the call touches (each distinct expert's w13 + w2, and scales, once) and its fraction
of the device-to-device copy bandwidth measured in the same run. The end of the output has one
ready-to-paste line per shape with the best decode config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_timing import copy_gbps, graph_us  # noqa: E402

from mlac.core.fp8 import FP8  # noqa: E402
from mlac.kernels.moe import decode_config as MD  # noqa: E402
from mlac.kernels.moe import fused as M  # noqa: E402
from mlac.kernels.moe import routing as R  # noqa: E402
from mlac.kernels.moe.grouped import pick_moe_config  # noqa: E402

DEV = "cuda"
CALLS = 20  # calls per graph
SHAPES = [  # name, E, top_k, H, I
    ("v2lite", 64, 6, 2048, 1408),
    ("v3slice", 32, 8, 7168, 2048),
]
TOKENS = [1, 4, 8, 32]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_weights(e: int, h: int, i: int, fp8: bool):
    """(w13, w2, s13, s2) with random values (scales None for bf16)."""
    if not fp8:
        w13 = torch.randn(e, 2 * i, h, device=DEV, dtype=torch.bfloat16) / h**0.5
        w2 = torch.randn(e, h, i, device=DEV, dtype=torch.bfloat16) / i**0.5
        return w13, w2, None, None
    w13 = (torch.randn(e, 2 * i, h, device=DEV) * 64).clamp_(-448, 448).to(FP8)
    w2 = (torch.randn(e, h, i, device=DEV) * 64).clamp_(-448, 448).to(FP8)
    s13 = (torch.rand(e, -(-2 * i // 128), -(-h // 128), device=DEV) + 0.5) * (0.02 / h**0.5)
    s2 = (torch.rand(e, -(-h // 128), -(-i // 128), device=DEV) + 0.5) * (0.02 / i**0.5)
    return w13, w2, s13, s2


def expert_bytes(w13, w2, s13, s2) -> int:
    """Bytes of one expert: w13 + w2 (+ their scales)."""
    per = (w13[0].numel() * w13.element_size()) + (w2[0].numel() * w2.element_size())
    if s13 is not None:
        per += (s13[0].numel() + s2[0].numel()) * 4
    return per


def sweep(t: int, top_k: int, e: int) -> list[MD.MoeDecodeConfig]:
    """Decode configs to time, likeliest first (the time budget may cut the list): tensor-core
    tiles (block_n1, block_n2, block_k, num_warps, num_stages, fuse_sum), then CUDA-core tiles
    (block_n1, block_n2, block_k, num_warps, fuse_sum) for each `rows` that fits the routing."""
    p = t * top_k
    dot = [
        (64, 64, 128, 4, 4, False),
        (64, 16, 256, 4, 4, True),
        (32, 32, 128, 4, 4, False),
        (64, 32, 128, 4, 3, False),
        (128, 64, 128, 8, 4, False),
        (64, 16, 128, 4, 4, True),
        (32, 16, 256, 4, 4, True),
        (32, 16, 512, 4, 3, True),
        (64, 16, 512, 8, 3, True),
        (128, 32, 128, 4, 4, False),
        (32, 64, 128, 4, 5, False),
        (64, 64, 128, 4, 6, False),
        (32, 32, 128, 4, 6, False),
        (16, 32, 128, 4, 4, False),
        (128, 128, 128, 8, 3, False),
    ]
    out = [MD.MoeDecodeConfig(n1, n2, k, 1, w, s, fuse_sum=f, dot=True) for n1, n2, k, w, s, f in dot]
    rows = [1] if t == 1 else [1, 2] if p <= e else [4, 2]
    tiles = [
        (32, 16, 256, 8, True),
        (32, 32, 256, 4, False),
        (32, 16, 512, 8, True),
        (16, 16, 256, 4, True),
        (64, 32, 256, 8, False),
        (16, 32, 512, 4, False),
    ]
    out += [MD.MoeDecodeConfig(n1, n2, k, r, w, fuse_sum=f) for r in rows for n1, n2, k, w, f in tiles]
    return out


def bench_shape(name, e, top_k, h, i, fp8, t, copy, deadline, quick) -> dict:
    copies = [make_weights(e, h, i, fp8) for _ in range(2)]
    calls = []
    touched = []
    for c in range(CALLS):
        logits = torch.randn(t, e, device=DEV)
        weights, ids = R.route_ref(logits, R.RoutingSpec(e, top_k, "greedy", "softmax"))
        x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
        calls.append((x, *copies[c % 2], weights, ids))
        touched.append(ids.unique().numel())
    mean_bytes = sum(touched) / len(touched) * expert_bytes(*copies[0])
    p = t * top_k

    def run(cfg):
        return [
            lambda a=a: M.fused_moe(a[0], a[1], a[2], a[5], a[6], a[3], a[4], use_triton=True, config=cfg)
            for a in calls
        ]

    def row(label, cfg):
        us = graph_us(run(cfg))
        gbps = mean_bytes / us / 1e3
        return {
            "label": label,
            "config": cfg and dataclasses.asdict(cfg),
            "us": us,
            "GBps": gbps,
            "frac": gbps / copy,
        }

    a0 = calls[0]
    grouped_cfg = pick_moe_config(p, e, fp8)
    grouped = M.fused_moe(
        a0[0], a0[1], a0[2], a0[5], a0[6], a0[3], a0[4], use_triton=True, config=grouped_cfg
    )
    res = {"shape": name, "E": e, "top_k": top_k, "H": h, "I": i, "fp8": fp8, "T": t, "pairs": p}
    res["distinct_experts_mean"] = sum(touched) / len(touched)
    res["touched_MB"] = mean_bytes / 1e6
    res["grouped"] = row("grouped (pick_moe_config)", grouped_cfg)
    default = MD.pick_moe_decode_config(p, e, fp8)
    rows = []
    cands = ([default] if default else []) + ([] if quick else sweep(t, top_k, e))
    for cfg in dict.fromkeys(cands):
        if time.monotonic() > deadline and rows:
            log(f"  {name} T={t}: time budget spent, sweep cut at {len(rows)} configs")
            res["sweep_cut"] = True
            break
        try:
            out = M.fused_moe(a0[0], a0[1], a0[2], a0[5], a0[6], a0[3], a0[4], use_triton=True, config=cfg)
            err = ((out.float() - grouped.float()).norm() / grouped.float().norm()).item()
            r = row("decode", cfg) | {"rel_err_vs_grouped": err}
        except Exception as exc:  # noqa: BLE001 - one failing configuration must not end the run
            log(f"  {name} T={t} {cfg} FAILED {exc!r}"[:400])
            continue
        r["default"] = cfg == default
        rows.append(r)
    res["decode_sweep"] = rows
    res["decode_default"] = next((r for r in rows if r.get("default")), None)
    res["decode_best"] = min(rows, key=lambda r: r["us"]) if rows else None
    return res


def line(r: dict) -> str:
    g, d, b = r["grouped"], r["decode_default"], r["decode_best"]
    dd = f"{d['us']:7.1f} us {d['frac']:.2f}" if d else "   -"
    bb = f"{b['us']:7.1f} us {b['frac']:.2f}" if b else "   -"
    return (
        f"{r['shape']:8s} {'fp8 ' if r['fp8'] else 'bf16'} T={r['T']:<3d} {r['touched_MB']:7.1f} MB | "
        f"grouped {g['us']:7.1f} us {g['frac']:.2f} | decode default {dd} | best {bb}"
    )


def paste_line(r: dict) -> str:
    b = r["decode_best"]
    if b is None:
        return f"# {r['shape']} {'fp8' if r['fp8'] else 'bf16'} T={r['T']}: no decode config ran"
    c = b["config"]
    return (
        f"({r['pairs']}, {r['E']}, {r['fp8']}): MoeDecodeConfig(block_n1={c['block_n1']}, block_n2={c['block_n2']}, "
        f"block_k={c['block_k']}, rows={c['rows']}, num_warps={c['num_warps']}, num_stages={c['num_stages']}, "
        f"fuse_sum={c['fuse_sum']}, dot={c['dot']}),"
        f"  # {r['shape']} T={r['T']}: {b['us']:.1f} us, {b['frac']:.2f} of copy; grouped {r['grouped']['us']:.1f} us"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None, help="JSON results")
    ap.add_argument("--budget-s", type=float, default=140.0, help="stop sweeping after this many seconds")
    ap.add_argument("--quick", action="store_true", help="default configs only")
    args = ap.parse_args()
    t0 = time.monotonic()
    copy = copy_gbps()
    log(f"copy {copy:.0f} GB/s")
    results = []
    cases = [(s, fp8, t) for s in SHAPES for fp8 in (True, False) for t in TOKENS]
    for n, (shape, fp8, t) in enumerate(cases):
        # the sweep shares what is left of the budget with the cases still to run
        left = args.budget_s - (time.monotonic() - t0)
        deadline = time.monotonic() + max(0.0, left) / (len(cases) - n)
        r = bench_shape(*shape, fp8, t, copy, deadline, args.quick)
        results.append(r)
        torch.cuda.empty_cache()  # this case's weights
        log(line(r))
        if args.out:
            args.out.write_text(json.dumps(meta(copy, results, t0), indent=1))
    print("\n".join(line(r) for r in results))
    print("\n# best decode config per (pairs, E, fp8), ready to paste:")
    print("\n".join(paste_line(r) for r in results))


def meta(copy: float, results: list[dict], t0: float) -> dict:
    import triton

    return {
        "bench": "moe_decode",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "host": platform.node(),
        "decode_kernel_enabled": MD.ENABLED,
        "copy_GBps": copy,
        "calls_per_graph": CALLS,
        "elapsed_s": time.monotonic() - t0,
        "results": results,
    }


if __name__ == "__main__":
    main()
