"""Calibrated FP8 KV-cache scales: compile --calibration-text -> per-layer
kv_scales in the manifest -> the runtime's PagedKVCache scales."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from _hf_convert import raw_config
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from mlac.compiler.check import calibrate
from mlac.compiler.pipeline import compile_checkpoint
from mlac.core.artifact import CompileOptions, Manifest
from mlac.core.config import ModelConfig
from mlac.core.errors import MlacError
from mlac.runtime.engine.engine import Engine
from mlac.runtime.kvcache.paged import PagedKVCache
from mlac.tools.inspect import describe

PRESET = "tiny-v3"
SMALL_PRESET = "tiny-v2"  # bf16 weights: small_entries_checkpoint scales them exactly
CONFIG = ModelConfig.from_hf(raw_config("v3"))
TEXT = "def add(x, y):\n    return x + y\n\nclass Point:\n    pass\n" * 30
PROBE_TEXT = "import os\nfor name in os.listdir('.'):\n    print(name.upper())\n" * 4


@pytest.fixture(scope="module")
def compiled(checkpoint, tmp_path_factory):
    """Artifacts of tiny-v3 (no accuracy check) by name: bf16 KV, FP8 KV with and without scales."""
    root = tmp_path_factory.mktemp("kvcal")
    text = root / "calibration.txt"
    text.write_text(TEXT)
    ckpt = checkpoint(PRESET)
    out = {"text": text}
    for name, kv, cal in [
        ("bf16", "bf16", None),
        ("e4m3", "fp8_e4m3", None),
        ("e4m3-cal", "fp8_e4m3", text),
        ("e5m2-cal", "fp8_e5m2", text),
    ]:
        options = CompileOptions(kv_cache_dtype=kv, accuracy_check=False)
        compile_checkpoint(ckpt, root / name, options, calibration_text=cal)
        out[name] = root / name
    return out


def engine(path: Path, num_blocks: int = 40) -> Engine:
    return Engine.from_artifact(path, dtype=torch.float32, verify=False, num_blocks=num_blocks)


def bf16_cache_amax(path: Path, text: str) -> list[float]:
    """Per layer max |entry| of the unquantized cache, scoring the text in calibrate.WINDOW windows."""
    e = engine(path)
    ids = e.tokenizer.encode(text)
    amax = [0.0] * e.config.num_hidden_layers
    for s in range(0, len(ids), calibrate.WINDOW):
        e.score(ids[s : s + calibrate.WINDOW])
        amax = [max(a, float(pool.abs().max())) for a, pool in zip(amax, e.cache.layers, strict=True)]
    return amax


def test_manifest_scales_are_amax_over_fp8_max(compiled):
    q = Manifest.load(compiled["e4m3-cal"]).quantization
    layers = Manifest.load(compiled["e4m3-cal"]).model.num_hidden_layers
    want = bf16_cache_amax(compiled["bf16"], TEXT)
    assert q.kv_scales is not None and len(q.kv_scales) == layers
    assert all(s > 0 for s in q.kv_scales)
    assert q.kv_scales == pytest.approx([a / 448.0 for a in want], rel=1e-6)
    assert q.kv_calibration.amax == pytest.approx(want, rel=1e-6)
    assert q.kv_calibration.tokens == len(engine(compiled["bf16"]).tokenizer.encode(TEXT))
    e5m2 = Manifest.load(compiled["e5m2-cal"]).quantization.kv_scales
    assert e5m2 == pytest.approx([a / 57344.0 for a in want], rel=1e-6)


def test_runtime_cache_uses_manifest_scales(compiled):
    scales = Manifest.load(compiled["e4m3-cal"]).quantization.kv_scales
    got = [float(s) for s in engine(compiled["e4m3-cal"]).cache.scales]
    assert got == pytest.approx(scales, rel=1e-7)  # float32 of the manifest's float64
    assert len(set(got)) > 1  # one scale per layer, not one repeated
    uncal = engine(compiled["e4m3"])
    assert Manifest.load(compiled["e4m3"]).quantization.kv_scales is None
    assert [float(s) for s in uncal.cache.scales] == [1.0] * uncal.config.num_hidden_layers
    assert "per-layer scales" in describe(Manifest.load(compiled["e4m3-cal"]))
    assert "scale 1.0 (uncalibrated)" in describe(Manifest.load(compiled["e4m3"]))


def small_entries_checkpoint(src: Path, dst: Path, factor: float) -> Path:
    """A copy of the bf16 checkpoint `src` that computes the same function with cache entries
    `factor` (a power of 2: exact in bf16) times smaller: the latent (kv_a_layernorm) and the rope
    key (rows kv_lora.. of kv_a_proj_with_mqa) scaled by factor, what reads them (kv_b_proj, the
    rope rows of every head of q_b_proj) by 1/factor."""
    cfg = json.loads((src / "config.json").read_text())
    nope, rope, lora = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["kv_lora_rank"]
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for name, t in tensors.items():
        if name.endswith("kv_a_layernorm.weight"):
            t *= factor
        elif name.endswith("kv_a_proj_with_mqa.weight"):
            t[lora:] *= factor  # [kv_lora + rope, D]
        elif name.endswith("kv_b_proj.weight"):
            t /= factor  # [H * (nope + v), kv_lora]
        elif name.endswith("q_b_proj.weight"):
            t.view(-1, nope + rope, t.shape[-1])[:, nope:] /= factor  # [H * (nope + rope), q_lora]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_calibration_cuts_error_of_small_entries(checkpoint, tmp_path, fmt):
    """Cache entries ~1e-5: with scale 1.0 they fall in (or under) the FP8 subnormals; the
    calibrated scale (< 1) maps them onto the format's range and must cut the logit error
    against the unquantized cache, for the same function as the unscaled model."""
    ckpt = small_entries_checkpoint(checkpoint(SMALL_PRESET), tmp_path / "ckpt", 2.0**-16)
    (tmp_path / "t.txt").write_text(TEXT)
    for name, kv, cal in [("ref", "bf16", None), ("fp8", fmt, None), ("cal", fmt, tmp_path / "t.txt")]:
        compile_checkpoint(ckpt, tmp_path / name, CompileOptions(kv_cache_dtype=kv, accuracy_check=False),
                           calibration_text=cal)  # fmt: skip
    ref = engine(tmp_path / "ref")
    ids = ref.tokenizer.encode(PROBE_TEXT)
    want = ref.score(ids).double()

    def rel_err(name: str) -> float:
        return float((engine(tmp_path / name).score(ids).double() - want).norm() / want.norm())

    assert max(Manifest.load(tmp_path / "cal").quantization.kv_scales) < 1e-3
    calibrated, uncalibrated = rel_err("cal"), rel_err("fp8")
    assert 0 < calibrated < 0.5 * uncalibrated, (calibrated, uncalibrated)


def test_bad_calibration_text(checkpoint, tmp_path):
    ckpt = checkpoint(PRESET)
    options = CompileOptions(kv_cache_dtype="fp8_e4m3", accuracy_check=False)
    with pytest.raises(MlacError, match="file not found"):
        compile_checkpoint(ckpt, tmp_path / "a", options, calibration_text=tmp_path / "missing.txt")
    (tmp_path / "blank.txt").write_text(" \n\n")
    with pytest.raises(MlacError, match="is empty"):
        compile_checkpoint(ckpt, tmp_path / "b", options, calibration_text=tmp_path / "blank.txt")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_calibration_text_with_bf16_kv_warns(checkpoint, tmp_path):
    (tmp_path / "t.txt").write_text(TEXT)
    logged: list[str] = []
    options = CompileOptions(accuracy_check=False)
    m = compile_checkpoint(
        checkpoint(PRESET), tmp_path / "a", options, log=logged.append, calibration_text=tmp_path / "t.txt"
    )
    assert m.quantization.kv_scales is None
    assert any(line.startswith("warning: --calibration-text with a bf16 KV cache") for line in logged)


def test_cli_missing_calibration_text_is_one_line(checkpoint, tmp_path):
    from mlac.cli import main

    args = ["compile", str(checkpoint(PRESET)), str(tmp_path / "a"), "--kv-cache-dtype", "fp8_e4m3"]
    r = CliRunner().invoke(main, [*args, "--calibration-text", str(tmp_path / "none.txt")])
    assert r.exit_code != 0
    assert "error: --calibration-text" in r.output and "Traceback" not in r.output


def test_layer_scales_checked():
    n = CONFIG.num_hidden_layers
    c = PagedKVCache(CONFIG, 2, 4, torch.float32, kv_dtype="fp8_e4m3", kv_scale=[0.5] * n)
    assert [float(s) for s in c.scales] == [0.5] * n
    with pytest.raises(MlacError, match="per-layer scales"):
        PagedKVCache(CONFIG, 2, 4, kv_dtype="fp8_e4m3", kv_scale=[0.5] * (n + 1))
    with pytest.raises(MlacError, match="not a positive finite"):
        PagedKVCache(CONFIG, 2, 4, kv_dtype="fp8_e4m3", kv_scale=[0.0] * n)
