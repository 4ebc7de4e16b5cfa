"""A benchmark's worker object in a spawned child process, so that a fault that poisons a process
ends only that child: after a CUDA illegal memory access the CUDA context is unusable (every later
call raises, even torch.manual_seed), and a crash or a hang takes the process with it. The next call
starts a fresh child. Not a benchmark itself (inductor_glue.py runs its pieces in one).

The worker is made in the child by `make(*args_for(n))` (n: how many were started before it; `make`
must be importable by name, a module-level class or function). It has `hello() -> dict` (sent once,
when it is ready) and `do(task) -> (result, fatal)`: `fatal` says the process cannot go on, and the
child exits after answering. Tasks, results and hello are plain picklable data.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from typing import Any

POLL_S = 0.5  # how often a wait looks whether the child is still alive


class WorkerLost(Exception):
    """The child died (`died`) or overran its deadline while on a task; it has been stopped."""

    def __init__(self, message: str, died: bool):
        super().__init__(message)
        self.died = died


class WorkerStartError(Exception):
    """A child could not be started (its worker raised, it died, or the deadline came first)."""


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent goes, so a killed run leaves no child
    holding the GPU (a busy child would otherwise only notice at its next send)."""
    with contextlib.suppress(Exception):
        import ctypes  # noqa: PLC0415

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _child(conn, make: Callable[..., Any], args: tuple) -> None:
    _die_with_parent()
    try:
        worker = make(*args)
        conn.send(("ready", worker.hello()))
    except Exception as e:  # noqa: BLE001  (told to the parent, which stops)
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the parent is gone
            return
        if task is None:
            return
        try:
            result, fatal = worker.do(task)
        except Exception as e:  # noqa: BLE001  (a worker's own bug: told to the parent, not a traceback)
            result, fatal = f"{type(e).__name__}: {e}", True
            conn.send(("raised", result, fatal))
        else:
            conn.send(("done", result, fatal))
        if fatal:
            # NOTE: leave without Python's teardown: a faulted CUDA context can hang or crash in the
            # destructors (caching allocator, CUDA graphs) that exit would run.
            conn.close()
            os._exit(0)


class ChildWorker:
    """`call(task, deadline)` runs the task in the child, started first if there is none."""

    def __init__(self, make: Callable[..., Any], args_for: Callable[[int], tuple]):
        self.make, self.args_for = make, args_for
        self.starts = 0
        self.hello: dict | None = None  # the latest child's
        self.proc = self.conn = None

    def ready(self, deadline: float) -> None:
        """A child ready for a task, started now if needed; waits at most until `deadline` (monotonic)."""
        if self.proc is not None and self.proc.is_alive():
            return
        self.stop()  # one that died between tasks
        ctx = mp.get_context("spawn")  # NOTE: never fork: a forked child shares the parent's CUDA state
        self.conn, child_end = ctx.Pipe()
        self.proc = ctx.Process(
            target=_child, args=(child_end, self.make, self.args_for(self.starts)), daemon=True
        )
        self.proc.start()
        child_end.close()  # only the child's copy stays open: its exit is then an EOF here
        self.starts += 1
        answer = self._wait(deadline)
        if answer is None or answer[0] != "ready":
            why = "not ready by the run's deadline" if answer is None else answer[1]
            code = self.stop()
            raise WorkerStartError(f"worker process {self.starts}: {why} (exit code {code})")
        self.hello = answer[1]

    def call(self, task: Any, deadline: float) -> Any:
        """The task's result; WorkerLost if the child dies or the deadline (monotonic) comes first."""
        with contextlib.suppress(OSError):  # a child gone since its last answer: _wait sees it
            self.conn.send(task)
        answer = self._wait(deadline)
        if answer is None:
            # NOTE: the pipe's EOF can come before the child is reaped (is_alive() still True): an
            # answer missing before the deadline is a death, and the child is given time to go.
            if time.monotonic() >= deadline:
                self.stop()
                raise WorkerLost("no answer by its deadline; its process was stopped", died=False)
            self.proc.join(timeout=5)
            raise WorkerLost(f"the worker process died (exit code {self.stop()})", died=True)
        kind, result, fatal = answer
        if fatal:  # the child is leaving: the next call starts another
            self.proc.join(timeout=10)
            self.stop()
        if kind == "raised":
            raise WorkerLost(f"the worker raised {result}", died=True)
        return result

    def _wait(self, deadline: float) -> tuple | None:
        """The child's next message, or None if it died or the deadline passed."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if self.conn.poll(min(left, POLL_S)):
                try:
                    return self.conn.recv()
                except EOFError:
                    return None
            # a grandchild that inherited the pipe could keep it open: look at the child itself
            if not self.proc.is_alive():
                return None

    def stop(self) -> int | None:
        """Kill the child if it is still there -> its exit code (None: it was stopped here)."""
        if self.proc is None:
            return None
        code = self.proc.exitcode
        if code is None:
            self.proc.kill()
            self.proc.join(timeout=10)
        self.conn.close()
        self.proc = self.conn = None
        return code

    def close(self) -> None:
        """Ask the child to leave, kill it if it has not within 10 s."""
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.proc.join(timeout=10)
        self.stop()


class LocalWorker:
    """The same calls on a worker in this process: no isolation (a fault poisons the run); for
    debugging and for tests that patch a piece in this process."""

    def __init__(self, make: Callable[..., Any], args_for: Callable[[int], tuple]):
        self.make, self.args_for = make, args_for
        self.starts, self.hello, self.worker = 0, None, None

    def ready(self, deadline: float) -> None:
        if self.worker is None:
            self.worker = self.make(*self.args_for(0))
            self.starts, self.hello = 1, self.worker.hello()

    def call(self, task: Any, deadline: float) -> Any:
        return self.worker.do(task)[0]

    def close(self) -> None:
        self.worker = None
