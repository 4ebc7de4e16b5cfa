"""Bad inputs of `mlac generate` / `mlac serve`: a port out of range, an unknown or
unavailable device, a corrupt tokenizer file, a missing rank folder. Each is one `error: ...`
line (a usage error for a port), no traceback from any process, nothing written or deleted."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _paths import REPO
from click.testing import CliRunner
from test_bad_input import assert_clean_error

from mlac.cli import main
from mlac.compiler.pipeline import compile_checkpoint
from mlac.core.artifact import CompileOptions
from mlac.core.errors import MlacError
from mlac.runtime.worker.device import check_device

ROOT = REPO


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def run_cli(*args: str):
    return CliRunner().invoke(main, list(args))


def run_process(*args: str) -> subprocess.CompletedProcess:
    """The CLI in a fresh process, so that what spawned ranks print is seen too."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "mlac.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("port", ["99999", "0", "-1"])
def test_port_out_of_range_is_a_usage_error(port, tmp_path):
    result = run_cli("serve", str(tmp_path / "out"), "--port", port)
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--port'" in result.output and "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize(
    "device,cuda,needle",
    [
        ("gpu", False, "unknown device 'gpu'"),
        ("cpu:0", False, "unknown device 'cpu:0'"),
        ("cuda", False, "CUDA is not available"),
        ("cuda:1", True, "has 1 GPU(s)"),
    ],
)
def test_bad_device_is_one_clean_line(command, device, cuda, needle, artifact, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1 if cuda else 0)
    path = artifact("tiny-v2-lite")
    before = snapshot(path)
    args = ["--prompt", "hi"] if command == "generate" else []
    assert_clean_error(run_cli(command, str(path), "--device", device, *args), needle)
    assert snapshot(path) == before


def test_check_device_accepts_what_the_machine_has(monkeypatch):
    assert check_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [check_device(d) for d in ("cuda", "cuda:0", "cuda:1")] == ["cuda", "cuda:0", "cuda:1"]
    for bad in ("cuda:2", "CUDA", "cuda:", "cuda:-1", "mps", ""):
        with pytest.raises(MlacError):
            check_device(bad)


@pytest.fixture(scope="module")
def broken_tokenizer(checkpoint, tmp_path_factory):
    """broken_tokenizer(file) -> an artifact compiled from a checkpoint whose `file` is corrupt
    (valid hashes: the file is corrupt at the source)."""

    def make(file: str) -> Path:
        work = tmp_path_factory.mktemp("tok")
        ckpt = work / "ckpt"
        shutil.copytree(checkpoint("tiny-v2-lite"), ckpt)
        (ckpt / file).write_text('{"version": "1.0", "model": {')
        compile_checkpoint(ckpt, work / "out", CompileOptions(accuracy_check=False))
        return work / "out"

    return make


@pytest.mark.parametrize("file", ["tokenizer.json", "tokenizer_config.json"])
def test_corrupt_tokenizer_at_generate(file, broken_tokenizer):
    path = broken_tokenizer(file)
    before = snapshot(path)
    last = assert_clean_error(run_cli("generate", str(path), "--prompt", "hi"), f"tokenizer/{file}")
    assert "corrupt" in last or "invalid JSON" in last
    assert snapshot(path) == before


@pytest.fixture(scope="module")
def tp2_artifact(checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tp2") / "out"
    compile_checkpoint(checkpoint("tiny-v2-lite"), out, CompileOptions(tp=2, accuracy_check=False))
    return out


def assert_one_line(proc: subprocess.CompletedProcess, *needles: str, code: int = 1) -> None:
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_missing_rank_folder_is_one_line_from_one_process(tp2_artifact, tmp_path):
    path = tmp_path / "out"
    shutil.copytree(tp2_artifact, path)
    shutil.rmtree(path / "rank-00001-of-00002")
    before = snapshot(path)
    proc = run_process("generate", str(path), "--prompt", "hi", "--max-tokens", "1")
    assert_one_line(proc, "rank folder rank-00001-of-00002/ is missing", code=3)
    assert snapshot(path) == before


def test_a_follower_rank_error_has_no_traceback(tp2_artifact, tmp_path):
    """Rank 1 finds its file corrupt (same size, other bytes): rank 0 prints the error, once."""
    path = tmp_path / "out"
    shutil.copytree(tp2_artifact, path)
    head = path / "rank-00001-of-00002" / "head.safetensors"
    data = bytearray(head.read_bytes())
    data[-1] ^= 1
    head.write_bytes(bytes(data))
    before = snapshot(path)
    proc = run_process("generate", str(path), "--prompt", "hi", "--max-tokens", "1")
    assert_one_line(proc, "rank 1 failed", "head.safetensors: sha256 does not match")
    assert snapshot(path) == before


@pytest.mark.parametrize(
    "text,needle",
    [
        ("{not json", "not a JSON file"),
        ("[1, 2]", "a JSON schema is an object, not a list"),
        (
            '{"type": "object", "properties": {"a": {"type": "nope"}}}',
            "--json-schema",
        ),  # llguidance refuses it
    ],
)
def test_a_bad_json_schema_file_is_one_line_naming_the_flag(text, needle, artifact, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(text, encoding="utf-8")
    before = snapshot(tmp_path)
    result = run_cli("generate", str(artifact("tiny-v3")), "--prompt", "hi", "--device", "cpu",
                     "--json-schema", str(schema))  # fmt: skip
    last = assert_clean_error(result, needle, str(schema))
    assert "response_format" not in last
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("command", ["serve", "generate"])
@pytest.mark.parametrize("value, needle", [('{"temperature": -1}', "temperature=-1: must be >= 0"),
                                           ('{"top_p": 0}', "top_p=0: must be in (0, 1]")])  # fmt: skip
def test_a_generation_config_that_sampling_refuses_is_refused_at_start(
    command, value, needle, artifact, tmp_path
):
    """Not a server that starts and then answers every request that leaves sampling out with a 400
    about a field its client never sent: one line naming the file and the field, before serving."""
    (tmp_path / "generation_config.json").write_text(value)
    before = snapshot(tmp_path)
    with socket.socket() as busy:  # were it not refused first, serve would stop at this busy port
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        args = ["--prompt", "hi"] if command == "generate" else ["--port", str(busy.getsockname()[1])]
        result = run_cli(command, str(artifact("tiny-v3")), "--generation-config", str(tmp_path), *args)
    assert_clean_error(result, f"{tmp_path / 'generation_config.json'}: {needle}")
    assert snapshot(tmp_path) == before
