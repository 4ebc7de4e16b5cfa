"""benchmarks/train/train_small.py's `deep` recipe on CPU: its model, as the recipe shapes it, trains a
few steps on a sliver of the corpus, compiles with its MTP layer, and generates with and without
speculation (the draft is that MTP layer).

Only the data and the step are shrunk here (corpus, batch, window); the model config is the
recipe's own, so these are the shapes the GPU run trains and mlac compiles.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from _cli import invoke
from test_train_small import _load_script


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(checkpoint dir, report, recipe) of `deep` trained for 3 steps of 2 x 32 tokens."""
    ts = _load_script()
    recipe = ts.RECIPES["deep"]
    ts.RECIPES["deep"] = dataclasses.replace(recipe, seq=32, batch=2, warmup=1, train_bytes=120_000,
                                             held_bytes=20_000, eval_windows=2, log_every=1)  # fmt: skip
    out = tmp_path_factory.mktemp("train") / "deep"
    report = ts.run(ts.parse_args([str(out), "--config", "deep", "--steps", "3"]))
    return out, report, recipe


def test_deep_recipe_is_v2_lite_deep_with_one_mtp_layer(trained):
    out, report, recipe = trained
    raw = json.loads((out / "config.json").read_text())
    assert raw["num_hidden_layers"] == 27 and raw["num_nextn_predict_layers"] == 1  # V2-Lite's depth
    assert {k: raw[k] for k in recipe.model} == recipe.model  # the recipe's shapes, not the test's
    assert raw["topk_method"] == "noaux_tc" and raw["n_shared_experts"] == 1 and raw["q_lora_rank"]
    assert report["steps"] == len(report["losses"]) == 3
    assert report["parameters"] > report["parameters_main"]  # the MTP layer trained along


def _compiled_mtp(out, art, *flags) -> dict:
    """`mlac compile` out -> art with flags; the manifest's `mtp` entry."""
    r = invoke("compile", out, art, *flags)
    assert r.exit_code == 0, r.output
    return json.loads((art / "manifest.json").read_text())["mtp"]


def test_deep_compiles_with_mtp_and_generates(trained, tmp_path):
    out, _, _ = trained
    art = tmp_path / "art"
    mtp = _compiled_mtp(out, art)
    assert mtp["source_layers"] == [27] and mtp["prefixes"] == ["mtp.0"]
    fp8 = _compiled_mtp(out, tmp_path / "fp8", "--fp8", "--skip-accuracy-check")  # the GPU run's other one
    assert fp8["prefixes"] == ["mtp.0"] and fp8["tensors"] > mtp["tensors"]  # + the weights' scales
    args = ("generate", art, "--prompt", "def main():", "--max-tokens", "6", "--temperature", "0",
            "--dtype", "float32")  # fmt: skip
    plain = invoke(*args)
    spec = invoke(*args, "--speculative-num-steps", "2")
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert "completion tokens" in plain.output
    assert spec.output == plain.output  # greedy: the drafts change the speed, never the tokens
