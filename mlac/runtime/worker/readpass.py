"""One pass over the bytes: read files with several threads, hash what is read, copy it to the device.

The work is a list of byte ranges, each hashed on its own (sha256 is sequential per range): a file
with piece hashes in the manifest (FileEntry.pieces) gives one range per piece, any other file one
range for the whole file. The ranges are queued file by file, largest file first, each file's in
order; any thread takes the next one and reads it in chunks of `chunk` bytes, hashing them and
copying them to the range's offset of the file's destination. A file is finished by the thread that
completes its last range, once every range is in place and matched its sha256. So one big file
loads with every thread, not one, and only the few files being read hold a destination the pass
allocated. hashlib and file reads release the GIL, so the threads hash and read at the same time.
Where the bytes land:

- cpu: straight into the file's destination tensor (no staging);
- cuda: into pinned staging buffers (two per thread), copied with `non_blocking=True` on the
  thread's own stream; a staging buffer is refilled only after the event of its last copy;
- another device: into host memory, then one copy per file.

A file's bytes become one uint8 tensor on the device (or are only hashed, for files that hold no
tensors); `finish` turns that tensor into the caller's result once every byte is in place and, with
`verify`, every range's sha256 matched the manifest. A range that does not match fails the pass
with a message naming the file (and the piece's bytes): its file is never finished. A caller that
allocated the file's place itself (`FileRead.dest`, cpu or cuda) can run the pass in the background
(`ReadPass.start`, then `join`) while it does other work on the main thread (loader.start_load:
the CUDA graphs are captured meanwhile). A pass's streams and events are made by the thread that
makes the ReadPass; each reader pins its staging first thing, and `start` returns once all have.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mlac.core.errors import IntegrityError, MlacError
from mlac.core.files import FileEntry, Pieces, hash_mismatch

CHUNK = 64 << 20  # bytes per read; one read returns at most ~2 GiB on Linux, so reads loop anyway


MAX_THREADS = 16  # one H200 host's 16 cores: 7.3 GB/s verified with 8 threads, 11.7 GB/s with 16


def default_threads(local_ranks: int = 1) -> int:
    """Reader threads of one rank: this process's CPUs shared by the ranks loading on this node
    (sha256 runs at ~1.1 GB/s per core there, so the verified load scales with threads)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cpus // max(1, local_ranks)))


@dataclass(frozen=True)
class FileRead:
    """One file of the pass. `finish` gets the file's bytes on the device (a uint8 tensor of `size`)
    and returns the caller's result; None: the file is only hashed (it is not read without verify).
    `dest`: where the bytes go (uint8 [size] on the pass's device, cpu or cuda), allocated by the
    caller with no work pending on it in any stream; None: the pass allocates it. `pieces`: the
    manifest's piece hashes (then the pieces are checked, and `sha256` is not)."""

    path: Path
    rel: str  # the manifest's path, for messages
    size: int
    sha256: str
    finish: Callable[[torch.Tensor], Any] | None
    dest: torch.Tensor | None = None
    pieces: Pieces | None = None

    @property
    def entry(self) -> FileEntry:
        return FileEntry(path=self.rel, size=self.size, sha256=self.sha256, pieces=self.pieces)


@dataclass(frozen=True)
class PassResult:
    results: dict[str, Any]  # rel -> what finish returned (files with a finish only)
    bytes_read: int


def read_files(
    files: list[FileRead],
    device: torch.device,
    verify: bool,
    threads: int | None = None,
    chunk: int | None = None,
) -> PassResult:
    """Read, hash (with `verify`) and place every file; raise MlacError naming the first file that
    is short or whose sha256 (or a piece's) does not match. Sizes were checked before: a file that
    shrinks while it is read is reported as truncated."""
    return ReadPass(files, device, verify, threads, chunk).run()


