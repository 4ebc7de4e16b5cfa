"""Artifact writer: builds the artifact in a temporary sibling directory, renames it into place.

Nothing at `out/` looks like an artifact until every file is written and hashed. The manifest is
written after every other file, and its identity (`manifest.sha256`) last: a folder without the
identity is unfinished, and `verify` and the loader refuse it. An interrupted or failed compile
removes its temporary directory; one killed outright (SIGKILL) leaves `.<out>.tmp-<pid>`, which the
next compile to the same `out/` removes once that process is gone. An existing `out/` is replaced
only with `force`, and only after the new artifact is complete. The output may not overlap the
source checkpoint: replacing it would delete the source.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

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
        for stale in remove_stale_tmp(self.out):
            log(f"removed {stale}: the temporary folder of a compile that no longer runs")
        self.tmp = tmp_dir(self.out, os.getpid())
        self.tmp.mkdir()
        self.world_size, self.piece = world_size, piece
        self.files: list[FileEntry] = []
        self.tensors: list[dict[str, TensorEntry]] = [{} for _ in range(world_size)]

    def __enter__(self) -> ArtifactWriter:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

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
            [WriteSpec(n, t.dtype, t.shape, _stream(t)) for n, t in tensors.items()] for tensors in ranks
        ]
        hashes = write_safetensors_lockstep([self.tmp / rel for rel in rels], specs, self.piece)
        for r, (rel, h) in enumerate(zip(rels, hashes, strict=True)):
            self.files.append(FileEntry.of(rel, h))
            for n, t in ranks[r].items():
                self.tensors[r][n] = TensorEntry(file=rel, dtype=dtype_name(t.dtype), shape=list(t.shape))

    def copy_file(self, src: Path, rel: str) -> None:
        dst = self.tmp / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        self.files.append(file_entry(self.tmp, rel, self.piece))

    def commit(self, manifest: Manifest) -> Path:
        """Write the manifest, then its identity (last: it marks the artifact complete), then rename
        the folder into place, replacing the old `out/` only now."""
        _write_synced(self.tmp / MANIFEST, manifest.to_json())
        _write_synced(self.tmp / IDENTITY, identity_record(artifact_identity(self.tmp)))
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


def _stream(t: LazyTensor):
    for chunk in t.chunks():
        yield from iter_rows(chunk)
