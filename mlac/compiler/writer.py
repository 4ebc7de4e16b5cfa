"""Artifact writer: builds the artifact in a temporary sibling directory, renames it into place.

Nothing at `out/` looks like an artifact until every file is written and hashed and the manifest
is the last file in. An interrupted or failed compile removes its temporary directory; an
existing `out/` is replaced only with `force`, and only after the new artifact is complete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import TracebackType

from mlac.artifact import MANIFEST, FileEntry, Manifest, TensorEntry, rank_dir, sha256_file
from mlac.compiler.safetensors_io import WriteSpec, dtype_name, iter_rows, write_safetensors_lockstep
from mlac.errors import MlacError
from mlac.lazy import LazyTensor


class ArtifactWriter:
    def __init__(self, out: str | Path, world_size: int, force: bool = False):
        self.out = Path(out).absolute()
        if self.out.exists() and not force:
            raise MlacError(f"{out}: already exists; pass --force to replace it")
        if self.out.exists() and not self.out.is_dir():
            raise MlacError(f"{out}: exists and is not a directory")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.out.parent / f".{self.out.name}.tmp-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()
        self.world_size = world_size
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
        results = write_safetensors_lockstep([self.tmp / rel for rel in rels], specs)
        for r, (rel, (size, sha)) in enumerate(zip(rels, results, strict=True)):
            self.files.append(FileEntry(path=rel, size=size, sha256=sha))
            for n, t in ranks[r].items():
                self.tensors[r][n] = TensorEntry(file=rel, dtype=dtype_name(t.dtype), shape=list(t.shape))

    def copy_file(self, src: Path, rel: str) -> None:
        dst = self.tmp / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        self.files.append(FileEntry(path=rel, size=dst.stat().st_size, sha256=sha256_file(dst)))

    def commit(self, manifest: Manifest) -> Path:
        (self.tmp / MANIFEST).write_text(manifest.to_json())
        old = None
        if self.out.exists():
            old = self.out.parent / f".{self.out.name}.old-{os.getpid()}"
            self.out.rename(old)
        self.tmp.rename(self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.out


def _stream(t: LazyTensor):
    for chunk in t.chunks():
        yield from iter_rows(chunk)
