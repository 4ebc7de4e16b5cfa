"""CPU compile benchmark: `mlac synth PRESET` then `mlac compile --fp8`, with peak RSS and throughput.

    python benchmarks/compile/synth_compile.py --preset v2-lite --work /data/bench [--keep]

Each step runs as its own process; its peak RSS comes from wait4() (ru_maxrss), its time from
the wall clock. Source throughput = bytes of source tensors processed / compile wall time.
Targets (DESIGN.md): peak RSS at most 3 GB however large the model, and at least 200 MB/s of source on
the 2-core CPU machine (the compile is CPU-bound there). Writes benchmarks/results/compile_<preset>_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

RESULTS = Path(__file__).parents[1] / "results"


def run(cmd: list[str]) -> tuple[float, int]:
    """Run a command, streaming its output; return (seconds, peak RSS bytes)."""
    print("+", " ".join(cmd), flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"command failed: {' '.join(cmd)}")
    return elapsed, usage.ru_maxrss * 1024


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="v2-lite")
    ap.add_argument("--work", type=Path, default=Path("bench-work"))
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and artifact")
    args = ap.parse_args()
    ckpt, out = args.work / f"{args.preset}-ckpt", args.work / f"{args.preset}-fp8"
    shutil.rmtree(out, ignore_errors=True)
    synth_s = synth_rss = None
    if not (ckpt / "config.json").is_file():
        synth_s, synth_rss = run(["mlac", "synth", args.preset, str(ckpt), "--seed", "0"])
    compile_s, compile_rss = run(["mlac", "compile", "--fp8", str(ckpt), str(out)])
    from mlac.core.artifact import Manifest

    m = Manifest.load(out)
    import torch

    result = {
        "benchmark": "mlac synth + mlac compile --fp8 (CPU)",
        "date": date.today().isoformat(),
        "machine": {"cpus": os.cpu_count(), "ram_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1),
                    "platform": platform.platform()},
        "versions": {"mlac": m.mlac_version, "torch": torch.__version__, "python": platform.python_version()},
        "preset": args.preset,
        "source_bytes": m.source.bytes,
        "checkpoint_dir_bytes": dir_bytes(ckpt),
        "artifact_bytes": sum(f.size for f in m.files),
        "synth_seconds": synth_s,
        "synth_peak_rss_gb": synth_rss and round(synth_rss / 1e9, 3),
        "synth_mb_per_s": synth_s and round(dir_bytes(ckpt) / 1e6 / synth_s, 1),
        "compile_seconds": round(compile_s, 1),
        "compile_peak_rss_gb": round(compile_rss / 1e9, 3),
        "compile_source_mb_per_s": round(m.source.bytes / 1e6 / compile_s, 1),
        "targets": {"compile_peak_rss_gb": 3.0, "compile_source_mb_per_s": 200},
        "accuracy": m.accuracy.model_dump(),
    }  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"compile_{args.preset}_cpu.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
