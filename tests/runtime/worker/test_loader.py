"""Strict artifact loading: sizes and hashes, tensor names, shapes and dtypes, compute-dtype casts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from _hf_convert import build_hf, convert, raw_config, write_artifact

from mlac.core.artifact import IDENTITY, artifact_identity, identity_record
from mlac.core.config import ModelConfig
from mlac.core.errors import MlacError
from mlac.runtime.engine.engine import Engine
from mlac.runtime.worker.loader import load_artifact

RAW = raw_config("v3", num_hidden_layers=2)


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    return convert(build_hf(RAW), ModelConfig.from_hf(RAW))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, tensors) -> Path:
    return write_artifact(tmp_path_factory.mktemp("art") / "a", RAW, tensors, None)


@pytest.fixture
def art(tmp_path, pristine) -> Path:
    """A fresh copy to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "a"))


def edit_manifest(root: Path, fn) -> None:
    m = json.loads((root / "manifest.json").read_text())
    fn(m)
    (root / "manifest.json").write_text(json.dumps(m))
    (root / IDENTITY).write_text(identity_record(artifact_identity(root)))  # re-sealed


def layer_file(root: Path) -> Path:
    return root / "rank-00000-of-00001" / "layer-00001.safetensors"


def test_loads_every_tensor_casting_only_floating_non_fp32_contract_tensors(pristine, tensors):
    loaded = load_artifact(pristine, dtype=torch.bfloat16)
    assert loaded.tensors.keys() == tensors.keys()
    assert loaded.tensors["layers.1.moe.w13"].dtype == torch.bfloat16
    assert loaded.tensors["layers.1.moe.gate_bias"].dtype == torch.float32  # the contract keeps it float32
    assert torch.equal(loaded.tensors["embed"], tensors["embed"].to(torch.bfloat16))
    f32 = load_artifact(pristine, dtype=torch.float32, verify=False)
    assert all(torch.equal(f32.tensors[k], t) for k, t in tensors.items())


def test_tampered_file_fails_the_hash(art):
    path = layer_file(art)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # same size, different bytes
    path.write_bytes(bytes(data))
    with pytest.raises(MlacError, match="layer-00001.safetensors: sha256 does not match"):
        load_artifact(art)
    load_artifact(art, verify=False)  # without hashing only sizes are checked


def test_size_is_checked_even_without_hashing(art):
    with open(layer_file(art), "ab") as f:
        f.write(b"\0")
    with pytest.raises(MlacError, match="size"):
        load_artifact(art, verify=False)


def test_missing_file_is_refused(art):
    layer_file(art).unlink()
    with pytest.raises(MlacError, match="missing from the artifact"):
        load_artifact(art, verify=False)


def test_tensor_in_file_but_not_in_manifest_is_refused(art):
    edit_manifest(art, lambda m: m["tensors"][0].pop("layers.1.moe.w2"))
    with pytest.raises(MlacError, match=r"layer-00001.safetensors: extra tensor 'layers.1.moe.w2'"):
        load_artifact(art)


def test_tensor_in_manifest_but_not_in_file_is_refused(art):
    def add(m):
        m["tensors"][0]["layers.1.moe.w3"] = dict(m["tensors"][0]["layers.1.moe.w2"])

    edit_manifest(art, add)
    with pytest.raises(MlacError, match=r"'layers.1.moe.w3' listed in the manifest is missing from the file"):
        load_artifact(art)


@pytest.mark.parametrize("field, value, shown", [("shape", [1, 2], "[1, 2]"), ("dtype", "BF16", "BF16")])
def test_shape_or_dtype_mismatch_is_refused(art, field, value, shown):
    edit_manifest(art, lambda m: m["tensors"][0]["layers.1.attn.wo"].__setitem__(field, value))
    with pytest.raises(
        MlacError, match=rf"tensor 'layers.1.attn.wo' is F32\[64, 64\], the manifest says .*{shown}"
    ):
        load_artifact(art)


def test_unlisted_tensor_file_is_refused(art):
    shutil.copy(layer_file(art), art / "rank-00000-of-00001" / "layer-00009.safetensors")
    with pytest.raises(MlacError, match="layer-00009.safetensors: not part of the artifact"):
        load_artifact(art)


def test_tensor_file_outside_the_hashed_files_is_refused(art):
    edit_manifest(
        art, lambda m: m.__setitem__("files", [f for f in m["files"] if "layer-00001" not in f["path"]])
    )
    with pytest.raises(MlacError, match="not listed"):
        load_artifact(art)


def test_rank_out_of_range(pristine):
    with pytest.raises(MlacError, match="rank 1 out of range"):
        load_artifact(pristine, rank=1)


def test_a_tensor_the_model_needs_but_the_artifact_lacks(tmp_path, tensors):
    partial = {k: v for k, v in tensors.items() if k != "layers.1.moe.gate_bias"}
    root = write_artifact(tmp_path / "p", RAW, partial, None)
    load_artifact(root)  # consistent with its own manifest...
    with pytest.raises(MlacError, match="'layers.1.moe.gate_bias' is missing"):
        Engine.from_artifact(root)  # ...but not with the model


def test_a_tensor_the_model_does_not_use(tmp_path, tensors):
    root = write_artifact(tmp_path / "x", RAW, {**tensors, "layers.0.attn.bogus": torch.zeros(3)}, None)
    with pytest.raises(MlacError, match="does not use: layers.0.attn.bogus"):
        Engine.from_artifact(root)
