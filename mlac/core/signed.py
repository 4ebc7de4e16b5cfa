"""What a signature covers: an artifact's files and digests, or a kernel-cache unit's (core/signing.py
signs and checks them). Imports no torch: `serve --require-signature` checks before anything loads."""

from __future__ import annotations

import hashlib
from pathlib import Path

from mlac.core.artifact import IDENTITY, MANIFEST, Manifest, check_identity, identity_record
from mlac.core.signing import SIGNATURE, UNIT_SIGNATURE, Signed, check_signature
from mlac.core.units import (
    CACHE_DIR,
    UNIT_IDENTITY,
    UNIT_MANIFEST,
    UnitManifest,
    unit_identity,
    unit_identity_record,
)


def artifact_signed(root: Path, manifest: Manifest, identity: str) -> Signed:
    """The artifact's signed digests: its manifest, identity and every listed file. Units are signed
    apart (they come later, from GPU jobs): a schema-3 signature leaves cache/ out."""
    digests = {MANIFEST: identity, IDENTITY: _sha256(identity_record(identity))}
    digests |= {f.path: f.sha256 for f in manifest.files}
    ignored = (CACHE_DIR,) if manifest.schema_version >= 3 else ()
    return Signed(root, digests, SIGNATURE, ignored)


def unit_signed(folder: Path, unit: UnitManifest) -> Signed:
    """A unit's signed digests: unit.json, unit.sha256 and its files."""
    identity = unit_identity(folder)
    digests = {UNIT_MANIFEST: identity, UNIT_IDENTITY: _sha256(unit_identity_record(identity))}
    digests |= {f.path: f.sha256 for f in unit.files}
    return Signed(folder, digests, UNIT_SIGNATURE)


def check_artifact_signature(root: str | Path, public_key: Path) -> str:
    """The artifact's identity, once its manifest matches it and its signature verifies with
    `public_key` (IntegrityError otherwise); its files are the loader's and verify's to check."""
    root = Path(root)
    manifest = Manifest.load(root)
    identity = check_identity(root, manifest)
    check_signature(artifact_signed(root, manifest, identity), public_key)
    return identity


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
