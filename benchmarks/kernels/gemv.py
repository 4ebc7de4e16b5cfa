"""The skinny decode GEMM (skinny_linear, mlac/kernels/gemm/) against cuBLAS and the block-FP8 GEMM, on one GPU.

    python benchmarks/kernels/gemv.py [--out results.json] [--quick] [--jobs 12] [--budget-s 140]

For V2-Lite's and V3's dense shapes and M in (1, 2, 4, 8, 16) it times
  bf16 weights:  cuBLAS F.linear, and skinny_linear over a sweep of configs;
  FP8 weights:   the block-FP8 GEMM (fp8_linear on an Fp8Act, as the model feeds it), and
                 skinny_linear on the same Fp8Act over a sweep; then skinny_linear's best config on
                 a bf16 x (quantized inside the kernel).
Timing: a CUDA graph of at least 20 calls over rotated copies of the weights (together larger than
L2, as in a decode step where every weight is read once), replayed many times between two CUDA
events: microseconds per call, launch overhead excluded as in the model's captured decode.
GB/s counts the bytes that must move (weight, scales, x, y); `frac` is that over the device-to-device
copy bandwidth measured in the same run (read + write). Every skinny result is checked against the
reference (rel_err). Kernels are compiled first by `--jobs` worker processes into Triton's disk cache.

The end of the output is a block of `TUNED` lines, the best config per (kind, N, K, m_class), ready
to paste into mlac/kernels/gemm/gemv_configs.py.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from timing import copy_gbps as gpu_copy_gbps  # noqa: E402

from mlac.kernels.fp8_quant import Fp8Act, act_quant  # noqa: E402
from mlac.kernels.gemm import fp8_gemm as G  # noqa: E402
from mlac.kernels.gemm import gemv, gemv_configs  # noqa: E402

DEV = "cuda"
SHAPES = {  # name: (N, K)
    "v2lite.q_proj": (3072, 2048),
    "v2lite.kv_a": (576, 2048),
    "v2lite.o_proj": (2048, 2048),
    "v2lite.shared_w13": (2816, 2048),
    "v2lite.shared_w2": (2048, 1408),
    "v2lite.dense_w13": (21888, 2048),
    "v2lite.dense_w2": (2048, 10944),
    "v3.q_a": (1536, 7168),
    "v3.q_b": (24576, 1536),
    "v3.kv_a": (576, 7168),
    "v3.o": (7168, 16384),
    "v3.shared_w13": (4096, 7168),
    "v3.shared_w2": (7168, 2048),
}
MS = (1, 2, 4, 8, 16)
ROTATE_BYTES = 192 << 20  # weight copies per graph: together ~4x the H200's L2
MIN_CALLS, TOTAL_CALLS = 20, 400  # calls per graph (at least), calls timed per measurement (about)
C = gemv_configs.SkinnyConfig


def candidates(kind: str, n: int, k: int, m: int, sms: int, quick: bool) -> list[gemv_configs.SkinnyConfig]:
    """default_config first, then tiles around it: CUDA-core ones up to M = 4, tensor-core ones at
    every M; each at the rule's split and at twice it."""
    fp8 = kind == "fp8"
    cands = [gemv_configs.default_config(kind, n, k, m, sms)]
    if m <= 4:
        rows = [(32, 128, 4), (64, 128, 4), (16, 128, 4), (64, 128, 8)] if fp8 else []
        if not fp8:
            rows = (
                [(32, 256, 4), (16, 512, 4), (64, 128, 4), (32, 256, 8)]
                if m == 1
                else [(16, 256, 4), (32, 128, 4)]
            )
        cands += [C(bn, bk, num_warps=w, num_stages=4) for bn, bk, w in rows]
    dots = [(64, 128, 4, 4), (32, 128, 4, 4), (128, 128, 4, 3), (128, 128, 8, 3)]
    if not fp8:
        dots.append((64, 256, 4, 3))
    cands += [C(bn, bk, num_warps=w, num_stages=s, dot=True) for bn, bk, w, s in dots]
    out = []
    for c in cands:
        k_steps = -(-k // c.block_k)
        split = gemv_configs.split_for(-(-n // c.block_n), k_steps, sms)
        out += [replace(c, split_k=s) for s in (split, 2 * split) if s <= k_steps]
    out = list(dict.fromkeys(out))
    return out[:3] if quick else out


class Case:
    """Inputs of one (N, K, kind, M): `rot` copies of the weight, an x per copy (bf16, and its Fp8Act
    for FP8), and the float32 reference of copy 0."""

    def __init__(self, n: int, k: int, kind: str, m: int, rotate: bool = True):
        self.n, self.k, self.kind, self.m = n, k, kind, m
        w_bytes = n * k * (1 if kind == "fp8" else 2)
        self.rot = max(1, min(256, math.ceil(ROTATE_BYTES / w_bytes))) if rotate else 1
        g = torch.Generator(device=DEV).manual_seed(n + k + m)
        self.xs = [torch.randn(m, k, device=DEV, generator=g).bfloat16() for _ in range(self.rot)]
        if kind == "fp8":
            w = (torch.randn(n, k, device=DEV, generator=g) * 64).clamp_(-448, 448).to(G.FP8)
            s = torch.rand(-(-n // 128), -(-k // 128), device=DEV, generator=g) * 1e-2 + 5e-3
            self.ws, self.ss = [w] + [w.clone() for _ in range(self.rot - 1)], [s] * self.rot
            self.acts = [Fp8Act(*act_quant(x), x.dtype) for x in self.xs]
        else:
            w = (torch.randn(n, k, device=DEV, generator=g) / k**0.5).bfloat16()
            self.ws, self.ss, self.acts = (
                [w] + [w.clone() for _ in range(self.rot - 1)],
                [None] * self.rot,
                None,
            )
        self.ref = gemv.skinny_linear_ref(self.acts[0] if self.acts else self.xs[0], self.ws[0], self.ss[0])

    def bytes_moved(self) -> int:
        w = self.n * self.k * (1 if self.kind == "fp8" else 2) + (
            self.ss[0].numel() * 4 if self.ss[0] is not None else 0
        )
        return w + self.m * self.k * 2 + self.m * self.n * 2

    def call(self, impl: str, cfg: gemv_configs.SkinnyConfig | None, i: int) -> torch.Tensor:
        x, w, s = self.xs[i], self.ws[i], self.ss[i]
        if impl == "cublas":
            return F.linear(x, w)
        if impl == "fp8_gemm":
            return G.fp8_linear(self.acts[i], w, s)
        if impl == "skinny":
            return gemv.skinny_linear(self.acts[i] if self.acts else x, w, s, cfg)
        if impl == "skinny_xbf16":
            return gemv.skinny_linear(x, w, s, cfg)
        raise ValueError(impl)


def time_calls(case: Case, impl: str, cfg: gemv_configs.SkinnyConfig | None) -> float:
    """Microseconds per call: a graph of max(20, rot) calls over the rotated copies, replayed
    between CUDA events until about TOTAL_CALLS calls."""
    calls = max(MIN_CALLS, case.rot)
    case.call(impl, cfg, 0)  # compile, allocate split-K counters, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            case.call(impl, cfg, i % case.rot)
    replays = max(3, TOTAL_CALLS // calls)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    del graph
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30)).item()


# ---- the sweep --------------------------------------------------------------------------------


def work_items(quick: bool, sms: int) -> list[tuple[str, int, int, str, int, list]]:
    """(shape name, N, K, kind, M, skinny configs) for every measured case."""
    ms = (1, 16) if quick else MS
    return [
        (name, n, k, kind, m, candidates(kind, n, k, m, sms, quick))
        for name, (n, k) in SHAPES.items()
        for kind in ("bf16", "fp8")
        for m in ms
    ]


def _compile_worker(items: list) -> int:
    """Run each config once (one copy, no graph): Triton writes the kernels to its disk cache."""
    done = 0
    for _, n, k, kind, m, cfgs in items:
        case = Case(n, k, kind, m, rotate=False)
        for cfg in cfgs:
            try:
                case.call("skinny", cfg, 0)
                done += 1
            except Exception:  # noqa: BLE001 - the main process records the error
                pass
        extra = [("skinny_xbf16", cfgs[0]), ("fp8_gemm", None)] if kind == "fp8" else []
        for impl, cfg in extra:
            try:
                case.call(impl, cfg, 0)
            except Exception:  # noqa: BLE001
                pass
    torch.cuda.synchronize()
    return done


def precompile(items: list, jobs: int) -> None:
    if jobs <= 0:
        return
    t0 = time.time()
    chunks = [items[i::jobs] for i in range(jobs)]
    with mp.get_context("spawn").Pool(jobs) as pool:
        done = sum(pool.map(_compile_worker, chunks))
    print(f"compiled {done} kernel calls in {jobs} processes: {time.time() - t0:.1f} s", file=sys.stderr)


def measure(case: Case, impl: str, cfg, copy_gbps: float) -> dict:
    row = dict(impl=impl, config=asdict(cfg) if cfg else None)
    try:
        us = time_calls(case, impl, cfg)
        gbps = case.bytes_moved() / (us * 1e-6) / 1e9
        row.update(us=us, GBps=gbps, frac=gbps / copy_gbps)
        if impl.startswith("skinny"):
            row["rel_err"] = rel_err(case.call(impl, cfg, 0), case.ref)
    except Exception as exc:  # noqa: BLE001 - record it, go on
        row.update(error=repr(exc)[:300])
    return row


def run_case(item, copy_gbps: float, deadline: float) -> dict:
    name, n, k, kind, m, cfgs = item
    case = Case(n, k, kind, m)
    base = measure(case, "cublas" if kind == "bf16" else "fp8_gemm", None, copy_gbps)
    sweep = []
    for i, cfg in enumerate(cfgs):
        if i > 0 and time.time() > deadline:
            break  # over budget: the default config only
        sweep.append(measure(case, "skinny", cfg, copy_gbps))
    ok = [r for r in sweep if "us" in r]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    rec = dict(shape=name, n=n, k=k, kind=kind, m=m, baseline=base, sweep=sweep, best=best)
    if kind == "fp8" and best is not None:
        rec["xbf16"] = measure(case, "skinny_xbf16", C(**best["config"]), copy_gbps)
    return rec


def _fmt(r: dict | None) -> str:
    if r is None or "us" not in r:
        return f"{'error' if r else '-':>22}"
    return f"{r['us']:8.2f} {r['GBps']:6.0f} {r['frac']:5.2f}"


def table(records: list[dict]) -> str:
    head = f"{'shape':<18}{'kind':<5}{'M':>3} | {'baseline us GB/s frac':>22} | {'default':>22} | {'best':>22} | x"
    lines = [head, "-" * len(head)]
    for r in records:
        default = r["sweep"][0] if r["sweep"] else None
        speed = r["baseline"]["us"] / r["best"]["us"] if r["best"] and "us" in r["baseline"] else float("nan")
        lines.append(
            f"{r['shape']:<18}{r['kind']:<5}{r['m']:>3} | {_fmt(r['baseline'])} | {_fmt(default)} | "
            f"{_fmt(r['best'])} | {speed:.2f}"
        )
    return "\n".join(lines)


def tuned_lines(records: list[dict]) -> list[str]:
    """Per (kind, N, K, m_class): the config with the least total time over the class's M values
    (only configs measured at all of them)."""
    groups: dict[tuple, dict[str, list]] = {}
    for r in records:
        key = (r["kind"], r["n"], r["k"], gemv_configs.m_class(r["m"]))
        by_cfg = groups.setdefault(key, {})
        for s in r["sweep"]:
            if "us" in s:
                by_cfg.setdefault(json.dumps(s["config"], sort_keys=True), []).append(
                    (r["m"], s["us"], s["frac"])
                )
    lines = []
    for key, by_cfg in sorted(groups.items()):
        ms = {m for runs in by_cfg.values() for m, _, _ in runs}
        full = {c: runs for c, runs in by_cfg.items() if {m for m, _, _ in runs} == ms}
        if not full:
            continue
        cfg, runs = min(full.items(), key=lambda kv: sum(us for _, us, _ in kv[1]))
        c = C(**json.loads(cfg))
        detail = ", ".join(f"M={m}: {us:.2f} us {frac:.2f}" for m, us, frac in sorted(runs))
        lines.append(f"    {key!r}: {c!r},  # {detail}")
    return lines


def summary(records: list[dict]) -> str:
    """Per (model, kind, M): the sum over that model's shapes, baseline against the best skinny."""
    sums: dict[tuple, list[float]] = {}
    for r in records:
        if r["best"] and "us" in r["baseline"]:
            acc = sums.setdefault((r["shape"].split(".")[0], r["kind"], r["m"]), [0.0, 0.0])
            acc[0] += r["baseline"]["us"]
            acc[1] += r["best"]["us"]
    return "\n".join(
        f"{model:<8}{kind:<5} M={m:<3} all shapes once: baseline {b:8.1f} us, skinny best {s:8.1f} us ({b / s:.2f}x)"
        for (model, kind, m), (b, s) in sums.items()
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="M in (1, 16), three configs per case")
    ap.add_argument("--jobs", type=int, default=12, help="processes that compile the kernels first (0: none)")
    ap.add_argument("--budget-s", type=float, default=140.0, help="past this, cases time the default only")
    args = ap.parse_args()
    t0 = time.time()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    items = work_items(args.quick, sms)
    precompile(items, args.jobs)
    copy_gbps = gpu_copy_gbps()
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s; {len(items)} cases", file=sys.stderr)
    records = []
    for item in items:
        records.append(run_case(item, copy_gbps, t0 + args.budget_s))
        print(table(records[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    print(table(records))
    print("\n" + summary(records))
    lines = tuned_lines(records)
    print("\n# paste into mlac/kernels/gemm/gemv_configs.py TUNED:\n" + "\n".join(lines))
    print(f"\nwall {time.time() - t0:.1f} s", file=sys.stderr)
    if args.out:
        meta = dict(
            device=torch.cuda.get_device_name(0),
            torch=torch.__version__,
            triton=__import__("triton").__version__,
            host=platform.node(),
            copy_GBps=copy_gbps,
            wall_s=time.time() - t0,
        )
        args.out.write_text(json.dumps(dict(meta=meta, records=records, tuned=lines), indent=1))


if __name__ == "__main__":
    main()
