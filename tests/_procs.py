"""Processes the tests start: the live ones multiprocessing spawned (not its resource tracker)."""

from __future__ import annotations

import psutil


def spawned(root: psutil.Process | None = None) -> set[int]:
    """Pids of live processes that multiprocessing spawned under `root` (default: this process)."""
    live = set()
    for p in (root or psutil.Process()).children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(p.cmdline()):
                live.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return live
