"""The load phase alone: one rank of an artifact read, hashed and placed on the device.

    python benchmarks/e2e/load.py out/ [--device cuda:0|cpu] [--threads N] [--chunk-mib M] [--no-verify]
        [--drop-cache] [--repeat R] [--json results/load_<name>.json]

Times `load_artifact` (manifest, checks, read + sha256 + copy to the device; the same call the
server makes) and prints bytes, seconds, GB/s. `--drop-cache` asks the kernel to drop each file's
pages first (posix_fadvise DONTNEED; advisory, and only clean pages go) for a cold-disk figure.
Ceilings measured in the same run, after the load: the page-cache read rate with the same threads
and no hashing, sha256 on one thread (times the threads: the hashing bound), and the pinned
host-to-device copy. The result is reported as a fraction of the lowest of them (the floor).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import time
from datetime import date
from pathlib import Path

import torch

from mlac.core.artifact import Manifest
from mlac.runtime.worker.loader import load_artifact, rank_files
from mlac.runtime.worker.readpass import FileRead, default_threads, read_files

GB = 1e9


def drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed_load(args, device: torch.device, paths: list[Path]) -> dict:
    if args.drop_cache:
        drop_cache(paths)
    start = time.perf_counter()
    loaded = load_artifact(args.artifact, rank=args.rank, device=device, dtype=getattr(torch, args.dtype),
                           verify=not args.no_verify, threads=args.threads,
                           chunk_bytes=args.chunk_mib << 20)  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    s = loaded.stats
    print(f"{s}  ({len(loaded.tensors)} tensors, {s.threads} threads, wall {wall:.2f} s)")
    return {"bytes": s.bytes, "seconds": round(s.seconds, 3), "gb_per_s": round(s.gb_per_s, 2)}


def page_cache_read(paths: list[Path], threads: int) -> float:
    """GB/s reading the files into host memory with `threads` threads, no hashing (after the load:
    the pages are cached)."""
    files = [FileRead(p, p.name, p.stat().st_size, "", lambda data: None) for p in paths]
    start = time.perf_counter()
    done = read_files(files, torch.device("cpu"), verify=False, threads=threads)
    return done.bytes_read / GB / (time.perf_counter() - start)


def sha256_one_thread(nbytes: int = 256 << 20) -> float:
    data = memoryview(bytearray(os.urandom(1 << 20)) * (nbytes >> 20))
    start = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    return nbytes / GB / (time.perf_counter() - start)


def pinned_h2d(device: torch.device, nbytes: int = 1 << 30, reps: int = 10) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return reps * nbytes / GB / (time.perf_counter() - start)


def ceilings(device: torch.device, paths: list[Path], threads: int, verify: bool) -> dict:
    out = {"page_cache_read_gb_per_s": round(page_cache_read(paths, threads), 2)}
    if verify:
        one = sha256_one_thread()
        out["sha256_one_thread_gb_per_s"] = round(one, 2)
        out["sha256_all_threads_gb_per_s"] = round(one * threads, 2)
    if device.type == "cuda":
        out["pinned_h2d_gb_per_s"] = round(pinned_h2d(device), 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact", type=Path)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--threads", type=int, default=None, help=f"reader threads (default {default_threads()})")
    p.add_argument("--chunk-mib", type=int, default=64, help="bytes per read (and per staging buffer), MiB")
    p.add_argument("--no-verify", action="store_true", help="sizes only, skip sha256")
    p.add_argument("--drop-cache", action="store_true", help="posix_fadvise(DONTNEED) each file first")
    p.add_argument("--repeat", type=int, default=1, help="loads to time (the best is reported)")
    p.add_argument("--json", type=Path, default=None, help="write the result record here")
    args = p.parse_args()
    device = torch.device(args.device)
    threads = args.threads or default_threads()
    manifest = Manifest.load(args.artifact)
    paths = [args.artifact / f.path for f in rank_files(manifest, args.rank)]
    runs = [timed_load(args, device, paths) for _ in range(args.repeat)]
    best = max(runs, key=lambda r: r["gb_per_s"])
    ceil = ceilings(device, paths, threads, not args.no_verify)
    floor = min(v for k, v in ceil.items() if k != "sha256_one_thread_gb_per_s")
    print(
        f"ceilings: {ceil}; best load {best['gb_per_s']} GB/s = {best['gb_per_s'] / floor:.0%} of the floor"
    )
    record = {
        "date": date.today().isoformat(),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "artifact": str(args.artifact),
        "rank": args.rank,
        "files": len(paths),
        "threads": threads,
        "chunk_mib": args.chunk_mib,
        "verify": not args.no_verify,
        "drop_cache": args.drop_cache,
        **best,
        "runs": runs,
        "ceilings": ceil,
        "fraction_of_floor": round(best["gb_per_s"] / floor, 3),
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