class ReadPass:
    """One pass over `files` (read_files), run here (`run`) or on a background thread (`start`,
    then `join`, or `cancel`). Its lanes' streams and events are made here, on the calling
    thread; each reader pins its staging on its own thread, first thing."""

    def __init__(
        self,
        files: list[FileRead],
        device: torch.device,
        verify: bool,
        threads: int | None = None,
        chunk: int | None = None,
    ):
        self.todo = [f for f in files if f.finish is not None or verify]
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.verify = verify
        self.stop = threading.Event()
        self.work: queue.SimpleQueue[_Range] = queue.SimpleQueue()
        # largest file first (the threads finish together), each file's ranges in order (few files open)
        ranges = [r for f in sorted(self.todo, key=lambda f: -f.size) for r in _ranges(f)]
        for r in ranges:
            self.work.put(r)
        chunk = max(1, min(chunk or CHUNK, max((r.size for r in ranges), default=1)))
        n = max(1, min(threads or default_threads(), len(ranges)))
        self.lanes = [_Lane(device, chunk) for _ in range(n)] if self.todo else []
        self.finished_at: float | None = None  # perf_counter() when the last reader thread ended
        self._outcomes: list[Any] = []
        self._thread: threading.Thread | None = None

    def run(self) -> PassResult:
        """The whole pass on this thread's pool of readers; raise its first error."""
        self._drain()
        return self._result()

    def start(self) -> None:
        """Run the pass on a background thread; `join` (or `cancel`) must follow. Returns once
        every reader holds its pinned staging: no host memory is pinned after it (not while the
        caller captures a CUDA graph)."""
        self._thread = threading.Thread(target=self._drain, name="mlac-load-pass", daemon=True)
        self._thread.start()
        for lane in self.lanes:
            lane.staged.wait()

    def join(self) -> PassResult:
        """Wait for `start`'s pass; raise its first error (MlacError: a short or modified file)."""
        assert self._thread is not None, "join() without start()"
        self._thread.join()
        return self._result()

    def cancel(self) -> None:
        """Stop the readers after their current chunk and wait for them (errors dropped): nothing
        writes the destinations afterwards."""
        self.stop.set()
        if self._thread is not None:
            self._thread.join()

    def _drain(self) -> None:
        try:
            self._outcomes = self._run_lanes() if self.lanes else []
        finally:
            for lane in self.lanes:
                lane.staged.set()  # NOTE: `start` waits on them, whatever happened
            self.finished_at = time.perf_counter()

    def _run_lanes(self) -> list[Any]:
        """Every lane on a thread of its own: what each returned, or its exception."""
        with ThreadPoolExecutor(len(self.lanes), thread_name_prefix="mlac-load") as pool:
            futures = [pool.submit(lane.drain, self.work, self.verify, self.stop) for lane in self.lanes]
            return [f.exception() or f.result() for f in futures]

    def _result(self) -> PassResult:
        errors = [d for d in self._outcomes if isinstance(d, BaseException)]
        if errors:
            raise errors[0]
        results = {rel: r for d in self._outcomes for rel, r in d.items()}
        return PassResult(results, sum(f.size for f in self.todo))


def read_exact(fd: int, view: memoryview, offset: int, rel: str) -> None:
    """Fill `view` from `offset`, looping over short reads; a read of 0 bytes means truncation."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise IntegrityError(f"{rel}: truncated while reading (at byte {offset + got}); the file changed")
        got += n


class _File:
    """A file being read by any lanes, range by range: its destination, allocated once by the first
    lane that needs it, and how many of its ranges are still to be placed and checked."""

    def __init__(self, read: FileRead, ranges: int):
        self.read, self.left = read, ranges
        self.dest = read.dest
        self.lock = threading.Lock()

    def destination(self, lane: _Lane) -> torch.Tensor | None:
        """Where the file's bytes go (None: a file only hashed)."""
        with self.lock:
            if self.dest is None and self.read.finish is not None:
                self.dest = lane._destination(self.read.size)
            return self.dest

    def placed(self) -> bool:
        """Count one range in place (and checked); True for the file's last."""
        with self.lock:
            self.left -= 1
            return self.left == 0


@dataclass(frozen=True)
class _Range:
    """Bytes [begin, end) of a file, hashed on their own against `sha256`."""

    file: _File
    begin: int
    end: int
    sha256: str

    @property
    def size(self) -> int:
        return self.end - self.begin


def _ranges(f: FileRead) -> list[_Range]:
    """The file's ranges: one per piece when the manifest has piece hashes, else the whole file."""
    checks = f.entry.checks()
    state = _File(f, len(checks))
    return [_Range(state, begin, end, sha) for begin, end, sha in checks]


