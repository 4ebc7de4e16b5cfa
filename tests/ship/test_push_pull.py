"""push and pull through a real OCI registry (tests/ship/conftest.py): only the ranks and units asked
for, every blob checked as it streams, resumed after a kill, atomic; units and signatures travel."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _paths import REPO

import mlac.runtime.worker.kernel_cache as kc
import mlac.runtime.worker.target as target_mod
import mlac.tools.prepare as prep
from mlac.compiler.pipeline import compile_checkpoint
from mlac.core.artifact import CompileOptions, Manifest, artifact_identity
from mlac.core.errors import IntegrityError, MlacError, RegistryError
from mlac.core.progress import Progress
from mlac.core.signed import artifact_signed
from mlac.core.signing import SIGNATURE
from mlac.core.units import TargetSignature
from mlac.core.validity import check_artifact
from mlac.ship import oci
from mlac.ship.pull import pull, pull_size, resolve
from mlac.ship.push import push
from mlac.ship.reference import parse
from mlac.ship.registry import Registry
from mlac.ship.store import local_artifact

SIG = TargetSignature(gpu_name="NVIDIA H200", compute_capability="9.0", cuda="13.0", driver="580.65.06",
                      torch="2.11.0", triton="3.6.0")  # fmt: skip


@pytest.fixture(scope="module")
def tp2(checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ship") / "tiny-v3-tp2"
    compile_checkpoint(checkpoint("tiny-v3"), out, CompileOptions(tp=2, fp8=True, accuracy_check=False))
    return out


@pytest.fixture
def art(tp2, tmp_path) -> Path:
    return Path(shutil.copytree(tp2, tmp_path / "art"))


def rank_digests(root: Path, rank: int) -> set[str]:
    m = Manifest.load(root)
    return {"sha256:" + f.sha256 for f in m.files if f.path.startswith(m.rank_dir(rank) + "/")}


def test_pull_of_one_rank_fetches_only_its_blobs_and_verifies(art, registry, tmp_path):
    ref = parse(registry.ref("mlac/tiny:v1"))
    pushed = push(art, ref, plain_http=True)
    assert pushed.identity == artifact_identity(art) and pushed.uploaded_blobs == pushed.files
    assert push(art, ref, plain_http=True).uploaded_blobs == 0  # the registry holds every blob
    before = len(registry.requests("GET", "blobs"))
    got = pull(ref, tmp_path / "rank1", ranks=[1], plain_http=True)
    fetched = {uri.rsplit("/", 1)[1] for uri in registry.requests("GET", "blobs")[before:]}
    assert got.ranks == [1] and not (tmp_path / "rank1" / "rank-00000-of-00002").exists()
    assert not fetched & rank_digests(art, 0)  # rank 0's weights: never asked for
    assert rank_digests(art, 1) <= fetched and set(got.fetched) <= fetched
    checked = check_artifact(tmp_path / "rank1")
    assert checked.ranks == [1] and checked.identity == pushed.identity
    whole = pull(ref, tmp_path / "whole", plain_http=True)
    assert check_artifact(tmp_path / "whole").whole and whole.identity == pushed.identity
    assert (tmp_path / "whole" / "manifest.json").read_bytes() == (art / "manifest.json").read_bytes()
    assert not list(tmp_path.glob(".*"))  # no staging folder left


def test_a_blob_replaced_in_the_registry_is_refused_and_nothing_is_written(art, registry, tmp_path):
    ref = parse(registry.ref("mlac/tiny:v1"))
    push(art, ref, plain_http=True)
    victim = next(iter(rank_digests(art, 1)))
    data = registry.blob_file(victim)
    data.write_bytes(bytes(b ^ 0xFF for b in data.read_bytes()))  # same size, other bytes
    with pytest.raises(IntegrityError, match="another digest"):
        pull(ref, tmp_path / "out", plain_http=True)
    assert not (tmp_path / "out").exists()


def test_a_killed_pull_resumes_and_completes(art, registry, tmp_path):
    """A pull in its own process, slowed to stream, is killed (SIGKILL) once it has written part of a
    file; a second pull finishes it, reusing the finished files and the partial one."""
    ref = registry.ref("mlac/tiny:v1")
    push(art, parse(ref), plain_http=True)
    dest = tmp_path / "out"
    script = (
        "import sys, time\n"
        "import mlac.ship.registry as r\n"
        "r.CHUNK = 1 << 14\n"
        "from mlac.ship.pull import pull\n"
        "from mlac.ship.reference import parse\n"
        "from pathlib import Path\n"
        "pull(parse(sys.argv[1]), Path(sys.argv[2]), plain_http=True, progress=lambda n: time.sleep(0.005))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, ref, str(dest)], env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    stage = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        parts = [p for p in tmp_path.glob(".out.pull-*/**/*.part") if p.stat().st_size > 0]
        if parts and any(not p.name.endswith(".part") for p in tmp_path.glob(".out.pull-*/rank-*/*")):
            stage = parts[0]
            break
        time.sleep(0.01)
    assert stage is not None, "the pull finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not dest.exists()  # nothing half-written at the destination
    finished = [p for p in tmp_path.glob(".out.pull-*/rank-*/*") if not p.name.endswith(".part")]
    finished = {"sha256:" + hashlib.sha256(p.read_bytes()).hexdigest() for p in finished}
    done = pull(parse(ref), dest, plain_http=True)
    assert done.reused_bytes > 0 and done.downloaded_bytes < done.bytes
    ranges = [
        line for line in registry.log.read_text().splitlines()[-200:] if "206" in line and "/blobs/" in line
    ]
    assert ranges, "the partial file was not resumed with a range request"
    # each file finished before the kill was fetched once, by the first pull: the second reused it. (The
    # registry logs a request when it ends, and the killed pull's streams end a little later: counting
    # all of the second pull's requests would race with those lines.)
    fetched = registry.requests("GET", "blobs")
    assert finished and all(sum(uri.endswith(d) for uri in fetched) == 1 for d in finished), (
        finished,
        fetched,
    )
    assert check_artifact(dest).whole


def test_units_and_signatures_travel_with_the_artifact(art, registry, tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "current_target", lambda device="cuda": SIG)
    monkeypatch.setattr(kc, "current_target", lambda device="cuda": SIG)
    monkeypatch.setattr(target_mod, "current_target", lambda device="cuda": SIG)  # pull's --target auto

    def warm(root, cache_dir, options):
        (cache_dir / "K").mkdir()
        (cache_dir / "K" / "k.cubin").write_bytes(b"\x7fELF")

    keys = tmp_path / "keys"
    keys.mkdir()
    for name in ("key", "other"):
        subprocess.run(
            ["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", keys / f"{name}.pem"],
            check=True,
        )
        subprocess.run(["openssl", "ec", "-in", keys / f"{name}.pem", "-pubout", "-out", keys / f"{name}.pub"], check=True,
                       capture_output=True)  # fmt: skip
    from mlac.core.signing import sign

    sign(artifact_signed(art, Manifest.load(art), artifact_identity(art)), keys / "key.pem")
    unit, _ = prep.prepare(art, warm=warm, cache_out=tmp_path / "unit")
    ref = parse(registry.ref("mlac/tiny:v2"))
    push(art, ref, plain_http=True)
    pushed_unit = push(tmp_path / "unit", ref, plain_http=True)  # a GPU job's unit, to its artifact
    assert pushed_unit.units == [unit.key]
    none = pull(ref, tmp_path / "none", target="none", plain_http=True)
    assert none.units == [] and none.signed and (tmp_path / "none" / SIGNATURE).is_file()
    remote = resolve(Registry(ref, plain_http=True))
    with Progress(pull_size(remote, None), "pulling", stream=io.StringIO()) as bar:
        auto = pull(ref, tmp_path / "auto", target="auto", plain_http=True, device="cuda",  # "on" the H200 of SIG
                    progress=bar.update, grow=bar.grow, remote=remote)  # fmt: skip
    assert auto.units == [unit.key]
    assert (
        bar.done == bar.total == auto.bytes > pull_size(remote, None)
    )  # the unit's bytes counted in the total
    checked = check_artifact(tmp_path / "auto", public_key=keys / "key.pub")
    assert checked.units[unit.key] == unit and checked.signed_by == keys / "key.pub"
    with pytest.raises(IntegrityError, match="does not verify"):
        check_artifact(tmp_path / "auto", public_key=keys / "other.pub")
    other = Path(shutil.copytree(art, tmp_path / "other"))
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["target"] = "another"
    (other / "manifest.json").write_text(json.dumps(manifest))
    (other / "manifest.sha256").write_text(f"{artifact_identity(other)}  manifest.json\n")
    (other / SIGNATURE).unlink()
    push(other, parse(registry.ref("mlac/other:v1")), plain_http=True)
    with pytest.raises(
        MlacError, match="a kernel-cache unit of artifact .* push it to the artifact it was prepared for"
    ):
        push(tmp_path / "unit", parse(registry.ref("mlac/other:v1")), plain_http=True)


def test_an_oci_artifact_that_mlac_did_not_push_is_refused(registry, tmp_path):
    reg = Registry(parse(registry.ref("someone/else:v1")), plain_http=True)
    config = b'{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}'
    reg.push_blob(oci.digest_of(config), len(config), config)
    body = {"schemaVersion": 2, "mediaType": oci.MANIFEST_TYPE, "layers": [],
            "config": oci.descriptor("application/vnd.oci.image.config.v1+json", config)}  # fmt: skip
    reg.put_manifest("v1", body)
    with pytest.raises(MlacError, match="not an mlac artifact"):
        pull(parse(registry.ref("someone/else:v1")), tmp_path / "out", plain_http=True)
    assert not (tmp_path / "out").exists()


def test_registry_errors_are_one_line_and_fast(registry, tmp_path, art):
    start = time.monotonic()
    with pytest.raises(RegistryError, match="not found in the registry"):
        pull(parse(registry.ref("mlac/tiny:missing")), tmp_path / "out", plain_http=True)
    with pytest.raises(RegistryError, match="cannot reach 127.0.0.1:9"):
        pull(parse("oci://127.0.0.1:9/mlac/tiny:v1"), tmp_path / "out", plain_http=True)
    assert time.monotonic() - start < 15 and not (tmp_path / "out").exists()
    with pytest.raises(MlacError, match="push to a tag"):
        push(art, parse(registry.ref("mlac/tiny@sha256:" + "0" * 64)), plain_http=True)


def test_the_store_pulls_once_and_a_second_start_downloads_nothing(art, registry, tmp_path):
    ref = registry.ref("mlac/tiny:v1")
    push(art, parse(ref), plain_http=True)
    first = local_artifact(ref, tmp_path / "store", plain_http=True, target="none")
    assert first == tmp_path / "store" / "artifacts" / artifact_identity(art)
    before = len(registry.requests("GET", "blobs"))
    assert local_artifact(ref, tmp_path / "store", plain_http=True, target="none") == first
    assert len(registry.requests("GET", "blobs")) == before  # a manifest request, no blob
    assert check_artifact(first).whole
