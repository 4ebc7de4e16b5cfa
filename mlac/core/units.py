"""Kernel-cache units: one GPU target's compiled kernels, bound to one artifact identity.

`mlac prepare` compiles every Triton kernel the server meets on a GPU and stores Triton's cache
directory as a unit: a folder with its own small manifest (`unit.json`: the target signature, the
base artifact's identity, every file with its size and sha256) and the unit's identity
(`unit.sha256`, the sha256 of unit.json). A unit never changes the artifact it belongs to: it lies
beside the artifact's own files, under `cache/<key>/` (key: `target_key(signature)`), or in any
folder of its own (`prepare --cache-out DIR`), and travels as its own OCI artifact.

    cache/<key>/unit.json      UnitManifest (sorted keys, no timestamps)
    cache/<key>/unit.sha256    "<sha256 of unit.json>  unit.json"
    cache/<key>/triton/...     Triton's cache directory (group files with relative member paths)
    cache/<key>/flashinfer/... optional: FlashInfer's built MLA modules, as they lie in its JIT
                               workspace (`.cache/flashinfer/<version>/<arch>/cached_ops/<name>/<name>.so`),
                               for `--attention-backend flashinfer`; `flashinfer` names their version
    cache/<key>/unit.sig.json  its signature (optional; outside what it signs)

Artifacts of schema 1 and 2 listed a target's cache in the manifest itself (`Manifest.caches`,
`KernelCache` below): those still load.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from mlac.core.errors import IntegrityError, MlacError
from mlac.core.files import FileEntry, check_inside, sha256_file
from mlac.core.frozen import Frozen
from mlac.core.signing import UNIT_SIGNATURE


class TargetSignature(Frozen):
    """What a compiled kernel depends on: a kernel cache is used only where every field is equal."""

    gpu_name: str  # torch.cuda.get_device_properties().name, e.g. "NVIDIA H200"
    compute_capability: str  # "9.0"
    cuda: str | None  # torch.version.cuda
    driver: str | None  # the NVIDIA driver version (nvidia-smi), None where it could not be read
    torch: str  # without the local part ("2.11.0", not "2.11.0+cu130")
    triton: str | None

    def label(self) -> str:
        """A short name for messages: "sm90/NVIDIA H200/triton 3.6.0"."""
        return f"sm{self.compute_capability.replace('.', '')}/{self.gpu_name}/triton {self.triton}"


class KernelCache(Frozen):
    """One target's compile caches, added by `mlac prepare`: Triton's cache directory, stored under
    `path` (cache/<key>/triton); its files are listed (hashed) in Manifest.files like every file."""

    key: str  # target_key(signature): the folder name under cache/
    signature: TargetSignature
    path: str  # relative, POSIX: cache/<key>/triton
    files: int
    bytes: int


CACHE_DIR = "cache"


def target_key(sig: TargetSignature) -> str:
    """The folder name of a target's caches: "sm90-nvidia-h200-triton3.6.0-torch2.11.0-cu13.0"
    (lowercase letters, digits, dots and dashes). The driver is not in it: a target prepared again
    under another driver replaces its cache."""
    slug = lambda s: re.sub(r"[^a-z0-9.]+", "-", str(s).lower()).strip("-.") or "none"  # noqa: E731
    sm = sig.compute_capability.replace(".", "")
    return f"sm{slug(sm)}-{slug(sig.gpu_name)}-triton{slug(sig.triton)}-torch{slug(sig.torch)}-cu{slug(sig.cuda)}"


def cache_path(key: str) -> str:
    """Where a target's Triton cache lies in the artifact."""
    return f"{CACHE_DIR}/{key}/triton"


def signature_differences(cached: TargetSignature, here: TargetSignature) -> list[tuple[str, Any, Any]]:
    """(field, value in the cache, value here) for every field that differs, in field order."""
    fields = TargetSignature.model_fields
    return [
        (f, getattr(cached, f), getattr(here, f)) for f in fields if getattr(cached, f) != getattr(here, f)
    ]


