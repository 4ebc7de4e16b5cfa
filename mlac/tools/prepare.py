"""`mlac prepare`: compile this GPU's kernels for an artifact, as a unit of their own.

On a GPU, the artifact's engine is built as the server builds it, from the same EngineOptions
(CUDA graphs captured for every decode bucket), and warmed up (Engine.warmup: the prefill and
decode shapes), with Triton's cache directory pointed at a fresh empty one: every kernel variant
the server meets is compiled there. That directory becomes a kernel-cache unit (core/units.py):
`triton/` with a `unit.json` that lists every file with its sha256, names the GPU's target
signature and binds the unit to the artifact's identity. The artifact itself is not changed: its
manifest, identity and signature stay as they were compiled. The unit goes to `cache/<key>/` inside
the artifact, or with `cache_out` to a folder of its own (a GPU job then publishes megabytes, not
the weights). Preparing a target again replaces its unit.

With the FlashInfer attention backend (`backends` holding "flashinfer"), FlashInfer's workspace
(FLASHINFER_WORKSPACE_BASE) points at a fresh empty folder too, and the MLA modules that FlashInfer
built there (JIT: nvcc and ninja, about 20 s each) are stored in the same unit under `flashinfer/`,
as they lie in that workspace, with the FlashInfer version in unit.json: a server started with that
backend loads them and builds nothing. One prepare may warm several backends in turn (each engine
built, warmed, freed), into the same caches: a unit for both serves either.

Atomic: the unit is built in a temporary folder beside its destination's parent (`.<name>.tmp-<pid>`,
outside the artifact), fsynced, then renamed into place (an older unit renamed aside first). A prepare
killed outright leaves that folder, which the next prepare to the same place removes once its
process is gone. NOTE: a kernel that this process compiled before `prepare` (held in Triton's memory)
is not written to the fresh directory: run prepare in a process that has run no Triton kernel (the
CLI does; `compile --prepare` compiles on the CPU first). The same holds for a FlashInfer module this
process loaded before.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from mlac.core.atomic import remove_stale_tmp, tmp_dir
from mlac.core.errors import MlacError
from mlac.core.files import FileEntry, sha256_file
from mlac.core.progress import Watch, human_bytes
from mlac.core.units import (
    CACHE_DIR,
    FLASHINFER_DIR,
    TRITON_DIR,
    UNIT_IDENTITY,
    UNIT_MANIFEST,
    UnitManifest,
    target_key,
    unit_identity,
    unit_identity_record,
)
from mlac.core.validity import check_artifact
from mlac.core.version import __version__
from mlac.kernels.attention.flashinfer_mla import WORKSPACE_ENV, point_flashinfer_at, workspace_modules
from mlac.runtime.engine.options import EngineOptions
from mlac.runtime.worker.backend_check import flashinfer_version
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
    cache_out: str | Path | None = None,
    progress_stream: TextIO | None = None,
    backends: Sequence[str] | None = None,
) -> tuple[UnitManifest, Path]:
    """Compile every kernel the server meets on `options.runtime.device` (default: the server's
    options on "cuda") for the artifact at `root` into a unit (module docstring) at `cache_out`,
    else at root/cache/<key>; return it and its folder. `backends`: the attention backends warmed, in
    turn (default: options.runtime.attention_backend's alone). MlacError: not an artifact, no GPU, a
    `cache_out` that holds something else than a unit, or a FlashInfer backend that built no module.
    While the kernels compile, a line on `progress_stream` (default stderr) at least every 10 s says
    how many files Triton has written."""
    root = Path(root)
    options = options or EngineOptions.of(device="cuda")
    backends = list(backends or [options.runtime.attention_backend])
    device = options.runtime.device
    identity = check_artifact(root, hashes=False).identity  # the weights are hashed as they load
    target = current_target(device)
    if target is None:
        raise MlacError(
            f"prepare needs a CUDA GPU (device {device!r}): the caches are compiled for the GPU it runs on"
        )
    key = target_key(target)
    dest = Path(cache_out) if cache_out is not None else root / CACHE_DIR / key
    check_destination(dest)
    spot = dest if cache_out is not None else root.parent / f"{root.name}.{key}"  # temporaries: beside it
    spot.parent.mkdir(parents=True, exist_ok=True)
    for stale in remove_stale_tmp(spot) + remove_stale_tmp(spot.with_name(spot.name + ".old")):
        log(f"removed {stale}: the temporary folder of a prepare that no longer runs")
    tmp = tmp_dir(spot, os.getpid())
    try:
        with (
            tempfile.TemporaryDirectory(prefix="mlac-prepare-") as compiled,
            tempfile.TemporaryDirectory(prefix="mlac-prepare-flashinfer-") as fi_built,
            triton_cache_dir(Path(compiled)),
            flashinfer_workspace(Path(fi_built)),
        ):
            for backend in backends:
                log(
                    f"compiling the kernels of {target.label()} (CUDA graphs, warm-up, {backend} attention) ..."
                )
                with Watch("compiling kernels", lambda: _compiled(Path(compiled)), stream=progress_stream):
                    (warm or warm_kernels)(root, Path(compiled), options.updated(attention_backend=backend))
            files = store_cache(Path(compiled), tmp / TRITON_DIR, TRITON_DIR)
            modules = store_modules(Path(fi_built), tmp / FLASHINFER_DIR) if "flashinfer" in backends else []
        unit = UnitManifest(base_identity=identity, key=key, signature=target, mlac_version=__version__,
                            files=files + modules, flashinfer=flashinfer_version() if modules else None)  # fmt: skip
        _write_synced(tmp / UNIT_MANIFEST, unit.to_json().encode())
        _write_synced(tmp / UNIT_IDENTITY, unit_identity_record(unit_identity(tmp)).encode())
        replace_folder(tmp, dest, spot)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"kernel cache {key}: {len(unit.files)} files, {unit.bytes / 1e6:.1f} MB in {dest}")
    return unit, dest


def _compiled(folder: Path) -> str:
    """How much Triton has written to its cache directory so far."""
    files = [p for p in folder.rglob("*") if p.is_file()]
    return f"{len(files)} cache files, {human_bytes(sum(p.stat().st_size for p in files))}"


def check_destination(dest: Path) -> None:
    """A unit's destination must be absent, an empty folder, or a unit (replaced)."""
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise MlacError(f"{dest}: exists and is not a folder; give --cache-out a new or empty folder")
    if dest.is_dir() and any(dest.iterdir()) and not (dest / UNIT_MANIFEST).is_file():
        raise MlacError(
            f"{dest}: exists and is not a kernel-cache unit; give --cache-out a new or empty folder"
        )


def replace_folder(tmp: Path, dest: Path, spot: Path) -> None:
    """Put the finished folder `tmp` at `dest`, an older `dest` renamed aside first and then removed."""
    old = tmp_dir(spot.with_name(spot.name + ".old"), os.getpid())
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists():
        dest.rename(old)
    tmp.rename(dest)
    _fsync_dir(dest.parent)
    shutil.rmtree(old, ignore_errors=True)


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


@contextmanager
def flashinfer_workspace(path: Path) -> Iterator[Path]:
    """FlashInfer's workspace is `path` inside the block; the environment is restored after (and an
    imported flashinfer pointed back at the workspace it had)."""
    before = os.environ.get(WORKSPACE_ENV)
    point_flashinfer_at(path)
    try:
        yield path
    finally:
        point_flashinfer_at(Path(before) if before is not None else Path.home())
        if before is None:
            os.environ.pop(WORKSPACE_ENV, None)


def store_modules(src: Path, dst: Path) -> list[FileEntry]:
    """Copy the modules FlashInfer built in its workspace `src` (workspace_modules: the libraries
    alone) to `dst`, fsynced; return their entries as they will lie under the unit's flashinfer/."""
    files = []
    for rel in workspace_modules(src):
        out = dst / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        _write_synced(out, (src / rel).read_bytes())
        files.append(
            FileEntry(path=f"{FLASHINFER_DIR}/{rel}", size=out.stat().st_size, sha256=sha256_file(out))
        )
    if not files:
        raise MlacError(
            "the flashinfer warm-up built no FlashInfer module: nothing to store (was one loaded in this "
            "process before prepare? run prepare in a fresh process)"
        )
    return files


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
