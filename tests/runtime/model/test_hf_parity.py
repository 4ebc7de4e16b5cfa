"""End to end: synth -> compile -> Engine, against transformers' DeepseekV2/V3ForCausalLM.

Without --fp8 the artifact runs in float32 and must match transformers within 1e-4 (max abs
logit error over the max abs logit) and give the same 32 greedy tokens. With --fp8 the error
is bounded by FP8_BOUND (measured, see below), and a wrong FP8 path (a scale dropped, blocks
misplaced) must exceed that bound: the last test proves it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mlac.runtime.engine.engine import Engine
from mlac.runtime.model import attention as attention_forms
from mlac.runtime.worker.loader import load_artifact

TINY_PRESETS = ("tiny-v2-lite", "tiny-v2", "tiny-v3")
PARITY_BOUND = 1e-4
# FP8 (e4m3 weights, 128x128 blocks, W8A8 activations per token per 128 channels) against the
# float32 reference, as relative L2 over all logits of the prompts. e4m3 rounds each weight and
# activation by ~2.5%; on these random-weight models that compounds over ~10 matmuls (and flips
# some expert choices) into a logit rel_l2 of 0.086, 0.179, 0.191 (tiny-v2-lite, -v2, -v3; seed 0). The
# bound leaves headroom over the worst preset; a wrong FP8 path (a scale dropped, blocks read
# transposed) lands far above it: test_wrong_fp8_path_fails_the_bound.
FP8_BOUND = 0.4
PROMPT_LEN = 40
GREEDY_TOKENS = 32


def prompts(vocab: int, n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (PROMPT_LEN + 3 * i,), generator=g).tolist() for i in range(n)]


def dequantized_copy(src: Path, dst: Path) -> Path:
    """The checkpoint with every FP8 weight dequantized to bf16 by DeepSeek's rule.

    Written here, independently of mlac: w[i, j] * weight_scale_inv[i // 128, j // 128].
    (transformers 5.x's CPU dequantizer derives the block size from the scale grid instead,
    rows // grid_rows, which misplaces scales whenever the last block is partial, as in
    kv_a_proj_with_mqa: 576 rows in DeepSeek-V3, 160 in tiny-v3.)
    """
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        for name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
            scale, w = tensors.pop(name), tensors[name.removesuffix("_scale_inv")]
            rows, cols = w.shape
            s = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
            tensors[name.removesuffix("_scale_inv")] = (w.float() * s).to(torch.bfloat16)
        save_file(tensors, f, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def hf_model(checkpoint, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    made = {}

    def get(preset: str):
        if preset not in made:
            path = checkpoint(preset)
            if "quantization_config" in json.loads((path / "config.json").read_text()):
                path = dequantized_copy(path, tmp_path_factory.mktemp("hf") / preset)
            # bf16 weights (as stored, or as dequantized by mlac), computed in float32
            made[preset] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return made[preset]

    return get


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("form", ["mha", "absorbed"])
@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_logits_match_transformers(preset, form, artifact, hf_model, monkeypatch):
    # Both exact prefill forms (runtime/model/attention.py), forced one way or the other.
    monkeypatch.setattr(attention_forms, "ABSORBED_MAX_Q_LEN", 0 if form == "mha" else 1 << 30)
    engine = Engine.from_artifact(artifact(preset), dtype=torch.float32)
    model = hf_model(preset)
    for ids in prompts(engine.config.vocab_size):
        err = max_rel_err(engine.score(ids), hf_logits(model, ids))
        assert err <= PARITY_BOUND, (preset, err)


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy decoding through transformers' own KV cache, EOS allowed like any token
    (generate(min_new_tokens=...) would mask EOS and change the argmax)."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = []
    for _ in range(n):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_greedy_tokens_match_transformers(preset, artifact, hf_model):
    engine = Engine.from_artifact(artifact(preset), dtype=torch.float32)
    model = hf_model(preset)
    for ids in prompts(engine.config.vocab_size, n=2):
        want = hf_greedy(model, ids, GREEDY_TOKENS)
        got = engine.generate(ids, max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True).token_ids
        assert got == want, preset


def fp8_errors(engine: Engine, model) -> tuple[float, float]:
    """(rel_l2 over all prompts' logits, top-1 agreement)."""
    got, want = [], []
    for ids in prompts(engine.config.vocab_size):
        got.append(engine.score(ids).double())
        want.append(hf_logits(model, ids).double())
    got, want = torch.cat(got), torch.cat(want)
    return float((got - want).norm() / want.norm()), float(
        (got.argmax(-1) == want.argmax(-1)).double().mean()
    )


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_fp8_error_is_bounded(preset, artifact, hf_model):
    engine = Engine.from_artifact(artifact(preset, fp8=True), dtype=torch.float32)
    rel_l2, top1 = fp8_errors(engine, hf_model(preset))
    print(f"{preset} fp8: rel_l2={rel_l2:.4f} top1={top1:.3f}")
    assert 0 < rel_l2 <= FP8_BOUND, (preset, rel_l2)  # > 0: the FP8 path really ran


def _drop_scales(tensors: dict) -> None:
    for name in [n for n in tensors if n.endswith(".scale")]:
        tensors[name] = torch.ones_like(tensors[name])  # as if the scale were missing


def _transpose_blocks(tensors: dict) -> None:
    """Read every full 128x128 block transposed, as a kernel with swapped block strides would."""
    for name in [n.removesuffix(".scale") for n in tensors if n.endswith(".scale")]:
        w = tensors[name]
        *lead, n, k = w.shape
        if n % 128 == 0 and k % 128 == 0:
            blocks = w.reshape(*lead, n // 128, 128, k // 128, 128)
            tensors[name] = blocks.transpose(-1, -3).reshape(w.shape).contiguous()


@pytest.mark.parametrize(
    "corrupt", [_drop_scales, _transpose_blocks], ids=["missing-scale", "transposed-blocks"]
)
def test_wrong_fp8_path_fails_the_bound(corrupt, artifact, hf_model):
    path = artifact("tiny-v2", fp8=True)
    tensors = load_artifact(path, dtype=torch.float32).tensors
    corrupt(tensors)
    engine = Engine.from_artifact(path, dtype=torch.float32)
    broken = Engine.from_tensors(engine.config, tensors, dtype=torch.float32)
    rel_l2, _ = fp8_errors(broken, hf_model("tiny-v2"))
    print(f"{corrupt.__name__}: rel_l2={rel_l2:.3f}")
    assert rel_l2 > 2 * FP8_BOUND, rel_l2
