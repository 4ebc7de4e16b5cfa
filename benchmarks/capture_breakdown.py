"""Where the CUDA graphs' eager warm-runs go at start-up, bucket by bucket (no profiler).

    MLAC_LOAD_OVERLAP=0 python benchmarks/capture_breakdown.py ART --json OUT.json [--verify]

Loads a prepared artifact as the server does (`serve.load_engine`, the prepared kernel cache
required), with `graphs.capture_buckets` replaced by a copy that, for every bucket, times:
- `eager1_ms`: the eager warm-run that precedes the capture (what start-up pays now);
- `eager2_ms`: the same step again at once, everything warm (what is left without first-use work);
- `capture_ms`: the capture (recording and instantiation);
- `triton_loads`, `triton_load_ms`: Triton kernels bound to the GPU in the warm-run (cache hits of
  the prepared cache: `CompiledKernel._init_handles`, the module load the capture could not do);
- `linear_ms`: F.linear's host time in the warm-run (cuBLAS's first call for each new shape is in
  it), against `linear2_ms` in the warm step;
- `segments`: the caching allocator's new segments (cudaMalloc calls) in the warm-run.
MLAC_LOAD_OVERLAP=0 makes the graphs run after the load, with the process to itself. One row per
bucket, the ladder's and then the grouped twins', and the sums.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mlac.runtime.worker import graphs


class Meter:
    """Accumulates the host time and count of a wrapped callable while `on`."""

    def __init__(self):
        self.on, self.n, self.s = False, 0, 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.s += time.perf_counter() - t0
                self.n += 1

        return timed

    def take(self) -> tuple[int, float]:
        n, s = self.n, self.s
        self.n, self.s = 0, 0.0
        return n, s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--verify", action="store_true")
    args = ap.parse_args()

    from triton.compiler.compiler import CompiledKernel

    loads, linear = Meter(), Meter()
    CompiledKernel._init_handles = loads.wrap(CompiledKernel._init_handles)
    F.linear = linear.wrap(F.linear)
    rows: list[dict] = []

    def segments() -> int:
        return torch.cuda.memory_stats().get("segment.all.allocated", 0)

    def capture_buckets(buckets, step, pool=None, timings=None, label=""):
        out, stream = {}, torch.cuda.Stream()
        timings = {} if timings is None else timings
        for bs in reversed(buckets):
            row: dict = {"bucket": bs, "form": label.rstrip("_") or "per-row"}
            seg0 = segments()
            loads.on = linear.on = True
            t0 = time.perf_counter()
            step(bs)
            torch.cuda.current_stream().synchronize()
            row["eager1_ms"] = (time.perf_counter() - t0) * 1e3
            row["triton_loads"], s = loads.take()
            row["triton_load_ms"] = s * 1e3
            row["linear_calls"], s = linear.take()
            row["linear_ms"] = s * 1e3
            row["segments"] = segments() - seg0
            t0 = time.perf_counter()
            step(bs)
            torch.cuda.current_stream().synchronize()
            row["eager2_ms"] = (time.perf_counter() - t0) * 1e3
            _, s = linear.take()
            row["linear2_ms"] = s * 1e3
            loads.on = linear.on = False
            t0 = time.perf_counter()
            graph = torch.cuda.CUDAGraph()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    step(bs)
                finally:
                    graph.capture_end()
            torch.cuda.current_stream().wait_stream(stream)
            row["capture_ms"] = (time.perf_counter() - t0) * 1e3
            pool = graph.pool()
            out[bs] = graph
            rows.append({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
            print(json.dumps(rows[-1]), flush=True)
        torch.cuda.current_stream().synchronize()
        return out, pool

    graphs.capture_buckets = capture_buckets

    from mlac.runtime.serve.config import ServerConfig
    from mlac.runtime.serve.engine_start import load_engine

    config = ServerConfig.of(
        artifact=args.artifact, device=args.device, verify=args.verify, kernel_cache="require"
    )
    engine = load_engine(config)
    try:
        keys = (
            "eager1_ms",
            "eager2_ms",
            "capture_ms",
            "triton_loads",
            "triton_load_ms",
            "linear_ms",
            "linear2_ms",
        )
        sums = {k: round(sum(r[k] for r in rows), 2) for k in keys}
        result = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "startup": engine.startup,
        }
        result.update(sums=sums, buckets=rows)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(sums), flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
