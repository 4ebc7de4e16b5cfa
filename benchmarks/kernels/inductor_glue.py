"""torch.compile (Inductor) against mlac's hand-written glue of a decode step, side by side on one GPU.

    python benchmarks/kernels/inductor_glue.py --json out.json
    python benchmarks/kernels/inductor_glue.py --device cpu --smoke   # tiny shapes on CPU: the checks

For each piece of glue (glue_pieces.py: RMSNorm with the residual add, alone and with the fused FP8
quantization; the latent q_norm; rope's cos/sin and mla_prep; FP8 activation quantization; SiLU-mul
alone and quantized; greedy and temperature/top-k/top-p sampling; the embedding lookup and the
logits' cast into the graphs' buffer) at V2-Lite's and V3's shapes (bf16 activations), at 1 and 256
tokens:

  mlac       the piece as the decode step runs it: its Triton kernel through its wrapper, or the
             plain eager ops where the model has no kernel (cos/sin, the sampler)
  inductor   torch.compile of the piece's pure-torch reference (fullgraph=True, dynamic=False), in
             mode "default" and "max-autotune-no-cudagraphs", compiled by its first call (timed:
             compile_s) in an empty Inductor cache (a temporary folder unless --cache-dir), after
             one throwaway compile that pays Inductor's start (imports, compile workers)

Both are timed as CUDA-graph replays (timing.graph_us) after the compiled outputs are checked
against mlac's (max_error: the largest difference relative to the largest value of each output,
FP8 dequantized; for ids the fraction of rows that differ; `ok`: within the piece's tolerance). A
row gives microseconds, the ratio mlac over inductor (> 1: Inductor is faster), the fraction of the
bandwidth ceiling (bytes the piece must read and write over the device-copy bandwidth measured in
this run; the inputs stay in L2 between replays, as a step's glue finds what the kernel before it
wrote: a fraction above 1 is L2) and compile seconds. The sampler runs outside the graphs today:
`sampling.sample` itself is also timed eagerly (eager_us), with its per-row host parameters and
torch.multinomial row by row (a host sync each).

Time is bounded: every piece compiles in mode default first; max-autotune (which benchmarks kernel
configs as it compiles) follows where it could change the verdict first (the rows whose default
came closest to mlac or beat it, then the largest batches), while --budget-s allows; a row skipped
says so. Rerun those alone: --modes max-autotune-no-cudagraphs --pieces ... --batches ...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import glue_pieces as gp  # noqa: E402
from timing import copy_gbps, graph_us  # noqa: E402

MODES = ("default", "max-autotune-no-cudagraphs")
SCRIPT = "python benchmarks/kernels/inductor_glue.py"


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def wall_us(fn, dev: torch.device, calls: int = 3) -> float:
    """Median wall microseconds of eager calls, each synchronized (CPU, and what runs outside graphs)."""
    fn()
    sync(dev)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        sync(dev)
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def time_us(fn, dev: torch.device) -> float:
    """CUDA-graph replay median on CUDA; eager wall time on CPU (no graphs there)."""
    return graph_us([fn]) if dev.type == "cuda" else wall_us(fn, dev)


def call(case: gp.Case, fn, args: tuple):
    """One timed call: the case's `before` (fresh noise), then fn."""
    if case.before is not None:
        case.before(args)
    return fn(*args)


def compile_ref(case: gp.Case, args: tuple, mode: str, backend: str, dev: torch.device):
    """torch.compile of the reference, compiled by a first call on args -> (fn, its output, seconds)."""
    torch._dynamo.reset()  # each shape its own compile, never a recompile limit reached
    kw = {"mode": None if mode == "default" else mode} if backend == "inductor" else {}
    fn = torch.compile(case.ref, backend=backend, fullgraph=True, dynamic=False, **kw)
    start = time.perf_counter()
    out = fn(*args)
    sync(dev)
    return fn, out, time.perf_counter() - start


def warm_inductor(dev: torch.device) -> float:
    """Seconds of one throwaway compile: Inductor's one-time start, kept out of every piece's compile_s."""
    x = torch.ones(8, device=dev)
    start = time.perf_counter()
    torch.compile(lambda a: a * 2 + 1, fullgraph=True, dynamic=False)(x)
    sync(dev)
    torch._dynamo.reset()
    return round(time.perf_counter() - start, 2)


def failed(e: Exception) -> dict:
    torch._dynamo.reset()
    return {"error": f"{type(e).__name__}: {str(e).strip()[:400]}"}


def fraction(nbytes: int, us: float | None, bw: float | None) -> float | None:
    """The bandwidth floor of nbytes over the measured time (bw in GB/s: GB/s x 1e3 = bytes per us)."""
    return None if us is None or bw is None else round(nbytes / (bw * 1e3) / us, 3)


