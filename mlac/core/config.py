"""ModelConfig: a DeepSeek `config.json`, parsed once, validated and frozen.

Every field here changes the math of the model. Anything mlac does not implement is refused
with an error that names the field and its value; nothing is guessed from shapes or names.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mlac.core.errors import MlacError
from mlac.core.jsonio import load_json

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
FP8_BLOCK = 128

Positive = Annotated[int, Field(gt=0)]  # a size or count that must be at least 1
Count = Annotated[int, Field(ge=0)]  # a count that may be 0
PositiveFloat = Annotated[float, Field(gt=0)]


class Frozen(BaseModel):
    """Frozen, no unknown fields, no NaN or inf. `from_hf` validates strictly: a JSON string is not
    a number, a bool not an int."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class YarnScaling(Frozen):
    """YaRN rope scaling (the only scaling DeepSeek uses)."""

    factor: PositiveFloat
    original_max_position_embeddings: Positive
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


class FP8Source(Frozen):
    """The checkpoint's own FP8 format: e4m3 weights with a float32 `weight_scale_inv` per block."""

    fmt: Literal["e4m3"] = "e4m3"
    activation_scheme: Literal["dynamic"] = "dynamic"
    weight_block_size: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)


class ModelConfig(Frozen):
    model_type: Literal["deepseek_v2", "deepseek_v3"]
    vocab_size: Positive
    hidden_size: Positive
    intermediate_size: Positive
    num_hidden_layers: Positive
    num_attention_heads: Positive
    # MLA
    q_lora_rank: Positive | None  # None: plain q_proj (V2-Lite, Moonlight)
    kv_lora_rank: Positive
    qk_nope_head_dim: Positive
    qk_rope_head_dim: Positive
    v_head_dim: Positive
    # MoE
    n_routed_experts: Positive | None  # None: every layer dense
    n_shared_experts: Count
    num_experts_per_tok: Count  # <= n_routed_experts, and >= 1 when there are routed experts
    moe_intermediate_size: Count
    first_k_dense_replace: Count
    moe_layer_freq: Positive
    topk_method: Literal["greedy", "group_limited_greedy", "noaux_tc"]
    scoring_func: Literal["softmax", "sigmoid"]
    n_group: Positive
    topk_group: Positive
    norm_topk_prob: bool
    routed_scaling_factor: PositiveFloat
    # norms, rope, vocabulary
    rms_norm_eps: PositiveFloat
    rope_theta: PositiveFloat
    rope_scaling: YarnScaling | None
    max_position_embeddings: Positive
    bos_token_id: Count | None
    eos_token_ids: tuple[Count, ...]
    # extras
    num_nextn_predict_layers: Count  # MTP layers stored after the main ones (V3)
    quantization: FP8Source | None  # set when the checkpoint itself is FP8
    torch_dtype: Literal["bfloat16", "float16", "float32"]

    # ---- derived quantities (named once here, used everywhere) ----

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_latent_dim(self) -> int:
        """Width of one cached token per layer: the latent plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.n_routed_experts is not None
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times mscale² under YaRN (mscale from mscale_all_dim)."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_mscale(rs.factor, rs.mscale_all_dim)
            scale *= m * m
        return scale

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise MlacError(f"{path}: config.json not found (is {model_dir} a Hugging Face checkpoint?)")
        return cls.from_hf(load_json(path.read_bytes(), str(path)), source=str(path))

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Parse a Hugging Face DeepSeek config dict; refuse what mlac cannot run: wrong types
        (strictly: "64" is not an int), NaN or inf, values out of range, inconsistent counts."""
        try:
            config = cls.model_validate(_translate(raw, source), strict=True)
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(p) for p in err["loc"])
            raise MlacError(f"{source}: field {field!r}: {err['msg']} (got {err.get('input')!r})") from None
        _check_moe(config, source)
        return config


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# ---------------------------------------------------------------------------------------------


def _refuse(source: str, field: str, value: Any, why: str) -> MlacError:
    return MlacError(f"{source}: unsupported {field}={value!r}: {why}")


