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

Order: every row in the first mode (default), V2-Lite then V3, 1 token then 256; then
max-autotune (which benchmarks kernel configs as it compiles: seconds to a minute a row) only where
default came within 20% of mlac or beat it, closest first. Time is bounded: no compile starts unless
its estimate ends by --budget-s; a task (one row's mlac, or one compile and its timing) that runs past
--compile-cap-s, or past --budget-s plus that, is stopped and recorded as a timeout, so the run ends by
itself within --budget-s + --compile-cap-s. Rerun skipped rows alone: --modes ... --pieces ... --batches ...

The pieces are measured in a worker process (glue_worker.py, started by worker_process.py): a CUDA
fault (an illegal memory access poisons the process's CUDA context) or a crash becomes that row's
error ("CUDA fault: ..."), and a fresh worker takes the rows after it. Errors print as one line each,
in full in the JSON, which is rewritten (atomically) after every row: a run cut off keeps what it
measured ("complete": false).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import glue_pieces as gp  # noqa: E402
from glue_worker import FAULT, Worker  # noqa: E402
from worker_process import ChildWorker, LocalWorker, WorkerLost, WorkerStartError  # noqa: E402

MODES = ("default", "max-autotune-no-cudagraphs")
SCRIPT = "python benchmarks/kernels/inductor_glue.py"
FIRST_EST_S = 5.0  # a first compile's estimate in mode default (seconds)
AUTOTUNE_WITHIN = 1.2  # later modes only where the first mode's time <= this x mlac's


def one_line(text: str, width: int = 200) -> str:
    """An error's first line, cut to `width` (the whole text is in the JSON)."""
    line = str(text).strip().splitlines()[0] if str(text).strip() else ""
    return line if len(line) <= width else line[: width - 3] + "..."


def add_ratio(row: dict, mode: str) -> None:
    r = row["inductor"][mode]
    if "us" in r and row.get("mlac_us"):
        r["ratio"] = round(row["mlac_us"] / r["us"], 3)


def show(row: dict, mode: str | None) -> None:
    head = f"{row['piece']:18} {row['model']:7} T={row['batch']:<4}"
    if mode is None:
        extra = f"  eager sampler {row['eager_us']['sampler']:.1f} us" if "eager_us" in row else ""
        mlac = (
            f"{row['mlac_us']:8.2f} us" if "mlac_us" in row else one_line(row.get("error") or row["skipped"])
        )
        print(f"{head} mlac     {mlac}  {row.get('shape', '')}{extra}", flush=True)
        return
    r = row["inductor"][mode]
    if "us" not in r:
        print(f"{head} {mode}: {one_line(r.get('error') or r.get('skipped'))}", flush=True)
        return
    flag = "" if r["ok"] else f"  MISMATCH (tol {r['tol']})"
    print(f"{head} {mode:26} {r['us']:8.2f} us  mlac/inductor {r.get('ratio', float('nan')):.2f}  "
          f"compile {r['compile_s']:.1f} s  max err {r['max_error']:.1e}{flag}", flush=True)  # fmt: skip


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


def write_json(path: Path, record: dict) -> None:
    """Atomically: a reader (or a run cut off mid-write) sees the old record or the new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)


class Budget:
    """--budget-s: no compile starts unless its estimate ends by it. --compile-cap-s: the most one task
    may take. The run ends by start + budget + cap: a task's deadline is the nearer of the two."""

    def __init__(self, seconds: float, cap: float):
        self.start, self.seconds, self.cap = time.monotonic(), seconds, cap

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def fits(self, est: float) -> bool:
        return self.elapsed() + est <= self.seconds

    def end(self) -> float:
        return self.start + self.seconds + self.cap

    def over(self) -> bool:
        return time.monotonic() >= self.end()

    def deadline(self) -> float:
        return min(time.monotonic() + self.cap, self.end())


class Run:
    """The parent's side: asks the worker for each row in the plan's order, keeps the record, and
    writes it after every answer."""

    def __init__(self, args: argparse.Namespace, argv: list[str]):
        self.args, self.budget = args, Budget(args.budget_s, args.compile_cap_s)
        self.record = header(args, argv)
        self.rows: list[dict] = self.record["rows"]
        self.pool = (LocalWorker if args.in_process else ChildWorker)(Worker, self.worker_args)

    def worker_args(self, index: int) -> tuple:
        opts = {k: getattr(self.args, k) for k in ("device", "smoke", "backend", "inject_fault")}
        return opts, self.record.get("copy_gb_per_s"), index  # the first worker measures the copy rate

    def ask(self, task: dict) -> dict:
        """The worker's answer; a worker lost on the task is that task's error. WorkerStartError
        (no worker could be started) ends the run."""
        self.pool.ready(self.budget.end())
        self.greet()
        try:
            return self.pool.call(task, self.budget.deadline())
        except WorkerLost as e:
            if e.died:
                return {"error": f"{FAULT}: {e}"}
            cap = self.args.compile_cap_s
            return {"error": f"timeout: past --compile-cap-s {cap:.0f} or the run's end: {e}"}

    def greet(self) -> None:
        if self.pool.starts == self.record["worker_starts"]:
            return
        self.record["worker_starts"] = self.pool.starts
        if self.pool.starts > 1:
            print(f"worker process {self.pool.starts} started", flush=True)
            return
        self.record.update(self.pool.hello)
        for key in ("device", "copy_gb_per_s", "inductor_start_s", "mlac_path"):
            print(f"{key}: {self.record[key]}", flush=True)

    def save(self) -> None:
        self.record["wall_s"] = round(self.budget.elapsed(), 1)
        if self.args.json:
            write_json(self.args.json, self.record)

    def first_pass(self) -> None:
        """Every row: mlac's piece, then the reference compiled in the first mode."""
        args = self.args
        for model in args.models:
            for t in args.batches:
                for piece in args.pieces:
                    row = {"piece": piece, "model": model, "batch": t}
                    if self.budget.over():
                        self.rows.append(row := {**row, "skipped": "the run's end", "inductor": {}})
                        show(row, None)
                        continue
                    fields = self.ask({"kind": "mlac", "row": (piece, model, t)})
                    if fields.get("absent"):
                        continue
                    self.rows.append(row := {**row, **fields, "inductor": {}})
                    show(row, None)
                    self.save()
                    if "mlac_us" in row:
                        self.compile_mode(row, args.modes[0], FIRST_EST_S)

    def later_pass(self, mode: str) -> None:
        """A slower mode, only for rows whose first mode came within AUTOTUNE_WITHIN of mlac or beat
        it, closest first, then the largest batches. A compile starts only if its estimate fits the
        budget: the first mode's compile time times the largest slowdown seen so far in this mode (10
        before any)."""
        first = self.args.modes[0]
        near = [r for r in self.rows if "us" in r["inductor"].get(first, {})
                and r["inductor"][first]["us"] <= AUTOTUNE_WITHIN * r["mlac_us"]]  # fmt: skip
        within = f"{first} within {AUTOTUNE_WITHIN - 1:.0%} of mlac or faster"
        for row in self.rows:
            if "mlac_us" in row and not any(row is r for r in near):
                row["inductor"][mode] = {"skipped": f"not {within}"}
        print(f"{mode}: {len(near)} of {len(self.rows)} rows ({within})", flush=True)
        self.save()
        slowdowns: list[float] = []
        for row in sorted(near, key=lambda r: (-r["inductor"][first].get("ratio", 0.0), -r["batch"])):
            base = row["inductor"][first].get("compile_s") or FIRST_EST_S
            self.compile_mode(row, mode, base * (max(slowdowns) if slowdowns else 10.0))
            r = row["inductor"][mode]
            if "compile_s" in r:
                slowdowns.append(r["compile_s"] / base)
            elif r.get("error", "").startswith("timeout"):
                slowdowns.append(self.args.compile_cap_s / base)

    def compile_mode(self, row: dict, mode: str, est: float) -> None:
        """One mode of one row, if the budget allows a compile of about `est` seconds."""
        if not self.budget.fits(est):
            row["inductor"][mode] = {"skipped": f"run budget ({self.args.budget_s:.0f} s, --budget-s)"}
        else:
            row["inductor"][mode] = self.ask(
                {"kind": "compile", "row": (row["piece"], row["model"], row["batch"]), "mode": mode}
            )
            add_ratio(row, mode)
        show(row, mode)
        self.save()


def fault_spec(text: str) -> tuple[tuple[str, str, int], str]:
    """PIECE/MODEL/T:KIND -> ((piece, model, t), kind)."""
    row, _, kind = text.partition(":")
    piece, model, t = row.split("/")
    if kind not in ("raise", "die", "hang"):
        raise argparse.ArgumentTypeError(f"{text!r}: KIND is raise, die or hang")
    return (piece, model, int(t)), kind


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None, help="the record, rewritten after every row")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (the tiny presets), batches 1 and 5")
    ap.add_argument("--pieces", nargs="+", choices=list(gp.PIECES), default=list(gp.PIECES))
    ap.add_argument("--models", nargs="+", choices=("v2-lite", "v3"), default=["v2-lite", "v3"])
    ap.add_argument("--batches", nargs="+", type=int, default=None, help="token counts (default 1 256)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=None, help="default: both (smoke: default)")
    ap.add_argument("--backend", choices=("inductor", "aot_eager"), default="inductor",
                    help="aot_eager: trace only (fullgraph), no code generated: the fast CPU test")  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=180.0, help="no compile starts past this (since start)")
    ap.add_argument("--compile-cap-s", type=float, default=60.0,
                    help="the most one task (a compile and its timing) may take; the run ends by budget + this")  # fmt: skip
    ap.add_argument(
        "--cache-dir", type=Path, default=None, help="Inductor cache (default: a new temp folder)"
    )
    ap.add_argument("--in-process", action="store_true",
                    help="no worker process: a CUDA fault ends the run (debugging, tests that patch a piece)")  # fmt: skip
    ap.add_argument("--inject-fault", type=fault_spec, default=None, metavar="PIECE/MODEL/T:KIND",
                    help="test hook: a simulated CUDA fault at that row's compile (raise, die or hang)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.in_process and args.inject_fault and args.inject_fault[1] != "raise":
        ap.error("--inject-fault die or hang would take this process: not with --in-process")
    args.batches = args.batches or ([1, 5] if args.smoke else [1, 256])
    args.modes = args.modes or (["default"] if args.smoke or args.backend != "inductor" else list(MODES))
    return args


def header(args: argparse.Namespace, argv: list[str]) -> dict:
    """What the parent knows; the worker's hello adds the device, its copy rate and mlac's path."""
    return {
        "benchmark": "decode-step glue: mlac against torch.compile (Inductor)",
        "torch": torch.__version__, "triton": gp.triton_version(), "cuda": torch.version.cuda,
        "python": platform.python_version(), "command": " ".join([SCRIPT, *argv]),
        "backend": args.backend, "modes": args.modes, "budget_s": args.budget_s,
        "compile_cap_s": args.compile_cap_s, "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "timing": "CUDA-graph replay, median (timing.graph_us)" if args.device == "cuda" else "CPU wall, eager",
        "complete": False, "worker_starts": 0, "rows": [],
    }  # fmt: skip


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    job = Run(args, argv)
    for key in ("torch", "triton", "cuda", "command"):
        print(f"{key}: {job.record[key]}", flush=True)
    job.save()
    try:
        job.first_pass()
        for mode in args.modes[1:]:
            job.later_pass(mode)
        job.record["complete"] = True
    except WorkerStartError as e:
        job.record["stopped"] = str(e)
        print(f"stopped: {one_line(str(e))}", flush=True)
    finally:
        job.pool.close()
    job.save()
    summary(job.rows)
    return job.record


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    cache = str(args.cache_dir or tempfile.mkdtemp(prefix="inductor_glue_"))
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    # read at each compile, and by every worker process (spawned with this environment)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    try:
        return run(args, argv)
    finally:
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


if __name__ == "__main__":
    main()
