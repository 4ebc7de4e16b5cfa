"""The artifact: deterministic, hashed, atomic, inspectable, verifiable, schema-checked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlac.artifact import Manifest, manifest_json_schema
from mlac.cli import main

SCHEMA = Path(__file__).parent.parent / "artifacts" / "manifest.schema.json"


def invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_manifest_schema_is_current():
    """artifacts/manifest.schema.json must be regenerated when the Manifest changes:
    python -c "from mlac.artifact import manifest_json_schema as s; print(s(), end='')" > artifacts/manifest.schema.json"""
    assert SCHEMA.read_text() == manifest_json_schema()


@pytest.mark.parametrize("fp8", [False, True])
def test_compiling_twice_gives_identical_bytes(checkpoint, tmp_path, fp8):
    flags = ["--fp8"] if fp8 else []
    for out in ("a", "b"):
        r = invoke("compile", checkpoint("tiny-v3"), tmp_path / out, *flags)
        assert r.exit_code == 0, r.output
    assert tree_bytes(tmp_path / "a") == tree_bytes(tmp_path / "b")


def test_manifest_records_files_tensors_and_source(artifact, checkpoint):
    root = artifact("tiny-v3", fp8=True)
    m = Manifest.load(root)
    on_disk = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} - {"manifest.json"}
    assert {f.path for f in m.files} == on_disk
    assert {"tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"} <= on_disk
    assert m.quantization.scheme == "fp8-block" and m.quantization.kept_source_blocks
    assert m.source.mtp_layers == [m.model.num_hidden_layers] and m.source.mtp_tensors > 0
    names = set(m.tensors[0])
    assert not any(".experts." in n or "mtp" in n for n in names)
    assert {"embed", "head", "norm", "layers.1.moe.w13", "layers.1.moe.w13.scale", "layers.1.attn.w_kc"} <= names
    assert m.tensors[0]["layers.1.attn.w_kc"].dtype == "BF16"  # absorbed weights are not FP8
    assert [p.name for p in m.passes] == ["read", "rope", "fuse", "absorb", "fp8"]


def test_verify_and_inspect(artifact, tmp_path):
    root = artifact("tiny-v2")
    r = invoke("verify", root)
    assert r.exit_code == 0 and r.stdout.startswith("ok:"), r.output
    r = invoke("inspect", root)
    assert r.exit_code == 0, r.output
    for needle in ("deepseek_v2", "group_limited_greedy", "passes", "rank-00000-of-00001", "accuracy"):
        assert needle in r.output
    r = invoke("inspect", root, "--json")
    assert json.loads(r.output)["schema_version"] == 1


def test_verify_names_the_tampered_file(artifact, tmp_path):
    root = tmp_path / "art"
    shutil.copytree(artifact("tiny-v2-lite"), root)
    victim = root / "rank-00000-of-00001" / "layer-00001.safetensors"
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    r = invoke("verify", root)
    assert r.exit_code == 1
    assert r.output.strip().splitlines()[-1] == (
        "error: rank-00000-of-00001/layer-00001.safetensors: sha256 does not match the manifest (file modified or corrupt)"
    )


def test_manifest_paths_cannot_escape(artifact, tmp_path):
    root = tmp_path / "art"
    shutil.copytree(artifact("tiny-v2-lite"), root)
    raw = json.loads((root / "manifest.json").read_text())
    raw["files"][0]["path"] = "../../etc/passwd"
    (root / "manifest.json").write_text(json.dumps(raw))
    r = invoke("verify", root)
    assert r.exit_code == 1 and "leaves the artifact directory" in r.output


def test_force_replaces_only_after_success(checkpoint, tmp_path):
    out = tmp_path / "out"
    assert invoke("compile", checkpoint("tiny-v2-lite"), out, "--skip-accuracy-check").exit_code == 0
    first = tree_bytes(out)
    r = invoke("compile", checkpoint("tiny-v2-lite"), out, "--fp8", "--force", "--skip-accuracy-check")
    assert r.exit_code == 0, r.output
    assert tree_bytes(out) != first
    assert Manifest.load(out).options.fp8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
