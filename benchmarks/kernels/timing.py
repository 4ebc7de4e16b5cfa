"""What the kernel benchmarks share (moe_decode.py, pdl.py, gemv.py, router.py, mla_rows.py, mla_out.py): the
time of calls captured in one CUDA graph, and the device-copy ceiling (mlac.tools.bench's, the same as
`mlac bench`'s). Not a benchmark itself."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mlac.tools.bench import copy_bandwidth  # noqa: E402


def graph_us(fns, replays: int = 10) -> float:
    """Median microseconds per call of fns (each called once per replay, in order), captured in one CUDA
    graph after an eager call of each (compiles, allocates); every replay timed alone between events,
    after 3 warm ones."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    del graph
    return statistics.median(times)


def copy_gbps() -> float:
    """Device-to-device copy bandwidth of 1 GiB, GB/s counting bytes read plus bytes written."""
    return copy_bandwidth(torch.device("cuda")) / 1e9
