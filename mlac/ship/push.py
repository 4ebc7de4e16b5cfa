"""`mlac push`: an artifact (with its signature and kernel-cache units), or one unit, to a registry.

    push(Path("out/"), parse("oci://registry:5000/deepseek/v3:r1"))
    push(Path("unit/"), parse("oci://registry:5000/deepseek/v3:r1"))   # a GPU job's unit, to that artifact

Each file is one blob, uploaded in parallel unless the registry holds it already (a second push
of the same artifact uploads nothing but manifests). The blob digests are the manifest's own
sha256 (the registry checks each upload against it: a file that changed since the compile is
refused there). The artifact is checked first as the loader would (sizes, headers, listing): a
folder that would not load is not pushed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from mlac.core.artifact import MANIFEST
from mlac.core.errors import MlacError
from mlac.core.files import FileEntry, verify_files
from mlac.core.signing import SIGNATURE, UNIT_SIGNATURE
from mlac.core.units import UNIT_MANIFEST, UnitManifest, load_unit
from mlac.core.validity import check_artifact
from mlac.ship import oci
from mlac.ship.reference import Reference
from mlac.ship.registry import Registry, canonical

THREADS = 4
Progress = Callable[[int], None]


@dataclass
class Pushed:
    """What a push did (`push --json`)."""

    reference: str
    digest: str  # of the OCI manifest pushed (the artifact's, or the unit's)
    identity: str  # of the artifact
    files: int = 0
    bytes: int = 0
    uploaded_blobs: int = 0
    uploaded_bytes: int = 0
    seconds: float = 0.0
    units: list[str] = field(default_factory=list)  # keys pushed
    signed: bool = False


def push_size(path: Path) -> int:
    """The bytes a push of `path` reads at most (for its progress)."""
    if (path / UNIT_MANIFEST).is_file() and not (path / MANIFEST).is_file():
        return load_unit(path).bytes
    checked = check_artifact(path, hashes=False)
    return sum(f.size for f in checked.manifest.files) + sum(u.bytes for u in checked.units.values())


def push(
    path: Path,
    ref: Reference,
    plain_http: bool = False,
    progress: Progress | None = None,
) -> Pushed:
    """Push the artifact or unit folder at `path` to `ref` (a tag); see the module docstring."""
    if ref.digest is not None:
        raise MlacError(f"{ref}: push to a tag (oci://HOST/REPO:TAG), not a digest")
    start = time.perf_counter()
    reg = Registry(ref, plain_http)
    if (path / UNIT_MANIFEST).is_file() and not (path / MANIFEST).is_file():
        done = push_unit_folder(reg, path, progress)
    else:
        done = push_artifact(reg, path, progress)
    done.seconds = time.perf_counter() - start
    return done


def push_artifact(reg: Registry, path: Path, progress: Progress | None) -> Pushed:
    checked = check_artifact(path, hashes=False)
    m = checked.manifest
    if not checked.whole:
        raise MlacError(f"{path}: holds ranks {checked.ranks} of {m.plan.world_size}; push a whole artifact")
    files = [_blob(f) for f in m.files]
    done = Pushed(str(reg.ref), "", checked.identity, len(files), sum(b.size for b in files))
    _upload(reg, path, files, done, progress)
    manifest_json = (path / MANIFEST).read_bytes()
    reg.push_blob(oci.digest_of(manifest_json), len(manifest_json), manifest_json)
    body = oci.artifact_manifest(manifest_json, files, checked.identity)
    done.digest = reg.put_manifest(reg.ref.target, body)
    subject = oci.subject_of(done.digest, len(canonical(body)))
    if (path / SIGNATURE).is_file():
        push_signature(reg, (path / SIGNATURE).read_bytes(), subject)
        done.signed = True
    for key, unit in checked.units.items():
        _push_unit(reg, path / "cache" / key, unit, subject, done, progress)
    return done


def push_unit_folder(reg: Registry, folder: Path, progress: Progress | None) -> Pushed:
    """A unit alone (`prepare --cache-out DIR`), to the artifact that `reg.ref` names: refused
    unless that artifact is the one the unit was compiled for."""
    unit = load_unit(folder)
    verify_files(folder, unit.files, hashes=False)
    base, digest = reg.get_manifest(reg.ref.target)
    if oci.kind_of(base) != "artifact":
        raise MlacError(f"{reg.ref}: not an mlac artifact; a unit is pushed to the artifact it belongs to")
    identity = base["config"]["digest"].removeprefix("sha256:")
    if identity != unit.base_identity:
        raise MlacError(
            f"{folder}: a kernel-cache unit of artifact {unit.base_identity[:16]}..., but {reg.ref} is artifact "
            f"{identity[:16]}...; push it to the artifact it was prepared for"
        )
    done = Pushed(str(reg.ref), "", identity)
    _push_unit(reg, folder, unit, oci.subject_of(digest, len(canonical(base))), done, progress)
    return done


def _push_unit(reg: Registry, folder: Path, unit: UnitManifest, subject: dict, done: Pushed,
               progress: Progress | None) -> None:  # fmt: skip
    files = [_blob(f) for f in unit.files]
    done.files += len(files)
    done.bytes += sum(b.size for b in files)
    _upload(reg, folder, files, done, progress)
    unit_json = (folder / UNIT_MANIFEST).read_bytes()
    reg.push_blob(oci.digest_of(unit_json), len(unit_json), unit_json)
    body = oci.unit_manifest(unit_json, files, unit.key, subject)
    digest = reg.put_manifest(oci.unit_tag(subject["digest"], unit.key), body)
    done.digest = done.digest or digest
    if (folder / UNIT_SIGNATURE).is_file():
        push_signature(
            reg, (folder / UNIT_SIGNATURE).read_bytes(), oci.subject_of(digest, len(canonical(body)))
        )
    done.units.append(unit.key)


def push_signature(reg: Registry, bundle: bytes, subject: dict) -> str:
    """A signature file as its own artifact, linked to the manifest it signs."""
    reg.push_blob(oci.EMPTY_CONFIG["digest"], oci.EMPTY_CONFIG["size"], oci.EMPTY_BYTES)
    reg.push_blob(oci.digest_of(bundle), len(bundle), bundle)
    return reg.put_manifest(oci.signature_tag(subject["digest"]), oci.signature_manifest(bundle, subject))


def _blob(f: FileEntry) -> oci.Blob:
    return oci.Blob(f.path, "sha256:" + f.sha256, f.size)


def _upload(
    reg: Registry, root: Path, files: list[oci.Blob], done: Pushed, progress: Progress | None
) -> None:
    """Upload the blobs the registry lacks, THREADS at a time (each digest once)."""
    unique = list({b.digest: b for b in files}.values())

    def one(b: oci.Blob) -> bool:
        sent = reg.push_blob(b.digest, b.size, root / b.path, progress)
        if not sent and progress is not None:
            progress(b.size)  # held already: done
        return sent

    with ThreadPoolExecutor(THREADS, thread_name_prefix="mlac-push") as pool:
        for b, sent in zip(unique, pool.map(one, unique), strict=True):
            done.uploaded_blobs += sent
            done.uploaded_bytes += b.size if sent else 0
