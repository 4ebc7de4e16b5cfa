"""Start to ready of `mlac serve`, two source trees in turns: each start's seconds from process start
to the first `/health` 200 (measured here, outside the server) beside the server's own phases.

    python benchmarks/e2e/start_ready.py --tree base=BASE_DIR:ART_A --tree this=.:ART_B --pairs 3 \
        --json out/startup_ab.json [--serve-args "--no-verify --require-prepared ..."]

Each start is a fresh `python -m mlac.cli serve ART --port P SERVE_ARGS` run from that tree (its own
code, its own artifact: a tree reads the artifacts it compiled), with an empty Triton home (a fresh
TRITON_HOME: no ~/.triton cache, as on a new machine), polled every 20 ms until /health says 200,
then stopped with SIGTERM. The trees take turns (A, B, A, B, ...) so that a drift of the machine
(page cache, clocks, other tenants) falls on both. The server's phases come from /health's
`startup` (import, load, graphs, warm-up; runtime/serve/engine_start.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

DEFAULT_SERVE_ARGS = "--no-verify --require-prepared --kv-cache-bytes 4294967296"
PHASES = ("import_s", "load_s", "graphs_s", "load_graphs_s", "warmup_s", "ready_s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(port: int) -> dict | None:
    """/health's body once it says 200, else None (not listening yet, or 503 while loading)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return json.loads(r.read()) if r.status == 200 else None
    except OSError:
        return None


def start_once(tree: Path, artifact: str, serve_args: list[str], log: Path, timeout: float) -> dict:
    """One start of `artifact` from `tree`: {"ready_s": wall seconds to /health 200, "phases": the
    server's, "error": None}; a server that exits or misses `timeout` gives "error" (its log's tail)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory(prefix="triton-home-") as home, open(log, "w") as out:
        env["TRITON_HOME"] = home
        cmd = [sys.executable, "-m", "mlac.cli", "serve", artifact, "--port", str(port), *serve_args]
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)
        body = None
        while body is None and proc.poll() is None and time.monotonic() - t0 < timeout:
            body = health(port)
            if body is None:
                time.sleep(0.02)
        wall = time.monotonic() - t0
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if body is None:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        return {
            "ready_s": None,
            "phases": None,
            "error": " | ".join(tail) or f"no /health 200 in {timeout:.0f} s",
        }
    phases = body.get("startup") or {}
    return {"ready_s": round(wall, 3), "phases": {k: phases[k] for k in PHASES if k in phases}, "error": None}


def summary(rows: list[dict], name: str) -> dict:
    times = [r["ready_s"] for r in rows if r["tree"] == name and r["ready_s"] is not None]
    if not times:
        return {"starts": 0}
    return {"starts": len(times), "median_s": statistics.median(times), "mean_s": round(statistics.fmean(times), 3),
            "min_s": min(times), "max_s": max(times)}  # fmt: skip


def versions() -> dict:
    """The machine's GPU and versions, asked after the starts (torch is not imported before them)."""
    import torch
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "device": gpu or platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def parse_tree(spec: str) -> tuple[str, Path, str]:
    """NAME=TREE_DIR:ARTIFACT -> (name, tree, artifact)."""
    name, _, rest = spec.partition("=")
    tree, _, artifact = rest.partition(":")
    if not (name and tree and artifact):
        raise SystemExit(f"--tree {spec!r}: give NAME=TREE_DIR:ARTIFACT")
    return name, Path(tree).resolve(), artifact


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", required=True, help="NAME=TREE_DIR:ARTIFACT (give two)")
    ap.add_argument("--pairs", type=int, default=3, help="starts of each tree, in turns")
    ap.add_argument("--serve-args", default=DEFAULT_SERVE_ARGS)
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds a start may take")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--logs", type=Path, default=Path(tempfile.gettempdir()), help="each start's server log here"
    )
    args = ap.parse_args(argv)
    trees = [parse_tree(t) for t in args.tree]
    args.logs.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(1, args.pairs + 1):
        for name, tree, artifact in trees:
            log = args.logs / f"start-{name}-{i}.log"
            row = {
                "tree": name,
                "turn": i,
                **start_once(tree, artifact, args.serve_args.split(), log, args.timeout),
            }
            rows.append(row)
            phases = " ".join(f"{k}={v}" for k, v in (row["phases"] or {}).items())
            print(f"{name} {i}: " + (f"ready {row['ready_s']:.2f} s  {phases}" if row["error"] is None
                                     else f"failed: {row['error']}"), flush=True)  # fmt: skip
    record = {
        "benchmark": "start to ready, two trees in turns",
        "python": platform.python_version(),
        "command": "python benchmarks/e2e/start_ready.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "serve_args": args.serve_args,
        "trees": {name: {"tree": str(tree), "artifact": artifact} for name, tree, artifact in trees},
        "rows": rows,
        "summary": {name: summary(rows, name) for name, _, _ in trees},
    }
    record.update(versions())
    for name, s in record["summary"].items():
        print(f"{name}: {s}")
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
