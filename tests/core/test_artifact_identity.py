"""The artifact's identity: manifest.sha256 over the manifest (which lists every file's sha256),
checked by `verify` and at load; symlinks refused; an unfinished (tmp) artifact never verifies."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _cli import invoke, one_line_error
from _paths import REPO

from mlac.core.artifact import IDENTITY, MANIFEST, Manifest, check_identity
from mlac.core.errors import MlacError
from mlac.runtime.engine.engine import Engine
from mlac.runtime.worker.loader import load_artifact

LAYER = "rank-00000-of-00001/layer-00001.safetensors"


@pytest.fixture
def art(artifact, tmp_path) -> Path:
    """A private copy of a compiled tiny artifact, to damage."""
    return Path(shutil.copytree(artifact("tiny-v2-lite"), tmp_path / "art"))


def edit_model(root: Path, **changes) -> None:
    raw = json.loads((root / MANIFEST).read_text())
    raw["model"].update(changes)
    (root / MANIFEST).write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def test_compile_writes_the_identity_in_sha256sum_format(art):
    digest = hashlib.sha256((art / MANIFEST).read_bytes()).hexdigest()
    assert (art / IDENTITY).read_text() == f"{digest}  manifest.json\n"
    if shutil.which("sha256sum"):
        subprocess.run(["sha256sum", "--quiet", "-c", IDENTITY], cwd=art, check=True)
    assert check_identity(art, Manifest.load(art)) == digest


def test_verify_and_inspect_print_the_identity(art):
    digest = (art / IDENTITY).read_text()[:64]
    r = invoke("verify", art)
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("ok:") and r.stdout.strip().endswith(f"identity {digest}")
    r = invoke("inspect", art)
    assert r.exit_code == 0, r.output
    assert f"identity      {digest}\n" in r.stdout


@pytest.mark.parametrize("field, value", [("rope_theta", 20000.0), ("vocab_size", 4096)])
def test_an_edited_manifest_is_refused_by_verify_and_load(art, field, value):
    edit_model(art, **{field: value})
    Manifest.load(art)  # still a valid manifest: only the identity catches the edit
    one_line_error(
        invoke("verify", art), "manifest.json: sha256", "does not match manifest.sha256", "recompile", code=3
    )
    with pytest.raises(MlacError, match="does not match manifest.sha256.*recompile") as e:
        Engine.from_artifact(art, num_blocks=8)
    assert "\n" not in str(e.value)
    with pytest.raises(MlacError, match="does not match manifest.sha256"):
        load_artifact(art, verify=False)  # trusted storage skips file hashes, not the identity
    assert "MISMATCH" in invoke("inspect", art).stdout  # inspect shows it, to diagnose


def test_a_reformatted_manifest_is_an_edit_too(art):
    """The identity is the manifest's bytes: no canonicalisation that an edit could hide behind."""
    (art / MANIFEST).write_text(json.dumps(json.loads((art / MANIFEST).read_text())))
    one_line_error(invoke("verify", art), "does not match manifest.sha256", code=3)


def test_an_artifact_without_identity_is_refused_unless_unverified(art):
    (art / IDENTITY).unlink()
    one_line_error(invoke("verify", art), "manifest.sha256 not found", "unfinished", "recompile", code=3)
    with pytest.raises(MlacError, match="manifest.sha256 not found"):
        load_artifact(art)
    assert load_artifact(art, verify=False).tensors  # compile's own accuracy check loads it so
    assert "no manifest.sha256" in invoke("inspect", art).stdout


@pytest.mark.parametrize(
    "text", ["", "abc  manifest.json\n", "0" * 64 + "  other.json\n", "Z" * 64 + "  manifest.json\n"]
)
def test_a_malformed_identity_is_refused(art, text):
    (art / IDENTITY).write_text(text)
    one_line_error(invoke("verify", art), "manifest.sha256: malformed", code=3)


def test_a_file_replaced_by_a_symlink_to_an_identical_file_outside_is_refused(art, tmp_path):
    outside = tmp_path / "outside.safetensors"
    shutil.copyfile(art / LAYER, outside)
    (art / LAYER).unlink()
    (art / LAYER).symlink_to(outside)
    one_line_error(invoke("verify", art), "layer-00001.safetensors: is a symlink", code=3)
    with pytest.raises(MlacError, match="is a symlink"):
        load_artifact(art, verify=False)


def test_a_rank_folder_that_is_a_symlink_is_refused(art, tmp_path):
    rank = art / "rank-00000-of-00001"
    shutil.move(rank, tmp_path / "elsewhere")
    rank.symlink_to(tmp_path / "elsewhere")
    one_line_error(invoke("verify", art), "rank-00000-of-00001: is a symlink", code=3)
    with pytest.raises(MlacError, match="is a symlink"):
        Engine.from_artifact(art, num_blocks=8)


def test_a_symlinked_manifest_is_refused(art, tmp_path):
    shutil.move(art / MANIFEST, tmp_path / MANIFEST)
    (art / MANIFEST).symlink_to(tmp_path / MANIFEST)
    one_line_error(invoke("verify", art), "manifest.json: is a symlink", code=3)


def test_the_artifact_folder_itself_may_be_a_symlink(art, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(art)
    assert invoke("verify", link).exit_code == 0
    assert load_artifact(link).tensors


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"a":' * 100_000 + "1" + "}" * 100_000, "nested too deeply"),
        ("[1, 2]", "not a manifest (a JSON list"),
        ("42", "not a manifest (a JSON int"),
        ('"x"', "not a manifest (a JSON str"),
    ],
)
def test_a_hostile_manifest_is_a_one_line_error(art, text, needle):
    (art / MANIFEST).write_text(text)
    for command in ("verify", "inspect"):
        one_line_error(invoke(command, art), "manifest.json", needle)


KILLED_COMPILE = """
import os, signal, sys
import mlac.compiler.writer as w
from mlac.compiler.pipeline import compile_checkpoint
from mlac.core.artifact import CompileOptions
def killed(identity):  # SIGKILL after the manifest is written, before its identity
    os.kill(os.getpid(), signal.SIGKILL)
w.identity_record = killed
compile_checkpoint(sys.argv[1], sys.argv[2], CompileOptions(accuracy_check=False))
"""


def test_a_compile_killed_before_its_identity_leaves_a_folder_that_never_verifies(checkpoint, tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-c", KILLED_COMPILE, str(checkpoint("tiny-v2-lite")), str(out)]
    p = subprocess.Popen(args, env=env)
    p.wait()
    assert p.returncode == -9
    (tmp,) = [d for d in tmp_path.iterdir() if d.name.startswith(".out.tmp-")]
    assert tmp.name == f".out.tmp-{p.pid}" and (tmp / MANIFEST).is_file() and not out.exists()
    one_line_error(invoke("verify", tmp), "manifest.sha256 not found", "unfinished", code=3)
    r = invoke("compile", checkpoint("tiny-v2-lite"), out, "--skip-accuracy-check")
    assert r.exit_code == 0, r.output
    assert f"removed {tmp}: the temporary folder of a compile that no longer runs" in r.output
    assert sorted(d.name for d in tmp_path.iterdir()) == ["out"]
    assert invoke("verify", out).exit_code == 0
