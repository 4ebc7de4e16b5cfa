"""Artifact writer: builds the artifact in a temporary sibling directory, renames it into place.

Nothing at `out/` looks like an artifact until every file is written and hashed. The manifest is
written after every other file, and its identity (`manifest.sha256`) last: a folder without the
identity is unfinished, and `verify` and the loader refuse it. An interrupted or failed compile
removes its temporary directory; one killed outright (SIGKILL) leaves `.<out>.tmp-<pid>`, which the
next compile to the same `out/` removes once that process is gone. An existing `out/` is replaced
only with `force`, and only after the new artifact is complete. The output may not overlap the
source checkpoint: replacing it would delete the source.

One compile at a time writes a given `out/`: the writer holds an exclusive lock on
`.<out>.lock` beside it from start to commit (a second compile is refused with one line). Every
tensor written is checked finite (a NaN or inf weight is refused, naming the tensor), and a write
that fails (a full disk, a quota) is one line naming the file; the temporary folder goes either way.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

import torch

from mlac.core.artifact import (
    IDENTITY,
    MANIFEST,
    Manifest,
    TensorEntry,
    artifact_identity,
    identity_record,
    rank_dir,
)
from mlac.core.atomic import check_not_source, remove_stale_tmp, tmp_dir
from mlac.core.errors import MlacError
from mlac.core.files import FileEntry, file_entry
from mlac.core.hashing import PIECE_SIZE
from mlac.core.lazy import LazyTensor
from mlac.core.safetensors_io import WriteSpec, dtype_name, iter_rows, write_safetensors_lockstep

Log = Callable[[str], None]


class ArtifactWriter:
    def __init__(
        self,
        out: str | Path,
        world_size: int,
        source: str | Path,
        force: bool = False,
        log: Log = lambda msg: None,
        piece: int = PIECE_SIZE,
    ):
        """Refuse a bad `out` (overlapping `source`, existing without `force`, not a directory) before
        touching anything; then remove stale temporary folders of dead compiles to `out` (naming them
        in `log`) and start a fresh one. Every file longer than `piece` bytes is listed with the
        sha256 of each piece (FileEntry.pieces), hashed as it is written."""
        self.out = Path(out).absolute()
        check_not_source(Path(out), Path(source))
        if self.out.exists() and not force:
            raise MlacError(f"{out}: already exists; pass --force to replace it")
        if self.out.exists() and not self.out.is_dir():
            raise MlacError(f"{out}: exists and is not a directory")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.force = force
        self._lock = lock_out_dir(self.out)
        try:
            for stale in remove_stale_tmp(self.out):
                log(f"removed {stale}: the temporary folder of a compile that no longer runs")
            self.tmp = tmp_dir(self.out, os.getpid())
            with disk_errors(self.tmp.name):
                self.tmp.mkdir()
        except BaseException:
            self._lock.release()
            raise
        self.world_size, self.piece = world_size, piece
        self.files: list[FileEntry] = []
        self.tensors: list[dict[str, TensorEntry]] = [{} for _ in range(world_size)]

    def __enter__(self) -> ArtifactWriter:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        self._lock.release()

    @property
    def root(self) -> Path:
        """Where the artifact is being built (valid to read before commit)."""
        return self.tmp

    def write_group(self, file: str, ranks: list[dict[str, LazyTensor]]) -> None:
        """One safetensors file per rank, `rank-XXXXX-of-YYYYY/<file>`, written in lockstep."""
        assert len(ranks) == self.world_size
        rels = [f"{rank_dir(r, self.world_size)}/{file}" for r in range(self.world_size)]
        for rel in rels:
            (self.tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        specs = [
            [WriteSpec(n, t.dtype, t.shape, _stream(n, t)) for n, t in tensors.items()] for tensors in ranks
        ]
        with disk_errors(rels[0]):
            hashes = write_safetensors_lockstep([self.tmp / rel for rel in rels], specs, self.piece)
        for r, (rel, h) in enumerate(zip(rels, hashes, strict=True)):
            self.files.append(FileEntry.of(rel, h))
            for n, t in ranks[r].items():
                self.tensors[r][n] = TensorEntry(file=rel, dtype=dtype_name(t.dtype), shape=list(t.shape))

    def copy_file(self, src: Path, rel: str) -> None:
        dst = self.tmp / rel
        with disk_errors(rel):
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
        self.files.append(file_entry(self.tmp, rel, self.piece))

    def commit(self, manifest: Manifest) -> Path:
        """Write the manifest, then its identity (last: it marks the artifact complete), then rename
        the folder into place, replacing the old `out/` only now (refused if one appeared meanwhile
        and `force` was not given)."""
        with disk_errors(MANIFEST):
            _write_synced(self.tmp / MANIFEST, manifest.to_json())
            _write_synced(self.tmp / IDENTITY, identity_record(artifact_identity(self.tmp)))
        if self.out.exists() and not self.force:
            raise MlacError(f"{self.out}: appeared while compiling (another program wrote it); not replaced")
        old = None
        if self.out.exists():
            old = self.out.parent / f".{self.out.name}.old-{os.getpid()}"
            self.out.rename(old)
        self.tmp.rename(self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.out


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _stream(name: str, t: LazyTensor):
    for chunk in t.chunks():
        check_finite(name, chunk)
        yield from iter_rows(chunk)


def check_finite(name: str, chunk: torch.Tensor) -> None:
    """Refuse a weight holding NaN or inf (a corrupt or diverged source): an artifact of it would
    compile, pass its own hashes, and answer garbage."""
    if chunk.dtype == torch.float8_e4m3fn:
        bad = (chunk.view(torch.uint8) & 0x7F) == 0x7F  # e4m3fn's only non-finite code: NaN
    elif chunk.is_floating_point():
        bad = ~torch.isfinite(chunk)
    else:
        return
    if bool(bad.any()):
        raise MlacError(
            f"{name}: {int(bad.sum())} NaN or inf value(s) in the weights; refusing to compile them"
        )


@contextmanager
def disk_errors(rel: str):
    """An OSError while writing `rel` (a full disk, a quota, permissions) as one line."""
    try:
        yield
    except OSError as e:
        why = (
            "no space left on the device" if e.errno in (errno.ENOSPC, errno.EDQUOT) else e.strerror or str(e)
        )
        raise MlacError(f"writing {rel}: {why}; nothing was written to the output directory") from None


class OutDirLock:
    """An exclusive lock on `.<out>.lock` beside `out` (flock: released when the process dies)."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    def release(self) -> None:
        if self.fd < 0:
            return
        self.path.unlink(missing_ok=True)  # NOTE: unlinked while held, so no one locks a stale file
        os.close(self.fd)
        self.fd = -1


def lock_out_dir(out: Path) -> OutDirLock:
    """Lock `out` for this compile, or refuse with one line naming the process that holds it."""
    path = out.parent / f".{out.name}.lock"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise MlacError(
                f"{out}: another compile is writing it (pid {holder}); wait for it, or choose another OUT_DIR"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:  # else its holder released (unlinked) it between our open and flock: try again
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
            return OutDirLock(path, fd)
        os.close(fd)
