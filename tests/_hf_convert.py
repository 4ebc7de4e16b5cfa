"""Test helper: tiny random transformers DeepSeek models, converted to mlac tensor names.

Stands in for the compiler (mlac.compiler) in runtime tests: the conversion here follows the
tensor contract of artifacts/README.md, written independently of the compiler's passes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mlac.core.config import ModelConfig

BASE: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    routed_scaling_factor=1.0,
    norm_topk_prob=False,
    scoring_func="softmax",
    n_group=1,
    topk_group=1,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
    torch_dtype="float32",
)

PRESETS: dict[str, dict[str, Any]] = {
    # V2-Lite-like: plain q_proj, greedy softmax routing, YaRN with mscale == mscale_all_dim
    "v2-lite": dict(
        model_type="deepseek_v2",
        q_lora_rank=None,
        topk_method="greedy",
        rope_scaling=dict(
            type="yarn",
            factor=4.0,
            original_max_position_embeddings=64,
            beta_fast=32,
            beta_slow=1,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
    ),
    # V2-like: q_lora, group-limited greedy, YaRN with mscale != mscale_all_dim (cos/sin scaled)
    "v2": dict(
        model_type="deepseek_v2",
        q_lora_rank=48,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
        n_shared_experts=2,
        rope_scaling=dict(
            type="yarn",
            factor=8.0,
            original_max_position_embeddings=32,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=0.5,
        ),
    ),
    # V3-like: q_lora, noaux_tc sigmoid routing with a correction bias, YaRN
    "v3": dict(
        model_type="deepseek_v3",
        q_lora_rank=48,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_scaling=dict(
            type="yarn",
            factor=4.0,
            original_max_position_embeddings=64,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
    # V3 without rope scaling
    "v3-norope-scaling": dict(
        model_type="deepseek_v3",
        q_lora_rank=48,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        rope_scaling=None,
    ),
}


def raw_config(preset: str, **overrides: Any) -> dict[str, Any]:
    return {**BASE, **PRESETS[preset], **overrides}


def build_hf(raw: dict[str, Any], seed: int = 0, std: float = 0.1):
    """A random fp32 transformers model for `raw` (eager attention, weights drawn with `std`)."""
    import transformers

    cls_cfg, cls_model = {
        "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    }[raw["model_type"]]
    kwargs = {k: v for k, v in raw.items() if k not in ("model_type", "torch_dtype")}
    cfg = cls_cfg(**kwargs, attn_implementation="eager")
    torch.manual_seed(seed)
    model = cls_model(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # RMSNorm weights around 1
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def deinterleave(w: torch.Tensor, rope: int) -> torch.Tensor:
    """Reorder the last `rope` rows of w [.., rope + ?] pairs (r0 r1)(r2 r3).. -> r0 r2 .. r1 r3 .."""
    perm = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    head, tail = w[:-rope], w[-rope:]
    return torch.cat([head, tail[perm]])


def convert(model, config: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers DeepSeek state dict -> mlac tensors (1 rank, no FP8)."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    c = config
    h, nope, rope, v = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    out: dict[str, torch.Tensor] = {
        "embed": sd["model.embed_tokens.weight"],
        "norm": sd["model.norm.weight"],
        "head": sd["lm_head.weight"],
    }

    def q_rows(w: torch.Tensor) -> torch.Tensor:  # per head: nope rows, then de-interleaved rope rows
        w = w.view(h, nope + rope, -1)
        return torch.stack([deinterleave(w[i], rope) for i in range(h)]).reshape(h * (nope + rope), -1)

    for i in range(c.num_hidden_layers):
        s, o = f"model.layers.{i}.", f"layers.{i}."
        a = s + "self_attn."
        out[o + "attn_norm"] = sd[s + "input_layernorm.weight"]
        out[o + "ffn_norm"] = sd[s + "post_attention_layernorm.weight"]
        kv_a = deinterleave(sd[a + "kv_a_proj_with_mqa.weight"], rope)
        if c.q_lora_rank is not None:
            out[o + "attn.w_qkv_a"] = torch.cat([sd[a + "q_a_proj.weight"], kv_a])
            out[o + "attn.q_norm"] = sd[a + "q_a_layernorm.weight"]
            out[o + "attn.wq_b"] = q_rows(sd[a + "q_b_proj.weight"])
        else:
            out[o + "attn.wq"] = q_rows(sd[a + "q_proj.weight"])
            out[o + "attn.w_kv_a"] = kv_a
        out[o + "attn.kv_norm"] = sd[a + "kv_a_layernorm.weight"]
        kv_b = sd[a + "kv_b_proj.weight"].view(h, nope + v, c.kv_lora_rank)
        out[o + "attn.w_kc"] = kv_b[:, :nope, :].contiguous()
        out[o + "attn.w_vc"] = kv_b[:, nope:, :].transpose(1, 2).contiguous()
        out[o + "attn.wo"] = sd[a + "o_proj.weight"]
        m = s + "mlp."
        if c.is_moe_layer(i):
            out[o + "moe.gate"] = sd[m + "gate.weight"]
            if c.topk_method == "noaux_tc":
                out[o + "moe.gate_bias"] = sd[m + "gate.e_score_correction_bias"].float()
            out[o + "moe.w13"] = sd[m + "experts.gate_up_proj"]
            out[o + "moe.w2"] = sd[m + "experts.down_proj"]
            if c.n_shared_experts:
                sh = m + "shared_experts."
                out[o + "moe.shared.w13"] = torch.cat(
                    [sd[sh + "gate_proj.weight"], sd[sh + "up_proj.weight"]]
                )
                out[o + "moe.shared.w2"] = sd[sh + "down_proj.weight"]
        else:
            out[o + "mlp.w13"] = torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]])
            out[o + "mlp.w2"] = sd[m + "down_proj.weight"]
    return {k: t.contiguous() for k, t in out.items()}


# ---- a minimal artifact writer (until mlac.compiler lands) -------------------------------------

SAFETENSORS_DTYPE = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float8_e4m3fn: "F8_E4M3",
}


def _file_of(name: str, n_layers: int) -> str:
    if name == "embed":
        return "embed.safetensors"
    if name.startswith("layers."):
        return f"layer-{int(name.split('.')[1]):05d}.safetensors"
    return "head.safetensors"


def write_artifact(
    out: Path, raw: dict[str, Any], tensors: dict[str, torch.Tensor], tokenizer_dir: Path | None
) -> Path:
    """Write tensors + manifest in the artifact layout (1 rank). Returns `out`."""
    from mlac.core.artifact import IDENTITY, Manifest, artifact_identity, identity_record

    config = ModelConfig.from_hf(raw)
    out.mkdir(parents=True, exist_ok=True)
    rank = "rank-00000-of-00001"
    (out / rank).mkdir(exist_ok=True)
    by_file: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        by_file.setdefault(_file_of(name, config.num_hidden_layers), {})[name] = t
    entries = {}
    for fname, group in by_file.items():
        save_file({k: v.contiguous() for k, v in sorted(group.items())}, str(out / rank / fname))
        for name, t in group.items():
            entries[name] = {
                "file": f"{rank}/{fname}",
                "dtype": SAFETENSORS_DTYPE[t.dtype],
                "shape": list(t.shape),
            }
    if tokenizer_dir is not None:
        (out / "tokenizer").mkdir(exist_ok=True)
        for f in sorted(tokenizer_dir.iterdir()):
            (out / "tokenizer" / f.name).write_bytes(f.read_bytes())
    files = []
    for path in sorted(p for p in out.rglob("*") if p.is_file() and p.name != "manifest.json"):
        data = path.read_bytes()
        files.append(
            {
                "path": path.relative_to(out).as_posix(),
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )
    manifest = Manifest.model_validate(
        {
            "mlac_version": "test",
            "torch_version": torch.__version__,
            "triton_version": None,
            "source": {"config_sha256": "0" * 64, "files": 1, "bytes": 0, "dtypes": ["F32"]},
            "model": config.model_dump(mode="json"),
            "options": {},
            "passes": [],
            "plan": {},
            "quantization": {"scheme": "none"},
            "accuracy": {"status": "skipped", "reason": "test"},
            "tensors": [entries],
            "files": files,
        }
    )
    (out / "manifest.json").write_text(manifest.to_json())
    (out / IDENTITY).write_text(identity_record(artifact_identity(out)))
    return out


def make_tokenizer(out: Path, vocab_size: int = 256) -> Path:
    """A byte-level BPE tokenizer with <bos>=0, <eos>=1, trained on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = ["the quick brown fox jumps over the lazy dog", "hello world, hello mlac", "DeepSeek MLA MoE"] * 20
    tok.train_from_iterator(text, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    template = (
        "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    cfg = {
        "bos_token": "<bos>",
        "eos_token": {"content": "<eos>"},
        "add_bos_token": True,
        "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out
