"""Top-p without a sort (mlac.kernels.top_p) against the sort it replaced (top_p_filter_ref: sort, cumsum,
the cut), at the vocabularies of V2-Lite (102,400) and V3 (129,280), batches 1 to 256, every row
top_p 0.95 (DeepSeek-V3's and R1's generation config). Each call timed in a CUDA graph
(timing.graph_us), and eagerly as the sampler calls it (host included); the kernel's tiles swept (BLOCK columns a step, CANDS candidates a pass, warps).
The ceiling: reading the logits once and writing them once at the device-copy bandwidth of the same
run. Each config's kept tokens are checked against the sort's (`mismatched`: tokens kept by one only).

    python benchmarks/kernels/top_p.py --json benchmarks/results/kernels_top_p_h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.kernels.timing import copy_gbps, graph_us  # noqa: E402
from mlac.kernels import top_p as tp  # noqa: E402

VOCABS = {"v2-lite": 102_400, "v3": 129_280}
# tiles swept (the first: the defaults)
SWEEP = [dict(block=1024, cands=8, num_warps=8), dict(block=512, cands=8, num_warps=4),
         dict(block=1024, cands=16, num_warps=8), dict(block=2048, cands=8, num_warps=8),
         dict(block=1024, cands=4, num_warps=8), dict(block=256, cands=32, num_warps=4)]  # fmt: skip  # block, cands, warps


def eager_us(fn, reps: int = 20) -> float:
    """Median microseconds of one eager call, host and device (synchronized around each)."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e6 * (time.perf_counter() - start))
    return statistics.median(times)


def measure(x: torch.Tensor, p: torch.Tensor, gbps: float) -> dict:
    """One (vocabulary, batch): the sort's time and each swept config's, with their kept tokens checked."""
    floor_us = 2 * x.numel() * 4 / (gbps * 1e3)  # read + write once
    want = torch.isfinite(tp.top_p_filter_ref(x, p))
    sort_us = graph_us([lambda: tp.top_p_filter_ref(x, p)])
    row = dict(
        floor_us=round(floor_us, 2),
        sort_us=round(sort_us, 1),
        kept_per_row=round(want.sum().item() / len(x), 1),
        eager_sort_us=round(eager_us(lambda: tp.top_p_filter_ref(x, p)), 1),
        eager_search_us=round(eager_us(lambda: tp.top_p_filter_triton(x, p)), 1),
    )
    row["configs"] = []
    for kw in SWEEP:
        got = torch.isfinite(tp.top_p_filter_triton(x, p, **kw))
        us = graph_us([lambda kw=kw: tp.top_p_filter_triton(x, p, **kw)])
        mismatched = int((got != want).sum())
        row["configs"].append(
            dict(
                kw,
                us=round(us, 1),
                speedup=round(sort_us / us, 2),
                frac=round(floor_us / us, 3),
                mismatched=mismatched,
            )
        )
        print(f"  sort {sort_us:8.1f} us  {kw}: {us:8.1f} us  x{sort_us / us:5.2f}  {floor_us / us:5.1%} of read+write"
              f"  mismatched {mismatched}", flush=True)  # fmt: skip
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32,64,256")
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    import triton

    dev = torch.device("cuda")
    gbps = copy_gbps()
    record = dict(
        bench="top_p", device=torch.cuda.get_device_name(dev), torch=torch.__version__,
        triton=triton.__version__, python=platform.python_version(), copy_GBps=round(gbps, 1),
        top_p=args.top_p, default=SWEEP[0], rows=[],
    )  # fmt: skip
    for model, vocab in VOCABS.items():
        for b in map(int, args.batches.split(",")):
            print(f"{model} ({vocab}) batch {b}", flush=True)
            x = 4 * torch.randn(b, vocab, device=dev, generator=torch.Generator(dev).manual_seed(b))
            p = torch.full((b,), args.top_p, device=dev)
            record["rows"].append(dict(model=model, vocab=vocab, batch=b, **measure(x, p, gbps)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
