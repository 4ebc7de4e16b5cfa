"""The artifact: deterministic, hashed, atomic, inspectable, verifiable, schema-checked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from _cli import invoke
from _paths import REPO

from mlac.core.artifact import Manifest, manifest_json_schema

SCHEMA = REPO / "artifacts" / "manifest.schema.json"


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_manifest_schema_is_current():
    """artifacts/manifest.schema.json must be regenerated when the Manifest changes:
    python -c "from mlac.core.artifact import manifest_json_schema as s; print(s(), end='')" > artifacts/manifest.schema.json"""
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
    on_disk = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} - {
        "manifest.json",
        "manifest.sha256",
    }
    assert {f.path for f in m.files} == on_disk
    assert {"tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"} <= on_disk
    assert m.quantization.scheme == "fp8-block" and m.quantization.kept_source_blocks
    assert m.source.mtp_layers == [m.model.num_hidden_layers] and m.source.mtp_tensors > 0
    names = set(m.tensors[0])
    assert not any(".experts." in n for n in names)  # stacked; the MTP layer: test_mtp_compile.py
    assert {
        "embed",
        "head",
        "norm",
        "layers.1.moe.w13",
        "layers.1.moe.w13.scale",
        "layers.1.attn.w_kc",
    } <= names
    assert m.tensors[0]["layers.1.attn.w_kc"].dtype == "BF16"  # absorbed weights are not FP8
    assert [p.name for p in m.passes] == ["read", "rope", "fuse", "absorb", "fp8", "buckets"]


def test_verify_and_inspect(artifact, tmp_path):
    root = artifact("tiny-v2")
    r = invoke("verify", root)
    assert r.exit_code == 0 and r.stdout.startswith("ok:"), r.output
    r = invoke("inspect", root)
    assert r.exit_code == 0, r.output
    for needle in ("deepseek_v2", "group_limited_greedy", "passes", "rank-00000-of-00001", "accuracy"):
        assert needle in r.output
    r = invoke("inspect", root, "--json")
    assert json.loads(r.output)["schema_version"] == 3


def test_verify_names_the_tampered_file(artifact, tmp_path):
    root = tmp_path / "art"
    shutil.copytree(artifact("tiny-v2-lite"), root)
    victim = root / "rank-00000-of-00001" / "layer-00001.safetensors"
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    r = invoke("verify", root)
    assert r.exit_code == 3  # an integrity failure
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


def test_sharded_and_single_file_sources_compile_alike(checkpoint, tmp_path):
    from mlac.compiler.pipeline import compile_tensors
    from mlac.synth import synthesize

    sharded = synthesize(tmp_path / "sharded", preset="tiny-v3", seed=0, max_shard_bytes=2 << 20)
    assert (sharded / "model.safetensors.index.json").is_file() and len(
        list(sharded.glob("*.safetensors"))
    ) > 2
    a, b = compile_tensors(sharded)[0], compile_tensors(checkpoint("tiny-v3"))[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp16_and_fp32_sources(checkpoint, tmp_path, dtype):
    """Unquantized tensors keep the source dtype; --fp8 quantizes from it."""
    from safetensors.torch import load_file, save_file

    from mlac.runtime.engine.engine import Engine

    src = tmp_path / "src"
    shutil.copytree(checkpoint("tiny-v2"), src)
    f = src / "model.safetensors"
    save_file({k: v.to(dtype) for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    for fp8 in (False, True):
        out = tmp_path / f"out-{fp8}"
        assert invoke("compile", src, out, *(["--fp8"] if fp8 else [])).exit_code == 0
        m = Manifest.load(out)
        assert m.source.dtypes == [str(dtype).removeprefix("torch.")]
        assert m.tensors[0]["layers.0.attn.w_kc"].dtype == {torch.float16: "F16", torch.float32: "F32"}[dtype]
        assert m.accuracy.status == "measured"
        assert Engine.from_artifact(out, dtype=torch.float32).score([1, 2, 3]).isfinite().all()


def test_accuracy_report_in_manifest(artifact, checkpoint, tmp_path):
    plain = Manifest.load(artifact("tiny-v2")).accuracy
    assert plain.status == "measured" and plain.rel_l2 == 0.0 and plain.top1_agreement == 1.0
    fp8 = Manifest.load(artifact("tiny-v2", fp8=True)).accuracy
    assert fp8.status == "measured" and 0 < fp8.rel_l2 < 1 and fp8.probes * fp8.tokens_per_probe >= 128
    r = invoke("compile", checkpoint("tiny-v2"), tmp_path / "skip", "--skip-accuracy-check")
    assert Manifest.load(tmp_path / "skip").accuracy.status == "skipped"
    assert "skipped" in r.output


def test_generate_cli_prints_a_completion(artifact):
    r = invoke(
        "generate", artifact("tiny-v3", fp8=True), "--prompt", "The quick brown fox", "--max-tokens", "8"
    )
    assert r.exit_code == 0, r.output
    assert "8 completion tokens" in r.output or "finish: stop" in r.output


def test_generate_refuses_a_tampered_artifact(artifact, tmp_path):
    root = tmp_path / "art"
    shutil.copytree(artifact("tiny-v2-lite"), root)
    victim = root / "rank-00000-of-00001" / "head.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    r = invoke("generate", root, "--prompt", "hi")
    assert r.exit_code == 3 and "Traceback" not in r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("error: ") and "head.safetensors" in last and "sha256" in last
