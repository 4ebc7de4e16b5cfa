"""Round trip of a decode Step between two processes on CPU: gloo broadcasts vs the shared-memory channel.

    python benchmarks/step_channel_cpu.py [--iters 2000] [--out benchmarks/results/step_channel_cpu.json]

Rank 0 sends a decode Step (B sequences, one new token each, block tables W wide) to rank 1 the way
the runtime does (step_link.send_step over a StepLink: two gloo broadcasts over TCP loopback, or one
ShmChannel write); rank 1 receives and decodes it (step_link.recv_step) and answers with an 8-byte ack
by the same kind of path (a gloo broadcast from rank 1, or a second channel). The round trip is
timed on rank 0; one way is about half. The floor: the same round trip of an 8-byte message.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from mlac.runtime.dist.shm_channel import ShmChannel  # noqa: E402
from mlac.runtime.dist.step_link import StepLink, recv_step, send_step  # noqa: E402
from mlac.runtime.step import Step  # noqa: E402

CASES = [(1, 8), (32, 8)]  # (B, W): decode Steps
WARMUP = 200


def decode_step(b: int, w: int) -> Step:
    return Step(
        tuple(range(b)), (100,) * b, (1,) * b, tuple(tuple(range(i * w, (i + 1) * w)) for i in range(b))
    )


def open_links(rank: int, kind: str, store: dist.Store) -> tuple[StepLink, ShmChannel | None]:
    """The step link (rank 0 -> 1) and, for shm, the ack channel (1 -> 0)."""
    gloo = dist.new_group(backend="gloo")
    if kind == "gloo":
        return StepLink(gloo), None
    mine = ShmChannel.create(1)
    store.set(f"{kind}/{rank}", mine.name)
    theirs = ShmChannel.attach(store.get(f"{kind}/{1 - rank}").decode(), 0)
    dist.barrier(gloo)
    mine.unlink()
    step, ack = (mine, theirs) if rank == 0 else (theirs, mine)
    return StepLink(gloo, step), ack


def run(rank: int, port: int, iters: int, out: mp.Queue) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    results = []
    for kind in ("gloo", "shm"):
        link, ack = open_links(rank, kind, store)
        for b, w in [(0, 0), *CASES]:
            step = decode_step(b, w) if b else None
            times = []
            for i in range(WARMUP + iters):
                t = time.perf_counter()
                if rank == 0:
                    send(link, step)
                    wait_ack(link, ack)
                else:
                    recv(link, step)
                    send_ack(link, ack)
                if i >= WARMUP:
                    times.append(time.perf_counter() - t)
            if rank == 0:
                us = sorted(x * 1e6 for x in times)
                med, p99 = statistics.median(us), us[int(0.99 * len(us))]
                results.append({"path": kind, "B": b, "W": w, "round_trip_us_median": round(med, 1),
                                "round_trip_us_p99": round(p99, 1)})  # fmt: skip
        link.close()
        if ack is not None:
            ack.close()
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def send(link: StepLink, step: Step | None) -> None:
    """The Step, or (None) the floor's 8-byte message."""
    if step is None:
        link.send([7])  # one int64: over gloo, one broadcast of [1]
    else:
        send_step(link, step)


def recv(link: StepLink, step: Step | None) -> None:
    if step is not None:
        recv_step(link)
    elif link.channel is not None:
        link.channel.read()
    else:
        dist.broadcast(torch.empty(1, dtype=torch.int64), src=0, group=link.group)


def send_ack(link: StepLink, ack: ShmChannel | None) -> None:
    if ack is not None:
        ack.write(b"ack_ack_")
    else:
        dist.broadcast(torch.zeros(1, dtype=torch.int64), src=1, group=link.group)


def wait_ack(link: StepLink, ack: ShmChannel | None) -> None:
    if ack is not None:
        ack.read()
    else:
        dist.broadcast(torch.empty(1, dtype=torch.int64), src=1, group=link.group)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "step_channel_cpu.json")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, port, args.iters, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = out.get(timeout=600)
    for p in procs:
        p.join(60)
    floor = {r["path"]: r["round_trip_us_median"] for r in results if r["B"] == 0}
    print(
        f"{'path':5} {'B':>3} {'W':>3} {'round trip median us':>21} {'p99 us':>8}   (floor: 8-byte message)"
    )
    for r in results:
        b = "8 B" if r["B"] == 0 else r["B"]
        print(f"{r['path']:5} {b:>3} {r['W']:>3} {r['round_trip_us_median']:>21} {r['round_trip_us_p99']:>8}")
    record = {"what": "decode Step round trip, 2 processes, CPU", "cpus": os.cpu_count(), "torch": torch.__version__,
              "iters": args.iters, "floor_us": floor, "results": results}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
