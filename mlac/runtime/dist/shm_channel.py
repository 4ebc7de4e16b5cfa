"""ShmChannel: one writer, many readers, on one node, through a shared-memory ring of slots.

Rank 0 sends every step to the other ranks of its node this way (step_link.StepLink): a write is a
copy into shared memory and one 8-byte store; a reader that polls sees it within microseconds,
where a gloo broadcast over TCP loopback takes two round trips. The channel moves bytes; what
they mean is the caller's.

Layout of the segment (a file in /dev/shm, mapped by every process; int64 fields, 64-byte lines):

    line 0              magic, slots, capacity, readers, writer pid
    line 1 + r          reader r's pid (set when it attaches)
    then per slot       line: seq, size | one line per reader: the seq it consumed | capacity bytes

Message k (seq k + 1, counted from 1) goes to slot k % slots. The writer waits until every
reader's consumed seq equals the slot's seq (the slot's last message was read by all, or the
slot is unused: 0 == 0), writes the bytes and the size, and publishes by storing the seq last.
A reader waits for the seq it expects, copies the bytes out, then stores that seq as consumed.
A message larger than a slot publishes size ELSEWHERE instead of bytes: the writer sends it by
another path (step_link.py: the gloo broadcast) and the reader returns None to say so. No limit.

Memory order (NOTE: correct on x86-64, not on ARM): there are no fences. x86's total store order
makes each process's stores visible to others in program order, and loads are not reordered
with older loads, nor stores with older loads: the writer's bytes are visible before its seq, a
reader that saw the seq reads the new bytes, and its consumed flag is stored only after its
copy has read them. Every field is an aligned int64, stored and loaded whole. On a weakly
ordered CPU (aarch64) this needs release/acquire fences around the seq and flag stores.

Waiting: spin (sched_yield) for `spin_s`, long enough to cover a decode step so that a busy
server's readers wake within microseconds; then sleeps growing to MAX_SLEEP_S, so that an idle
server does not burn a core per rank. Every CHECK_S a waiter checks that the other side lives
(its pid, and the caller's `alive` callback) and raises MlacError if not: a dead writer or
reader fails its peer instead of hanging it.
"""

from __future__ import annotations

import array
import mmap
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from mlac.core.errors import MlacError

SHM_DIR = Path("/dev/shm")
PREFIX = "mlac-step-"  # every segment's file name starts so (tests look for leftovers)
MAGIC = 0x31505453_43414C4D  # "MLACSTP1"
LINE = 64  # bytes: one cache line per field that one process writes and others poll
SLOTS = 4
CAPACITY = 4 << 20  # bytes per slot: a Step of 512 sequences x 1,024 blocks (int64) fits
ELSEWHERE = -1  # a slot's size when the message went by another path
SPIN_S = 0.02  # spin this long before sleeping: more than a decode step
MAX_SLEEP_S = 1e-3
CHECK_S = 0.1  # how often a waiter checks that the other side lives

Buffer = bytes | bytearray | memoryview | array.array
Alive = Callable[[], None]  # raises (MlacError) when the other side is gone


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not: it died and waits for its parent)."""
    try:
        state = _pid_state(pid)
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: existence only
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state not in ("Z", "X")


def pid_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP, a debugger): alive, but it runs nothing until
    SIGCONT. False where /proc cannot say."""
    try:
        return _pid_state(pid) in ("T", "t")
    except (OSError, IndexError):
        return False


