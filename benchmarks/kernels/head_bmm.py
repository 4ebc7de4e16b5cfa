"""Absorbed-MLA batched matmuls (w_kc, w_vc) per head, bf16 against block-FP8 weights, on one GPU.

    python benchmarks/kernels/head_bmm.py [--out results.json] [--quick] [--heads 16,128] [--batches 1,64]

Also run by all.py, which records it in results/kernels_h200.json.

For each matmul (w_kc "bhd,hdc->bhc" with q_nope a strided slice of q, w_vc "bhc,hcv->bhv"),
H in (16, 128) and B in (1, 16, 64, 256, 4096) it times
  torch.einsum bf16 (bare, and with the .contiguous() the model adds: the baseline),
  Triton head_bmm with bf16 weights, with e4m3 weights (W8A16), and W8A8,
each Triton kind the fastest of a few configurations. Timing as gemm_moe.py's: a CUDA
graph of calls over rotated copies of the inputs (weights + activations at least L2_ROTATE_BYTES
per pass, so L2 does not hold the weights), replayed under do_bench, median per call.
Each row records us, GB/s on the bytes that must move (weight + scales + activation + output),
the fraction of the copy bandwidth measured in the same run, TFLOP/s, and rel_err: the relative
Frobenius error against a float64 product with the original (unquantized) bf16 weights. A
`verdict` row per (matmul, H, B) names the fastest and what FP8 costs in accuracy.
A configuration that fails to compile or run is recorded with its error; the run goes on.
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

_HERE = Path(__file__).resolve().parent
for _p in (str(_HERE), str(_HERE.parents[1])):
    if _p not in sys.path:
        sys.path.insert(0, _p)
import gemm_moe as BG  # noqa: E402 - the timing helpers and ceilings are shared

from mlac.kernels.attention import head_bmm as HB  # noqa: E402

DEV = "cuda"
MATMULS = {  # name: (einsum, K, N, extra columns of x's buffer: q_nope is a slice of q [B, H, 192])
    "w_kc": ("bhd,hdc->bhc", 128, 512, 64),
    "w_vc": ("bhc,hcv->bhv", 512, 128, 0),
}
HEADS = (16, 128)  # V3/V2 at TP-8 and V2-Lite; V3 at TP-1
BATCHES = (1, 16, 64, 256, 4096)
ROTATE_MAX = 128  # copies: B=1, H=16 moves 2 MB per call
REP_MS = 20
FORMATS = ("bf16", "fp8_w8a16", "fp8_w8a8")


def candidates(b: int, n: int, fmt: str, quick: bool) -> list[HB.HeadBmmConfig]:
    """The default first, then a few alternatives; W8A8 needs block_k 128."""
    C = HB.HeadBmmConfig
    if b <= HB.DECODE_MAX_B:  # weight streaming: enough CTAs over (N tiles, H)
        cands = [HB.CONFIGS["decode"], C(16, 32, 128, 4, 4)]
        cands.append(C(16, 128, 128, 4, 3) if n >= 512 else C(16, 16, 128, 4, 4))
        if b > 16:
            cands.append(C(64, 64, 128, 4, 3))
    else:
        cands = [HB.CONFIGS["large"], C(64, 128, 64, 4, 3), C(128, 128, 128, 8, 3)]
        if fmt == "fp8_w8a8":
            cands.append(C(64, 128, 128, 4, 3))
    if fmt == "fp8_w8a8":
        cands = [c for c in cands if c.block_k == 128]
    return cands[:2] if quick else cands


def _rel_err(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out.double() - exact).norm() / exact.norm()).item()


class _Case:
    """Inputs of one (matmul, H, B): `rot` copies of x (views like the model's) and of the weights
    in each format, the exact float64 product of copy 0 with the original bf16 weights."""

    def __init__(self, which: str, h: int, b: int, weights: dict):
        eq, k, n, pad = MATMULS[which]
        self.which, self.eq, self.h, self.b, self.k, self.n = which, eq, h, b, k, n
        w, q, s = weights[(which, h)]
        x_bytes, w_bytes = b * h * k * 2, w.numel() * 2
        self.rot = max(1, min(ROTATE_MAX, math.ceil(BG.L2_ROTATE_BYTES / (w_bytes + x_bytes))))
        scale = 1 + 4 * torch.rand(b, h, 1, device=DEV)  # tokens of different magnitudes
        self.xs = [
            (torch.randn(b, h, k + pad, device=DEV) * scale).bfloat16()[..., :k] for _ in range(self.rot)
        ]
        self.ws = [w] + [w.clone() for _ in range(self.rot - 1)]  # equal values, distinct memory
        self.qs = [q] + [q.clone() for _ in range(self.rot - 1)]
        self.ss = [s] + [s.clone() for _ in range(self.rot - 1)]
        self.exact = torch.einsum("bhk,hkn->bhn", self.xs[0].double(), w.double())
        self.bytes = {  # what must move: weight (+ scales), activation, output
            "bf16": w_bytes + x_bytes + b * h * n * 2,
            "fp8": q.numel() + s.numel() * 4 + x_bytes + b * h * n * 2,
        }
        self.flops = 2 * b * h * k * n

    def call(self, kernel: str, fmt: str, cfg: HB.HeadBmmConfig | None, i: int) -> torch.Tensor:
        x = self.xs[i]
        if kernel == "torch_einsum":
            return torch.einsum(self.eq, x, self.ws[i])
        if kernel == "torch_einsum_contig":  # as MLAAttention.decode uses it
            return torch.einsum(self.eq, x, self.ws[i]).contiguous()
        if fmt == "bf16":
            return HB.head_bmm_triton(x, self.ws[i], config=cfg)
        return HB.head_bmm_triton(x, self.qs[i], self.ss[i], quant_act=fmt == "fp8_w8a8", config=cfg)

    def reference(self, fmt: str) -> torch.Tensor:
        """The kernel's own contract (quantized operands, float32 math): a correctness check."""
        if fmt == "bf16":
            return HB.head_bmm_ref(self.xs[0], self.ws[0])
        return HB.head_bmm_ref(self.xs[0], self.qs[0], self.ss[0], quant_act=fmt == "fp8_w8a8")


def _measure(case: _Case, kernel: str, fmt: str, cfg: HB.HeadBmmConfig | None) -> dict:
    tag = f"{case.which} H={case.h} B={case.b} {kernel} {fmt} {cfg}"
    try:
        out = case.call(kernel, fmt, cfg, 0)
        res = {"config": cfg.__dict__ if cfg else None, "rel_err": _rel_err(out, case.exact)}
        if kernel == "triton":
            res["rel_err_vs_ref"] = _rel_err(out, case.reference(fmt).double())
        del out
        fns = [lambda i=i: case.call(kernel, fmt, cfg, i) for i in range(case.rot)]
        res["us"] = BG.time_graph(fns, rep_ms=REP_MS)
    except Exception as exc:  # noqa: BLE001 - one failing configuration must not end the run
        BG.log(f"  {tag} FAILED {exc!r}"[:400])
        return {"config": cfg.__dict__ if cfg else None, "error": repr(exc)[:400]}
    BG.log(f"  {tag} {res['us']:.2f} us err {res['rel_err']:.2e}")
    return res


def _row(case: _Case, kernel: str, fmt: str, sweep: list[dict], ceil: dict) -> dict:
    ok = [r for r in sweep if "us" in r]
    row = {
        "kind": "timing",
        "matmul": case.which,
        "einsum": case.eq,
        "kernel": kernel,
        "format": fmt,
        "weight_dtype": "bf16" if fmt == "bf16" else "e4m3",
        "act_dtype": "e4m3" if fmt == "fp8_w8a8" else "bf16",
        "H": case.h,
        "B": case.b,
        "K": case.k,
        "N": case.n,
        "rotate": case.rot,
        "sweep": sweep,
    }
    if not ok:
        row["error"] = "; ".join(r.get("error", "") for r in sweep)
        return row
    best = min(ok, key=lambda r: r["us"])
    nbytes = case.bytes["bf16" if fmt == "bf16" else "fp8"]
    gbps = nbytes / best["us"] / 1e3
    row.update(
        us=best["us"],
        config=best["config"],
        default_us=sweep[0].get("us"),
        bytes=nbytes,
        GBps=gbps,
        fraction_copy=gbps / ceil["copy_GBps"],
        TFLOPs=case.flops / best["us"] / 1e6,
        fraction_bf16_mm=case.flops / best["us"] / 1e6 / ceil["bf16_mm_TFLOPs"],
        rel_err=best["rel_err"],
        rel_err_vs_ref=best.get("rel_err_vs_ref"),
    )
    return row


def verdict(rows: list[dict]) -> dict:
    """The fastest of one (matmul, H, B), and FP8's accuracy next to bf16's. The bare einsum is
    left out of the race: its output is a strided view that the model then copies (the
    `.contiguous()` / `flatten(1)` after it), so `torch_einsum_contig` is the baseline."""
    r0 = rows[0]
    out = {"kind": "verdict", "matmul": r0["matmul"], "H": r0["H"], "B": r0["B"]}
    ok = {f"{r['kernel']} {r['format']}": r for r in rows if "us" in r and r["kernel"] != "torch_einsum"}
    if not ok:
        return {**out, "summary": "every kernel failed"}
    fastest = min(ok, key=lambda k: ok[k]["us"])
    bf16 = [k for k in ok if ok[k]["format"] == "bf16"]
    best_bf16 = min(bf16, key=lambda k: ok[k]["us"]) if bf16 else None
    base = ok.get("torch_einsum_contig bf16")
    out.update(
        fastest=fastest,
        fastest_us=ok[fastest]["us"],
        baseline_us=base["us"] if base else None,
        speedup_vs_baseline=base["us"] / ok[fastest]["us"] if base else None,
        fastest_bf16=best_bf16,
        fastest_bf16_us=ok[best_bf16]["us"] if best_bf16 else None,
        us={k: r["us"] for k, r in ok.items()},
        rel_err={k: r["rel_err"] for k, r in ok.items()},
    )
    parts = [f"fastest {fastest} {ok[fastest]['us']:.1f} us"]
    if base:
        parts.append(f"{out['speedup_vs_baseline']:.2f}x vs einsum+contig {base['us']:.1f} us")
    if best_bf16:
        b16 = ok[best_bf16]
        parts.append(f"best bf16 ({best_bf16}) {b16['us']:.1f} us err {b16['rel_err']:.1e}")
        for fmt in ("fp8_w8a16", "fp8_w8a8"):
            r = ok.get(f"triton {fmt}")
            if r:
                parts.append(f"{fmt} {r['us']:.1f} us ({b16['us'] / r['us']:.2f}x) err {r['rel_err']:.1e}")
    out["summary"] = "; ".join(parts)
    return out


def _weights(which: str, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gaussian bf16 weights (absorbed kv_b scale) and their per-head block-FP8 form."""
    _, k, n, _ = MATMULS[which]
    w = (torch.randn(h, k, n, device=DEV) / k**0.5).bfloat16()
    q, s = HB.quantize_head_weight(w)
    return w, q, s


def run(
    ceilings: dict,
    quick: bool = False,
    heads: tuple[int, ...] = HEADS,
    batches: tuple[int, ...] = BATCHES,
    matmuls: tuple[str, ...] = tuple(MATMULS),
) -> list[dict]:
    """Timing rows (one per kernel and format) and a verdict row per (matmul, H, B)."""
    torch.manual_seed(0)
    weights = {(m, h): _weights(m, h) for m in matmuls for h in heads}
    rows: list[dict] = []
    for which in matmuls:
        for h in heads:
            for b in batches:
                case = _Case(which, h, b, weights)
                group = []
                for kernel in ("torch_einsum", "torch_einsum_contig"):
                    group.append(_row(case, kernel, "bf16", [_measure(case, kernel, "bf16", None)], ceilings))
                for fmt in FORMATS:
                    sweep = [_measure(case, "triton", fmt, c) for c in candidates(b, case.n, fmt, quick)]
                    group.append(_row(case, "triton", fmt, sweep, ceilings))
                rows += group + [verdict(group)]
                BG.log(f"{which} H={h} B={b}: {rows[-1]['summary']}")
                del case
                torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    head = (
        f"{'matmul':<6}{'H':>5}{'B':>6}  {'kernel':<20}{'format':<11}{'us':>9}{'GB/s':>8}{'frac':>6}"
        f"{'TFLOP/s':>9}{'rel_err':>9}  config"
    )
    lines = [head]
    for r in rows:
        if r["kind"] == "verdict":
            lines.append(f"{'':<6}{'':>5}{'':>6}  => {r['summary']}")
            continue
        key = f"{r['matmul']:<6}{r['H']:>5}{r['B']:>6}  {r['kernel']:<20}{r['format']:<11}"
        if "us" not in r:
            lines.append(f"{key}FAILED {r.get('error', '')[:80]}")
            continue
        cfg = r["config"]
        cfg = "-" if cfg is None else "{block_m}x{block_n}x{block_k} w{num_warps} s{num_stages}".format(**cfg)
        lines.append(
            f"{key}{r['us']:>9.2f}{r['GBps']:>8.0f}{r['fraction_copy']:>6.2f}{r['TFLOPs']:>9.1f}"
            f"{r['rel_err']:>9.1e}  {cfg}"
        )
    return "\n".join(lines)


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(v) for v in s.split(",") if v)


def main() -> None:
    ap = argparse.ArgumentParser()
    out_dir = os.environ.get("OUT", "benchmarks/results")
    ap.add_argument("--out", default=os.path.join(out_dir, "kernels_head_bmm.json"))
    ap.add_argument("--quick", action="store_true", help="two configurations per Triton kind")
    ap.add_argument("--heads", default=",".join(map(str, HEADS)))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--matmuls", default=",".join(MATMULS))
    args = ap.parse_args()
    t0 = time.time()
    res = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": BG.triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "timing": f"CUDA graph of calls over rotated inputs, do_bench median per call (rep {REP_MS} ms)",
        "rel_err": "||out - exact|| / ||exact||, exact = float64 product with the unquantized bf16 weights",
    }
    res["ceilings"] = BG.ceilings()
    BG.log(f"ceilings {res['ceilings']}")
    matmuls = tuple(m for m in args.matmuls.split(",") if m)
    res["rows"] = run(res["ceilings"], args.quick, _ints(args.heads), _ints(args.batches), matmuls)
    res["wall_s"] = time.time() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    Path(args.out).with_suffix(".log").write_text("\n".join(BG.LOG))
    c = res["ceilings"]
    print(f"device {res['device']}  torch {res['torch']}  triton {res['triton']}  wall {res['wall_s']:.0f} s")
    print(f"ceilings: copy {c['copy_GBps']:.0f} GB/s | bf16 mm {c['bf16_mm_TFLOPs']:.0f} TFLOP/s")
    print(table(res["rows"]))


if __name__ == "__main__":
    main()
