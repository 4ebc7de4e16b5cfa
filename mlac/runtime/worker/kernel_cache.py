"""Kernel caches at start: point Triton at a verified copy of the artifact's cache for this GPU.

Triton looks a kernel up in its cache directory before compiling it (env TRITON_CACHE_DIR, read at
each compile in triton 3.x through `triton.knobs.cache.dir`). `mlac prepare` stores that directory,
for one target, as a kernel-cache unit under cache/<key>/ (core/units.py); artifacts of schema 1-2
list it in their manifest instead (`Manifest.caches`). At start, `use_kernel_cache` picks the cache
whose signature equals this GPU's, copies its files into a fresh directory of this process (the
artifact may be read-only, and Triton writes there), checking each file's size and sha256 on the
bytes it copies, and points Triton at it. It must run before the process compiles any kernel; the
ranks that the process spawns inherit the environment variable. With a public key
(`serve --require-signature`), a unit is used only if its own signature verifies with that key.

Triton's group files (`__grp__*`) name their member files by absolute path: the artifact stores
those paths relative to the cache directory (`portable_group`), and the copy makes them absolute
again (`local_group`); otherwise Triton would miss the group and compile again.

With `--attention-backend flashinfer` the unit's FlashInfer modules (flashinfer/, prepared with that
backend) are copied, checked the same way, into a fresh FlashInfer workspace of this process, and
FLASHINFER_WORKSPACE_BASE points at it (kernels/attention/flashinfer_mla.py: FlashInfer then loads
them without building); the ranks that the process spawns inherit it. They are used only when the
installed flashinfer is the version that built them; `--require-prepared` refuses to start otherwise,
as it refuses a target without a cache.
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
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

import torch

from mlac.core.artifact import Manifest, cache_files
from mlac.core.errors import IntegrityError, MlacError, TargetMismatch
from mlac.core.files import FileEntry, check_inside
from mlac.core.signed import unit_signed
from mlac.core.signing import check_signature
from mlac.core.units import (
    CACHE_DIR,
    FLASHINFER_DIR,
    TRITON_DIR,
    TargetSignature,
    UnitManifest,
    signature_differences,
)
from mlac.core.validity import ArtifactCheck
from mlac.kernels.attention.flashinfer_mla import point_flashinfer_at
from mlac.runtime.worker.backend_check import flashinfer_version
from mlac.runtime.worker.target import current_target

CacheMode = Literal["use", "require", "off"]  # off: Triton's own cache directory, untouched
TRITON_CACHE_ENV = "TRITON_CACHE_DIR"
GROUP_PREFIX = "__grp__"

log = logging.getLogger("mlac.kernel_cache")


@dataclass(frozen=True)
class Candidate:
    """A kernel cache the artifact holds: `files` under `folder`, Triton's directory at `prefix`."""

    key: str
    signature: TargetSignature
    folder: Path
    prefix: str  # "triton/" in a unit; "cache/<key>/triton/" in a schema 1-2 manifest
    files: list[FileEntry]
    shown: str  # what messages put before a file's path: "cache/<key>/" for a unit
    modules: tuple[FileEntry, ...] = ()  # FlashInfer's, under flashinfer/ (a unit prepared for it)
    flashinfer: str | None = None  # the FlashInfer version that built `modules`

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)


def candidates(root: Path, manifest: Manifest, units: dict[str, UnitManifest]) -> list[Candidate]:
    """The units (checked by check_artifact) and the manifest's own caches (schema 1-2), units first."""
    out = [
        Candidate(
            key,
            u.signature,
            root / CACHE_DIR / key,
            TRITON_DIR + "/",
            u.files_under(TRITON_DIR),
            f"{CACHE_DIR}/{key}/",
            tuple(u.files_under(FLASHINFER_DIR)),
            u.flashinfer,
        )  # fmt: skip
        for key, u in units.items()
    ]
    return out + [
        Candidate(c.key, c.signature, root, c.path + "/", cache_files(manifest, c), "")
        for c in manifest.caches
    ]


def use_kernel_cache(
    checked: ArtifactCheck,
    device: torch.device | str,
    mode: CacheMode = "use",
    verify: bool = True,
    public_key: Path | None = None,
    attention_backend: str = "triton",
) -> Path | None:
    """Point Triton at a copy of the artifact's kernel cache for `device`'s target; return the copy's
    directory (removed at exit), or None: off, not a CUDA device, or no cache of this target (one
    warning line naming what differs; TargetMismatch instead with mode "require"). `checked`: the
    artifact as check_artifact found it. The files are checked for size, and with `verify` for
    sha256: a tampered file is refused as the loader refuses one. With `public_key`, an unsigned unit
    (or one signed by another key) is not used (a warning line; refused under "require").
    `attention_backend` "flashinfer": FlashInfer's modules of that cache too (use_flashinfer_modules)."""
    here = current_target(device) if mode != "off" else None
    if here is None:
        return None
    cache = matching_cache(checked, here, mode == "require", public_key)
    if cache is None:
        return None
    dest = Path(tempfile.mkdtemp(prefix="mlac-triton-"))
    atexit.register(shutil.rmtree, dest, True)
    copy_cache(cache, dest, verify)
    point_triton_at(dest)
    log.info(
        "kernel cache %s: %d files, %.1f MB, copied to %s",
        cache.key,
        len(cache.files),
        cache.bytes / 1e6,
        dest,
    )
    if attention_backend == "flashinfer":
        use_flashinfer_modules(cache, mode == "require", verify)
    return dest


