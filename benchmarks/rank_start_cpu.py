"""When a tp-2 artifact's rank 1 starts, against rank 0's import, under `mlac serve` on CPU.

    python benchmarks/rank_start_cpu.py [--artifact DIR] [--runs 3] [--repo CHECKOUT ...] [--json out.json]

Starts `mlac serve` (the code of each --repo, default this checkout) on a tp-2 artifact (default: the
tiny-v2-lite synthetic, compiled into a temporary folder), waits for /health 200, reads the
server's start-up phases there (import_s: the process's start to the engine's start of its load;
ranks_met_s: rank 0's wait for the other ranks to reach the store, where the code records it),
and takes each process's start from the OS (psutil create_time, 10 ms ticks): the engine's
(rank 0's) and rank 1's, from the `mlac serve` process's. Rank 1 spawned before rank 0 imported
torch starts well before import_s and is met at once; spawned at the join, it starts after
import_s and rank 0 waits for its imports (ranks_met_s: about one torch import).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tp2_artifact(work: Path) -> Path:
    """The tiny-v2-lite synthetic compiled --tp 2 (this checkout's compiler)."""
    sys.path.insert(0, str(REPO))
    from mlac.compiler.pipeline import compile_checkpoint
    from mlac.core.artifact import CompileOptions
    from mlac.synth import synthesize

    ckpt = synthesize(work / "ckpt", preset="tiny-v2-lite", seed=0)
    compile_checkpoint(ckpt, work / "tp2", CompileOptions(tp=2, accuracy_check=False))
    return work / "tp2"


def spawned(root: psutil.Process) -> dict[int, tuple[float, int]]:
    """multiprocessing's spawned descendants of `root` (the engine, the ranks): pid -> (its start,
    its parent's pid)."""
    found = {}
    for p in root.children(recursive=True):
        try:
            if "spawn_main" in " ".join(p.cmdline()):
                found[p.pid] = (p.create_time(), p.ppid())
        except psutil.Error:
            pass
    return found


def one_run(artifact: Path, repo: Path, timeout_s: float) -> dict:
    """One `mlac serve` to /health 200: its phases, and when the engine and rank 1 started."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "mlac.cli", "serve", str(artifact), "--port", str(port), "--dtype", "float32",
           "--no-verify", "--num-blocks", "64", "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=env, cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    serve = psutil.Process(proc.pid)
    seen: dict[int, tuple[float, int]] = {}
    deadline, health = time.monotonic() + timeout_s, None
    try:
        while health is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"serve did not become ready:\n{proc.stderr.read()[-2000:]}")
            seen.update(spawned(serve))
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                health = r.json() if r.status_code == 200 else None
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        seen.update(spawned(serve))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    t0 = serve.create_time()
    engine_pid, engine_t = next((pid, t) for pid, (t, parent) in seen.items() if parent == proc.pid)
    ranks = sorted(t for t, parent in seen.values() if parent == engine_pid)
    phases = health["startup"]
    return {
        "engine_start_s": round(engine_t - t0, 3),
        "rank1_start_s": round(ranks[0] - t0, 3) if ranks else None,
        "import_s": phases["import_s"],
        "ranks_met_s": phases.get("ranks_met_s"),
        "ready_s": phases["ready_s"],
    }


def medians(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if all(r[k] is not None for r in runs)]
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path, help="a tp-2 artifact (default: tiny-v2-lite, compiled now)")
    ap.add_argument("--repo", type=Path, action="append", help="a checkout whose `mlac serve` runs "
                    "(repeat to compare: their runs alternate; default: this one)")  # fmt: skip
    ap.add_argument("--runs", type=int, default=3, help="per checkout")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--json", type=Path, help="write the runs and their medians here")
    args = ap.parse_args()
    repos = [str(r) for r in args.repo or [REPO]]
    runs: dict[str, list[dict]] = {r: [] for r in repos}
    with tempfile.TemporaryDirectory() as work:
        artifact = args.artifact or tp2_artifact(Path(work))
        for _ in range(args.runs):
            for repo in repos:  # alternate: a busy machine slows both alike
                runs[repo].append(one_run(artifact, Path(repo), args.timeout_s))
                print(repo, json.dumps(runs[repo][-1]), flush=True)
    median = {repo: medians(r) for repo, r in runs.items()}
    for repo, m in median.items():
        print("median", repo, json.dumps(m))
    if args.json:
        record = {"cpus": os.cpu_count(), "load_avg": os.getloadavg(), "runs": runs, "median": median}
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
