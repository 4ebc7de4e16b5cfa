"""Bad inputs of `mlac compile`: safetensors headers that do not tile the data, short
reads, config values of the wrong type or out of range, JSON nested too deep, a bad index, an
OUT_DIR that cannot be created. Each is one `error: ...` line, exit code 1, nothing written or
deleted."""

from __future__ import annotations

import io
import json
import math
import os
import struct
from pathlib import Path

import pytest
import torch
from _paths import CONFIGS
from safetensors.torch import load_file
from test_bad_input import (
    assert_clean_error,
    assert_nothing_written,
    ckpt,
    edit_config,
    run_compile,
    weights_file,
)

from mlac.core import safetensors_io
from mlac.core.config import ModelConfig
from mlac.core.errors import MlacError
from mlac.core.safetensors_io import SafetensorsFile, readinto_exact

__all__ = ["ckpt"]  # the fixture, shared with test_bad_input.py

DEEP = "[" * 100_000 + "]" * 100_000  # nested past the parser's recursion limit


# ---- safetensors files written by hand: 8-byte LE header length + JSON header + data --------


def raw_safetensors(header: dict, data: bytes, header_text: str | None = None) -> bytes:
    text = (json.dumps(header) if header_text is None else header_text).encode()
    return struct.pack("<Q", len(text)) + text + data


def read_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def edit_header(ckpt: Path, fn) -> None:
    """Rewrite the checkpoint's header through fn(header) -> None, keeping its data bytes."""
    path = weights_file(ckpt)
    header, data = read_header(path)
    fn(header)
    path.write_bytes(raw_safetensors(header, data))


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def _alias(header):  # two names on the same bytes
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"
    header[b]["data_offsets"] = list(header[a]["data_offsets"])


def _overlap(header):  # a tensor begins 2 bytes inside the one before it
    name = "model.layers.0.mlp.down_proj.weight"
    header[name]["data_offsets"] = [x - 2 for x in header[name]["data_offsets"]]


def _garbage_after_data(ckpt):
    with open(weights_file(ckpt), "ab") as f:
        f.write(b"garbage")


def _deep_header(ckpt):
    weights_file(ckpt).write_bytes(raw_safetensors({}, b"", header_text='{"x": ' + DEEP + "}"))


def _sharded(ckpt: Path, weight_map_text: str) -> None:
    """Turn the single file into a one-shard checkpoint with the given index text."""
    weights_file(ckpt).rename(ckpt / "model-00001-of-00001.safetensors")
    (ckpt / "model.safetensors.index.json").write_text(weight_map_text)


def _index_value_is_a_list(ckpt):
    names = sorted(load_file(weights_file(ckpt)))
    weight_map = {n: "model-00001-of-00001.safetensors" for n in names}
    weight_map[names[0]] = ["model-00001-of-00001.safetensors"]
    _sharded(ckpt, json.dumps({"metadata": {}, "weight_map": weight_map}))


