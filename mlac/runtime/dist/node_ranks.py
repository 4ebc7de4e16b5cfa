"""The other ranks of this node: the one place that spawns them, as early as this process knows
that it needs them.

A node's first process (rank 0 on one machine, each node's first with --nnodes; none under
torchrun) runs the node's other ranks, one fresh interpreter each (multiprocessing spawn).
Importing torch and the runtime takes each interpreter seconds, so they can be spawned before
the first process imports its own (world.start_node_ranks, from the manifest's JSON): each
imports the runtime at once, then waits on its pipe for its work.

    first process                                rank r (spawned, daemonic)
    NodeRanks.spawn(ranks)              ──────▶  imports `preload` (torch, the runtime)
    imports torch, reads its config ...
    RankGroup.join opens the store,
    hand_over(target, args, worlds)     ─pipe─▶  target(*args, its world)  (runner.run_rank)

A rank whose pipe closes before its work came (the first process failed before it needed the
ranks, `close`d them, or died) exits. This module imports nothing heavy.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import signal
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

PRELOAD = (
    "mlac.runtime.worker.distributed"  # what a spawned rank imports while it waits: torch and the runtime
)
STOP_GRACE_S = 5.0  # for a rank that was never handed its work to exit once terminated


class NodeRanks:
    """The processes of this node's other ranks (global rank -> process), spawned and waiting for
    their work until `hand_over` gives it and hands the processes to the caller."""

    def __init__(self, procs: dict[int, BaseProcess], pipes: dict[int, Connection]):
        self.procs = procs
        self._pipes = pipes  # global rank -> the sending end of its pipe

    @classmethod
    def spawn(cls, ranks: list[int], preload: str = PRELOAD) -> NodeRanks:
        """Start one process per global rank in `ranks`; each imports `preload` and waits."""
        ctx = mp.get_context("spawn")
        procs, pipes = {}, {}
        for rank in ranks:
            receive, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=rank_main, args=(receive, preload), name=f"mlac-rank-{rank}", daemon=True)
            p.start()
            receive.close()  # the child holds its end: when ours closes too, it reads EOF
            procs[rank], pipes[rank] = p, send
        return cls(procs, pipes)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.procs)

    def hand_over(
        self, target: Callable[..., Any], args: tuple, worlds: Mapping[int, Any]
    ) -> dict[int, BaseProcess]:
        """Send each rank r `target(*args, worlds[r])` to run, and give up the processes: they are
        the caller's to watch and reap from now on (close() no longer touches them). A rank that
        died meanwhile gets nothing; the caller sees its exit code.
        The work carries this process's environment as it is now: what the first process set after
        the spawn (TRITON_CACHE_DIR, pointed at the artifact's verified kernel cache) reaches the
        rank as it would have reached a rank spawned now."""
        environ = dict(os.environ)
        for rank, pipe in self._pipes.items():
            try:
                pipe.send((target, args, worlds[rank], environ))
            except OSError:  # BrokenPipeError: it exited already
                pass
            pipe.close()
        procs, self.procs, self._pipes = self.procs, {}, {}
        return procs

    def close(self) -> None:
        """Stop the ranks that were not handed over (idempotent): they hold nothing but imports."""
        for pipe in self._pipes.values():
            pipe.close()
        for p in self.procs.values():
            p.terminate()
        for p in self.procs.values():
            p.join(STOP_GRACE_S)
            if p.is_alive():
                p.kill()
                p.join()
        self.procs, self._pipes = {}, {}


def rank_main(pipe: Connection, preload: str) -> None:
    """A spawned rank's process: import `preload`, then run the work its pipe brings, or exit when
    the pipe closes first. Ctrl-C is ignored: it reaches the first process, which stops the ranks."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    importlib.import_module(preload)
    try:
        target, args, world, environ = pipe.recv()
    except (EOFError, OSError):
        return
    finally:
        pipe.close()
    # HAZARD: what the preload read at import (TRITON_*, ...) came from the environment the first
    # process had at the spawn; mlac's settings (mlac/settings.py) and later compiles (Triton's cache
    # directory) are read at first use, from this one
    os.environ.update(environ)
    target(*args, world)
