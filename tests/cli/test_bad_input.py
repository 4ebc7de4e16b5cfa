"""Every bad input is a one-line error naming the problem, exit code 1, no traceback, nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from mlac.cli import main


@pytest.fixture
def ckpt(checkpoint, tmp_path) -> Path:
    """A private, editable copy of the tiny-v2-lite checkpoint."""
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoint("tiny-v2-lite"), dst)
    return dst


def weights_file(ckpt: Path) -> Path:
    files = sorted(ckpt.glob("*.safetensors"))
    assert len(files) == 1, files
    return files[0]


def edit_tensors(ckpt: Path, fn) -> None:
    path = weights_file(ckpt)
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def edit_config(ckpt: Path, **changes) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(changes)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def run_compile(ckpt: Path, out: Path, *extra: str):
    result = CliRunner().invoke(main, ["compile", str(ckpt), str(out), *extra])
    return result


def assert_clean_error(result, *needles: str) -> str:
    assert result.exit_code == 1, (result.exit_code, result.output, result.exception)
    out = result.output.strip()
    assert "Traceback" not in out
    last = out.splitlines()[-1]
    assert last.startswith("error: "), out
    for n in needles:
        assert n in last, (n, last)
    return last


def assert_nothing_written(out: Path) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def _break_missing_config(ckpt):
    (ckpt / "config.json").unlink()


def _break_invalid_json(ckpt):
    (ckpt / "config.json").write_text("{ not json")


def _break_model_type(ckpt):
    edit_config(ckpt, model_type="llama")


def _break_rope_scaling(ckpt):
    edit_config(ckpt, rope_scaling={"type": "linear", "factor": 2.0})


def _break_hidden_act(ckpt):
    edit_config(ckpt, hidden_act="gelu")


def _break_quant_method(ckpt):
    edit_config(ckpt, quantization_config={"quant_method": "gptq", "bits": 4})


def _break_missing_tensor(ckpt):
    edit_tensors(ckpt, lambda t: t.pop("model.layers.1.self_attn.kv_b_proj.weight"))


def _break_extra_tensor(ckpt):
    edit_tensors(ckpt, lambda t: t.update({"model.layers.0.self_attn.surprise.weight": torch.zeros(4)}))


def _break_misshapen_tensor(ckpt):
    def shrink(t):
        name = "model.layers.0.self_attn.o_proj.weight"
        t[name] = t[name][:, :-1].contiguous()

    edit_tensors(ckpt, shrink)


def _break_wrong_dtype(ckpt):
    edit_tensors(ckpt, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.int32)}))


def _break_truncated(ckpt):
    path = weights_file(ckpt)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])


def _break_corrupt_header(ckpt):
    path = weights_file(ckpt)
    data = bytearray(path.read_bytes())
    data[8:16] = b"\xff\xfe garb"
    path.write_bytes(bytes(data))


def _break_missing_shard(ckpt):
    path = weights_file(ckpt)
    tensors = load_file(path)
    names = sorted(tensors)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, ckpt / shard, metadata={"format": "pt"})
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    path.unlink()
    (ckpt / "model-00002-of-00002.safetensors").unlink()


CASES = {
    "missing config.json": (_break_missing_config, ["config.json not found"]),
    "invalid config.json": (_break_invalid_json, ["invalid JSON"]),
    "unsupported model type": (_break_model_type, ["model_type='llama'"]),
    "unsupported rope scaling": (_break_rope_scaling, ["rope_scaling.type", "linear"]),
    "unsupported activation": (_break_hidden_act, ["hidden_act='gelu'"]),
    "unsupported quantization": (_break_quant_method, ["quant_method", "gptq"]),
    "missing tensor": (
        _break_missing_tensor,
        ["missing tensor", "model.layers.1.self_attn.kv_b_proj.weight"],
    ),
    "extra tensor": (_break_extra_tensor, ["unexpected tensor", "surprise"]),
    "misshapen tensor": (_break_misshapen_tensor, ["o_proj.weight", "shape", "config implies"]),
    "wrong dtype": (_break_wrong_dtype, ["model.norm.weight", "dtype"]),
    "truncated safetensors": (_break_truncated, ["truncated"]),
    "corrupt safetensors header": (_break_corrupt_header, ["corrupt"]),
    "index names a missing shard": (
        _break_missing_shard,
        ["model-00002-of-00002.safetensors", "does not exist"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_checkpoint_is_one_clean_line(case, ckpt, tmp_path):
    breaker, needles = CASES[case]
    breaker(ckpt)
    out = tmp_path / "out"
    assert_clean_error(run_compile(ckpt, out), *needles)
    assert_nothing_written(out)


def test_existing_output_is_refused_without_force(checkpoint, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    assert_clean_error(
        run_compile(checkpoint("tiny-v2-lite"), out, "--skip-accuracy-check"), "already exists", "--force"
    )
    assert (out / "keep.txt").read_text() == "user data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_tp_without_shard_pass_is_refused(checkpoint, tmp_path):
    out = tmp_path / "out"
    assert_clean_error(run_compile(checkpoint("tiny-v2-lite"), out, "--tp", "3"), "--tp 3")
    assert_nothing_written(out)
