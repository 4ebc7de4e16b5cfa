"""A registry reference: `oci://HOST[:PORT]/REPO[:TAG]` or `oci://HOST[:PORT]/REPO@sha256:HEX`.

The repository follows the OCI distribution spec's grammar (lowercase path components), the tag
its 128-character rule; a reference without tag or digest means the tag `latest`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mlac.core.errors import MlacError

SCHEME = "oci://"
REPO = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*")
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
HOST = re.compile(r"[A-Za-z0-9.-]+(?::[0-9]{1,5})?|\[[0-9a-fA-F:]+\](?::[0-9]{1,5})?")


@dataclass(frozen=True)
class Reference:
    registry: str  # host[:port]
    repository: str
    tag: str | None = None
    digest: str | None = None  # "sha256:<hex>"

    @property
    def target(self) -> str:
        """What the manifest URL names: the digest if given, else the tag."""
        return self.digest or self.tag or "latest"

    def with_tag(self, tag: str) -> Reference:
        return Reference(self.registry, self.repository, tag)

    def at(self, digest: str) -> Reference:
        return Reference(self.registry, self.repository, None, digest)

    def __str__(self) -> str:
        end = f"@{self.digest}" if self.digest else f":{self.tag or 'latest'}"
        return f"{SCHEME}{self.registry}/{self.repository}{end}"


def is_reference(text: str | object) -> bool:
    """Whether a command argument names a registry artifact rather than a folder."""
    return isinstance(text, str) and "://" in text


def parse(text: str) -> Reference:
    """Parse a reference; MlacError naming what is wrong (scheme, host, repository, tag, digest)."""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme != SCHEME[:-3]:
        raise MlacError(
            f"{text!r}: unknown scheme {scheme + '://' if sep else ''!r}; want oci://HOST[:PORT]/REPO:TAG"
        )
    host, slash, path = rest.partition("/")
    if not slash or not path:
        raise MlacError(f"{text!r}: no repository; want oci://HOST[:PORT]/REPO[:TAG]")
    if not HOST.fullmatch(host):
        raise MlacError(f"{text!r}: {host!r} is not a registry host[:port]")
    digest = tag = None
    if "@" in path:
        path, digest = path.split("@", 1)
        if not DIGEST.fullmatch(digest):
            raise MlacError(f"{text!r}: digest {digest!r} is not sha256:<64 hex digits>")
    elif ":" in path.rsplit("/", 1)[-1]:
        path, tag = path.rsplit(":", 1)
        if not TAG.fullmatch(tag):
            raise MlacError(
                f"{text!r}: tag {tag!r} is not a valid tag (letters, digits, '_', '.', '-'; 128 at most)"
            )
    if not REPO.fullmatch(path):
        raise MlacError(
            f"{text!r}: repository {path!r} is not valid (lowercase letters, digits, '.', '_', '-', '/')"
        )
    return Reference(host, path, tag if digest is None else None, digest)
