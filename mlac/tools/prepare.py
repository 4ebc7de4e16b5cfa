"""`mlac prepare`: add this GPU's compile caches to an existing artifact, atomically.

On a GPU, the artifact's engine is built as the server builds it, from the same EngineOptions
(CUDA graphs captured for every decode bucket), and warmed up (Engine.warmup: the prefill and
decode shapes), with Triton's cache directory pointed at a fresh empty one: every kernel variant
the server meets is compiled there.
That directory becomes cache/<key>/triton/ of the artifact (artifact.target_key), its files hashed
into manifest.files and the target recorded in manifest.caches (artifact.KernelCache). Preparing
a target again replaces its cache; the other targets' caches stay.

Atomic: the cache is built in `.cache.tmp-<pid>/` and the new manifest in `manifest.json.tmp-<pid>`
(both fsynced) while the artifact is untouched; an exception or kill there leaves the artifact as it
was, and the next prepare removes the dead process's folder. Then the folder is renamed into place
(the target's old cache renamed aside first), manifest.json replaced, and manifest.sha256 last.
NOTE: a kill between those renames (milliseconds) leaves an artifact that `verify` refuses; prepare
it again. NOTE: a kernel that this process compiled before `prepare` (held in Triton's memory) is
not written to the fresh directory: run prepare in a process that has run no Triton kernel (the
CLI does; `compile --prepare` compiles on the CPU first).
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from mlac.core.artifact import (
    CACHE_DIR,
    IDENTITY,
    MANIFEST,
    FileEntry,
    KernelCache,
    Manifest,
    cache_path,
    check_identity,
    identity_record,
    sha256_file,
    target_key,
)
from mlac.core.atomic import remove_stale_tmp, tmp_dir
from mlac.core.errors import MlacError
from mlac.runtime.engine.options import EngineOptions
from mlac.runtime.worker.kernel_cache import is_group, portable_group, triton_cache_dir
from mlac.runtime.worker.target import current_target

Log = Callable[[str], None]


def warm_kernels(root: Path, cache_dir: Path, options: EngineOptions) -> None:
    """Build the engine as the server does with `options` (CUDA graphs: every bucket captured) and
    warm it up, so that Triton compiles every kernel variant into its cache directory (`cache_dir`,
    already set). The options that decide which variants exist are the server's: its dtype,
    max_running_requests, chunked_prefill_size and cuda_graph_max_bs; a server started with other
    values may meet variants that the cache does not hold."""
    import torch

    from mlac.runtime.engine.engine import Engine

    with Engine.from_artifact(root, options, kernel_cache="off") as engine:
        engine.warmup()
        torch.cuda.synchronize()
    # NOTE: the engine sized its KV cache as a server would (most of the GPU): give it all back, so that
    # a server started next, in another process, finds the GPU free (prepare runs inside tests too).
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def prepare(
    root: str | Path,
    options: EngineOptions | None = None,
    log: Log = lambda msg: None,
    warm: Callable[[Path, Path, EngineOptions], None] | None = None,
) -> KernelCache:
    """Compile every kernel the server meets on `options.runtime.device` (default: the server's
    options on "cuda") into the artifact at `root` (module docstring); return the cache's manifest
    entry. MlacError: not an artifact, or no GPU."""
    root = Path(root)
    options = options or EngineOptions.of(device="cuda")
    device = options.runtime.device
    manifest = Manifest.load(root)
    check_identity(root, manifest)
    target = current_target(device)
    if target is None:
        raise MlacError(
            f"prepare needs a CUDA GPU (device {device!r}): the caches are compiled for the GPU it runs on"
        )
    key = target_key(target)
    (root / CACHE_DIR).mkdir(exist_ok=True)
    for stale in remove_stale_tmp(root / CACHE_DIR) + remove_stale_tmp(root / CACHE_DIR / key):
        log(f"removed {stale}: the temporary folder of a prepare that no longer runs")
    tmp = tmp_dir(root / CACHE_DIR, os.getpid())  # .cache.tmp-<pid>, beside cache/
    try:
        with (
            tempfile.TemporaryDirectory(prefix="mlac-prepare-") as compiled,
            triton_cache_dir(Path(compiled)),
        ):
            log(f"compiling the kernels of {target.label()} (CUDA graphs, warm-up) ...")
            (warm or warm_kernels)(root, Path(compiled), options)
            files = store_cache(Path(compiled), tmp / "triton", cache_path(key))
        cache = KernelCache(key=key, signature=target, path=cache_path(key), files=len(files),
                            bytes=sum(f.size for f in files))  # fmt: skip
        commit(root, with_cache(manifest, cache, files), tmp, key)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"kernel cache {key}: {cache.files} files, {cache.bytes / 1e6:.1f} MB")
    return cache


def store_cache(src: Path, dst: Path, rel: str) -> list[FileEntry]:
    """Copy Triton's cache directory `src` to `dst` (group files made portable; Triton's unfinished
    `tmp.*` folders left out), fsynced; return the entries of the files as they will lie at `rel`."""
    files = []
    for path in sorted(p for p in src.rglob("*") if p.is_file() and not p.is_symlink()):
        part = path.relative_to(src).as_posix()
        if any(seg.startswith("tmp.") for seg in part.split("/")):
            continue
        data = path.read_bytes()
        if is_group(part):
            data = portable_group(data, src, f"{rel}/{part}")
        out = dst / part
        out.parent.mkdir(parents=True, exist_ok=True)
        _write_synced(out, data)
        files.append(FileEntry(path=f"{rel}/{part}", size=len(data), sha256=sha256_file(out)))
    if not files:
        raise MlacError("the warm-up compiled no Triton kernel: nothing to store (is the device a GPU?)")
    return files


def with_cache(manifest: Manifest, cache: KernelCache, files: list[FileEntry]) -> Manifest:
    """The manifest with `cache` (and its files) in place of any earlier cache of the same key."""
    kept_files = [f for f in manifest.files if not f.path.startswith(f"{CACHE_DIR}/{cache.key}/")]
    caches = sorted([c for c in manifest.caches if c.key != cache.key] + [cache], key=lambda c: c.key)
    return manifest.model_copy(update={"files": kept_files + files, "caches": caches})


def commit(root: Path, manifest: Manifest, tmp: Path, key: str) -> None:
    """Write the new manifest aside, put the cache folder `tmp` in place of cache/<key>, then replace
    manifest.json and, last, manifest.sha256 (module docstring)."""
    pid = os.getpid()
    new_manifest, new_identity = root / f"{MANIFEST}.tmp-{pid}", root / f"{IDENTITY}.tmp-{pid}"
    try:
        text = manifest.to_json()
        _write_synced(new_manifest, text.encode())
        _write_synced(new_identity, identity_record(sha256_file(new_manifest)).encode())
        final = root / CACHE_DIR / key
        old = tmp_dir(final, pid)  # cache/.<key>.tmp-<pid>: a later prepare removes it if left
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        os.replace(new_manifest, root / MANIFEST)
        os.replace(new_identity, root / IDENTITY)
        _fsync_dir(root)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        new_manifest.unlink(missing_ok=True)
        new_identity.unlink(missing_ok=True)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
