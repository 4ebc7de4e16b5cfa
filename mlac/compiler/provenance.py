"""Provenance: what an artifact was compiled from, recorded in its manifest (`Manifest.provenance`).

    the sha256 of every source file the compile read (config, index, weight shards, tokenizer files)
    the source's repository id and revision: given (--source-repo, --source-revision), or read off a
        Hugging Face cache layout (.../models--ORG--NAME/snapshots/REVISION/)
    the versions of the tools that compiled it (mlac, torch, triton, safetensors, python)

The weight shards are hashed on threads of their own while the compile reads them (the bytes are
then in the page cache: one read from disk for both), and joined before the manifest is written.
"""

from __future__ import annotations

import hashlib
import platform
import re
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from mlac.core.artifact import Provenance, SourceFile
from mlac.core.errors import MlacError
from mlac.core.version import __version__

HASH_THREADS = 2  # sha256 runs at ~1 GB/s per core; the compile itself needs the other cores
CHUNK = 1 << 24
HF_SNAPSHOT = re.compile(r"models--(?P<repo>[^/]+)/snapshots/(?P<revision>[^/]+)$")
REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,254}")
REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def hf_cache_origin(model_dir: Path) -> tuple[str | None, str | None]:
    """(repo id, revision) of a folder inside a Hugging Face hub cache, else (None, None)."""
    m = HF_SNAPSHOT.search(Path(model_dir).absolute().as_posix().rstrip("/"))
    if m is None:
        return None, None
    return m.group("repo").replace("--", "/", 1), m.group("revision")


def check_origin(repo: str | None, revision: str | None) -> None:
    """Refuse a --source-repo / --source-revision that cannot be a hub id or a git revision."""
    if repo is not None and not REPO.fullmatch(repo):
        raise MlacError(f"--source-repo {repo!r}: not a repository id (want ORG/NAME)")
    if revision is not None and not REVISION.fullmatch(revision):
        raise MlacError(f"--source-revision {revision!r}: not a revision (a commit hash, tag or branch)")


def tool_versions() -> dict[str, str | None]:
    import safetensors
    import torch

    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "mlac": __version__,
        "torch": torch.__version__.split("+")[0],
        "triton": triton_version,
        "safetensors": safetensors.__version__,
        "python": platform.python_version(),
    }


class SourceHashes:
    """The sha256 of source files, computed on background threads from the moment it is made.

    `progress(n)` is called with the bytes hashed (from those threads). `result()` waits for every
    file and returns them sorted by path; `close()` stops early (a failed compile)."""

    def __init__(self, root: Path, rels: list[str], progress: Callable[[int], None] | None = None):
        self.root = root
        self._progress = progress
        self._stop = False
        self._pool = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="mlac-source-hash")
        self._jobs: dict[str, Future] = {rel: self._pool.submit(self._hash, rel) for rel in sorted(set(rels))}

    def _hash(self, rel: str) -> SourceFile:
        h, size = hashlib.sha256(), 0
        with open(self.root / rel, "rb") as f:
            while not self._stop and (block := f.read(CHUNK)):
                h.update(block)
                size += len(block)
                if self._progress is not None:
                    self._progress(len(block))
        return SourceFile(path=rel, size=size, sha256=h.hexdigest())

    @property
    def total_bytes(self) -> int:
        return sum((self.root / rel).stat().st_size for rel in self._jobs)

    def result(self) -> list[SourceFile]:
        try:
            return [job.result() for job in self._jobs.values()]
        except OSError as e:
            raise MlacError(f"{self.root}: cannot read a source file to hash it ({e.strerror})") from None
        finally:
            self._pool.shutdown()

    def close(self) -> None:
        self._stop = True
        self._pool.shutdown(cancel_futures=True)


def provenance(
    model_dir: Path, files: list[SourceFile], repo: str | None = None, revision: str | None = None
) -> Provenance:
    """The record of a compile from `model_dir`: a given repo/revision wins over the cache layout's."""
    found_repo, found_revision = hf_cache_origin(model_dir)
    return Provenance(
        repo=repo or found_repo,
        revision=revision or found_revision,
        files=files,
        tools=tool_versions(),
    )
