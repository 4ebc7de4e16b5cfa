"""One pass over the bytes: read files with several threads, hash what is read, copy it to the device.

Each file is read by one thread, in order, in chunks of `chunk` bytes (sha256 is sequential per
file); files run in parallel, largest first. hashlib and file reads release the GIL, so the threads
hash and read at the same time. Where the bytes land:

- cpu: straight into the file's destination tensor (no staging);
- cuda: into pinned staging buffers (two per thread), copied with `non_blocking=True` on the
  thread's own stream; a staging buffer is refilled only after the event of its last copy;
- another device: into host memory, then one copy per file.

A file's bytes become one uint8 tensor on the device (or are only hashed, for files that hold no
tensors); `finish` turns that tensor into the caller's result once every byte is in place and, with
`verify`, the file's sha256 matched the manifest. A caller that allocated the file's place itself
(`FileRead.dest`, cpu or cuda) can run the pass in the background (`ReadPass.start`, then `join`)
while it does other work on the main thread (loader.start_load: the CUDA graphs are captured
meanwhile). A pass's streams and events are made by the thread that makes the ReadPass; each
reader pins its staging first thing, and `start` returns once all have.
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

from mlac.errors import MlacError

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
    caller with no work pending on it in any stream; None: the pass allocates it."""

    path: Path
    rel: str  # the manifest's path, for messages
    size: int
    sha256: str
    finish: Callable[[torch.Tensor], Any] | None
    dest: torch.Tensor | None = None


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
    is short or whose sha256 does not match. Sizes were checked before: a file that shrinks while it
    is read is reported as truncated."""
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
        self.work: queue.SimpleQueue[FileRead] = queue.SimpleQueue()
        for f in sorted(self.todo, key=lambda f: -f.size):  # largest first: the threads finish together
            self.work.put(f)
        chunk = max(1, min(chunk or CHUNK, max((f.size for f in self.todo), default=1)))
        n = max(1, min(threads or default_threads(), len(self.todo)))
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
            raise MlacError(f"{rel}: truncated while reading (at byte {offset + got}); the file changed")
        got += n


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
        """Read files from `work` until it is empty (or another thread failed)."""
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
                        f = work.get_nowait()
                    except queue.Empty:
                        break
                    out[f.rel] = self._file(f, verify, stop)
        except BaseException:
            stop.set()
            raise
        return {rel: r for rel, r in out.items() if r is not _SKIPPED}

    def _file(self, f: FileRead, verify: bool, stop: threading.Event) -> Any:
        dest = f.dest if f.dest is not None or f.finish is None else self._destination(f.size)
        h = hashlib.sha256() if verify else None
        try:
            fd = os.open(f.path, os.O_RDONLY)
        except OSError as e:
            raise MlacError(f"{f.rel}: cannot read ({e.strerror})") from None
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            for offset in range(0, f.size, self.chunk):
                if stop.is_set():
                    return _SKIPPED
                self._chunk(fd, f.rel, offset, min(self.chunk, f.size - offset), dest, h)
        finally:
            os.close(fd)
            if self.stream is not None:
                self.stream.synchronize()  # NOTE: before `dest` can be freed or used on another stream
        if h is not None and h.hexdigest() != f.sha256:
            raise MlacError(f"{f.rel}: sha256 does not match the manifest (file modified or corrupt)")
        if f.finish is None:
            return _SKIPPED
        return f.finish(dest if dest.device == self.device else dest.to(self.device))

    def _destination(self, size: int) -> torch.Tensor:
        """The file's bytes: on the device, or on the host for a device that is neither cpu nor cuda."""
        on = self.device if self.device.type in ("cpu", "cuda") else torch.device("cpu")
        dest = torch.empty(size, dtype=torch.uint8, device=on)
        if self.stream is not None:  # NOTE: the memory may still be in use by work queued before it was freed
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return dest

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


_SKIPPED = object()  # a file only hashed, or left when another thread failed