def use_flashinfer_modules(cache: Candidate, require: bool = False, verify: bool = True) -> Path | None:
    """Point FlashInfer at a fresh workspace holding a checked copy of `cache`'s FlashInfer modules;
    return it (removed at exit), or None when the cache holds none built by the installed flashinfer
    (one warning line: FlashInfer compiles them on first use; TargetMismatch if `require`)."""
    here = flashinfer_version()
    if not cache.modules or cache.flashinfer != here:
        why = (
            f"the kernel cache {cache.key} holds no FlashInfer modules"
            if not cache.modules
            else f"the kernel cache {cache.key} holds FlashInfer {cache.flashinfer}'s modules, not {here}'s"
        )
        if require:
            raise TargetMismatch(
                f"--require-prepared: {why}; run `mlac prepare ARTIFACT --attention-backend flashinfer` on this GPU"
            )
        log.warning("%s; FlashInfer compiles its modules on first use", why)
        return None
    dest = Path(tempfile.mkdtemp(prefix="mlac-flashinfer-"))
    atexit.register(shutil.rmtree, dest, True)
    for entry in cache.modules:
        data = read_checked(cache.folder, entry, verify, cache.shown + entry.path)
        out = dest / entry.path[len(FLASHINFER_DIR) + 1 :]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)
    point_flashinfer_at(dest)
    log.info("FlashInfer %s modules of %s: %d, copied to %s", here, cache.key, len(cache.modules), dest)
    return dest


def matching_cache(
    checked: ArtifactCheck, here: TargetSignature, require: bool = False, public_key: Path | None = None
) -> Candidate | None:
    """The cache whose signature equals `here`; else None after one warning line (TargetMismatch
    if `require`). With `public_key`, a matching unit must be signed by it."""
    held = candidates(checked.root, checked.manifest, checked.units)
    for cache in held:
        if cache.signature != here:
            continue
        if public_key is not None and cache.folder != checked.root:
            try:
                check_signature(unit_signed(cache.folder, checked.units[cache.key]), public_key)
            except IntegrityError as e:
                if require:
                    raise
                log.warning("kernel cache %s not used: %s; kernels compile on first use", cache.key, e)
                return None
        return cache
    message = mismatch_message([c.signature for c in held], here)
    if require:
        raise TargetMismatch(f"--require-prepared: {message}; run `mlac prepare ARTIFACT` on this GPU")
    log.warning("%s; kernels compile on first use", message)
    return None


def mismatch_message(held: list[TargetSignature], here: TargetSignature) -> str:
    """Why no cache is used: none held, or the closest one (fewest differing fields) and what differs."""
    if not held:
        return f"the artifact holds no kernel cache (this GPU: {here.label()})"
    diff, closest = min(((signature_differences(s, here), s) for s in held), key=lambda d: len(d[0]))
    fields = ", ".join(f"{field} is {mine} here ({theirs} in the cache)" for field, theirs, mine in diff)
    return f"kernel cache for {closest.label()} not used: {fields}"


def copy_cache(cache: Candidate, dest: Path, verify: bool = True) -> None:
    """Write `cache`'s files under `dest` as Triton's cache directory, each checked as it is copied."""
    for entry in cache.files:
        data = read_checked(cache.folder, entry, verify, cache.shown + entry.path)
        rel = entry.path[len(cache.prefix) :]
        if is_group(rel):
            data = local_group(data, dest, entry.path)
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)


def read_checked(root: Path, entry: FileEntry, verify: bool, shown: str | None = None) -> bytes:
    """A listed file's bytes, refused (as files.verify_files refuses) if missing, of another size,
    or, with `verify`, of another sha256. Messages name the file as `shown` (default: its path)."""
    path, shown = root / entry.path, shown or entry.path
    if not path.is_file() or path.is_symlink():
        raise IntegrityError(f"{shown}: missing from the artifact (or a symlink)")
    data = path.read_bytes()
    if len(data) != entry.size:
        raise IntegrityError(f"{shown}: size {len(data)} does not match the manifest ({entry.size})")
    if verify and hashlib.sha256(data).hexdigest() != entry.sha256:
        raise IntegrityError(f"{shown}: sha256 does not match the manifest (file modified or corrupt)")
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
