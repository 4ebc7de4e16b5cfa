"""Where a prepared artifact's start-up goes: the imports, then the engine's load under cProfile.

    python benchmarks/e2e/profile_startup.py ART --device cuda --out DIR [--verify] [--top 45]

1. `python -X importtime` of what the engine's process imports before it loads (torch, mlac's
   runtime): DIR/imports.txt, the slowest imports by cumulative and by self time.
2. In this process, `serve.load_engine` (Engine.from_artifact with the prepared kernel cache
   required, the warm-up, the CUDA graphs) under cProfile: DIR/load_profile.txt, the functions by
   cumulative and by own time, and Triton's share (its JIT's cache lookups and module loads). The
   engine's `startup` phases go to DIR/startup.json.

cProfile slows Python-heavy phases (the graphs' eager runs, Triton's launch path) more than the
GPU or I/O bound ones: read its shares, not its seconds, against the phases of an unprofiled start.
Run it in a fresh process with an empty ~/.triton, as a server starts.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import subprocess
import sys
import time
from pathlib import Path

ENGINE_IMPORTS = "import torch, triton; import mlac.runtime.serve.engine_start, mlac.runtime.engine.engine"


def import_times(top: int) -> str:
    """`-X importtime` of ENGINE_IMPORTS in a fresh interpreter: the `top` slowest by cumulative
    and by self time (microseconds), and the whole."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", ENGINE_IMPORTS], capture_output=True, text=True, check=True
    )
    wall = time.perf_counter() - t0
    rows = []
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, cum_us, name = (part.strip() for part in line[len("import time:") :].split("|"))
        rows.append((int(self_us), int(cum_us), name))
    by_cum = sorted(rows, key=lambda r: -r[1])[:top]
    by_self = sorted(rows, key=lambda r: -r[0])[:top]
    lines = [
        f"{ENGINE_IMPORTS}: {wall:.2f} s in a fresh interpreter, {len(rows)} modules",
        "",
        "by cumulative:",
    ]
    lines += [f"{cum / 1e6:8.3f} s  {name}" for _, cum, name in by_cum]
    lines += ["", "by self:"] + [f"{own / 1e6:8.3f} s  {name.strip()}" for own, _, name in by_self]
    return "\n".join(lines) + "\n"


def stats_text(profile: cProfile.Profile, top: int) -> str:
    out = io.StringIO()
    for key in ("cumulative", "tottime"):
        out.write(f"==== by {key} ====\n")
        pstats.Stats(profile, stream=out).sort_stats(key).print_stats(top)
    out.write("==== Triton's functions, by cumulative ====\n")
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats("triton", top)
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--verify", action="store_true", help="verify the artifact's hashes (serve's default)")
    ap.add_argument("--top", type=int, default=45)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "imports.txt").write_text(import_times(args.top))

    from mlac.runtime.serve.config import ServerConfig
    from mlac.runtime.serve.engine_start import load_engine

    config = ServerConfig.of(
        artifact=args.artifact, device=args.device, verify=args.verify, kernel_cache="require"
    )
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    profile.enable()
    engine = load_engine(config)
    profile.disable()
    wall = time.perf_counter() - t0
    try:
        startup = {"wall_s_profiled": round(wall, 3), **engine.startup}
        (args.out / "startup.json").write_text(json.dumps(startup, indent=1) + "\n")
        (args.out / "load_profile.txt").write_text(stats_text(profile, args.top))
        print(json.dumps(startup), flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