def run_mlac(case: gp.Case, dev: torch.device, bw: float | None) -> tuple[dict, list | None]:
    """mlac's piece: checked against the eager reference, timed -> (row fields, its outputs)."""
    row: dict = {}
    try:
        args = case.inputs()
        want = case.outputs(args, case.mlac(*args))
        ref_args = case.inputs()
        row["ref_max_error"] = gp.max_error(case, case.outputs(ref_args, case.ref(*ref_args)), want)
        row["ref_ok"] = row["ref_max_error"] <= case.tol
        timed = case.inputs()
        row["mlac_us"] = round(time_us(lambda: call(case, case.mlac, timed), dev), 2)
        row["mlac_fraction"] = fraction(case.nbytes, row["mlac_us"], bw)
        if case.checks is not None:
            row.update(case.checks())
        for name, fn in (case.eager or {}).items():
            row.setdefault("eager_us", {})[name] = round(wall_us(fn, dev), 2)
    except Exception as e:  # noqa: BLE001  (recorded in the row; the run goes on)
        return failed(e), None
    return row, want


def run_inductor(case: gp.Case, want: list, mode: str, args_ns, dev: torch.device, bw: float | None) -> dict:
    """The compiled reference in `mode`: compiled, checked against mlac's outputs, timed."""
    try:
        args = case.inputs()
        fn, out, compile_s = compile_ref(case, args, mode, args_ns.backend, dev)
        err = gp.max_error(case, case.outputs(args, out), want)
        timed = case.inputs()
        us = round(time_us(lambda: call(case, fn, timed), dev), 2)
    except Exception as e:  # noqa: BLE001
        return failed(e)
    finally:
        torch._dynamo.reset()
    return {"us": us, "compile_s": round(compile_s, 2), "max_error": err, "ok": err <= case.tol, "tol": case.tol,
            "fraction": fraction(case.nbytes, us, bw)}  # fmt: skip


def add_ratio(row: dict, mode: str) -> None:
    r = row["inductor"][mode]
    if "us" in r and row.get("mlac_us"):
        r["ratio"] = round(row["mlac_us"] / r["us"], 3)


def show(row: dict, mode: str | None) -> None:
    head = f"{row['piece']:18} {row['model']:7} T={row['batch']:<4}"
    if mode is None:
        extra = f"  eager sampler {row['eager_us']['sampler']:.1f} us" if "eager_us" in row else ""
        mlac = f"{row['mlac_us']:8.2f} us" if "mlac_us" in row else row.get("error", "-")
        print(f"{head} mlac     {mlac}  {row['shape']}{extra}", flush=True)
        return
    r = row["inductor"][mode]
    if "us" not in r:
        print(f"{head} {mode}: {r.get('error') or r.get('skipped')}", flush=True)
        return
    flag = "" if r["ok"] else f"  MISMATCH (tol {r['tol']})"
    print(f"{head} {mode:26} {r['us']:8.2f} us  mlac/inductor {r.get('ratio', float('nan')):.2f}  "
          f"compile {r['compile_s']:.1f} s  max err {r['max_error']:.1e}{flag}", flush=True)  # fmt: skip


class Budget:
    """Seconds left of --budget-s since the start; whether a compile estimated at `est` still fits."""

    def __init__(self, seconds: float):
        self.start, self.seconds = time.monotonic(), seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def fits(self, est: float) -> bool:
        return self.elapsed() + est <= self.seconds


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (the tiny presets), batches 1 and 5")
    ap.add_argument("--pieces", nargs="+", choices=list(gp.PIECES), default=list(gp.PIECES))
    ap.add_argument("--models", nargs="+", choices=("v2-lite", "v3"), default=["v2-lite", "v3"])
    ap.add_argument("--batches", nargs="+", type=int, default=None, help="token counts (default 1 256)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=None, help="default: both (smoke: default)")
    ap.add_argument("--backend", choices=("inductor", "aot_eager"), default="inductor",
                    help="aot_eager: trace only (fullgraph), no code generated: the fast CPU test")  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=230.0, help="no compile starts past this (since start)")
    ap.add_argument(
        "--cache-dir", type=Path, default=None, help="Inductor cache (default: a new temp folder)"
    )
    args = ap.parse_args(argv)
    args.batches = args.batches or ([1, 5] if args.smoke else [1, 256])
    args.modes = args.modes or (["default"] if args.smoke or args.backend != "inductor" else list(MODES))
    return args


