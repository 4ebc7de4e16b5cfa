"""What a valid artifact is: the one check that `mlac verify`, the loader, `pull` and `serve` share.

    checked = check_artifact(root, hashes=True)               # mlac verify
    checked = check_artifact(root, ranks=[r], hashes=False)   # the loader of rank r (it hashes as it reads)

An artifact folder holds exactly:
    manifest.json, manifest.sha256     the manifest, and its identity (the sha256 of its bytes)
    every file the manifest lists      with its size and sha256 (pieces), tensor files holding exactly
                                       the tensors the manifest says, with their dtypes and shapes
    signature.sig.json                 optional: a signature over the identity (core/signing.py)
    cache/<key>/                       optional kernel-cache units, each bound to this identity
                                       (core/units.py), with its own files listed and hashed
Anything else, anywhere in the folder, is refused: the runtime reads no file that the identity does
not cover (tokenizer, chat templates, generation config and kernel caches included).

A rank folder may be absent as a whole (a node that pulled only its own ranks: `mlac pull
--ranks`); the shared files never. A present rank folder must be complete.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from mlac.core.artifact import IDENTITY, MANIFEST, Manifest, TensorEntry, check_identity
from mlac.core.errors import IntegrityError, MlacError
from mlac.core.files import FileEntry, check_no_symlinks, verify_files
from mlac.core.safetensors_io import SafetensorsFile, dtype_name
from mlac.core.signed import artifact_signed
from mlac.core.signing import SIGNATURE, UNIT_SIGNATURE, check_signature
from mlac.core.units import (
    CACHE_DIR,
    UNIT_IDENTITY,
    UNIT_MANIFEST,
    UnitManifest,
    load_unit,
)

Progress = Callable[[int], None]


@dataclass
class ArtifactCheck:
    """What check_artifact found: the identity, the ranks present, the units, the parsed headers of
    the tensor files it checked (rel -> header, for the loader), and whether a signature verified."""

    root: Path
    manifest: Manifest
    identity: str
    ranks: list[int]  # the rank folders present (all of them for a whole artifact)
    units: dict[str, UnitManifest] = field(default_factory=dict)  # key -> unit
    headers: dict[str, SafetensorsFile] = field(default_factory=dict)
    signed_by: Path | None = None  # the public key the signature verified with

    @property
    def whole(self) -> bool:
        return len(self.ranks) == self.manifest.plan.world_size

    def files(self) -> list[FileEntry]:
        """The listed files of the present ranks and the shared files."""
        return present_files(self.manifest, self.ranks)


def check_artifact(
    root: str | Path,
    *,
    ranks: Iterable[int] | None = None,
    hashes: bool = True,
    identity_required: bool | None = None,
    public_key: Path | None = None,
    progress: Progress | None = None,
    threads: int | None = None,
) -> ArtifactCheck:
    """Check the artifact at `root` as the module docstring says; raise on the first problem.

    `ranks`: the ranks that must be present (default: every rank folder that is). `hashes`: also
    the sha256 of every file checked, and of every unit's files (the tamper check), with `progress`
    called with the bytes hashed; without, only what costs no reading of the data (the loader hashes
    what it reads). `identity_required` (default: `hashes`): refuse a folder without manifest.sha256
    (an unfinished compile); a compile checking its own unfinished artifact passes False.
    `public_key`: the signature must verify with it. IntegrityError for a file that
    is missing, of another size or other bytes, an unlisted file, a unit of another artifact, a
    signature that does not verify; MlacError for a manifest that is not one."""
    root = Path(root)
    manifest = Manifest.load(root)
    identity = check_identity(
        root, manifest, required=hashes if identity_required is None else identity_required
    )
    check_tensor_files_listed(manifest)
    present = present_ranks(root, manifest, ranks)
    units = {key: _check_unit(folder, identity) for key, folder in unit_folders(root).items()}
    check_listing(root, manifest, units)
    files = present_files(manifest, present)
    verify_files(root, files, hashes=False)  # present, with their sizes: before any header is parsed
    headers = {
        rel: checked_header(root, rel, entries) for rel, entries in tensor_files(manifest, present).items()
    }
    unit_files = [
        f.model_copy(update={"path": f"{CACHE_DIR}/{key}/{f.path}"})
        for key, u in units.items()
        for f in u.files
    ]
    verify_files(root, unit_files, hashes=False)
    if hashes:
        verify_files(root, files + unit_files, progress=progress, threads=threads)
    check = ArtifactCheck(root, manifest, identity, present, units, headers)
    if public_key is not None:
        check_signature(artifact_signed(root, manifest, identity), public_key)
        check.signed_by = public_key
    return check


def verify_bytes(root: str | Path) -> int:
    """The bytes check_artifact(root, hashes=True) reads: the present ranks' and shared files, and
    every unit's (for its progress). Cheap: the manifests and folder listings only."""
    root = Path(root)
    m = Manifest.load(root)
    ranks = [r for r in range(m.plan.world_size) if (root / m.rank_dir(r)).is_dir()]
    units = sum(load_unit(folder).bytes for folder in unit_folders(root).values())
    return sum(f.size for f in present_files(m, ranks)) + units


# ---- the parts, each usable alone ----------------------------------------------------------------


