"""Benchmark: one MoE layer at batch 1 with its shared experts, apart (their own MLP) or inside the
routed experts' decode launches (moe/shared.py, SharedExperts).

    python benchmarks/bench_moe_shared.py [--out results.json] [--sweep] [--shapes v2lite,v3slice]

Shapes: V2-Lite (E=64, top-6, H=2048, I=1408, 2 shared experts) and a 32-expert slice of V3
(H=7168, I=2048, top-8, 1 shared), bf16 and block-FP8, one token. "apart" is the model's path
before: runtime.model.MLP (w13 GEMM, silu_mul[_quant], w2 GEMM, as the model dispatches them) and
`fused_moe(..., shared_out=...)`; "inside" is `fused_moe(..., shared=...)`. FP8 input comes
quantized by its producer (Fp8Act), as the norm hands it to the layer.

Timing: CALLS calls per CUDA graph (gpu_timing.graph_us), each with its own routing and input and
alternating between two copies of the weights (a call does not find the previous call's weights in
L2). Reported: microseconds per call, the bytes the call reads (distinct routed experts' and the
shared experts' weights and scales) as a fraction of the device-to-device copy bandwidth measured
in the same run, and the kernel launches of one call (torch.profiler). MLAC_PDL applies as set.
`--sweep`: also "inside" under each decode config of bench_moe_decode.sweep (one token), fastest first:
the FP8 default reads its experts at well under bf16's fraction of copy bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_moe_decode import sweep  # noqa: E402
from gpu_timing import copy_gbps, graph_us  # noqa: E402

from mlac.core.fp8 import FP8  # noqa: E402
from mlac.kernels.fp8_quant import Fp8Act  # noqa: E402
from mlac.kernels.gemm.fp8_gemm import quantize_act_ref  # noqa: E402
from mlac.kernels.moe import fused as M  # noqa: E402
from mlac.kernels.moe import routing as R  # noqa: E402
from mlac.kernels.moe.shared import SharedExperts  # noqa: E402
from mlac.runtime.model.layers import Weights  # noqa: E402
from mlac.runtime.model.model import MLP  # noqa: E402

DEV = "cuda"
CALLS = 20
SHAPES = [("v2lite", 64, 6, 2048, 1408, 2), ("v3slice", 32, 8, 7168, 2048, 1)]  # name, E, top_k, H, I, shared


def rand_weight(lead: tuple[int, ...], n: int, k: int, fp8: bool):
    """(weight [*lead, n, k], block scales or None)."""
    if not fp8:
        return (torch.randn(*lead, n, k, device=DEV) / k**0.5).to(torch.bfloat16), None
    w = (torch.randn(*lead, n, k, device=DEV) * 64).clamp_(-448, 448).to(FP8)
    return w, (torch.rand(*lead, -(-n // 128), -(-k // 128), device=DEV) + 0.5) * (0.02 / k**0.5)


def make_layer(e: int, h: int, i: int, n_shared: int, fp8: bool):
    """(routed (w13, w2, s13, s2), the shared experts' MLP module, their SharedExperts)."""
    w13, s13 = rand_weight((e,), 2 * i, h, fp8)
    w2, s2 = rand_weight((e,), h, i, fp8)
    sw13, ss13 = rand_weight((), 2 * n_shared * i, h, fp8)
    sw2, ss2 = rand_weight((), h, n_shared * i, fp8)
    tensors = {"s.w13": sw13, "s.w2": sw2} | ({"s.w13.scale": ss13, "s.w2.scale": ss2} if fp8 else {})
    mlp = MLP(Weights(tensors), "s", reduce=False)
    shared = SharedExperts(sw13, sw2, ss13, ss2, lambda x, x_act: mlp(x_act if x_act is not None else x))
    return (w13, w2, s13, s2), mlp, shared


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def bench(name, e, top_k, h, i, n_shared, fp8, copy, configs: bool = False) -> dict:
    layers = [make_layer(e, h, i, n_shared, fp8) for _ in range(2)]
    calls, touched = [], []
    for c in range(CALLS):
        weights, ids = R.route_ref(
            torch.randn(1, e, device=DEV), R.RoutingSpec(e, top_k, "greedy", "softmax")
        )
        x = torch.randn(1, h, device=DEV, dtype=torch.bfloat16)
        x_act = Fp8Act(*quantize_act_ref(x), x.dtype, x) if fp8 else None
        calls.append((x, x_act, weights, ids, layers[c % 2]))
        touched.append(ids.unique().numel())
    (w13, w2, s13, s2), _, shared = layers[0]
    per_expert = nbytes(w13, w2, s13, s2) / e
    moved = sum(touched) / len(touched) * per_expert + nbytes(
        shared.w13, shared.w2, shared.w13_scale, shared.w2_scale
    )

    def apart(x, x_act, weights, ids, layer):
        routed, mlp, _ = layer
        shared_out = mlp(x_act if x_act is not None else x)
        return M.fused_moe(
            x, routed[0], routed[1], weights, ids, *routed[2:], shared_out=shared_out, x_act=x_act
        )

    def inside(x, x_act, weights, ids, layer, config=None):
        routed, _, sh = layer
        return M.fused_moe(
            x, routed[0], routed[1], weights, ids, *routed[2:], x_act=x_act, shared=sh, config=config
        )

    res = {"shape": name, "E": e, "top_k": top_k, "H": h, "I": i, "n_shared": n_shared, "fp8": fp8}
    res["read_MB"] = moved / 1e6
    outs = {}
    for label, fn in (("apart", apart), ("inside", inside)):
        us = graph_us([lambda a=a, fn=fn: fn(*a) for a in calls])
        outs[label] = fn(*calls[0])
        res[label] = {"us": us, "frac_of_copy": moved / us / 1e3 / copy, "launches": launches(fn, calls[0])}
    a, b = outs["apart"].float(), outs["inside"].float()
    res["rel_err_inside_vs_apart"] = ((a - b).norm() / a.norm()).item()
    if configs:
        res["inside_sweep"] = sorted(
            (row for cfg in sweep(1, top_k, e) if (row := timed(inside, cfg, calls, moved, copy, a))),
            key=lambda r: r["us"],
        )
    return res


def timed(fn, cfg, calls, moved: float, copy: float, expected: torch.Tensor) -> dict | None:
    """fn under decode config cfg: us per call and fraction of copy, or None where it fails or its
    output of the first call is not `expected` (float32) within 2e-2 relative."""
    try:
        err = ((fn(*calls[0], config=cfg).float() - expected).norm() / expected.norm()).item()
        if not err < 2e-2:
            raise ValueError(f"relative error {err:.1e}")
        us = graph_us([lambda a=a: fn(*a, config=cfg) for a in calls])
    except Exception as exc:  # noqa: BLE001 - one failing configuration must not end the sweep
        print(f"  {cfg} FAILED {exc!r}"[:300], file=sys.stderr)
        return None
    return {
        "config": dataclasses.asdict(cfg),
        "us": us,
        "frac_of_copy": moved / us / 1e3 / copy,
        "rel_err": err,
    }


def launches(fn, args) -> int:
    """GPU kernels one eager call launches."""
    fn(*args)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return sum(1 for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA)


def line(r: dict) -> str:
    a, b = r["apart"], r["inside"]
    return (
        f"{r['shape']:8s} {'fp8 ' if r['fp8'] else 'bf16'} {r['read_MB']:6.1f} MB | apart {a['us']:6.1f} us "
        f"{a['frac_of_copy']:.2f} ({a['launches']} launches) | inside {b['us']:6.1f} us {b['frac_of_copy']:.2f} "
        f"({b['launches']} launches) | rel err {r['rel_err_inside_vs_apart']:.1e}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None, help="JSON results")
    ap.add_argument("--sweep", action="store_true", help="also time 'inside' under each decode config")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES), help="comma-separated shape names")
    args = ap.parse_args()
    copy = copy_gbps()
    shapes = [s for s in SHAPES if s[0] in args.shapes.split(",")]
    results = [bench(*shape, fp8, copy, args.sweep) for shape in shapes for fp8 in (True, False)]
    print(f"copy {copy:.0f} GB/s, {torch.cuda.get_device_name()}")
    print("\n".join(line(r) for r in results))
    for r in results:
        for row in r.get("inside_sweep", [])[:3]:
            print(f"  {r['shape']:8s} {'fp8 ' if r['fp8'] else 'bf16'} {row['us']:6.1f} us "
                  f"{row['frac_of_copy']:.2f} {row['config']}")  # fmt: skip
    if args.out:
        args.out.write_text(
            json.dumps({"bench": "moe_shared", "copy_GBps": copy, "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
