"""Kernel caches at start: point Triton at a verified copy of the artifact's cache for this GPU.

Triton looks a kernel up in its cache directory before compiling it (env TRITON_CACHE_DIR, read at
each compile in triton 3.x through `triton.knobs.cache.dir`). `mlac prepare` stores that directory,
for one target, under cache/<key>/triton (artifact.KernelCache). At start, `use_kernel_cache` picks
the cache whose signature equals this GPU's, copies its files into a fresh directory of this process
(the artifact may be read-only, and Triton writes there), checking each file's size and sha256 on
the bytes it copies, and points Triton at it. It must run before the process compiles any kernel;
the ranks that the process spawns inherit the environment variable.

Triton's group files (`__grp__*`) name their member files by absolute path: the artifact stores
those paths relative to the cache directory (`portable_group`), and the copy makes them absolute
again (`local_group`); otherwise Triton would miss the group and compile again.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Literal

import torch

from mlac.core.artifact import (
    FileEntry,
    KernelCache,
    Manifest,
    TargetSignature,
    cache_files,
    check_identity,
    check_inside,
    signature_differences,
)
from mlac.core.errors import MlacError
from mlac.runtime.worker.target import current_target

CacheMode = Literal["use", "require", "off"]  # off: Triton's own cache directory, untouched
TRITON_CACHE_ENV = "TRITON_CACHE_DIR"
GROUP_PREFIX = "__grp__"

log = logging.getLogger("mlac.kernel_cache")


def use_kernel_cache(
    root: str | Path,
    manifest: Manifest,
    device: torch.device | str,
    mode: CacheMode = "use",
    verify: bool = True,
) -> Path | None:
    """Point Triton at a copy of the artifact's kernel cache for `device`'s target; return the copy's
    directory (removed at exit), or None: off, not a CUDA device, or no cache of this target (one
    warning line naming what differs; MlacError instead with mode "require"). The files are checked
    for size, and with `verify` for sha256: a tampered file is refused as the loader refuses one."""
    here = current_target(device) if mode != "off" else None
    if here is None:
        return None
    cache = matching_cache(manifest, here, require=mode == "require")
    if cache is None:
        return None
    check_identity(root, manifest, required=verify)  # the manifest that lists these hashes is unedited
    dest = Path(tempfile.mkdtemp(prefix="mlac-triton-"))
    atexit.register(shutil.rmtree, dest, True)
    copy_cache(Path(root), manifest, cache, dest, verify)
    point_triton_at(dest)
    log.info(
        "kernel cache %s: %d files, %.1f MB, copied to %s", cache.key, cache.files, cache.bytes / 1e6, dest
    )
    return dest


def matching_cache(manifest: Manifest, here: TargetSignature, require: bool = False) -> KernelCache | None:
    """The cache whose signature equals `here`; else None after one warning line (MlacError if `require`)."""
    for cache in manifest.caches:
        if cache.signature == here:
            return cache
    message = mismatch_message(manifest.caches, here)
    if require:
        raise MlacError(f"--require-prepared: {message}; run `mlac prepare ARTIFACT` on this GPU")
    log.warning("%s; kernels compile on first use", message)
    return None


def mismatch_message(caches: list[KernelCache], here: TargetSignature) -> str:
    """Why no cache is used: none held, or the closest one (fewest differing fields) and what differs."""
    if not caches:
        return f"the artifact holds no kernel cache (this GPU: {here.label()})"
    diff, closest = min(
        ((signature_differences(c.signature, here), c) for c in caches), key=lambda d: len(d[0])
    )
    fields = ", ".join(f"{field} is {mine} here ({theirs} in the cache)" for field, theirs, mine in diff)
    return f"kernel cache for {closest.signature.label()} not used: {fields}"


def copy_cache(root: Path, manifest: Manifest, cache: KernelCache, dest: Path, verify: bool = True) -> None:
    """Write `cache`'s files under `dest` as Triton's cache directory, each checked as it is copied."""
    prefix = cache.path + "/"
    for entry in cache_files(manifest, cache):
        data = read_checked(root, entry, verify)
        rel = entry.path[len(prefix) :]
        if is_group(rel):
            data = local_group(data, dest, entry.path)
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)


def read_checked(root: Path, entry: FileEntry, verify: bool) -> bytes:
    """A listed file's bytes, refused (as artifact.verify_files refuses) if missing, of another size,
    or, with `verify`, of another sha256."""
    path = root / entry.path
    if not path.is_file() or path.is_symlink():
        raise MlacError(f"{entry.path}: missing from the artifact (or a symlink)")
    data = path.read_bytes()
    if len(data) != entry.size:
        raise MlacError(f"{entry.path}: size {len(data)} does not match the manifest ({entry.size})")
    if verify and hashlib.sha256(data).hexdigest() != entry.sha256:
        raise MlacError(f"{entry.path}: sha256 does not match the manifest (file modified or corrupt)")
    return data


# ---- Triton's cache directory -----------------------------------------------------------------


def point_triton_at(path: Path) -> None:
    """Make `path` Triton's cache directory for every later compile of this process (and of the
    processes it starts): the environment variable, and triton.knobs where triton is imported."""
    os.environ[TRITON_CACHE_ENV] = str(path)
    knobs = getattr(sys.modules.get("triton"), "knobs", None)
    if knobs is not None:
        knobs.cache.dir = str(path)


@contextmanager
def triton_cache_dir(path: Path) -> Iterator[Path]:
    """Triton's cache directory is `path` inside the block; the environment is restored after."""
    before = os.environ.get(TRITON_CACHE_ENV)
    point_triton_at(path)
    try:
        yield path
    finally:
        if before is None:
            os.environ.pop(TRITON_CACHE_ENV, None)
        else:
            os.environ[TRITON_CACHE_ENV] = before
        knobs = getattr(sys.modules.get("triton"), "knobs", None)
        if knobs is not None:
            del knobs.cache.dir  # back to reading the environment


# ---- group files: absolute member paths on disk, relative ones in the artifact -----------------


def is_group(rel: str) -> bool:
    return PurePosixPath(rel).name.startswith(GROUP_PREFIX)


def portable_group(data: bytes, cache_dir: Path, where: str) -> bytes:
    """A group file of Triton's cache at `cache_dir`, its member paths made relative to `cache_dir`."""
    group = _parse_group(data, where)
    rels = {}
    for name, p in group["child_paths"].items():
        if not Path(p).resolve().is_relative_to(cache_dir.resolve()):
            raise MlacError(f"{where}: Triton group file names {p}, outside its cache directory {cache_dir}")
        rels[name] = Path(p).resolve().relative_to(cache_dir.resolve()).as_posix()
    return json.dumps({**group, "child_paths": rels}, sort_keys=True).encode()


def local_group(data: bytes, cache_dir: Path, where: str) -> bytes:
    """A stored group file with its member paths made absolute under `cache_dir` (as Triton reads them)."""
    group = _parse_group(data, where)
    paths = {}
    for name, rel in group["child_paths"].items():
        check_inside(rel, Path(where))
        paths[name] = str(cache_dir / rel)
    return json.dumps({**group, "child_paths": paths}).encode()


def _parse_group(data: bytes, where: str) -> dict:
    try:
        group = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        group = None
    paths = group.get("child_paths") if isinstance(group, dict) else None
    if not isinstance(paths, dict) or not all(isinstance(p, str) for p in paths.values()):
        raise MlacError(f"{where}: not a Triton group file (want JSON with a child_paths object)")
    return group
