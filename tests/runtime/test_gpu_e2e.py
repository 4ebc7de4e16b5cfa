"""On CUDA the runtime runs the Triton kernels (MLA decode, extend attention, block-FP8 GEMM,
fused MoE); its logits must match the CPU reference path within the dtype's bound.

float32, bf16 weights: the kernels compute in float32 (no TF32): max relative logit error
<= 1e-4 and 32 identical greedy tokens (measured on an H200: <= 1.4e-6).
float32, FP8 weights: activations are quantized bit-exactly as the reference does, so short
prompts match to <= 1e-5 (measured 2.5e-7). Over longer prompts, GPU vs CPU summation order
flips single e4m3 activation roundings, which these random-weight models amplify (measured
rel_l2 0.02-0.12 on 40 tokens, the same with the torch references in place of both FP8 kernels
on the GPU: benchmarks/results/gpu_e2e_h200.json); that stays within the FP8 accuracy bound.
bfloat16: compared with the CPU float32 reference, rel_l2 <= BF16_BOUND (bf16 rounding of
activations, compounded over layers and expert choices, as transformers shows in bf16 too).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from mlac.runtime.engine.engine import Engine

pytestmark = pytest.mark.gpu

PRESETS = ("tiny-v2-lite", "tiny-v2", "tiny-v3")
BF16_BOUND = 0.3
FP8_BOUND = 0.4  # as tests/runtime/model/test_hf_parity.py: FP8 artifact vs float32 reference
RESULTS: dict[str, dict] = {}


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (40 + 5 * i,), generator=g).tolist() for i in range(3)]


def errors(engine: Engine, ref: Engine, length: int | None = None) -> tuple[float, float]:
    ps = [p[:length] for p in prompts(ref.config.vocab_size)]
    got = torch.cat([engine.score(p).cpu().double() for p in ps])
    want = torch.cat([ref.score(p).double() for p in ps])
    return float((got - want).abs().max() / want.abs().max()), float((got - want).norm() / want.norm())


@pytest.fixture(scope="module", autouse=True)
def record():
    yield
    out = os.environ.get("MLAC_GPU_RESULTS")
    if out:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": RESULTS}, f, indent=2)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-weights", "fp8-weights"])
@pytest.mark.parametrize("preset", PRESETS)
def test_gpu_float32_matches_cpu(preset, fp8, artifact):
    path = artifact(preset, fp8=fp8)
    ref = Engine.from_artifact(path, device="cpu", dtype=torch.float32)
    gpu = Engine.from_artifact(path, device="cuda", dtype=torch.float32)
    max_rel, rel_l2 = errors(gpu, ref)
    short_rel, _ = errors(gpu, ref, length=4)
    ids = prompts(ref.config.vocab_size)[0]
    same = (
        gpu.generate(ids, max_tokens=32, ignore_eos=True).token_ids
        == ref.generate(ids, max_tokens=32, ignore_eos=True).token_ids
    )
    RESULTS[f"{preset}/{'fp8' if fp8 else 'bf16'}/float32"] = {
        "max_rel": max_rel, "rel_l2": rel_l2, "short_max_rel": short_rel, "greedy_32_identical": same,
    }  # fmt: skip
    if fp8:
        assert short_rel <= 1e-5, short_rel
        assert rel_l2 <= FP8_BOUND, rel_l2
    else:
        assert max_rel <= 1e-4, max_rel
        assert same


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-weights", "fp8-weights"])
@pytest.mark.parametrize("preset", PRESETS)
def test_gpu_bfloat16_within_bound(preset, fp8, artifact):
    path = artifact(preset, fp8=fp8)
    ref = Engine.from_artifact(path, device="cpu", dtype=torch.float32)
    gpu = Engine.from_artifact(path, device="cuda", dtype=torch.bfloat16)
    max_rel, rel_l2 = errors(gpu, ref)
    RESULTS[f"{preset}/{'fp8' if fp8 else 'bf16'}/bfloat16"] = {"max_rel": max_rel, "rel_l2": rel_l2}
    assert rel_l2 <= BF16_BOUND, rel_l2
