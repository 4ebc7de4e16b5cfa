"""benchmarks/train/train_small.py on CPU: the micro config trains, its checkpoint compiles and serves.

The trained checkpoint is checked three ways: its loss falls and beats a unigram baseline on
held-out files; mlac's reader finds the MTP layer at index num_hidden_layers; and the compiled
artifact's logits equal those of transformers loading the same checkpoint on its own.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from _paths import REPO
from safetensors import safe_open

from mlac.compiler.pipeline import compile_checkpoint
from mlac.compiler.reader import Checkpoint
from mlac.core.artifact import CompileOptions

SCRIPT = REPO / "benchmarks" / "train" / "train_small.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("train_small", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ts():
    return _load_script()


@pytest.fixture(scope="module")
def trained(ts, tmp_path_factory):
    """(checkpoint dir, report) of `micro` trained for 30 steps, bf16."""
    out = tmp_path_factory.mktemp("train") / "micro"
    report = ts.run(ts.parse_args([str(out), "--steps", "30"]))
    return out, report


def _tensors(path: Path) -> dict[str, str]:
    """Tensor name -> safetensors dtype string ("BF16", "F8_E4M3", ...)."""
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}


def test_loss_falls_and_beats_unigram(trained):
    out, report = trained
    losses = report["losses"]
    assert report["steps"] == len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    assert report["held_out_perplexity"] < report["unigram_perplexity"]
    assert json.loads((out / "train_report.json").read_text())["parameters"] == report["parameters"]


def test_checkpoint_files_and_mtp_layer(trained):
    out, _ = trained
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == "deepseek_v3" and raw["topk_method"] == "noaux_tc"
    assert raw["q_lora_rank"] and raw["rope_scaling"]["type"] == "yarn"
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())
    assert (out / "generation_config.json").is_file() and (out / "tokenizer.json").is_file()
    n = raw["num_hidden_layers"]
    names = _tensors(out)
    for suffix in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                   "shared_head.head.weight", "embed_tokens.weight", "self_attn.q_a_proj.weight",
                   "mlp.experts.0.gate_proj.weight", "mlp.gate.e_score_correction_bias"):  # fmt: skip
        assert f"model.layers.{n}.{suffix}" in names
    assert not any(k.startswith(f"model.layers.{n + 1}.") for k in names)
    ckpt = Checkpoint(out)
    assert ckpt.mtp_layers == [n] and ckpt.mtp_tensors > 0


def test_compiles_generates_and_matches_transformers(trained, tmp_path):
    import transformers

    from mlac.runtime.engine.engine import Engine

    out, _ = trained
    manifest = compile_checkpoint(out, tmp_path / "art", CompileOptions())
    assert manifest.accuracy.status == "measured"
    engine = Engine.from_artifact(tmp_path / "art", dtype=torch.float32)
    ids = [0, *range(300, 340)]
    done = engine.generate(ids, max_tokens=4, ignore_eos=True)
    assert len(done.token_ids) == 4
    ref = transformers.DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]  # [T, V]
    got = engine.score(ids)
    assert ((got - want).norm() / want.norm()).item() < 1e-4


def test_fp8_checkpoint(ts, tmp_path):
    out = tmp_path / "fp8"
    ts.run(ts.parse_args([str(out), "--steps", "2", "--fp8"]))
    raw = json.loads((out / "config.json").read_text())
    assert raw["quantization_config"]["weight_block_size"] == [128, 128]
    names = _tensors(out)
    n = raw["num_hidden_layers"]
    for w in (
        f"model.layers.{n}.eh_proj",
        "model.layers.1.mlp.experts.3.down_proj",
        "model.layers.0.mlp.up_proj",
    ):
        assert names[w + ".weight"] == "F8_E4M3" and names[w + ".weight_scale_inv"] == "F32"
    assert names["model.layers.1.mlp.gate.weight"] == "BF16"  # the router stays unquantized
    assert compile_checkpoint(out, tmp_path / "art", CompileOptions()).accuracy.status == "measured"


def test_same_seed_same_losses(ts, tmp_path):
    def losses(name: str, seed: int) -> list[float]:
        return ts.run(ts.parse_args([str(tmp_path / name), "--steps", "4", "--seed", str(seed)]))["losses"]

    a = losses("a", 0)
    assert a == losses("b", 0)
    assert a != losses("c", 1)


def test_bad_out_dir(ts, tmp_path, capsys):
    (tmp_path / "x").write_text("keep")
    assert ts.main([str(tmp_path), "--steps", "1"]) == 1
    assert capsys.readouterr().err.startswith("error: ") and (tmp_path / "x").read_text() == "keep"
