"""Signatures over an artifact's identity, or a kernel-cache unit's, with OpenSSF model-signing.

    sign(folder, key_pem)                     # writes the folder's signature file
    check_signature(folder, public_key_pem)   # IntegrityError unless it verifies

The signature is a Sigstore bundle (model-signing's key mode: an elliptic-curve key, no network)
whose signed statement lists every file of the folder with its sha256: for an artifact,
manifest.json, manifest.sha256 and every file the manifest lists; for a unit, unit.json,
unit.sha256 and its files. Those digests are taken from the manifest, whose own digest is the
identity: nothing is hashed again to sign or to check a signature (`mlac verify` and the loader
check the files against the manifest). The signature file lies in the folder, outside what it
signs, and the statement names what a verifier must leave out (the signature file; for an
artifact, its kernel-cache units under cache/), so model-signing's own tool verifies it too,
re-hashing every file:

    model_signing verify key ART --signature ART/signature.sig.json --public_key pub.pem
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from mlac.core.errors import IntegrityError, MlacError

SIGNATURE = "signature.sig.json"  # an artifact's, beside its manifest.json
UNIT_SIGNATURE = "unit.sig.json"  # a unit's, beside its unit.json


@dataclass(frozen=True)
class Signed:
    """What one signature covers: `digests` (relative path -> sha256 hex) of `folder`, leaving out
    `ignored` (relative paths, files or folders) and the signature file `signature`."""

    folder: Path
    digests: dict[str, str]
    signature: str
    ignored: tuple[str, ...] = ()

    @property
    def signature_path(self) -> Path:
        return self.folder / self.signature


def _listed_manifest(signed: Signed):
    """model-signing's manifest of `signed`, from the digests as listed (no file is read)."""
    from model_signing import manifest  # noqa: PLC0415 (heavy: sigstore, protobuf)
    from model_signing._hashing.hashing import Digest  # noqa: PLC0415 (the digest type its manifests hold)

    items = [
        manifest.FileManifestItem(path=PurePosixPath(p), digest=Digest("sha256", bytes.fromhex(d)))
        for p, d in sorted(signed.digests.items())
    ]
    ignored = frozenset(Path(p) for p in (*signed.ignored, signed.signature))
    kind = manifest._FileSerialization("sha256", False, ignored)  # the "files" method, as hashing.Config
    return manifest.Manifest(signed.folder.name, items, kind)


def _listed_hashing(signed: Signed):
    """A hashing configuration whose `hash` returns the listed digests instead of reading files."""
    from model_signing import hashing  # noqa: PLC0415

    class Listed(hashing.Config):
        def hash(self, model_path, *, files_to_hash=None):
            return _listed_manifest(signed)

    return Listed()


def sign(signed: Signed, key: Path, password: str | None = None) -> Path:
    """Sign `signed` with the PEM private key `key` (elliptic curve: P-256, P-384 or P-521); write
    the signature file atomically and return its path. MlacError for a key that cannot be used."""
    from model_signing import signing  # noqa: PLC0415

    config = signing.Config().set_hashing_config(_listed_hashing(signed))
    try:
        config.use_elliptic_key_signer(private_key=key, password=password)
    except (OSError, ValueError, TypeError) as e:
        raise MlacError(
            f"--key {key}: not a usable elliptic-curve private key in PEM ({_first_line(e)})"
        ) from None
    tmp = signed.signature_path.with_name(signed.signature + ".tmp")
    try:
        config.sign(signed.folder, tmp)
        tmp.replace(signed.signature_path)
    finally:
        tmp.unlink(missing_ok=True)
    return signed.signature_path


def check_signature(signed: Signed, public_key: Path) -> None:
    """Raise IntegrityError unless `signed`'s signature file verifies with the PEM public key and
    lists exactly `signed.digests`; MlacError for a key that cannot be read."""
    from model_signing import verifying  # noqa: PLC0415

    path = signed.signature_path
    if not path.is_file() or path.is_symlink():
        raise IntegrityError(
            f"{signed.folder}: unsigned ({signed.signature} not found); sign it with `mlac sign`"
        )
    config = verifying.Config().set_hashing_config(_listed_hashing(signed))
    try:
        config.use_elliptic_key_verifier(public_key=public_key)
    except (OSError, ValueError, TypeError) as e:
        raise MlacError(
            f"{public_key}: not a usable elliptic-curve public key in PEM ({_first_line(e)})"
        ) from None
    try:
        config.verify(signed.folder, path)
    except Exception as e:  # noqa: BLE001  (model-signing raises ValueError, cryptography's, protobuf's)
        raise IntegrityError(f"{path}: the signature does not verify with {public_key} ({_why(e)})") from None


def signer_hint(signed: Signed) -> str | None:
    """The sha256 of the signing key's public key, as the signature file records it (None: none)."""
    try:
        bundle = json.loads(signed.signature_path.read_text())
        return bundle["verificationMaterial"]["publicKey"]["hint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _why(e: Exception) -> str:
    text = _first_line(e)
    if "Signature mismatch" in text:
        return "it signs other files or digests than these"
    if "Key mismatch" in text or type(e).__name__ == "InvalidSignature":
        return "signed with another key, or altered"
    return text or type(e).__name__


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
