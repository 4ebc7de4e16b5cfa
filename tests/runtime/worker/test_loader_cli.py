"""`--no-verify` on `generate` and `serve`: trusted storage, sizes only."""

from __future__ import annotations

import shutil
from pathlib import Path

from _cli import invoke

HELP = "trusted storage: check sizes only, skip sha256"


def test_generate_no_verify_skips_the_hash_but_not_the_size(artifact, tmp_path):
    root = Path(shutil.copytree(artifact("tiny-v3"), tmp_path / "a"))
    path = root / "rank-00000-of-00001" / "head.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # same size, different bytes
    path.write_bytes(bytes(data))
    args = ("generate", root, "--prompt", "hi", "--max-tokens", "1", "--dtype", "float32")
    r = invoke(*args)
    assert r.exit_code != 0 and "head.safetensors: sha256 does not match" in r.output
    r = invoke(*args, "--no-verify")
    assert r.exit_code == 0, r.output
    path.write_bytes(bytes(data[:-1]))
    r = invoke(*args, "--no-verify")
    assert r.exit_code != 0 and "head.safetensors: size" in r.output


def test_serve_and_generate_document_no_verify():
    for command in ("serve", "generate"):
        r = invoke(command, "--help")
        assert "--no-verify" in r.output and HELP in " ".join(r.output.split())
