"""An artifact, a kernel-cache unit and a signature as OCI artifacts (image manifests), and back.

    artifact   config: manifest.json (so the OCI config digest IS the artifact's identity)
               layers: every file the manifest lists, one blob each, its path in the layer's
                       `org.opencontainers.image.title` annotation (OCI digests are sha256: the
                       blob digests are the manifest's own file hashes)
    unit       config: unit.json; layers: the unit's files; subject: the artifact's OCI manifest
    signature  config: empty; one layer: the Sigstore bundle; subject: what it signs

A unit or a signature is linked to what it belongs to twice: by `subject` (the referrers API of
registries that have it) and by a tag (for those that do not, such as the CNCF distribution 2.x):

    sha256-<artifact manifest digest>.unit-<16 hex of sha256(key)>    a unit of that artifact
    sha256-<digest>.sig                                                the signature of that manifest

Manifests are written with sorted keys and no timestamps: the same artifact pushes to the same
digest every time.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import PurePosixPath

from mlac.core.errors import IntegrityError, MlacError

ARTIFACT_TYPE = "application/vnd.mlac.artifact.v1"
MANIFEST_CONFIG = "application/vnd.mlac.manifest.v1+json"
UNIT_TYPE = "application/vnd.mlac.unit.v1"
UNIT_CONFIG = "application/vnd.mlac.unit.v1+json"
SIGNATURE_TYPE = "application/vnd.mlac.signature.v1"
BUNDLE = "application/vnd.dev.sigstore.bundle.v0.3+json"
FILE = "application/vnd.mlac.file.v1"
EMPTY_CONFIG = {
    "mediaType": "application/vnd.oci.empty.v1+json",
    "digest": "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a",
    "size": 2,
}
EMPTY_BYTES = b"{}"
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
TITLE = "org.opencontainers.image.title"
IDENTITY_KEY = "dev.mlac.identity"
UNIT_KEY = "dev.mlac.unit.key"


@dataclass(frozen=True)
class Blob:
    """One layer: the file at `path` (relative, POSIX) with its digest and size."""

    path: str
    digest: str  # "sha256:<hex>"
    size: int

    def descriptor(self) -> dict:
        return {
            "mediaType": FILE,
            "digest": self.digest,
            "size": self.size,
            "annotations": {TITLE: self.path},
        }


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def descriptor(media_type: str, data: bytes) -> dict:
    return {"mediaType": media_type, "digest": digest_of(data), "size": len(data)}


def image_manifest(artifact_type: str, config: dict, layers: list[dict], annotations: dict,
                   subject: dict | None = None) -> dict:  # fmt: skip
    out = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "artifactType": artifact_type,
        "config": config,
        "layers": layers,
        "annotations": annotations,
    }
    if subject is not None:
        out["subject"] = subject
    return out


def artifact_manifest(manifest_json: bytes, files: list[Blob], identity: str) -> dict:
    """The OCI manifest of an artifact whose manifest.json is `manifest_json`."""
    layers = [b.descriptor() for b in sorted(files, key=lambda b: b.path)]
    return image_manifest(
        ARTIFACT_TYPE, descriptor(MANIFEST_CONFIG, manifest_json), layers, {IDENTITY_KEY: identity}
    )


def unit_manifest(unit_json: bytes, files: list[Blob], key: str, subject: dict) -> dict:
    layers = [b.descriptor() for b in sorted(files, key=lambda b: b.path)]
    return image_manifest(UNIT_TYPE, descriptor(UNIT_CONFIG, unit_json), layers, {UNIT_KEY: key}, subject)


def signature_manifest(bundle: bytes, subject: dict) -> dict:
    return image_manifest(SIGNATURE_TYPE, EMPTY_CONFIG, [descriptor(BUNDLE, bundle)], {}, subject)


def subject_of(manifest_digest: str, size: int) -> dict:
    return {"mediaType": MANIFEST_TYPE, "digest": manifest_digest, "size": size}


def kind_of(oci: dict) -> str:
    """artifact, unit or signature; MlacError for an OCI artifact that mlac did not make."""
    config = (oci.get("config") or {}).get("mediaType")
    kinds = {MANIFEST_CONFIG: "artifact", UNIT_CONFIG: "unit"}
    if oci.get("artifactType") == SIGNATURE_TYPE:
        return "signature"
    if config not in kinds:
        what = oci.get("artifactType") or config or oci.get("mediaType") or "unknown"
        raise MlacError(f"not an mlac artifact (its type is {what!r}); push one with `mlac push`")
    return kinds[config]


def layers_of(oci: dict) -> list[Blob]:
    """The files of an artifact or unit manifest, their paths checked to stay inside the folder."""
    out = []
    for layer in oci.get("layers") or []:
        path = (layer.get("annotations") or {}).get(TITLE)
        p = PurePosixPath(path or "")
        if not path or p.is_absolute() or ".." in p.parts or "\\" in path:
            raise IntegrityError(
                f"layer {layer.get('digest')}: file path {path!r} leaves the folder; refused"
            )
        out.append(Blob(path, layer["digest"], int(layer["size"])))
    return out


def unit_tag(artifact_digest: str, key: str) -> str:
    return f"{unit_tag_prefix(artifact_digest)}{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def unit_tag_prefix(artifact_digest: str) -> str:
    return f"sha256-{artifact_digest.removeprefix('sha256:')}.unit-"


def signature_tag(digest: str) -> str:
    return f"sha256-{digest.removeprefix('sha256:')}.sig"
