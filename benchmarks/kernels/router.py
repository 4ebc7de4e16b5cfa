"""The MoE router at decode, three ways, on one GPU (the router kernels of mlac/kernels/moe/).

    python benchmarks/kernels/router.py [--out results.json]

For V2-Lite (E=64, D=2048, greedy softmax top-6) and V3 (E=256, D=7168, noaux_tc top-8), T rows:
  torch:   F.linear(x.float(), gate), then `route` (cast, GEMV (2), route: router_plan's choice above 4 rows)
  logits:  the logits kernel, then `route` (2 launches)
  fused:   logits and routing in one launch (the last program routes)
each a chain of 27 calls (one per MoE layer of a V2-Lite step) in one CUDA graph: us per call, and the
ceiling, reading the float32 gate once at the device-copy bandwidth (fraction = ceiling / time).
Then, at the fused plan's T (1, 4), its tiles (block_d, num_warps) around its default. Every
plan's routing is checked against the torch path's (same ids) before it is timed. About a minute on an
H200; run under MLAC_PDL=0 as well to see what PDL gives.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from timing import copy_gbps, graph_us  # noqa: E402

from mlac.kernels.moe import router_gemv as rg  # noqa: E402
from mlac.kernels.moe.routing import RoutingSpec, route  # noqa: E402

LAYERS = 27
SHAPES = {  # name: (D, routing)
    "v2_lite": (2048, RoutingSpec(64, top_k=6, method="greedy", scoring="softmax")),
    "v3": (
        7168,
        RoutingSpec(
            256, top_k=8, method="noaux_tc", scoring="sigmoid", n_group=8, topk_group=4, norm_topk_prob=True
        ),
    ),
}
ROWS = (1, 2, 4, 8, 16)
SWEEP_ROWS = (1, 4)  # the fused plan's rows (router_plan)
DEVICE = "cuda"


def _inputs(t: int, d: int, spec: RoutingSpec):
    """(x [T, D] bf16, gate [E, D] float32, bias [E] or None)."""
    e = spec.n_experts
    x = torch.randn(t, d, device=DEVICE).to(torch.bfloat16)
    gate = torch.randn(e, d, device=DEVICE) / d**0.5
    bias = torch.randn(e, device=DEVICE) * 0.1 if spec.method == "noaux_tc" else None
    return x, gate, bias


def _plans(x, gate, spec, bias, config=None):
    """{plan: a call returning (weights, ids)}."""
    return {
        "torch": lambda: route(F.linear(x.float(), gate), spec, bias),
        "logits": lambda: route(rg.router_logits_triton(x, gate, config), spec, bias),
        "fused": lambda: rg.router_route_triton(x, gate, spec, bias, config=config)[:2],
    }


def bench_shape(name: str, ceiling_gbps: float) -> list[dict]:
    d, spec = SHAPES[name]
    e = spec.n_experts
    ceiling_us = e * d * 4 / (ceiling_gbps * 1e3)
    rows = []
    for t in ROWS:
        x, gate, bias = _inputs(t, d, spec)
        plans = _plans(x, gate, spec, bias)
        _, ref_ids = plans["torch"]()
        for plan, fn in plans.items():
            assert torch.equal(fn()[1], ref_ids), f"{name} T={t}: {plan} routes differently"
            us = graph_us([fn] * LAYERS)
            rows.append(dict(shape=name, t=t, plan=plan, us=round(us, 2), fraction=round(ceiling_us / us, 3)))
            print(
                f"{name:8s} T={t:2d} {plan:7s} {us:7.2f} us  ({ceiling_us / us:.0%} of the gate read)",
                flush=True,
            )
        if t in SWEEP_ROWS:
            rows += sweep_tiles(name, t, x, gate, spec, bias, ceiling_us)
    return rows


def sweep_tiles(name, t, x, gate, spec, bias, ceiling_us) -> list[dict]:
    """The fused kernel at pick_config's block_e, with block_d halved and doubled, at 1-8 warps."""
    e, d = gate.shape
    default = rg.pick_config(e, d, rg.t_class(t), rg.sm_count(gate.device))
    rows = []
    for block_d in (default.block_d // 2, default.block_d, 2 * default.block_d):
        for warps in (1, 2, 4, 8):
            cfg = rg.RouterConfig(default.block_e, max(64, block_d), warps)
            us = graph_us([_plans(x, gate, spec, bias, cfg)["fused"]] * LAYERS)
            mark = " (default)" if cfg == default else ""
            print(f"    tiles be={cfg.block_e} bd={cfg.block_d} w={warps}: {us:7.2f} us{mark}", flush=True)
            row = dict(
                shape=name, t=t, plan="fused_tiles", us=round(us, 2), fraction=round(ceiling_us / us, 3)
            )
            rows.append(dict(row, block_d=cfg.block_d, num_warps=warps))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: router.py needs a CUDA GPU")
    gbps = copy_gbps()
    print(f"{torch.cuda.get_device_name()}: device copy {gbps:.0f} GB/s")
    rows = [row for name in SHAPES for row in bench_shape(name, gbps)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                dict(device=torch.cuda.get_device_name(), copy_gbps=round(gbps), rows=rows), f, indent=1
            )


if __name__ == "__main__":
    main()
