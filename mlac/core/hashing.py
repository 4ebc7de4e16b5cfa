"""sha256 of a file's bytes, whole and per fixed-size piece, computed as the bytes stream by.

A file longer than one piece gets a digest per piece [k*piece, (k+1)*piece) (the last one shorter),
so that a reader can check its pieces on several threads at once (runtime/readpass.py); the whole
digest is kept beside them (artifacts/README.md says which is checked where). A leaf module: the
writer (safetensors_io) and the manifest (artifact) both use it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

PIECE_SIZE = 256 << 20  # bytes per hashed piece: a V3 MTP file of ~11 GB per rank is ~42 pieces


@dataclass(frozen=True)
class FileHashes:
    """What the manifest records of a file's bytes (artifact.FileEntry.of)."""

    size: int
    sha256: str  # of the whole file
    piece: int  # bytes per piece
    pieces: list[str]  # sha256 of each piece, in order; [] for a file no longer than one piece


class PieceHash:
    """Feed a byte stream in order (`update`, any chunk sizes); `pieces` is then the sha256 of each
    `piece`-byte piece, or [] when the stream is no longer than one piece (checked whole)."""

    def __init__(self, piece: int = PIECE_SIZE):
        assert piece > 0, piece
        self.piece = piece
        self.size = 0
        self._part = hashlib.sha256()  # the piece being fed
        self._done: list[str] = []  # digests of the full pieces so far

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            room = self.piece - self.size % self.piece
            self._part.update(view[:room])
            self.size += min(room, len(view))
            view = view[room:]
            if self.size % self.piece == 0:
                self._done.append(self._part.hexdigest())
                self._part = hashlib.sha256()

    def pieces(self) -> list[str]:
        if self.size <= self.piece:
            return []
        tail = [self._part.hexdigest()] if self.size % self.piece else []
        return self._done + tail


def hash_file(path: Path, piece: int = PIECE_SIZE, chunk: int = 1 << 24) -> FileHashes:
    """A file's hashes, read once in chunks of `chunk` bytes."""
    whole, parts = hashlib.sha256(), PieceHash(piece)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            whole.update(block)
            parts.update(block)
    return FileHashes(parts.size, whole.hexdigest(), piece, parts.pieces())


def piece_count(size: int, piece: int) -> int:
    """How many pieces a file of `size` bytes has (the last one may be shorter)."""
    return -(-size // piece)
