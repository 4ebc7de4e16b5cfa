"""The serving engine's own process, started before the server imports its HTTP stack.

    process = EngineProcess.start(path, launch)  # spawns the child: it spawns the artifact's
                                         # other ranks, then imports torch and mlac meanwhile
    process.configure(config, "info")    # the child loads the engine (serve/engine_child.py), while
    ...                                  # the server imports torch and FastAPI, checks the artifact
    ...                                  # messages over process.conn (serve/engine_client.py)
    process.close()

This module imports nothing heavy, so that the child starts (and imports torch) while the parent
is still importing. The child reads the artifact's manifest first and, for a multi-rank artifact,
spawns this node's other ranks before it imports torch (world.start_node_ranks): every rank
imports torch at once. The child ignores SIGINT and SIGTERM: the server process drains and then
tells it to stop; it also stops when the server process goes away (its end of the pipe closes).
It exits 1 when its engine died (engine_child.run); the server's process takes its death, or the
child's, as a dead engine (engine_client.EngineClient).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlac.runtime.dist.world import LaunchSpec

log = logging.getLogger("mlac.server")

JOIN_TIMEOUT_S = 30.0  # for the child to stop after `stop` or a closed pipe, before it is killed


class EngineProcess:
    """A handle on the engine's child process and the parent's end of its duplex pipe."""

    def __init__(self, process: mp.process.BaseProcess, conn: Connection):
        self.process, self.conn = process, conn
        self.configured = False

    @classmethod
    def start(cls, artifact: str | Path | None = None, launch: LaunchSpec | None = None) -> EngineProcess:
        """Spawn the child (not daemonic: it spawns the ranks of a multi-rank artifact). With the
        `artifact` (and the `launch`, a LaunchSpec, that its config will carry) the child spawns
        the artifact's other ranks on this node before it imports torch."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        args = (child, artifact, launch)
        process = ctx.Process(target=_child_main, args=args, name="mlac-engine", daemon=False)
        process.start()
        child.close()
        return cls(process, parent)

    def configure(self, config: Any, log_level: str, load: Callable[[], Any] | None = None) -> None:
        """Send the ServerConfig (and `load`, a picklable callable that returns the engine; None:
        launch.load_engine(config)): the child starts loading."""
        self.conn.send((config, log_level, load))
        self.configured = True

    def close(self, timeout: float = JOIN_TIMEOUT_S) -> None:
        """Close the pipe (the child stops), wait for it, kill it past `timeout`; a child never
        configured is killed at once (it has only imported modules)."""
        self.conn.close()
        self.process.join(timeout if self.configured else 0)
        if self.process.is_alive():
            if self.configured:
                log.warning("the engine process did not stop in %.0f s: killing it", timeout)
            self.process.kill()
            self.process.join()


def _child_main(conn: Connection, artifact: str | Path | None, launch: LaunchSpec | None) -> None:
    """The child: spawn the artifact's other ranks (if any), import the engine's modules now, then
    wait for the config and serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from mlac.runtime.dist.world import start_node_ranks  # (no torch)

    ranks = start_node_ranks(artifact, launch) if artifact is not None else None
    from mlac.runtime.engine import engine  # noqa: F401  (torch, the model, the runner: imported while
    from mlac.runtime.serve import engine_child  # the server imports its own, before the config comes)

    try:
        config, log_level, load = conn.recv()
    except (EOFError, OSError):  # the server stopped before it configured us
        if ranks is not None:
            ranks.close()
        return
    engine_child.run(conn, config, log_level, load, ranks)