CASES = {
    "two names on the same bytes": (
        lambda c: edit_header(c, _alias),
        ["post_attention_layernorm", "overlaps"],
    ),
    "overlapping offsets": (lambda c: edit_header(c, _overlap), ["down_proj.weight", "overlaps"]),
    "garbage after the data": (_garbage_after_data, ["7 bytes after the last tensor"]),
    "safetensors header nested 100k deep": (
        _deep_header,
        ["corrupt safetensors header", "nested too deeply"],
    ),
    "config.json nested 100k deep": (
        lambda c: (c / "config.json").write_text(DEEP),
        ["config.json", "deeply"],
    ),
    "index nested 100k deep": (lambda c: _sharded(c, DEEP), ["model.safetensors.index.json", "deeply"]),
    "weight_map value is a list": (_index_value_is_a_list, ["invalid shard file name ['model-00001"]),
    "rms_norm_eps NaN": (lambda c: edit_config(c, rms_norm_eps=float("nan")), ["rms_norm_eps", "finite"]),
    "rope_scaling a string": (lambda c: edit_config(c, rope_scaling="yarn"), ["rope_scaling='yarn'"]),
    "n_routed_experts a string": (
        lambda c: edit_config(c, n_routed_experts="64"),
        ["n_routed_experts", "'64'"],
    ),
    "moe_layer_freq 0": (lambda c: edit_config(c, moe_layer_freq=0), ["moe_layer_freq", "greater than 0"]),
    "num_experts_per_tok > experts": (
        lambda c: edit_config(c, num_experts_per_tok=1000),
        ["num_experts_per_tok=1000", "n_routed_experts="],
    ),
    "weight_block_size an int": (
        lambda c: edit_config(c, quantization_config={"quant_method": "fp8", "weight_block_size": 128}),
        ["weight_block_size=128"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_checkpoint_is_one_clean_line(case, ckpt, tmp_path):
    breaker, needles = CASES[case]
    breaker(ckpt)
    before = snapshot(ckpt)
    out = tmp_path / "out"
    assert_clean_error(run_compile(ckpt, out), *needles)
    assert_nothing_written(out)
    assert snapshot(ckpt) == before


# ---- the header rules, one by one, on tiny files ------------------------------------------


def two_tensors(tmp_path: Path, offsets_b=(8, 16), data=bytes(range(16)), header_text=None) -> Path:
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "I32", "shape": [2], "data_offsets": list(offsets_b)},
    }
    path = tmp_path / "t.safetensors"
    path.write_bytes(raw_safetensors(header, data, header_text))
    return path


def test_a_well_formed_file_reads_back(tmp_path):
    f = SafetensorsFile(two_tensors(tmp_path))
    assert (
        f.read("b").tolist()
        == torch.tensor([8, 9, 10, 11, 12, 13, 14, 15], dtype=torch.uint8).view(torch.int32).tolist()
    )


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"offsets_b": (0, 8)}, "tensor 'b' overlaps"),  # the same bytes as 'a'
        ({"offsets_b": (4, 12), "data": bytes(12)}, "tensor 'b' overlaps"),
        ({"offsets_b": (12, 20), "data": bytes(20)}, "tensor 'b' leaves a gap of 4 bytes"),
        ({"data": bytes(17)}, "1 bytes after the last tensor"),
        ({"data": bytes(15)}, "truncated: tensor 'b' ends at byte 16"),
        ({"offsets_b": (8, 20), "data": bytes(20)}, "header offsets do not match its shape"),
        ({"offsets_b": (8.0, 16)}, "corrupt header entry for tensor 'b'"),
        ({"offsets_b": (True, 16)}, "corrupt header entry for tensor 'b'"),
        (
            {"header_text": '{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "a": {}}'},
            "name 'a' appears twice",
        ),
        ({"header_text": "[]"}, "expected a JSON object"),
    ],
)
def test_header_rules(tmp_path, kw, needle):
    with pytest.raises(MlacError) as e:
        SafetensorsFile(two_tensors(tmp_path, **kw))
    assert needle in str(e.value) and "\n" not in str(e.value)


# ---- reads loop until complete ------------------------------------------------------------


class ShortReads(io.RawIOBase):
    """A file whose reads return at most 1000 bytes each, as a read of over 2 GiB does on Linux."""

    def __init__(self, path, mode="rb", buffering=-1):
        self.f = open(path, mode, buffering=0)  # noqa: SIM115
        self.calls = 0

    def readinto(self, buf):
        self.calls += 1
        return self.f.readinto(memoryview(buf)[:1000])

    def seek(self, offset, whence=0):
        return self.f.seek(offset, whence)

    def close(self):
        self.f.close()
        super().close()


def test_short_reads_are_completed(checkpoint, monkeypatch):
    path = weights_file(checkpoint("tiny-v2-lite"))
    want = load_file(path)
    opened: list[ShortReads] = []
    monkeypatch.setattr(safetensors_io, "open", lambda *a, **k: opened.append(ShortReads(*a, **k)) or opened[-1],
                        raising=False)  # fmt: skip
    f = SafetensorsFile(path)
    name = "model.embed_tokens.weight"  # 512 KiB: hundreds of short reads
    assert torch.equal(f.read(name), want[name])
    assert sum(s.calls for s in opened) > f.tensors[name].nbytes // 1000