def header(args: argparse.Namespace, dev: torch.device, bw: float | None, argv: list[str]) -> dict:
    interp = dev.type == "cpu" and gp.forced(dev)
    return {
        "benchmark": "decode-step glue: mlac against torch.compile (Inductor)",
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "triton": gp.triton_version(), "cuda": torch.version.cuda,
        "python": platform.python_version(), "command": " ".join([SCRIPT, *argv]),
        "copy_gb_per_s": bw and round(bw, 1), "backend": args.backend, "modes": args.modes,
        "budget_s": args.budget_s, "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "timing": "CUDA-graph replay, median (timing.graph_us)" if dev.type == "cuda" else "CPU wall, eager",
        "mlac_path": "Triton kernels" if dev.type == "cuda" else
        ("Triton interpreter" if interp else "the wrappers' CPU references"),
    }  # fmt: skip


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    dev = torch.device(args.device)
    budget = Budget(args.budget_s)
    bw = copy_gbps() if dev.type == "cuda" else None
    record = header(args, dev, bw, argv)
    for key in ("device", "torch", "triton", "cuda", "copy_gb_per_s", "command"):
        print(f"{key}: {record[key]}", flush=True)
    configs = gp.model_configs(args.smoke)
    if args.backend == "inductor":
        record["inductor_start_s"] = warm_inductor(dev)
    rows, wants = first_pass(args, configs, dev, bw, budget)
    for mode in args.modes[1:]:
        later_pass(rows, wants, mode, args, configs, dev, bw, budget)
    record["wall_s"] = round(budget.elapsed(), 1)
    record["rows"] = rows
    summary(rows)
    return record


def first_pass(args, configs, dev, bw, budget: Budget) -> tuple[list[dict], dict[int, list]]:
    """Every piece, model and batch: mlac's piece, then the reference compiled in the first mode ->
    (rows, mlac's outputs by id(row), None where mlac's piece failed)."""
    rows, wants = [], {}
    for t in args.batches:
        for model in args.models:
            for piece in args.pieces:
                case = gp.build(piece, configs[model], t, dev)
                if case is None:
                    continue
                row = {"piece": piece, "model": model, "batch": t, "shape": case.shape, "mlac": case.what,
                       "bytes": case.nbytes, "inductor": {}}  # fmt: skip
                fields, wants[id(row)] = run_mlac(case, dev, bw)
                row.update(fields)
                show(row, None)
                rows.append(row)
                if wants[id(row)] is not None:
                    compile_mode(row, case, wants[id(row)], args.modes[0], args, dev, bw, budget, est=5.0)
    return rows, wants


def later_pass(rows, wants, mode: str, args, configs, dev, bw, budget: Budget) -> None:
    """A slower mode (max-autotune benchmarks kernel configs as it compiles: seconds to a minute a
    row), first where it could change the verdict: rows whose first mode came closest to mlac or beat
    it, then the largest batches. A compile starts only if its estimate fits the budget: the first
    mode's compile time times the largest slowdown seen so far in this mode (10 before any)."""
    first = args.modes[0]
    order = sorted(rows, key=lambda r: (-r["inductor"].get(first, {}).get("ratio", 0.0), -r["batch"]))
    slowdowns: list[float] = []
    for row in order:
        if wants[id(row)] is None:
            continue
        base = row["inductor"].get(first, {}).get("compile_s") or 5.0
        est = base * (max(slowdowns) if slowdowns else 10.0)
        case = gp.build(row["piece"], configs[row["model"]], row["batch"], dev)
        compile_mode(row, case, wants[id(row)], mode, args, dev, bw, budget, est)
        if "compile_s" in row["inductor"][mode]:
            slowdowns.append(row["inductor"][mode]["compile_s"] / base)


def summary(rows: list[dict]) -> None:
    """One line per row: the best mode's ratio (> 1: Inductor faster), and what did not check out."""
    print("\nmlac over the best Inductor mode (> 1: Inductor faster):", flush=True)
    for row in rows:
        timed = {m: r for m, r in row["inductor"].items() if "ratio" in r}
        bad = [m for m, r in row["inductor"].items() if "us" in r and not r["ok"]] + (
            ["reference"] if row.get("ref_ok") is False else []
        )
        best = max(timed, key=lambda m: timed[m]["ratio"]) if timed else None
        ratio = f"{timed[best]['ratio']:6.2f} ({best})" if best else "     -"
        print(f"  {row['piece']:18} {row['model']:7} T={row['batch']:<4} {ratio}"
              f"{'  MISMATCH: ' + ', '.join(bad) if bad else ''}", flush=True)  # fmt: skip


def compile_mode(row, case, want, mode, args, dev, bw, budget: Budget, est: float) -> None:
    """One mode of one row, if the budget allows a compile of about `est` seconds."""
    if not budget.fits(est):
        row["inductor"][mode] = {"skipped": f"run budget ({args.budget_s:.0f} s, --budget-s)"}
    else:
        row["inductor"][mode] = run_inductor(case, want, mode, args, dev, bw)
        add_ratio(row, mode)
    show(row, mode)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    cache = str(args.cache_dir or tempfile.mkdtemp(prefix="inductor_glue_"))
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # read at each compile: nothing compiled before counts
    try:
        with torch.no_grad():
            record = run(args, argv)
    finally:
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    main()