def present_ranks(root: Path, manifest: Manifest, required: Iterable[int] | None) -> list[int]:
    """The ranks whose folder is present; every one of `required` must be."""
    world = manifest.plan.world_size
    present = [r for r in range(world) if (root / manifest.rank_dir(r)).is_dir()]
    for r in required if required is not None else ():
        if not 0 <= r < world:
            raise MlacError(f"{root}: rank {r} out of range (the artifact has {world} rank(s))")
        if r not in present:
            raise IntegrityError(f"{manifest.rank_dir(r)}: missing from the artifact (rank {r})")
    if not present:
        raise IntegrityError(f"{root}: holds no rank folder ({manifest.rank_dir(0)}, ...)")
    return present


def present_files(manifest: Manifest, ranks: Iterable[int]) -> list[FileEntry]:
    """The manifest's files of `ranks` and every file outside the rank folders (tokenizer, ...)."""
    own = tuple(manifest.rank_dir(r) + "/" for r in ranks)
    return [f for f in manifest.files if f.path.startswith(own) or not f.path.startswith("rank-")]


def tensor_files(manifest: Manifest, ranks: Iterable[int]) -> dict[str, dict[str, TensorEntry]]:
    """rel -> {tensor name -> entry} of the tensor files of `ranks`, sorted by file."""
    by_file: dict[str, dict[str, TensorEntry]] = {}
    for r in ranks:
        for name, entry in manifest.tensors[r].items():
            by_file.setdefault(entry.file, {})[name] = entry
    return dict(sorted(by_file.items()))


def check_tensor_files_listed(manifest: Manifest) -> None:
    """Every file that holds tensors of rank r is listed (hashed), inside rank r's folder."""
    listed = {f.path for f in manifest.files}
    for r, tensors in enumerate(manifest.tensors):
        own = manifest.rank_dir(r) + "/"
        for rel in sorted({e.file for e in tensors.values()}):
            if rel not in listed or not rel.startswith(own):
                raise IntegrityError(
                    f"{rel}: holds tensors of rank {r} but is not listed (hashed) in the manifest's files of "
                    f"{own.rstrip('/')}; the manifest is inconsistent"
                )


def checked_header(root: Path, rel: str, entries: dict[str, TensorEntry]) -> SafetensorsFile:
    """The file's safetensors header, holding exactly the manifest's tensors with their dtypes and shapes."""
    header = SafetensorsFile(root / rel)
    names = set(header.tensors)
    for name in sorted(names - entries.keys()):
        raise IntegrityError(f"{rel}: extra tensor {name!r} not in the manifest")
    for name in sorted(entries.keys() - names):
        raise IntegrityError(f"{rel}: tensor {name!r} listed in the manifest is missing from the file")
    for name, entry in sorted(entries.items()):
        info = header.tensors[name]
        got_dtype, got_shape = dtype_name(info.dtype), list(info.shape)
        if got_dtype != entry.dtype or got_shape != entry.shape:
            raise IntegrityError(
                f"{rel}: tensor {name!r} is {got_dtype}{got_shape}, the manifest says {entry.dtype}{entry.shape}"
            )
    return header


def unit_folders(root: Path) -> dict[str, Path]:
    """key -> folder of every unit under cache/ (a folder with a unit.json)."""
    cache = root / CACHE_DIR
    if not cache.is_dir() or cache.is_symlink():
        return {}
    return {p.name: p for p in sorted(cache.iterdir()) if (p / UNIT_MANIFEST).exists()}


def _check_unit(folder: Path, identity: str) -> UnitManifest:
    check_no_symlinks(folder, [UNIT_MANIFEST, UNIT_IDENTITY])
    unit = load_unit(folder)
    if folder.name != unit.key:
        raise IntegrityError(f"{folder}: holds the unit of {unit.key}; its folder must be named so")
    if unit.base_identity != identity:
        raise IntegrityError(
            f"{folder}: a kernel-cache unit of artifact {unit.base_identity[:16]}..., not of this one "
            f"({identity[:16]}...); remove it"
        )
    check_no_symlinks(folder, [f.path for f in unit.files])
    return unit


def check_listing(root: Path, manifest: Manifest, units: dict[str, UnitManifest]) -> None:
    """Refuse any file in the folder that is neither listed, nor the manifest, its identity or
    signature, nor part of a unit (its manifest, identity, signature and listed files)."""
    allowed = {MANIFEST, IDENTITY, SIGNATURE} | {f.path for f in manifest.files}
    for key, unit in units.items():
        base = f"{CACHE_DIR}/{key}/"
        allowed |= {base + UNIT_MANIFEST, base + UNIT_IDENTITY, base + UNIT_SIGNATURE}
        allowed |= {base + f.path for f in unit.files}
    check_no_symlinks(root, sorted(allowed & set(_walk(root))))
    for rel in _walk(root):
        if rel not in allowed:
            raise IntegrityError(
                f"{rel}: not part of the artifact (not listed in its manifest, nor in a unit's); the runtime "
                "reads no file its identity does not cover: remove it, or recompile"
            )


def _walk(root: Path) -> list[str]:
    """Every file and symlink under `root` (relative POSIX paths), symlinked folders not followed."""
    out = []
    for p in sorted(root.rglob("*")):
        if p.is_symlink() or p.is_file():
            out.append(p.relative_to(root).as_posix())
    return out