@pytest.mark.slow
def test_a_tensor_over_2_gib_reads_whole(tmp_path):
    """One read(2) returns at most 2,147,479,552 bytes on Linux: the tensor must still come back
    whole. A sparse file (zeros) with marked first and last bytes; allocates 2 GiB."""
    n = (2 << 30) + 4096
    path = tmp_path / "big.safetensors"
    head = raw_safetensors({"big": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}, b"")
    with open(path, "wb") as f:
        f.write(head + b"\x01")
        f.truncate(len(head) + n - 1)
        f.seek(len(head) + n - 1)
        f.write(b"\x02")
    t = SafetensorsFile(path).read("big")
    assert t.numel() == n and t[0].item() == 1 and t[-1].item() == 2 and t[n // 2].item() == 0


def test_readinto_exact_stops_at_end_of_file(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"abcdef")
    buf = bytearray(8)
    with open(path, "rb", buffering=0) as f:
        assert readinto_exact(f, 2, memoryview(buf)) == 4
    assert bytes(buf[:4]) == b"cdef"


# ---- config values ------------------------------------------------------------------------


def v3(**changes) -> dict:
    raw = json.loads((CONFIGS / "DeepSeek-V3.json").read_text())
    return {**raw, **changes}


@pytest.mark.parametrize(
    "changes,needle",
    [
        ({"rope_scaling": "yarn"}, "rope_scaling='yarn'"),
        (
            {"rope_scaling": {"type": "yarn", "factor": "40", "original_max_position_embeddings": 4096}},
            "rope_scaling.factor",
        ),  # fmt: skip
        ({"rope_parameters": 3, "rope_scaling": None}, "rope_parameters=3"),
        ({"n_routed_experts": "64"}, "'n_routed_experts'"),
        ({"hidden_size": 7168.0}, "'hidden_size'"),
        ({"num_hidden_layers": True}, "'num_hidden_layers'"),
        ({"norm_topk_prob": "yes"}, "'norm_topk_prob'"),
        ({"n_group": "8"}, "'n_group'"),
        ({"eos_token_id": [1, "2"]}, "eos_token_ids"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": 128}}, "weight_block_size=128"),
        (
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128.0, 128.0]}},
            "weight_block_size=[128.0, 128.0]",
        ),  # fmt: skip
        ({"quantization_config": "fp8"}, "quantization_config='fp8'"),
        ({"rms_norm_eps": float("nan")}, "'rms_norm_eps'"),
        ({"rope_theta": float("inf")}, "'rope_theta'"),
        ({"rms_norm_eps": 0.0}, "'rms_norm_eps'"),
        ({"moe_layer_freq": 0}, "'moe_layer_freq'"),
        ({"vocab_size": -1}, "'vocab_size'"),
        ({"num_experts_per_tok": 257}, "num_experts_per_tok=257"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok=0"),
    ],
)
def test_config_values_are_checked(changes, needle):
    with pytest.raises(MlacError) as e:
        ModelConfig.from_hf(v3(**changes))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_published_configs_still_parse():
    for path in sorted((CONFIGS).glob("*.json")):
        cfg = ModelConfig.from_hf(json.loads(path.read_text()), source=path.name)
        assert math.isfinite(cfg.rms_norm_eps) and cfg.moe_layer_freq >= 1


# ---- OUT_DIR ------------------------------------------------------------------------------


def test_out_dir_under_a_file(checkpoint, tmp_path):
    (tmp_path / "a_file").write_text("keep")
    for out in (tmp_path / "a_file" / "out", tmp_path / "a_file" / "x" / "out"):
        assert_clean_error(run_compile(checkpoint("tiny-v2-lite"), out), "a_file is not a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
    assert (tmp_path / "a_file").read_text() == "keep"


def test_out_dir_on_a_read_only_file_system(checkpoint, tmp_path, monkeypatch):
    """As root, chmod does not stop writes: access(2) is what says EROFS, so it is patched here."""
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == tmp_path / "ro" else real(p, mode))
    (tmp_path / "ro").mkdir()
    out = tmp_path / "ro" / "deeper" / "out"
    assert_clean_error(run_compile(checkpoint("tiny-v2-lite"), out), "ro is not writable")
    assert list((tmp_path / "ro").iterdir()) == []


def test_a_well_formed_index_compiles(ckpt, tmp_path):
    """The sharded layout built above compiles when the index is well formed (the cases are not vacuous)."""
    names = sorted(load_file(weights_file(ckpt)))
    _sharded(ckpt, json.dumps({"weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}))
    result = run_compile(ckpt, tmp_path / "out", "--skip-accuracy-check")
    assert result.exit_code == 0, result.output


def test_edited_header_compiles_when_it_still_tiles(ckpt, tmp_path):
    """edit_header itself keeps a valid file valid (so the header cases fail for their edit)."""
    edit_header(ckpt, lambda header: None)
    result = run_compile(ckpt, tmp_path / "out", "--skip-accuracy-check")
    assert result.exit_code == 0, result.output
