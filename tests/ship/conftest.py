"""A real OCI registry for the ship tests: the CNCF distribution registry (Debian's `docker-registry`,
which .ci/run installs), on a free port of 127.0.0.1, storing in a temporary folder.

Without the binary the tests skip, except where MLAC_REQUIRE_REGISTRY=1 (CI sets it): there a
missing registry is a failure, not a skip.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

BINARY = "docker-registry"


@dataclass
class LocalRegistry:
    host: str  # 127.0.0.1:PORT
    storage: Path
    log: Path

    def ref(self, repo_tag: str) -> str:
        return f"oci://{self.host}/{repo_tag}"

    def requests(self, method: str, kind: str) -> list[str]:
        """The URIs of the requests the registry logged (e.g. GET of /blobs/)."""
        out = []
        for line in self.log.read_text().splitlines():
            if '"' in line and f'"{method} /v2/' in line and f"/{kind}/" in line:
                out.append(line.split('"')[1].split()[1])
        return out

    def blob_file(self, digest: str) -> Path:
        hexd = digest.removeprefix("sha256:")
        return self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def registry(tmp_path):
    if shutil.which(BINARY) is None:
        if os.environ.get("MLAC_REQUIRE_REGISTRY") == "1":
            pytest.fail(f"{BINARY} not found (apt-get install docker-registry)")
        pytest.skip(f"{BINARY} not installed (apt-get install docker-registry)")
    port = _free_port()
    storage, log = tmp_path / "registry", tmp_path / "registry.log"
    config = tmp_path / "registry.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: info\n  accesslog:\n    disabled: false\n"
        f"storage:\n  filesystem:\n    rootdirectory: {storage}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    with open(log, "w") as out:
        proc = subprocess.Popen([BINARY, "serve", str(config)], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"{BINARY} did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)
    yield LocalRegistry(f"127.0.0.1:{port}", storage, log)
    proc.terminate()
    proc.wait(timeout=10)