# -- units ----------------------------------------------------------------------------------------

UNIT_MANIFEST = "unit.json"
UNIT_IDENTITY = "unit.sha256"
UNIT_SCHEMA_VERSION = 1
TRITON_DIR = "triton"
FLASHINFER_DIR = "flashinfer"


class UnitManifest(Frozen):
    """What a unit holds: `files` (paths relative to the unit folder) compiled for `signature`,
    for the artifact whose identity is `base_identity`: Triton's under triton/ and, where `flashinfer`
    names the FlashInfer version that built them, FlashInfer's modules under flashinfer/. A unit
    without FlashInfer's modules leaves the field out of its unit.json (the bytes an older mlac wrote)."""

    kind: Literal["mlac-kernel-cache"] = "mlac-kernel-cache"
    schema_version: Literal[1] = UNIT_SCHEMA_VERSION
    base_identity: str  # sha256 of the artifact's manifest.json
    key: str  # target_key(signature)
    signature: TargetSignature
    mlac_version: str
    files: list[FileEntry]
    flashinfer: str | None = None  # the version of FlashInfer that built the modules under flashinfer/

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    def files_under(self, folder: str) -> list[FileEntry]:
        """The files under `folder` (TRITON_DIR, FLASHINFER_DIR) of the unit."""
        return [f for f in self.files if f.path.startswith(folder + "/")]

    def to_json(self) -> str:
        record = self.model_dump(mode="json")
        if record["flashinfer"] is None:
            del record["flashinfer"]
        return json.dumps(record, indent=2, sort_keys=True) + "\n"


def unit_identity_record(identity: str) -> str:
    return f"{identity}  {UNIT_MANIFEST}\n"


def load_unit(folder: str | Path) -> UnitManifest:
    """Read and check a unit folder's manifest: valid, its identity recorded and matching, its paths
    inside the folder. MlacError for a folder that is not a unit, IntegrityError for a unit whose
    unit.json does not hash to unit.sha256. The files themselves are checked by whoever reads them."""
    folder = Path(folder)
    path = folder / UNIT_MANIFEST
    if not path.is_file() or path.is_symlink():
        raise MlacError(f"{folder}: not a kernel-cache unit ({UNIT_MANIFEST} not found)")
    try:
        unit = UnitManifest.model_validate(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise MlacError(f"{path}: invalid JSON ({type(e).__name__})") from None
    except ValidationError as e:
        err = e.errors()[0]
        raise MlacError(
            f"{path}: invalid unit manifest at {'.'.join(map(str, err['loc']))}: {err['msg']}"
        ) from None
    recorded = (folder / UNIT_IDENTITY).read_text() if (folder / UNIT_IDENTITY).is_file() else None
    identity = sha256_file(path)
    if recorded != unit_identity_record(identity):
        raise IntegrityError(f"{path}: does not match {UNIT_IDENTITY} (edited, corrupt or unfinished unit)")
    if unit.key != target_key(unit.signature) or not re.fullmatch(r"[a-z0-9][a-z0-9.-]*", unit.key):
        raise MlacError(f"{path}: key {unit.key!r} is not its signature's ({target_key(unit.signature)})")
    for f in unit.files:
        check_inside(f.path, path)
        if f.path in (UNIT_MANIFEST, UNIT_IDENTITY, UNIT_SIGNATURE):
            raise MlacError(f"{path}: lists its own {f.path}")
    return unit


def unit_identity(folder: str | Path) -> str:
    return sha256_file(Path(folder) / UNIT_MANIFEST)


def describe(unit: UnitManifest) -> dict[str, Any]:
    """The unit as `inspect --json` and `pull --json` show it."""
    shown = {"key": unit.key, "target": unit.signature.label(), "files": len(unit.files), "bytes": unit.bytes}
    return shown if unit.flashinfer is None else {**shown, "flashinfer": unit.flashinfer}
