"""The files of an artifact (or of a kernel-cache unit) and their digests: the entry of each file,
hashed whole and per piece, and the checks that its bytes are the ones listed.

Every check names the first file that fails; a digest mismatch, a missing file or a file of another
size is an IntegrityError (exit code 3), a path that leaves the folder or a symlink a MlacError.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import Field, model_validator

from mlac.core.errors import IntegrityError, MlacError
from mlac.core.frozen import Frozen
from mlac.core.hashing import PIECE_SIZE, FileHashes, hash_file, piece_count


class Pieces(Frozen):
    """A file's bytes cut into pieces [k*size, (k+1)*size) (the last one shorter), with the sha256
    of each: the loader and `verify` check a file with pieces piece by piece, on several threads."""

    size: int = Field(gt=0)  # bytes per piece (hashing.PIECE_SIZE when written)
    sha256: list[str]  # one per piece, in file order


class FileEntry(Frozen):
    """One file of the artifact. `sha256` is always the whole file's digest; a file longer than one
    piece also has `pieces` (schema_version 2), and those are what mlac checks (artifacts/README.md)."""

    path: str  # relative, POSIX
    size: int
    sha256: str
    pieces: Pieces | None = None

    @model_validator(mode="after")
    def _pieces_tile_the_file(self) -> FileEntry:
        p = self.pieces
        if p is not None and (self.size <= p.size or len(p.sha256) != piece_count(self.size, p.size)):
            raise ValueError(
                f"{self.path}: {len(p.sha256)} piece hashes for {self.size} bytes in pieces of {p.size} "
                f"(want {piece_count(self.size, p.size)}, and only for a file longer than one piece)"
            )
        return self

    @classmethod
    def of(cls, path: str, h: FileHashes) -> FileEntry:
        """The entry of a file with hashes `h` (pieces when it is longer than one piece)."""
        pieces = Pieces(size=h.piece, sha256=h.pieces) if h.pieces else None
        return cls(path=path, size=h.size, sha256=h.sha256, pieces=pieces)

    def checks(self) -> list[tuple[int, int, str]]:
        """(begin, end, sha256) of each byte range that is hashed on its own: every piece, or the
        whole file as one range. They tile [0, size)."""
        if self.pieces is None:
            return [(0, self.size, self.sha256)]
        step, digests = self.pieces.size, self.pieces.sha256
        return [
            (b, min(b + step, self.size), d) for b, d in zip(range(0, self.size, step), digests, strict=True)
        ]


def hash_mismatch(entry: FileEntry, begin: int, end: int) -> str:
    """The one-line message for a range of `entry` (FileEntry.checks) whose sha256 does not match."""
    where = "" if entry.pieces is None else f" of bytes [{begin}, {end})"
    return f"{entry.path}: sha256{where} does not match the manifest (file modified or corrupt)"


def check_inside(rel: str, where: Path) -> None:
    """Refuse a manifest path that would leave the artifact directory."""
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or "\\" in rel or not rel:
        raise MlacError(f"{where}: file path {rel!r} leaves the artifact directory; refusing to load")


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_entry(root: Path, rel: str, piece: int = PIECE_SIZE) -> FileEntry:
    """The manifest entry of the file `root/rel`: its size, sha256 and piece hashes (one read)."""
    return FileEntry.of(rel, hash_file(root / rel, piece))


def verify_files(
    root: str | Path,
    entries: list[FileEntry],
    progress: Any = None,
    hashes: bool = True,
    threads: int | None = None,
) -> None:
    """Check every file of `entries`: present with its size; then, with `hashes`, its bytes (the
    tamper check): each range of FileEntry.checks (the file's pieces, or the whole file) hashed on
    one of `threads` threads (default: this process's CPUs, at most VERIFY_THREADS). Raise naming
    the first file (in the manifest's order) that is missing or of another size; else the first
    whose bytes differ (with the piece's byte range). `progress(n)` is called with the bytes checked."""
    root = Path(root)
    for entry in entries:
        check_size(root, entry)
        if progress is not None and not hashes:
            progress(entry.size)
    if not hashes:
        return
    ranges = [(entry, begin, end, want) for entry in entries for begin, end, want in entry.checks()]
    pool = ThreadPoolExecutor(
        max(1, min(threads or _cpus(), VERIFY_THREADS)), thread_name_prefix="mlac-verify"
    )
    try:
        digests = pool.map(lambda r: sha256_range(root / r[0].path, r[1], r[2]), ranges)
        for (entry, begin, end, want), digest in zip(ranges, digests, strict=True):
            if digest != want:
                raise IntegrityError(hash_mismatch(entry, begin, end))
            if progress is not None:
                progress(end - begin)
    finally:
        pool.shutdown(cancel_futures=True)


VERIFY_THREADS = 16  # sha256 runs at ~1.1 GB/s per core: verify scales with threads up to the disk


def check_size(root: Path, entry: FileEntry) -> None:
    """Raise unless `root/entry.path` is a file of the manifest's size."""
    path = root / entry.path
    if not path.is_file():
        raise IntegrityError(f"{entry.path}: missing from the artifact")
    size = path.stat().st_size
    if size != entry.size:
        raise IntegrityError(f"{entry.path}: size {size} does not match the manifest ({entry.size})")


def sha256_range(path: Path, begin: int, end: int, chunk: int = 1 << 24) -> str:
    """The sha256 of bytes [begin, end) of a file (of fewer, if it ends before `end`)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        f.seek(begin)
        while begin < end and (block := f.read(min(chunk, end - begin))):
            h.update(block)
            begin += len(block)
    return h.hexdigest()


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_no_symlinks(root: Path, rels: list[str]) -> None:
    """Refuse a path of the artifact that is a symlink, lies under one, or resolves outside `root`
    (`root` itself may be a symlink: the artifact is what it points to)."""
    top = root.resolve()
    for rel in rels:
        check_inside(rel, root)
        parts = PurePosixPath(rel).parts
        for i in range(1, len(parts) + 1):
            if (top.joinpath(*parts[:i])).is_symlink():
                raise IntegrityError(
                    f"{root / '/'.join(parts[:i])}: is a symlink; an artifact must hold its own files "
                    "(replace the link by the file, or recompile)"
                )
        if not top.joinpath(*parts).resolve().is_relative_to(top):
            raise IntegrityError(f"{rel}: resolves outside the artifact directory; refusing it")
