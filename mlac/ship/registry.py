"""The OCI distribution API, as push and pull use it, over oras-py's client.

oras-py brings the registry's authentication: credentials from the standard container-registry
config file (`~/.docker/config.json`, `$DOCKER_CONFIG/config.json` or `$REGISTRY_AUTH_FILE`, with
their credential helpers) and bearer-token exchanges. mlac adds what moving a model needs: blobs
streamed to and from disk (never whole in memory), each download checked against its digest as
it streams and resumed where an earlier one stopped, bounded retries, and one-line errors. A
username and password may also come from the settings MLAC_REGISTRY_USERNAME / MLAC_REGISTRY_PASSWORD.
Credentials are never printed. A registry without TLS is spoken to over plain HTTP with
`--plain-http`, or when MLAC_INSECURE_REGISTRIES names it (HOST:PORT, comma-separated).

Every failure of the registry or the network is a RegistryError (exit code 5); bytes that do not
match their digest are an IntegrityError (exit code 3).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlac import settings
from mlac.core.errors import IntegrityError, RegistryError
from mlac.ship.reference import Reference

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
ACCEPT = ", ".join([MANIFEST_TYPE, INDEX_TYPE, "application/vnd.docker.distribution.manifest.v2+json"])
CHUNK = 1 << 20
ATTEMPTS = 3  # connection errors and 5xx: tried again after 1 s, then 2 s; 4xx: not
TIMEOUT_S = (10, 300)  # connect, read (between bytes)

Progress = Callable[[int], None]


class Registry:
    """One repository of one registry. Thread-safe: each thread gets its own HTTP session."""

    def __init__(self, ref: Reference, plain_http: bool = False):
        self.ref = ref
        # docker's "insecure-registries": HOST[:PORT] names
        self.plain_http = plain_http or ref.registry in settings.INSECURE_REGISTRIES.get()
        self.base = f"{'http' if self.plain_http else 'https'}://{ref.registry}/v2/{ref.repository}"
        self._local = threading.local()

    # ---- the client of this thread ----------------------------------------------------------

    def _client(self):
        client = getattr(self._local, "client", None)
        if client is None:
            import oras.provider  # noqa: PLC0415 (requests, jsonschema: only for registry commands)

            client = oras.provider.Registry(hostname=self.ref.registry, insecure=self.plain_http)
            configs = [
                p for p in (_docker_config(), os.environ.get("REGISTRY_AUTH_FILE")) if p and Path(p).is_file()
            ]
            client.auth.load_configs(client.get_container(self.ref.repository), configs=configs or None)
            user, password = settings.REGISTRY_USERNAME.get(), settings.REGISTRY_PASSWORD.get()
            if user and password:
                client.auth.set_basic_auth(user, password)
            self._local.client = client
        return client

    def request(self, method: str, url: str, ok: tuple[int, ...] = (200,), **kw) -> Any:
        """One HTTP request through the client's auth, tried again on a connection error or a 5xx;
        RegistryError for any other status than `ok` (the registry's own message included)."""
        import requests  # noqa: PLC0415

        client, last = self._client(), None
        for attempt in range(ATTEMPTS):
            try:
                # oras's do_request handles auth; its own retry decorator waits up to minutes: bypassed
                r = type(client).do_request.__wrapped__(client, url, method, **kw)
            except requests.exceptions.ConnectionError as e:
                last = f"cannot reach {self.ref.registry} ({_reason(e)})"
            except requests.exceptions.Timeout:
                last = f"{self.ref.registry} did not answer in time"
            except ValueError as e:  # oras: "Cannot respond to request for authentication."
                raise RegistryError(
                    f"{self.ref.registry}: authentication failed ({e}); check the credentials"
                ) from None
            else:
                if r.status_code in ok:
                    return r
                last = f"{method} {_path(url)}: HTTP {r.status_code}{_oci_error(r)}"
                if r.status_code < 500:
                    break
                r.close()
            if attempt + 1 < ATTEMPTS:
                time.sleep(2**attempt)
        raise RegistryError(f"{self.ref.registry}: {last}")

    # ---- manifests and tags -----------------------------------------------------------------

    def get_manifest(self, target: str) -> tuple[dict, str]:
        """The manifest at a tag or digest, and its digest (checked when `target` is one)."""
        try:
            r = self.request("GET", f"{self.base}/manifests/{target}", headers={"Accept": ACCEPT})
        except RegistryError as e:
            if "HTTP 404" in str(e):
                raise RegistryError(
                    f"{self.ref.with_tag(target) if ':' not in target else self.ref.at(target)}: not found in the registry"
                ) from None
            raise
        raw = r.content
        digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        if target.startswith("sha256:") and digest != target:
            raise IntegrityError(f"{self.ref.at(target)}: the registry sent a manifest of digest {digest}")
        try:
            return json.loads(raw), digest
        except ValueError:
            raise RegistryError(f"{self.ref}: the registry sent a manifest that is not JSON") from None

    def put_manifest(self, target: str, manifest: dict) -> str:
        """Store `manifest` under a tag (or its digest); return its digest."""
        raw = canonical(manifest)
        self.request("PUT", f"{self.base}/manifests/{target}", ok=(201, 200),
                     data=raw, headers={"Content-Type": manifest.get("mediaType", MANIFEST_TYPE)})  # fmt: skip
        return "sha256:" + hashlib.sha256(raw).hexdigest()

    def tags(self) -> list[str]:
        """Every tag of the repository (the registry's pages followed)."""
        out, url = [], f"{self.base}/tags/list?n=1000"
        while url:
            r = self.request("GET", url)
            out += r.json().get("tags") or []
            link = r.links.get("next", {}).get("url")
            url = f"{self.base.split('/v2/')[0]}{link}" if link else None
        return out

    def referrers(self, digest: str) -> list[dict] | None:
        """The manifests whose `subject` is `digest` (the distribution spec's referrers API), or None
        where the registry does not have it (then a tag convention links them, oci.py)."""
        try:
            r = self.request("GET", f"{self.base}/referrers/{digest}", ok=(200, 404),
                             headers={"Accept": INDEX_TYPE})  # fmt: skip
        except RegistryError:
            return None
        if r.status_code == 404 or r.headers.get("Content-Type", "").split(";")[0] != INDEX_TYPE:
            return None
        return r.json().get("manifests") or []

    # ---- blobs ------------------------------------------------------------------------------

    def has_blob(self, digest: str) -> bool:
        return self.request("HEAD", f"{self.base}/blobs/{digest}", ok=(200, 404)).status_code == 200

    def push_blob(
        self, digest: str, size: int, source: Path | bytes, progress: Progress | None = None
    ) -> bool:
        """Upload a blob (a file streamed from disk, or bytes) unless the registry holds it; return
        whether it was uploaded. The registry checks the digest (a file that changed is refused)."""
        if self.has_blob(digest):
            return False
        r = self.request("POST", f"{self.base}/blobs/uploads/", ok=(202,), headers={"Content-Length": "0"})
        location = r.headers.get("Location", "")
        if not location.startswith("http"):
            location = f"{self.base.split('/v2/')[0]}{location}"
        url = f"{location}{'&' if '?' in location else '?'}digest={digest}"
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        if isinstance(source, bytes):
            self.request("PUT", url, ok=(201,), data=source, headers=headers)
        else:
            with open(source, "rb") as f:
                self.request("PUT", url, ok=(201,), data=_Counted(f, progress), headers=headers)
        return True

    def fetch_blob(self, digest: str, size: int, dest: Path, progress: Progress | None = None) -> int:
        """Download a blob to `dest` (atomically, through `dest`.part, resumed from the bytes an earlier
        try left there), checking its sha256 as it streams; return the bytes downloaded. IntegrityError
        when the bytes do not match (the partial file is removed)."""
        part = dest.with_name(dest.name + ".part")
        have = part.stat().st_size if part.is_file() else 0
        if have > size:
            part.unlink()
            have = 0
        h = hashlib.sha256()
        if have:
            with open(part, "rb") as f:
                while block := f.read(CHUNK * 16):
                    h.update(block)
            if progress is not None:
                progress(have)
        got = 0
        if have < size:
            headers = {"Range": f"bytes={have}-"} if have else {}
            r = self.request(
                "GET", f"{self.base}/blobs/{digest}", ok=(200, 206), headers=headers, stream=True
            )
            if r.status_code == 200 and have:  # no range support: start over
                have, h = 0, hashlib.sha256()
            with r, open(part, "ab" if have else "wb") as out:
                for block in r.iter_content(CHUNK):
                    out.write(block)
                    h.update(block)
                    got += len(block)
                    if progress is not None:
                        progress(len(block))
                out.flush()
                os.fsync(out.fileno())
        if have + got != size or "sha256:" + h.hexdigest() != digest:
            part.unlink(missing_ok=True)
            raise IntegrityError(
                f"{self.ref.at(digest)}: the registry sent {have + got} bytes of another digest than the blob's "
                f"({size} bytes); refused"
            )
        part.replace(dest)
        return got

    def fetch_bytes(self, digest: str, size: int, limit: int = 16 << 20) -> bytes:
        """A small blob (a manifest.json, a unit.json, a signature) in memory, checked."""
        if size > limit:
            raise RegistryError(f"{self.ref.at(digest)}: {size} bytes, more than a config blob may hold")
        data = self.request("GET", f"{self.base}/blobs/{digest}").content
        if len(data) != size or "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise IntegrityError(f"{self.ref.at(digest)}: the registry sent bytes of another digest; refused")
        return data


def canonical(manifest: dict) -> bytes:
    """A manifest's bytes as mlac pushes them: sorted keys, no spaces (the same digest every time)."""
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()


class _Counted:
    """A file object that reports the bytes read (requests streams it as the request body)."""

    def __init__(self, f, progress: Progress | None):
        self._f, self._progress = f, progress

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        if data and self._progress is not None:
            self._progress(len(data))
        return data

    def __getattr__(self, name):
        return getattr(self._f, name)


def _docker_config() -> str | None:
    folder = os.environ.get("DOCKER_CONFIG")
    return str(Path(folder) / "config.json") if folder else None


def _path(url: str) -> str:
    return "/" + url.split("/", 3)[-1] if "://" in url else url


def _reason(e: Exception) -> str:
    text = str(e)
    for key in ("Connection refused", "Name or service not known", "No route to host", "timed out"):
        if key in text:
            return key.lower()
    return type(e).__name__


def _oci_error(r) -> str:
    try:
        errors = r.json().get("errors") or []
        first = errors[0]
        return f" ({first.get('code')}: {first.get('message')})"
    except Exception:  # noqa: BLE001  (not an OCI error body)
        return ""
