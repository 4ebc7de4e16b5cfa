"""The fused MoE at decode (few rows per expert), on one GPU, against the device-copy ceiling.

    python benchmarks/kernels/moe_decode.py [--out results.json] [--budget-s 140] [--quick]
    python benchmarks/kernels/moe_decode.py --shared [--sweep] [--shapes v2lite,v3slice] [--out results.json]

Routed experts (the default): the grouped GEMMs against the decode GEMVs (mlac/kernels/moe/).
Shapes: V2-Lite (E=64, top-6, H=2048, I=1408) and a 32-expert slice of V3 (H=7168, I=2048, top-8),
bf16 and block-FP8, T in {1, 4, 8, 32} tokens. Per shape it times the grouped-GEMM path (moe/grouped.py,
`pick_moe_config`), the decode kernel's default (`pick_moe_decode_config`) and a sweep of decode
configs, each as a whole `fused_moe` call (align/quant, GEMMs, top-k reduce). The end of the output
has one ready-to-paste line per shape with the best decode config.

`--shared`: one MoE layer at batch 1 with its shared experts, apart (their own MLP: w13 GEMM,
silu_mul[_quant], w2 GEMM, as the model dispatches them, then `fused_moe(..., shared_out=...)`) or
inside the routed experts' decode launches (`fused_moe(..., shared=...)`, the model's default).
V2-Lite has 2 shared experts, the V3 slice 1; FP8 input comes quantized by its producer (Fp8Act),
as the norm hands it to the layer. Also reports the kernel launches of one call (torch.profiler).
`--sweep` also times "inside" under each decode config of `sweep` (one token), fastest first.

Timing: CALLS calls per CUDA graph (timing.graph_us), each with its own routing and alternating
between two copies of the weights (a call does not find the previous call's experts in L2); CUDA
events around graph replays, median over replays, time per call. Reported: microseconds, GB/s of
the expert bytes the call touches (each distinct expert's w13 + w2, and scales, once; with
`--shared` the shared experts' too) and its fraction of the device-to-device copy bandwidth
measured in the same run (the ceiling). MLAC_PDL applies as set.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from timing import copy_gbps, graph_us  # noqa: E402

from mlac.core.fp8 import FP8  # noqa: E402
from mlac.kernels.fp8_quant import Fp8Act  # noqa: E402
from mlac.kernels.gemm.fp8_gemm import quantize_act_ref  # noqa: E402
from mlac.kernels.moe import decode_config as MD  # noqa: E402
from mlac.kernels.moe import fused as M  # noqa: E402
from mlac.kernels.moe import routing as R  # noqa: E402
from mlac.kernels.moe.grouped import pick_moe_config  # noqa: E402
from mlac.kernels.moe.shared import SharedExperts  # noqa: E402
from mlac.runtime.model.layers import Weights  # noqa: E402
from mlac.runtime.model.model import MLP  # noqa: E402

DEV = "cuda"
CALLS = 20  # calls per graph
SHAPES = [  # name, E, top_k, H, I
    ("v2lite", 64, 6, 2048, 1408),
    ("v3slice", 32, 8, 7168, 2048),
]
TOKENS = [1, 4, 8, 32]
SHARED_SHAPES = [("v2lite", 64, 6, 2048, 1408, 2), ("v3slice", 32, 8, 7168, 2048, 1)]  # ..., shared experts


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


# ---- --shared: one MoE layer with its shared experts, apart or inside the decode launches ----


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


def shared_bench(name, e, top_k, h, i, n_shared, fp8, copy, configs: bool = False) -> dict:
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
            (row for cfg in sweep(1, top_k, e) if (row := shared_timed(inside, cfg, calls, moved, copy, a))),
            key=lambda r: r["us"],
        )
    return res


def shared_timed(fn, cfg, calls, moved: float, copy: float, expected: torch.Tensor) -> dict | None:
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


def shared_line(r: dict) -> str:
    a, b = r["apart"], r["inside"]
    return (
        f"{r['shape']:8s} {'fp8 ' if r['fp8'] else 'bf16'} {r['read_MB']:6.1f} MB | apart {a['us']:6.1f} us "
        f"{a['frac_of_copy']:.2f} ({a['launches']} launches) | inside {b['us']:6.1f} us {b['frac_of_copy']:.2f} "
        f"({b['launches']} launches) | rel err {r['rel_err_inside_vs_apart']:.1e}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="JSON results")
    ap.add_argument("--budget-s", type=float, default=140.0, help="stop sweeping after this many seconds")
    ap.add_argument("--quick", action="store_true", help="default configs only")
    ap.add_argument(
        "--shared", action="store_true", help="one MoE layer with its shared experts, apart or inside"
    )
    ap.add_argument(
        "--sweep", action="store_true", help="with --shared: time 'inside' under each decode config"
    )
    ap.add_argument(
        "--shapes", default=",".join(s[0] for s in SHARED_SHAPES), help="with --shared: shape names"
    )
    args = ap.parse_args()
    if args.shared:
        shared_main(args)
        return
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


def shared_main(args: argparse.Namespace) -> None:
    copy = copy_gbps()
    shapes = [s for s in SHARED_SHAPES if s[0] in args.shapes.split(",")]
    results = [shared_bench(*shape, fp8, copy, args.sweep) for shape in shapes for fp8 in (True, False)]
    print(f"copy {copy:.0f} GB/s, {torch.cuda.get_device_name()}")
    print("\n".join(shared_line(r) for r in results))
    for r in results:
        for row in r.get("inside_sweep", [])[:3]:
            print(f"  {r['shape']:8s} {'fp8 ' if r['fp8'] else 'bf16'} {row['us']:6.1f} us "
                  f"{row['frac_of_copy']:.2f} {row['config']}")  # fmt: skip
    if args.out:
        record = {"bench": "moe_shared", "device": torch.cuda.get_device_name(), "torch": torch.__version__}
        args.out.write_text(json.dumps(record | {"copy_GBps": copy, "results": results}, indent=1))


def meta(copy: float, results: list[dict], t0: float) -> dict:
    import triton

    return {
        "bench": "moe_decode",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "host": platform.node(),
        "copy_GBps": copy,
        "calls_per_graph": CALLS,
        "elapsed_s": time.monotonic() - t0,
        "results": results,
    }


if __name__ == "__main__":
    main()
