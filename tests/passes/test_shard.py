"""The shard pass: per-rank slices add up to the 1-rank artifact, and bad plans are refused early."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from mlac.cli import main
from mlac.compiler.pipeline import compile_tensors
from mlac.core.artifact import CompileOptions, Manifest
from mlac.core.config import ModelConfig
from mlac.core.errors import MlacError
from mlac.passes import shard

REPLICATED = ("attn_norm", "ffn_norm", "attn.w_qkv_a", "attn.w_kv_a", "attn.q_norm", "attn.kv_norm", "moe.gate",
              "moe.gate_bias", "norm", "enorm", "hnorm", "eh_proj")  # fmt: skip


def kind(name: str, ep: int) -> str:
    layer = name.startswith(("layers.", "mtp."))  # an MTP layer's block is sharded as a layer
    suffix = name.removesuffix(".scale").split(".", 2)[-1] if layer else name
    if suffix in REPLICATED:
        return "replicated"
    if suffix in ("attn.wo", "mlp.w2", "moe.shared.w2") or (suffix == "moe.w2" and ep == 1):
        return "cols"
    if suffix in ("mlp.w13", "moe.shared.w13") or (suffix == "moe.w13" and ep == 1):
        return "gate_up"
    return "rows"  # wq/wq_b, w_kc/w_vc (heads), whole experts, embed/head (vocab)


def reassemble(parts: list[torch.Tensor], how: str) -> torch.Tensor:
    if how == "replicated":
        assert all(torch.equal(p, parts[0]) for p in parts)
        return parts[0]
    if how == "cols":
        return torch.cat(parts, dim=-1)
    if how == "gate_up":  # each rank: [gate slice; up slice] along the rows of each matrix
        halves = [p.chunk(2, dim=-2) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=-2)
    return torch.cat(parts, dim=0)


@pytest.mark.parametrize("preset", ["tiny-v2-lite", "tiny-v2", "tiny-v3"])
@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2), (4, 1)])
def test_slices_add_up_to_one_rank(preset, tp, ep, checkpoint):
    whole = compile_tensors(checkpoint(preset))[0]
    ranks = compile_tensors(checkpoint(preset), CompileOptions(tp=tp, ep=ep))
    assert len(ranks) == tp and all(set(r) == set(whole) for r in ranks)
    sliced_bytes = 0
    for name, full in whole.items():
        how = kind(name, ep)
        got = reassemble([r[name] for r in ranks], how)
        assert torch.equal(got, full), (name, how)
        if how != "replicated":
            sliced_bytes += sum(r[name].nbytes for r in ranks)
            assert all(r[name].nbytes * tp == full.nbytes for r in ranks), name
    assert sliced_bytes == sum(t.nbytes for n, t in whole.items() if kind(n, ep) != "replicated")


def test_fp8_source_blocks_are_sliced_with_their_weights(checkpoint):
    """tiny-v3 is stored in FP8. A cut on a 128 boundary slices weight and scales exactly; a cut
    inside a block (wo: 2 x 64 columns) is dequantized and requantized with blocks of its own."""
    from mlac.kernels.gemm.fp8_gemm import dequantize_blocks

    whole = compile_tensors(checkpoint("tiny-v3"), CompileOptions(fp8=True))[0]
    ranks = compile_tensors(checkpoint("tiny-v3"), CompileOptions(fp8=True, tp=2, ep=2))
    exact = 0
    for name in [n for n in whole if n.endswith(".scale")]:
        w = name.removesuffix(".scale")
        deq = [dequantize_blocks(r[w], r[name]) for r in ranks]
        got, want = reassemble(deq, kind(w, 2)), dequantize_blocks(whole[w], whole[name])
        if torch.equal(got, want):
            exact += 1
        else:
            torch.testing.assert_close(got, want, rtol=0.07, atol=0.07 * float(want.abs().max()))
    assert exact >= 3 * 2  # per MoE layer at least the experts (w13, w2) and wq_b are kept block for block


def test_per_rank_files_show_the_split(artifact, checkpoint, tmp_path):
    out = tmp_path / "tp2"
    r = CliRunner().invoke(main, ["compile", str(checkpoint("tiny-v2")), str(out), "--tp", "2"])
    assert r.exit_code == 0, r.output
    m = Manifest.load(out)
    assert m.plan.tp == 2 and len(m.tensors) == 2
    # the accuracy check ran the artifact with its 2 ranks against the 1-rank unquantized source
    assert m.accuracy.status == "measured" and m.accuracy.rel_l2 < 1e-5 and m.accuracy.top1_agreement == 1.0
    sizes = {}
    for f in m.files:
        if f.path.startswith("rank-"):
            sizes[f.path.split("/")[0]] = sizes.get(f.path.split("/")[0], 0) + f.size
    assert sorted(sizes) == ["rank-00000-of-00002", "rank-00001-of-00002"]
    one = sum(f.size for f in Manifest.load(artifact("tiny-v2")).files if f.path.startswith("rank-"))
    assert all(s < 0.6 * one for s in sizes.values()), (sizes, one)


def _cfg(checkpoint, **changes) -> ModelConfig:
    raw = json.loads((checkpoint("tiny-v2") / "config.json").read_text())
    raw.update(changes)
    return ModelConfig.from_hf(raw)


@pytest.mark.parametrize(
    "changes,tp,ep,needle",
    [
        ({}, 3, 1, "num_attention_heads=4"),
        ({"vocab_size": 2049}, 2, 1, "vocab_size=2049"),
        ({"moe_intermediate_size": 101}, 2, 1, "moe_intermediate_size=101"),
        ({"intermediate_size": 510}, 4, 1, "intermediate_size=510"),
        ({"n_routed_experts": 6, "n_group": 2, "topk_group": 1}, 4, 4, "n_routed_experts=6"),
        ({}, 2, 3, "--ep 3"),
    ],
)
def test_bad_plans_are_refused_naming_the_dimension(checkpoint, changes, tp, ep, needle):
    with pytest.raises(MlacError, match=needle.replace("*", r"\*")):
        shard.check(_cfg(checkpoint, **changes), CompileOptions(tp=tp, ep=ep))


def test_refusal_happens_before_reading(checkpoint, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint("tiny-v2"), ckpt)
    for f in ckpt.glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:1000])  # any read of tensor data would fail differently
    r = CliRunner().invoke(main, ["compile", str(ckpt), str(tmp_path / "out"), "--tp", "3"])
    assert r.exit_code == 1
    assert r.output.strip().splitlines()[-1] == "error: --tp 3 does not divide num_attention_heads=4"