class _Lane:
    """One reader thread's resources: on CUDA its stream and pinned staging buffers."""

    def __init__(self, device: torch.device, chunk: int):
        self.device, self.chunk = device, chunk
        self.cuda = device.type == "cuda"
        self.scratch: list[torch.Tensor] = []  # host buffers: staging (cuda) or for hash-only files
        self.events = [torch.cuda.Event() for _ in range(2)] if self.cuda else []
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.turn = 0
        self.staged = threading.Event()  # set once the lane's staging exists (or it failed first)

    def drain(self, work: queue.SimpleQueue, verify: bool, stop: threading.Event) -> dict[str, Any]:
        """Read ranges from `work` until it is empty (or another thread failed); return the results
        of the files whose last range this lane placed."""
        out: dict[str, Any] = {}
        try:
            with torch.cuda.device(self.device) if self.cuda else nullcontext():
                try:
                    if self.cuda:  # pinned first, the lanes in parallel (ReadPass.start waits for it)
                        self._staging(1)
                finally:
                    self.staged.set()
                while not stop.is_set():
                    try:
                        r = work.get_nowait()
                    except queue.Empty:
                        break
                    result = self._range(r, verify, stop)
                    if result is not _SKIPPED:
                        out[r.file.read.rel] = result
        except BaseException:
            stop.set()
            raise
        return out

    def _range(self, r: _Range, verify: bool, stop: threading.Event) -> Any:
        """Read, hash (with `verify`) and place bytes [r.begin, r.end) of their file; return the
        file's result when this was its last range, else _SKIPPED."""
        f = r.file.read
        dest = r.file.destination(self)
        h = hashlib.sha256() if verify else None
        try:
            fd = os.open(f.path, os.O_RDONLY)
        except OSError as e:
            raise MlacError(f"{f.rel}: cannot read ({e.strerror})") from None
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, r.begin, r.size, os.POSIX_FADV_SEQUENTIAL)
            if self.stream is not None and f.dest is None and dest is not None:
                # NOTE: the pass's allocation may still be in use by work queued before it was freed
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
            for offset in range(r.begin, r.end, self.chunk):
                if stop.is_set():
                    return _SKIPPED
                self._chunk(fd, f.rel, offset, min(self.chunk, r.end - offset), dest, h)
        finally:
            os.close(fd)
            if self.stream is not None:
                self.stream.synchronize()  # NOTE: before `dest` can be freed, used or finished elsewhere
        if h is not None and h.hexdigest() != r.sha256:
            raise IntegrityError(hash_mismatch(f.entry, r.begin, r.end))
        if not r.file.placed() or f.finish is None or dest is None:
            return _SKIPPED
        return f.finish(dest if dest.device == self.device else dest.to(self.device))

    def _destination(self, size: int) -> torch.Tensor:
        """A file's bytes: on the device, or on the host for a device that is neither cpu nor cuda."""
        on = self.device if self.device.type in ("cpu", "cuda") else torch.device("cpu")
        return torch.empty(size, dtype=torch.uint8, device=on)

    def _chunk(self, fd: int, rel: str, offset: int, n: int, dest: torch.Tensor | None, h) -> None:
        if dest is not None and not self.cuda:
            host = dest[offset : offset + n]  # cpu: read in place
        else:
            host = self._staging(n)
        view = memoryview(host.numpy())
        read_exact(fd, view, offset, rel)
        if dest is not None and self.cuda:
            with torch.cuda.stream(self.stream):
                dest[offset : offset + n].copy_(host, non_blocking=True)
                self.events[self.turn].record(self.stream)
            self.turn ^= 1
        if h is not None:
            h.update(view)  # the bytes just copied; the copy reads them too, nothing writes them

    def _staging(self, n: int) -> torch.Tensor:
        """A host buffer of n bytes whose last copy (if any) has completed."""
        if not self.scratch:
            pin = self.cuda
            self.scratch = [torch.empty(self.chunk, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        if self.cuda:
            self.events[self.turn].synchronize()
        return self.scratch[self.turn][:n]


_SKIPPED = object()  # not a file's last range, a file only hashed, or left when another thread failed
