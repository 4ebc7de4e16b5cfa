"""`mlac pull`: an artifact from a registry into a folder: only the ranks and units asked for.

    pull(parse("oci://registry:5000/deepseek/v3:r1"), Path("out/"), ranks=[1], target="auto")

1. The artifact's OCI manifest, then its config blob: the manifest.json, whose digest is the
   artifact's identity. An OCI artifact that mlac did not push is refused here.
2. The files: every shared file (tokenizer, ...) and those of the ranks asked for (all by default;
   `node=(r, n)`: node r's share of n nodes), THREADS blobs at a time, each checked against its
   sha256 as it streams (registry.fetch_blob).
3. The kernel-cache unit of this GPU (`target="auto"`; "all": every unit; "none"), found by the
   referrers API or the tag convention (oci.py), checked to belong to this identity; and the
   signatures of the artifact and of the units pulled.
4. The folder is checked as the loader checks it (check_artifact: the bytes were hashed on the
   way) and renamed into place.

Everything is written in `.<name>.pull-<identity>` beside the destination, whose name does not
change between tries: a pull that was interrupted (killed, the network gone) resumes there, keeping
the files it finished and continuing a file where it stopped. Nothing appears at the destination
until the pull is complete. `blobs`: a content-addressed folder (`blobs/sha256/<hex>`) of files
pulled before, hard-linked instead of downloaded (store.py).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from mlac.core.artifact import IDENTITY, MANIFEST, Manifest, identity_record
from mlac.core.errors import IntegrityError, MlacError, RegistryError
from mlac.core.signing import SIGNATURE, UNIT_SIGNATURE
from mlac.core.units import UNIT_IDENTITY, UNIT_MANIFEST, UnitManifest, unit_identity_record
from mlac.core.validity import check_artifact
from mlac.ship import oci
from mlac.ship.reference import Reference
from mlac.ship.registry import Registry

THREADS = 4
Target = Literal["auto", "all", "none"]
Progress = Callable[[int], None]
Log = Callable[[str], None]


@dataclass
class Pulled:
    """What a pull did (`pull --json`)."""

    reference: str
    digest: str  # of the artifact's OCI manifest
    identity: str
    path: str
    ranks: list[int]
    files: int = 0
    bytes: int = 0
    downloaded_blobs: int = 0
    downloaded_bytes: int = 0
    reused_bytes: int = 0  # already complete from an earlier try, or linked from the blob store
    seconds: float = 0.0
    units: list[str] = field(default_factory=list)
    signed: bool = False
    fetched: list[str] = field(default_factory=list)  # blob digests downloaded

    @property
    def gb_per_s(self) -> float:
        return self.downloaded_bytes / 1e9 / max(self.seconds, 1e-9)


@dataclass(frozen=True)
class Remote:
    """The artifact as the registry holds it."""

    digest: str
    body: dict
    manifest_json: bytes
    manifest: Manifest

    @property
    def identity(self) -> str:
        return self.body["config"]["digest"].removeprefix("sha256:")


def resolve(reg: Registry) -> Remote:
    """The artifact at `reg.ref`: its OCI manifest and its mlac manifest, checked."""
    body, digest = reg.get_manifest(reg.ref.target)
    if oci.kind_of(body) != "artifact":
        raise MlacError(
            f"{reg.ref}: a {oci.kind_of(body)} of an mlac artifact, not an artifact; pull the artifact"
        )
    config = body["config"]
    manifest_json = reg.fetch_bytes(config["digest"], int(config["size"]))
    manifest = Manifest.from_bytes(manifest_json, str(reg.ref))
    layers = {b.path: b for b in oci.layers_of(body)}
    for f in manifest.files:
        b = layers.get(f.path)
        if b is None or b.digest != "sha256:" + f.sha256 or b.size != f.size:
            raise IntegrityError(f"{reg.ref}: its layers do not match its manifest at {f.path}; refused")
    return Remote(digest, body, manifest_json, manifest)


def node_ranks(world: int, node: tuple[int, int]) -> list[int]:
    """The ranks of node `r` of `n` (contiguous, as `serve --nnodes` places them)."""
    r, n = node
    if n < 1 or world % n or not 0 <= r < n:
        raise MlacError(
            f"--node-rank {r} --nnodes {n}: a {world}-rank artifact splits into whole nodes of equal size"
        )
    per = world // n
    return list(range(r * per, (r + 1) * per))


def pull(
    ref: Reference,
    dest: Path,
    ranks: list[int] | None = None,
    node: tuple[int, int] | None = None,
    target: Target = "auto",
    plain_http: bool = False,
    progress: Progress | None = None,
    grow: Progress | None = None,
    log: Log = lambda m: None,
    force: bool = False,
    blobs: Path | None = None,
    device: str = "cuda",
    remote: Remote | None = None,
) -> Pulled:
    """Pull `ref` into `dest` (module docstring). `progress(n)`: n more bytes done; `grow(n)`: the
    kernel-cache units' bytes, once found, beyond pull_size's files. MlacError for a `dest` that
    exists (without `force`) or ranks out of range; RegistryError for the registry; IntegrityError
    for bytes."""
    start, reg = time.perf_counter(), Registry(ref, plain_http)
    if dest.exists() and not force:
        raise MlacError(
            f"{dest}: exists; pull into a new folder, or pass --force to replace it once complete"
        )
    remote = remote or resolve(reg)
    m = remote.manifest
    world = m.plan.world_size
    chosen = node_ranks(world, node) if node else sorted(set(ranks)) if ranks else list(range(world))
    if any(not 0 <= r < world for r in chosen):
        raise MlacError(f"--ranks {','.join(map(str, chosen))}: the artifact has ranks 0..{world - 1}")
    stage = dest.parent / f".{dest.name}.pull-{remote.identity[:16]}"
    stage.mkdir(parents=True, exist_ok=True)
    done = Pulled(str(ref), remote.digest, remote.identity, str(dest), chosen)
    own = tuple(m.rank_dir(r) + "/" for r in chosen)
    files = [oci.Blob(f.path, "sha256:" + f.sha256, f.size) for f in m.files
             if f.path.startswith(own) or not f.path.startswith("rank-")]  # fmt: skip
    units = _units(reg, remote, target, device, log)
    if grow is not None:
        grow(sum(b.size for _, _, unit_blobs, _ in units for b in unit_blobs))
    _fetch(reg, stage, files, done, progress, blobs)
    for unit, raw, folder_blobs, unit_digest in units:
        key, folder = unit.key, stage / "cache" / unit.key
        _fetch(reg, folder, folder_blobs, done, progress, blobs)
        _write(folder / UNIT_MANIFEST, raw)
        _write(folder / UNIT_IDENTITY, unit_identity_record(oci.digest_of(raw)[7:]).encode())
        if _signature(reg, unit_digest, folder / UNIT_SIGNATURE):
            log(f"unit {key}: signed")
        done.units.append(key)
    done.signed = _signature(reg, remote.digest, stage / SIGNATURE)
    _write(stage / MANIFEST, remote.manifest_json)
    _write(stage / IDENTITY, identity_record(remote.identity).encode())
    check_artifact(stage, ranks=chosen, hashes=False)  # the bytes were checked as they streamed
    _install(stage, dest, force)
    done.seconds = time.perf_counter() - start
    return done


def pull_size(remote: Remote, ranks: list[int] | None) -> int:
    m = remote.manifest
    own = tuple(m.rank_dir(r) + "/" for r in (ranks if ranks is not None else range(m.plan.world_size)))
    return sum(f.size for f in m.files if f.path.startswith(own) or not f.path.startswith("rank-"))


# ---- files -----------------------------------------------------------------------------------------


def _fetch(reg: Registry, root: Path, files: list[oci.Blob], done: Pulled, progress: Progress | None,
           blobs: Path | None) -> None:  # fmt: skip
    """Every blob of `files` at root/path: kept if an earlier try finished it, linked from the blob
    store if it holds it, else downloaded (resumed); THREADS at a time."""
    done.files += len(files)
    done.bytes += sum(f.size for f in files)

    def one(b: oci.Blob) -> int:
        path = root / b.path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_file() and path.stat().st_size == b.size:  # finished by an earlier try, checked then
            return _reused(done, b, progress)
        stored = blobs / "sha256" / b.digest[7:] if blobs is not None else None
        if stored is not None and stored.is_file() and stored.stat().st_size == b.size:
            _link(stored, path)
            return _reused(done, b, progress)
        got = reg.fetch_blob(b.digest, b.size, path, progress)
        if stored is not None:
            stored.parent.mkdir(parents=True, exist_ok=True)
            _link(path, stored)
        done.downloaded_blobs += 1
        done.downloaded_bytes += got
        done.fetched.append(b.digest)
        return got

    with ThreadPoolExecutor(THREADS, thread_name_prefix="mlac-pull") as pool:
        list(pool.map(one, files))


def _reused(done: Pulled, b: oci.Blob, progress: Progress | None) -> int:
    done.reused_bytes += b.size
    if progress is not None:
        progress(b.size)
    return 0


def _link(src: Path, dst: Path) -> None:
    """dst as a hard link to src (a copy across file systems); an existing dst is left as it is."""
    if dst.exists():
        return
    tmp = dst.with_name(dst.name + f".link-{os.getpid()}")
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    tmp.replace(dst)


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_bytes(data)
    tmp.replace(path)


def _install(stage: Path, dest: Path, force: bool) -> None:
    """Rename the finished folder into place (an existing dest, with `force`, renamed aside first)."""
    old = dest.parent / f".{dest.name}.old-{os.getpid()}"
    if dest.exists():
        if not force:
            raise MlacError(f"{dest}: appeared while pulling; not replaced")
        dest.rename(old)
    stage.rename(dest)
    shutil.rmtree(old, ignore_errors=True)


# ---- units and signatures ------------------------------------------------------------------------


def _units(reg: Registry, remote: Remote, target: Target, device: str, log: Log):
    """(unit, its unit.json, its blobs, its manifest digest) of each unit to pull."""
    if target == "none":
        return []
    here = None
    if target == "auto":
        from mlac.runtime.worker.target import current_target  # noqa: PLC0415 (torch)

        here = current_target(device)
        if here is None:
            log("no CUDA GPU here: no kernel-cache unit pulled (--target all pulls every one)")
            return []
    out = []
    for unit, raw, blobs, digest in find_units(reg, remote):
        if here is None or unit.signature == here:
            out.append((unit, raw, blobs, digest))
    if here is not None and not out:
        log(
            f"no kernel-cache unit of this GPU ({here.label()}) in the registry: kernels compile on first use"
        )
    return out


def find_units(reg: Registry, remote: Remote) -> list[tuple[UnitManifest, bytes, list[oci.Blob], str]]:
    """The units pushed for this artifact: by the referrers API, else by their tags."""
    found = reg.referrers(remote.digest)
    if found is not None:
        targets = [d["digest"] for d in found if d.get("artifactType") == oci.UNIT_TYPE]
    else:
        prefix = oci.unit_tag_prefix(remote.digest)
        targets = [t for t in reg.tags() if t.startswith(prefix)]
    out = []
    for t in targets:
        body, digest = reg.get_manifest(t)
        if oci.kind_of(body) != "unit":
            continue
        config = body["config"]
        raw = reg.fetch_bytes(config["digest"], int(config["size"]))
        unit = UnitManifest.model_validate_json(raw)
        if unit.base_identity != remote.identity:
            raise IntegrityError(
                f"{reg.ref}: the unit at {t} belongs to artifact {unit.base_identity[:16]}..., not this one; refused"
            )
        out.append((unit, raw, oci.layers_of(body), digest))
    return out


def _signature(reg: Registry, digest: str, dest: Path) -> bool:
    """Write the signature of manifest `digest` to `dest`, if the registry holds one."""
    try:
        body, _ = reg.get_manifest(oci.signature_tag(digest))
    except RegistryError as e:
        if "not found" in str(e):
            return False
        raise
    if oci.kind_of(body) != "signature" or (body.get("subject") or {}).get("digest") != digest:
        raise IntegrityError(
            f"{reg.ref}: {oci.signature_tag(digest)} is not a signature of {digest}; refused"
        )
    layer = body["layers"][0]
    _write(dest, reg.fetch_bytes(layer["digest"], int(layer["size"])))
    return True