def _pid_state(pid: int) -> str:
    """The state letter of /proc/<pid>/stat (R, S, D, T, t, Z, X, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


class ShmChannel:
    """One end of a channel: the writer's (`create`) or reader r's (`attach`). See the module
    docstring for the protocol. Not thread-safe: one thread per end."""

    def __init__(self, path: Path, mm: mmap.mmap, reader: int | None, spin_s: float):
        self.path = path
        self._mm = mm
        self._q = memoryview(mm).cast("q")  # the segment as int64 [bytes / 8]
        self._buf = memoryview(mm)
        self.slots, self.capacity, self.readers = self._q[1], self._q[2], self._q[3]
        self.reader = reader  # None: the writer
        self.spin_s = spin_s
        self.seq = 0  # the last message written (writer) or read (reader)
        self.unlinked = False

    # ---- opening -----------------------------------------------------------------------------

    @classmethod
    def create(
        cls, readers: int, slots: int = SLOTS, capacity: int = CAPACITY, spin_s: float = SPIN_S
    ) -> ShmChannel:
        """The writer's end: a new segment in /dev/shm (its name: `.name`). MlacError if /dev/shm
        cannot hold it. Unlink it once every reader attached (`unlink`), or at `close`."""
        capacity = -(-capacity // LINE) * LINE
        size = (1 + readers) * LINE + slots * ((1 + readers) * LINE + capacity)
        path = SHM_DIR / f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise MlacError(f"cannot create the step channel {path}: {e}") from e
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS at a later write
            mm = mmap.mmap(fd, size)
        except OSError as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise MlacError(f"cannot create the step channel {path} ({size >> 20} MiB): {e}") from e
        os.close(fd)
        q = memoryview(mm).cast("q")
        q[1], q[2], q[3], q[4] = slots, capacity, readers, os.getpid()
        q[0] = MAGIC  # last: a reader checks it
        q.release()
        return cls(path, mm, None, spin_s)

    @classmethod
    def attach(cls, name: str, reader: int, spin_s: float = SPIN_S) -> ShmChannel:
        """Reader `reader`'s end (0 .. readers - 1) of the segment `name` (a writer's `.name`)."""
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise MlacError(f"cannot open the step channel {path}: {e}") from e
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        except (OSError, ValueError) as e:
            raise MlacError(f"cannot map the step channel {path}: {e}") from e
        finally:
            os.close(fd)
        ch = cls(path, mm, reader, spin_s)
        if ch._q[0] != MAGIC or not 0 <= reader < ch.readers:
            ch.close()
            raise MlacError(f"{path} is not a step channel with a reader {reader}")
        ch._q[(1 + reader) * LINE // 8] = os.getpid()
        return ch

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def writer_pid(self) -> int:
        return self._q[4]

    def reader_pid(self, r: int) -> int:
        """Reader r's pid, 0 before it attached."""
        return self._q[(1 + r) * LINE // 8]

    # ---- slots -------------------------------------------------------------------------------

    def _slot(self, seq: int) -> int:
        """Byte offset of the slot of message `seq` (from 1)."""
        stride = (1 + self.readers) * LINE + self.capacity
        return (1 + self.readers) * LINE + (seq - 1) % self.slots * stride

    def _consumed(self, slot: int, r: int) -> int:
        return self._q[(slot + (1 + r) * LINE) // 8]

    # ---- writer ------------------------------------------------------------------------------

    def write(self, data: Buffer, alive: Alive = lambda: None, timeout_s: float | None = None) -> bool:
        """Publish the next message (any buffer: bytes, array, memoryview): True, or False when
        it does not fit a slot (the readers get None for it: send it by another path). Waits
        while the ring is full; MlacError if a reader dies meanwhile, `alive` raises, or
        `timeout_s` passes."""
        assert self.reader is None, "write on a reader's end"
        seq = self.seq + 1
        slot = self._slot(seq)
        prev = self._q[slot // 8]
        free = lambda: all(self._consumed(slot, r) == prev for r in range(self.readers))  # noqa: E731
        self._wait(free, self._readers_alive, alive, timeout_s)
        data = memoryview(data).cast("B")
        n = data.nbytes
        fits = n <= self.capacity
        if fits:
            start = slot + (1 + self.readers) * LINE
            self._buf[start : start + n] = data
        self._q[slot // 8 + 1] = n if fits else ELSEWHERE
        self._q[slot // 8] = seq  # NOTE: publish last (x86 TSO: the bytes are visible first)
        self.seq = seq
        return fits

    def _readers_alive(self) -> None:
        for r in range(self.readers):
            pid = self.reader_pid(r)
            if pid and not pid_alive(pid):
                raise MlacError(f"step channel reader {r} (pid {pid}) exited")

    # ---- reader ------------------------------------------------------------------------------

    def read(self, alive: Alive = lambda: None, timeout_s: float | None = None) -> bytes | None:
        """The next message's bytes, or None when it went by another path (the writer's write
        returned False). Waits for it; MlacError if the writer dies meanwhile, `alive` raises,
        or `timeout_s` passes."""
        assert self.reader is not None, "read on the writer's end"
        seq = self.seq + 1
        slot = self._slot(seq)
        self._wait(lambda: self._q[slot // 8] == seq, self._writer_alive, alive, timeout_s)
        n = self._q[slot // 8 + 1]
        start = slot + (1 + self.readers) * LINE
        data = None if n == ELSEWHERE else bytes(self._buf[start : start + n])
        self._q[(slot + (1 + self.reader) * LINE) // 8] = seq  # after the copy: the slot is free
        self.seq = seq
        return data

    def _writer_alive(self) -> None:
        if not pid_alive(self.writer_pid):
            raise MlacError(f"the step channel's writer (pid {self.writer_pid}) exited")

    # ---- waiting -----------------------------------------------------------------------------

    def _wait(self, ready: Callable[[], bool], peers: Alive, alive: Alive, timeout_s: float | None) -> None:
        """Return once `ready()`: spin, then sleep (module docstring); check the peers every CHECK_S."""
        if ready():
            return
        start = time.monotonic()
        check, sleep = start + CHECK_S, 0.0
        while not ready():
            now = time.monotonic()
            if now - start < self.spin_s:
                os.sched_yield()
            else:
                sleep = min(max(2 * sleep, 2e-5), MAX_SLEEP_S)
                time.sleep(sleep)
            if now >= check:
                peers()
                alive()
                if timeout_s is not None and now - start > timeout_s:
                    raise MlacError(f"step channel: no progress after {timeout_s:.0f}s")
                check = now + CHECK_S

    # ---- closing -----------------------------------------------------------------------------

    def unlink(self) -> None:
        """Remove the segment's name (idempotent): the mapped ends keep working; nothing stays
        in /dev/shm once they close, even if they crash."""
        if not self.unlinked:
            self.unlinked = True
            self.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Unmap this end (idempotent); the writer's end also unlinks."""
        if self.reader is None:
            self.unlink()
        if not self._mm.closed:
            self._q.release()
            self._buf.release()
            self._mm.close()