def _translate(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """Map HF config.json keys onto ModelConfig fields, checking the ones mlac fixes."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _refuse(source, "model_type", model_type, f"mlac compiles {', '.join(SUPPORTED_MODEL_TYPES)}")
    v3 = model_type == "deepseek_v3"

    fixed = {
        "hidden_act": ("silu", "only SiLU-gated MLPs are implemented"),
        "attention_bias": (False, "DeepSeek attention has no biases"),
        "tie_word_embeddings": (False, "DeepSeek's embedding and LM head are separate tensors"),
        "mlp_bias": (False, "DeepSeek MLPs have no biases"),
    }
    for field, (want, why) in fixed.items():
        if field in raw and raw[field] != want:
            raise _refuse(source, field, raw[field], why)
    if raw.get("rope_interleave", True) is not True:
        raise _refuse(
            source, "rope_interleave", raw["rope_interleave"], "DeepSeek checkpoints store rope interleaved"
        )

    n_routed = raw.get("n_routed_experts")
    topk_method = raw.get("topk_method", "noaux_tc" if v3 else "greedy")
    scoring = raw.get("scoring_func", "sigmoid" if v3 else "softmax")
    n_group = raw.get("n_group") or 1
    topk_group = raw.get("topk_group") or 1
    if raw.get("num_key_value_heads") not in (None, raw.get("num_attention_heads")):
        raise _refuse(source, "num_key_value_heads", raw["num_key_value_heads"], "MLA has one latent KV head")

    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))

    return {
        "model_type": model_type,
        "vocab_size": raw.get("vocab_size"),
        "hidden_size": raw.get("hidden_size"),
        "intermediate_size": raw.get("intermediate_size"),
        "num_hidden_layers": raw.get("num_hidden_layers"),
        "num_attention_heads": raw.get("num_attention_heads"),
        "q_lora_rank": raw.get("q_lora_rank"),
        "kv_lora_rank": raw.get("kv_lora_rank"),
        "qk_nope_head_dim": raw.get("qk_nope_head_dim"),
        "qk_rope_head_dim": raw.get("qk_rope_head_dim"),
        "v_head_dim": raw.get("v_head_dim"),
        "n_routed_experts": n_routed,
        "n_shared_experts": raw.get("n_shared_experts") or 0,
        "num_experts_per_tok": raw.get("num_experts_per_tok") or 0,
        "moe_intermediate_size": raw.get("moe_intermediate_size") or 0,
        "first_k_dense_replace": raw.get("first_k_dense_replace", 0),
        "moe_layer_freq": raw.get("moe_layer_freq", 1),
        "topk_method": topk_method,
        "scoring_func": scoring,
        "n_group": n_group,
        "topk_group": topk_group,
        # defaults as transformers' DeepseekV2Config / DeepseekV3Config (real configs set both)
        "norm_topk_prob": raw.get("norm_topk_prob", v3),
        "routed_scaling_factor": raw.get("routed_scaling_factor", 2.5 if v3 else 1.0),
        "rms_norm_eps": raw.get("rms_norm_eps", 1e-6),
        "rope_theta": raw.get("rope_theta", _rope_parameters(raw, source).get("rope_theta", 10000.0)),
        "rope_scaling": _rope_scaling(raw, source),
        "max_position_embeddings": raw.get("max_position_embeddings"),
        "bos_token_id": raw.get("bos_token_id"),
        "eos_token_ids": eos_ids,
        "num_nextn_predict_layers": raw.get("num_nextn_predict_layers", 0),
        "quantization": _quantization(raw, source),
        "torch_dtype": raw.get("torch_dtype") or raw.get("dtype") or "bfloat16",
    }


def _check_moe(cfg: ModelConfig, source: str) -> None:
    """The routing counts agree with each other, and rope works on pairs (checked once the types
    are known good)."""
    if cfg.qk_rope_head_dim % 2:
        raise _refuse(
            source, "qk_rope_head_dim", cfg.qk_rope_head_dim, "must be even (rope rotates pairs of dims)"
        )
    n = cfg.n_routed_experts
    if n is None:
        return
    if n % cfg.n_group:
        raise _refuse(source, "n_group", cfg.n_group, f"must divide n_routed_experts={n}")
    if cfg.topk_group > cfg.n_group:
        raise _refuse(source, "topk_group", cfg.topk_group, f"must be <= n_group={cfg.n_group}")
    if not 1 <= cfg.num_experts_per_tok <= n:
        why = f"must be between 1 and n_routed_experts={n}"
        raise _refuse(source, "num_experts_per_tok", cfg.num_experts_per_tok, why)


def _object(raw: dict[str, Any], field: str, source: str) -> dict[str, Any] | None:
    """raw[field] when it is a JSON object or null/absent; anything else is refused."""
    value = raw.get(field)
    if value is not None and not isinstance(value, dict):
        raise _refuse(source, field, value, "expected a JSON object (or null)")
    return value


def _rope_parameters(raw: dict[str, Any], source: str) -> dict[str, Any]:
    return _object(raw, "rope_parameters", source) or {}


def _rope_scaling(raw: dict[str, Any], source: str) -> dict[str, Any] | None:
    rs = _object(raw, "rope_scaling", source)
    if rs is None:
        params = _rope_parameters(raw, source)
        if params.get("rope_type", "default") == "default":
            return None
        rs = params
    kind = rs.get("type", rs.get("rope_type"))
    if kind != "yarn":
        raise _refuse(source, "rope_scaling.type", kind, "only YaRN rope scaling is implemented")
    keys = (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
    )
    return {k: rs[k] for k in keys if rs.get(k) is not None}


def _quantization(raw: dict[str, Any], source: str) -> dict[str, Any] | None:
    qc = _object(raw, "quantization_config", source)
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method != "fp8":
        raise _refuse(source, "quantization_config.quant_method", method, "only the block-FP8 format is read")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(source, "quantization_config.fmt", fmt, "only e4m3 FP8 weights are read")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _refuse(
            source, "quantization_config.activation_scheme", scheme, "only dynamic activation scaling"
        )
    block = qc.get("weight_block_size")
    if block != [FP8_BLOCK, FP8_BLOCK] or any(type(b) is not int for b in block):
        raise _refuse(source, "quantization_config.weight_block_size", block, "only [128, 128] blocks")
    return {"fmt": fmt, "activation_scheme": scheme, "weight_block_size": (FP8_BLOCK, FP8_BLOCK)}
