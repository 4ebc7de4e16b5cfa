"""FP8 artifacts: activations quantized once, by the norm / SiLU·mul that makes them, change no bit.

The model quantizes a normed hidden state in the norm's launch (`Reads.FP8`, `FP8_AND_X`) and
silu·mul's output in its launch, and the FP8 GEMMs read that `Fp8Act`; before, every FP8 GEMM
quantized its bf16 input itself. Here the same artifact runs both ways on the CPU path (the
references): logits bit-identical, greedy tokens identical, and every FP8 GEMM but `wo` (the
attention output, still quantized by its GEMM) reads an Fp8Act.
"""

from __future__ import annotations

import pytest
import torch

import mlac.runtime.model.layers as layers
import mlac.runtime.model.model as model_mod
from mlac.kernels.activation import silu_mul
from mlac.kernels.fp8_quant import Fp8Act
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.model.layers import Reads, RMSNorm
from mlac.runtime.model.model import MoE

PRESETS = ("tiny-v2-lite", "tiny-v3")  # q_lora None (wq and w_kv_a share one Fp8Act) / fused w_qkv_a


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def unfused_engine(path, **kwargs) -> Engine:
    """The path before: every norm and silu·mul writes bf16, every FP8 GEMM quantizes its input.
    Built so (CUDA graphs, where there are, are captured at construction)."""
    init = RMSNorm.__init__
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RMSNorm, "__init__", lambda self, w, name, eps, reads=None: init(self, w, name, eps))
        mp.setattr(model_mod, "silu_mul_quant", silu_mul)
        return Engine.from_artifact(path, **kwargs)


def norm_reads(engine: Engine) -> set[Reads]:
    return {m.reads for m in engine.runner.model.modules() if isinstance(m, RMSNorm)}


@pytest.mark.parametrize("preset", PRESETS)
def test_quantizing_once_changes_no_logit_and_no_token(preset, artifact):
    path = artifact(preset, fp8=True)
    fused, before = Engine.from_artifact(path), unfused_engine(path)
    assert norm_reads(fused) == {Reads.X, Reads.FP8, Reads.FP8_AND_X} and norm_reads(before) == {Reads.X}
    ids = prompt(24, seed=1)
    assert torch.equal(fused.score(ids), before.score(ids))  # prefill / extend
    out = fused.generate(ids, max_tokens=16, ignore_eos=True).token_ids
    assert out == before.generate(ids, max_tokens=16, ignore_eos=True).token_ids  # decode
    assert len(set(out)) > 2  # not degenerate


@pytest.mark.parametrize("preset", PRESETS)
def test_fp8_gemms_read_their_input_quantized_by_its_producer(preset, artifact, monkeypatch):
    engine = Engine.from_artifact(artifact(preset, fp8=True))
    model = engine.runner.model
    wo = {id(layer.attn.wo.weight) for layer in model.layers}
    plain, pre_quantized, moe_acts = [], [], []
    real_linear = layers.fp8_linear

    def spy_linear(x, w, *args, **kwargs):
        (pre_quantized if isinstance(x, Fp8Act) else plain).append(id(w))
        return real_linear(x, w, *args, **kwargs)

    real_moe = MoE.forward

    def spy_moe(self, x):
        moe_acts.append(isinstance(x, Fp8Act) and x.x is not None)
        return real_moe(self, x)

    monkeypatch.setattr(layers, "fp8_linear", spy_linear)
    monkeypatch.setattr(MoE, "forward", spy_moe)
    engine.generate(prompt(9, seed=2), max_tokens=3, ignore_eos=True)
    assert plain and set(plain) <= wo  # only the attention output is quantized by its GEMM
    assert pre_quantized and moe_acts and all(moe_acts)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", PRESETS)
def test_gpu_cuda_graph_decode_gives_the_tokens_of_before(preset, artifact):
    """Triton kernels, decode replayed from CUDA graphs: the fused kernels give the bits of
    act_quant + GEMM, so greedy tokens equal those of the unfused path captured the same way."""
    path = artifact(preset, fp8=True)
    kw = dict(device="cuda", dtype=torch.bfloat16, verify=False, num_blocks=256, cuda_graph_max_bs=4)
    fused, before = Engine.from_artifact(path, **kw), unfused_engine(path, **kw)
    assert fused.runner.graphs is not None and before.runner.graphs is not None
    for n in (1, 3):  # batch 1, and 3 padded to the bucket of 4
        prompts = [prompt(5 + 4 * i, seed=10 + i) for i in range(n)]
        params = SamplingParams(max_tokens=16, ignore_eos=True)
        got = [c.token_ids for c in fused.generate(prompts, params)]
        assert got == [c.token_ids for c in before.generate(prompts, params)], f"batch {n}"
