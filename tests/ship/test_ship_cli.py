"""The shipping story through the CLI, each step its own process, against a real registry:
compile tiny-v3 --tp 2 -> sign -> push -> pull rank 1 only -> a full pull verified with the public key
-> serve oci://... -> one chat request; and the refusals: a wrong key, a foreign reference."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from _paths import REPO

from mlac.core.artifact import Manifest

ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def mlac(*args, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "mlac.cli", *map(str, args)], env=ENV, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    assert not check or proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc


def keypair(folder: Path, name: str) -> tuple[Path, Path]:
    key, pub = folder / f"{name}.pem", folder / f"{name}.pub"
    subprocess.run(
        ["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", key], check=True
    )
    subprocess.run(["openssl", "ec", "-in", key, "-pubout", "-out", pub], check=True, capture_output=True)
    return key, pub


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def shipped(checkpoint, tmp_path_factory):
    """tiny-v3 compiled --tp 2 --fp8 and signed, through the CLI."""
    work = tmp_path_factory.mktemp("ship-cli")
    art = work / "art"
    record = json.loads(mlac("compile", "--tp", "2", "--fp8", "--skip-accuracy-check", "--json",
                             "--source-repo", "deepseek-ai/DeepSeek-V3", "--source-revision", "abc123",
                             checkpoint("tiny-v3"), art).stdout)  # fmt: skip
    assert record["ranks"] == 2 and record["provenance"]["repo"] == "deepseek-ai/DeepSeek-V3"
    key, pub = keypair(work, "key")
    mlac("sign", art, "--key", key)
    return work, art, key, pub, record["identity"]


def test_sign_push_pull_a_rank_verify_and_serve(shipped, registry, tmp_path):
    work, art, key, pub, identity = shipped
    ref = registry.ref("mlac/tiny-v3:r1")
    pushed = json.loads(mlac("push", "--json", "--plain-http", art, ref).stdout)
    assert pushed["identity"] == identity and pushed["signed"] and pushed["uploaded_blobs"] == pushed["files"]

    # a node that runs rank 1 pulls rank 1 only: rank 0's weights are never asked of the registry
    m = Manifest.load(art)
    rank0 = {"sha256:" + f.sha256 for f in m.files if f.path.startswith(m.rank_dir(0) + "/")}
    before = len(registry.requests("GET", "blobs"))
    one = json.loads(mlac("pull", "--json", "--plain-http", "--ranks", "1", ref, tmp_path / "rank1").stdout)
    fetched = {uri.rsplit("/", 1)[1] for uri in registry.requests("GET", "blobs")[before:]}
    assert one["ranks"] == [1] and not fetched & rank0 and len(one["fetched"]) == one["files"]
    assert "ranks 1 of 2" in mlac("verify", tmp_path / "rank1").stdout

    # the whole artifact, checked byte by byte and against the signer's public key
    mlac("pull", "--plain-http", ref, tmp_path / "whole")
    verified = json.loads(mlac("verify", "--json", "--public-key", pub, tmp_path / "whole").stdout)
    assert verified["identity"] == identity and verified["signature_verified"] and verified["ranks"] == [0, 1]
    provenance = json.loads(mlac("inspect", "--json", tmp_path / "whole").stdout)["provenance"]
    assert provenance["revision"] == "abc123" and provenance["files"]

    # serve straight from the registry, the signature required; one chat request
    port = free_port()
    cmd = [sys.executable, "-m", "mlac.cli", "serve", ref, "--plain-http", "--download-dir", tmp_path / "store",
           "--require-signature", pub, "--device", "cpu", "--dtype", "float32", "--num-blocks", "64",
           "--port", str(port), "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(list(map(str, cmd)), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no /health 200"
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        name = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert (tmp_path / "store" / "artifacts" / identity).is_dir()


def test_serve_with_the_wrong_key_refuses_before_loading(shipped, registry, tmp_path):
    work, art, key, pub, identity = shipped
    ref = registry.ref("mlac/tiny-v3:r2")
    mlac("push", "--plain-http", art, ref)
    _, other = keypair(tmp_path, "other")
    start = time.monotonic()
    proc = mlac("serve", ref, "--plain-http", "--download-dir", tmp_path / "store", "--require-signature", other,
                "--device", "cpu", "--port", free_port(), check=False)  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "signature does not verify" in lines[0]
    assert "load" not in proc.stderr.lower().replace("download", "")  # refused before any weight loads
    assert time.monotonic() - start < 120
    unsigned = tmp_path / "unsigned"
    mlac("pull", "--plain-http", ref, unsigned)
    (unsigned / "signature.sig.json").unlink()
    refused = mlac("generate", unsigned, "--prompt", "hi", "--require-signature", pub, check=False)
    assert refused.returncode == 3 and "unsigned" in refused.stderr


@pytest.mark.parametrize(
    "args, code, needle",
    [
        (["pull", "s3://bucket/model", "out"], 1, "unknown scheme 's3://'"),
        (["pull", "--plain-http", "oci://127.0.0.1:9/mlac/x:1", "out"], 5, "cannot reach 127.0.0.1:9"),
        (["push", "--plain-http", "art", "oci://127.0.0.1:9/mlac/x:1"], 5, "cannot reach 127.0.0.1:9"),
        (["serve", "gs://bucket/model"], 1, "unknown scheme 'gs://'"),
    ],
)
def test_bad_references_and_unreachable_registries_are_one_line(shipped, tmp_path, args, code, needle):
    work, art, *_ = shipped
    args = [str(art) if a == "art" else str(tmp_path / a) if a == "out" else a for a in args]
    proc = mlac(*args, check=False, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == code and lines[-1].startswith("error: ") and needle in lines[-1], proc.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_a_missing_tag_and_a_wrong_unit_are_one_line(shipped, registry, tmp_path):
    work, art, *_ = shipped
    proc = mlac("pull", "--plain-http", registry.ref("mlac/tiny-v3:nope"), tmp_path / "out", check=False)
    assert proc.returncode == 5 and "not found in the registry" in proc.stderr
    assert not (tmp_path / "out").exists()
