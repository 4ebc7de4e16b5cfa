"""The accuracy report's perplexity over calibration text: compile
--calibration-text -> source and artifact perplexity, top-1 agreement, the FP8 KV cache's cost."""

from __future__ import annotations

import math

import pytest
import torch

from mlac.compiler.check import accuracy, calibrate
from mlac.compiler.pipeline import compile_checkpoint, compile_tensors
from mlac.core.artifact import CompileOptions, Manifest
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.perplexity import perplexity
from mlac.tools.inspect import describe

PRESET = "tiny-v3"
TEXT = "def add(x, y):\n    return x + y\n\nclass Point:\n    pass\n" * 12
FIELDS = ("text_tokens", "text_window", "source_perplexity", "artifact_perplexity", "text_top1_agreement")


@pytest.fixture(scope="module")
def compiled(checkpoint, tmp_path_factory):
    """Manifests of tiny-v3 by name: bf16 with and without text, FP8 weights and FP8 KV with text."""
    root = tmp_path_factory.mktemp("accppl")
    text = root / "calibration.txt"
    text.write_text(TEXT)
    out = {"text": text}
    for name, options, cal in [
        ("plain", CompileOptions(), None),
        ("bf16", CompileOptions(), text),
        ("fp8-kv", CompileOptions(fp8=True, kv_cache_dtype="fp8_e4m3"), text),
    ]:
        out[name] = compile_checkpoint(checkpoint(PRESET), root / name, options, calibration_text=cal)
    return out


def test_source_perplexity_is_evaluate_perplexity(compiled, checkpoint):
    """Recomputed here: the source compiled without FP8, on the calibration tokens, in windows."""
    a = compiled["bf16"].accuracy
    ckpt = checkpoint(PRESET)
    tokens = calibrate.text_tokens(ckpt, compiled["text"])
    cfg = compiled["bf16"].model
    engine = Engine.from_tensors(cfg, compile_tensors(ckpt)[0], dtype=torch.float32, num_blocks=40)
    want = perplexity(engine, tokens, accuracy.text_window(cfg.max_position_embeddings))
    assert a.source_perplexity == pytest.approx(want.perplexity, rel=1e-9)
    assert a.text_tokens == want.tokens == len(tokens) - want.windows
    assert a.text_window == min(calibrate.WINDOW, cfg.max_position_embeddings)


@pytest.mark.parametrize("name", ["bf16", "fp8-kv"])
def test_text_fields_set_and_finite(compiled, name):
    a = compiled[name].accuracy
    assert a.status == "measured"
    for f in FIELDS:
        assert getattr(a, f) is not None and math.isfinite(getattr(a, f)), f
    assert 0.0 <= a.text_top1_agreement <= 1.0
    assert a.source_perplexity > 1.0


def test_bf16_artifact_matches_source(compiled):
    a = compiled["bf16"].accuracy
    assert a.artifact_perplexity == pytest.approx(a.source_perplexity, rel=1e-5)
    assert a.text_top1_agreement == 1.0
    assert a.kv_fp8_perplexity_cost is None  # no FP8 KV cache


def test_fp8_kv_cost(compiled, checkpoint):
    """The cost is the artifact's perplexity minus its weights' with an unquantized cache."""
    m = compiled["fp8-kv"]
    a = m.accuracy
    assert a.kv_fp8_perplexity_cost is not None and a.kv_fp8_perplexity_cost != 0.0
    ckpt = checkpoint(PRESET)
    tensors = compile_tensors(ckpt, m.options)[0]
    engine = Engine.from_tensors(m.model, tensors, dtype=torch.float32, num_blocks=40)
    tokens = calibrate.text_tokens(ckpt, compiled["text"])
    unquantized = perplexity(engine, tokens, accuracy.text_window(m.model.max_position_embeddings))
    assert a.kv_fp8_perplexity_cost == pytest.approx(a.artifact_perplexity - unquantized.perplexity, rel=1e-6)
    assert a.artifact_perplexity != a.source_perplexity  # FP8 weights and cache cost something


def test_without_text_fields_are_none(compiled):
    a = compiled["plain"].accuracy
    assert a.status == "measured" and a.rel_l2 is not None  # today's probe report
    for f in (*FIELDS, "kv_fp8_perplexity_cost"):
        assert getattr(a, f) is None, f
    assert "perplexity" not in describe(compiled["plain"])


def test_report_round_trips_and_probes_unchanged(compiled, tmp_path):
    """The text fields survive the manifest's JSON; the probe fields match a compile without text."""
    m = compiled["fp8-kv"]
    again = Manifest.model_validate_json(m.to_json())
    assert again.accuracy == m.accuracy
    assert compiled["bf16"].accuracy.rel_l2 == compiled["plain"].accuracy.rel_l2


def test_inspect_shows_lines(compiled):
    a = compiled["fp8-kv"].accuracy
    text = describe(compiled["fp8-kv"])
    assert f"perplexity    source {a.source_perplexity:.4f}, artifact {a.artifact_perplexity:.4f}" in text
    assert f"top-1         {a.text_top1_agreement:.4f} agreement" in text
    assert f"kv fp8 cost   {a.kv_fp8_perplexity_cost:+.4f} perplexity" in text
    assert "kv fp8 cost" not in describe(compiled["bf16"])


def test_skipped_check_skips_text(checkpoint, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    options = CompileOptions(accuracy_check=False)
    m = compile_checkpoint(checkpoint(PRESET), tmp_path / "a", options, calibration_text=text)
    assert m.accuracy.status == "skipped" and m.accuracy.source_perplexity is None
