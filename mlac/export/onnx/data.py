"""Where the initializers' bytes live in OUT_DIR: one of two layouts, chosen before the graph is built.

    packed  (default)  OUT_DIR/model.onnx.data: each tensor the graph uses copied once at a
                       4096-byte-aligned offset (onnxruntime can map it); the artifact's other bytes
                       (headers, the MTP layers) are left out.
    linked  (--link-weights)  OUT_DIR/weights/<artifact path>: the artifact's safetensors files,
                       hard-linked (copied whole where the filesystem refuses a link), and every
                       initializer points at its tensor's bytes inside them. A safetensors tensor is
                       contiguous, little-endian and row-major, which is ONNX raw data for bf16,
                       float8e4m3fn and float32 alike, and every initializer is a whole stored tensor
                       or a dim-0 slice of one (experts): nothing is rewritten. Seconds, no new disk.

Why linked is not the default: onnx (1.23 here) refuses external data with more than one hard link
(a defence against hardlink attacks), so `onnx.checker.check_model(path)` and `onnx.load(path)` with
its data fail on a linked OUT_DIR; onnxruntime loads it. A copy (`cp -r OUT_DIR`) has single links
and passes both. The writer still runs the full check: first over sparse stand-ins of the weight
files (same names and sizes, one link each), which `link` then replaces by the hard links.

A layout hands out (location, offset) for a byte range of an artifact file as the graph is built;
`write` puts the bytes (or stand-ins) in place before the check, `link` after it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlac.core.errors import MlacError

DATA_FILE = "model.onnx.data"
WEIGHTS_DIR = "weights"
ALIGN = 4096  # packed: each tensor starts on a page
COPY_CHUNK = 64 << 20  # packed: bytes read and written at a time

Progress = Callable[[int], None]


@dataclass(frozen=True)
class Copy:
    """`nbytes` bytes at `src_offset` of artifact file `src` -> `dst_offset` of the data file."""

    src: Path
    src_offset: int
    nbytes: int
    dst_offset: int


class PackedData:
    """Every placed range copied into one data file, page-aligned, in the order placed."""

    name = "packed"

    def __init__(self, root: Path):
        self.root = root
        self.copies: list[Copy] = []
        self.data_bytes = 0  # the data file's size (alignment gaps included)

    def place(self, rel: str, start: int, nbytes: int) -> tuple[str, int]:
        offset = -(-self.data_bytes // ALIGN) * ALIGN
        self.copies.append(Copy(self.root / rel, start, nbytes, offset))
        self.data_bytes = offset + nbytes
        return DATA_FILE, offset

    @property
    def files(self) -> list[str]:
        return [DATA_FILE]

    @property
    def write_bytes(self) -> int:
        return sum(c.nbytes for c in self.copies)

    def write(self, out: Path, progress: Progress) -> None:
        write_data(out / DATA_FILE, self.copies, self.data_bytes, progress)

    def link(self, out: Path, progress: Progress) -> None:
        """Nothing to link: the data file is complete."""

    def summary(self) -> str:
        return f"{self.write_bytes / 1e9:.3f} GB of weights copied into {DATA_FILE}"


class LinkedFiles:
    """The artifact's files that hold a placed range, hard-linked under weights/ (or copied)."""

    name = "linked"

    def __init__(self, root: Path):
        self.root = root
        self._used: set[str] = set()
        self.copied: list[str] = []  # files that could not be hard-linked (filled by `link`)

    def place(self, rel: str, start: int, nbytes: int) -> tuple[str, int]:
        self._used.add(rel)
        return f"{WEIGHTS_DIR}/{rel}", start

    @property
    def files(self) -> list[str]:
        return [f"{WEIGHTS_DIR}/{rel}" for rel in sorted(self._used)]

    @property
    def data_bytes(self) -> int:
        return sum((self.root / rel).stat().st_size for rel in self._used)

    @property
    def write_bytes(self) -> int:
        return self.data_bytes

    def write(self, out: Path, progress: Progress) -> None:
        """Sparse stand-ins of the files (their sizes, one link each, no disk) for the checker."""
        for rel in sorted(self._used):
            dst = out / WEIGHTS_DIR / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            with open(dst, "wb") as f:
                f.truncate((self.root / rel).stat().st_size)

    def link(self, out: Path, progress: Progress) -> None:
        """Replace each stand-in by a hard link to the artifact's file (or a copy where refused)."""
        for rel in sorted(self._used):
            src, dst = self.root / rel, out / WEIGHTS_DIR / rel
            dst.unlink()
            if not link_or_copy(src, dst):
                self.copied.append(rel)
            progress(src.stat().st_size)

    def summary(self) -> str:
        """After `link`: what was linked, and what had to be copied."""
        linked = f"{self.data_bytes / 1e9:.3f} GB of weights: the artifact's {len(self._used)} files"
        if not self.copied:
            return f"{linked}, hard-linked under {WEIGHTS_DIR}/"
        return f"{linked} under {WEIGHTS_DIR}/, {len(self.copied)} of them copied (hard links refused there)"


Layout = PackedData | LinkedFiles


def choose_layout(root: Path, out: Path, link_weights: bool) -> Layout:
    """Packed, or with `link_weights` linked: then OUT_DIR's parent (which must exist) must be on
    the artifact's filesystem (hard links cannot cross filesystems)."""
    if not link_weights:
        return PackedData(root)
    if os.stat(root).st_dev != os.stat(out.parent).st_dev:
        raise MlacError(
            f"{out}: --link-weights needs OUT_DIR on the artifact's filesystem (hard links cannot cross "
            "filesystems); export without --link-weights to copy the weights"
        )
    return LinkedFiles(root)


def link_or_copy(src: Path, dst: Path) -> bool:
    """Hard-link `src` at `dst`; where the filesystem refuses (no hard links, another filesystem,
    protected_hardlinks on a file of another user), copy it. True if linked."""
    try:
        os.link(src, dst)
        return True
    except OSError:
        shutil.copyfile(src, dst)
        return False


def write_data(path: Path, copies: list[Copy], size: int, progress: Progress) -> None:
    """Stream every copy into the data file at its offset (gaps stay zero: the alignment padding)."""
    with open(path, "wb") as dst:
        dst.truncate(size)
        for c in copies:
            with open(c.src, "rb") as src:
                src.seek(c.src_offset)
                dst.seek(c.dst_offset)
                left = c.nbytes
                while left:
                    chunk = src.read(min(left, COPY_CHUNK))
                    if not chunk:
                        raise MlacError(f"{c.src}: truncated while exporting")
                    dst.write(chunk)
                    left -= len(chunk)
                    progress(len(chunk))
