"""The model's building blocks as ONNX subgraphs, in float32, over packed tokens x [N, D] (N = B·T).

Each function mirrors the runtime module of the same name (mlac/runtime/model/model.py, layers.py) and
reads the artifact's tensors under the same names. A block-FP8 weight runs as the runtime's W8A8
does on CPU (kernels/fp8_gemm.fp8_linear_ref): the activations are quantized per token per 128
channels (QuantizeLinear to e4m3 with a dynamic blocked scale = amax / 448, then DequantizeLinear),
the weight is dequantized from its blocks, and the product is a float32 MatMul. This is the Q/DQ
form that TensorRT and other compilers fuse into an FP8 GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

from onnx import TensorProto

from mlac.core.config import ModelConfig
from mlac.core.fp8 import BLOCK, FP8_MAX
from mlac.export.onnx.builder import GraphBuilder
from mlac.export.onnx.weights import ArtifactWeights

LATENT_NORM_EPS = 1e-6  # as runtime/model.py: q_norm / kv_norm


@dataclass(frozen=True)
class Step:
    """The per-step tensors every layer reads: names in the graph."""

    bt: str  # int64 [2]: (B, T)
    cos: str  # float32 [T, R]
    sin: str  # float32 [T, R]
    mask: str  # float32 [T, P + T]: 0 where a query may attend, -inf elsewhere


def linear(g: GraphBuilder, w: ArtifactWeights, name: str, x: str, part: int | None = None) -> str:
    """x [N, K] -> x @ W.T [N, out] float32; an FP8 W quantizes x first, as the runtime does."""
    weight, fp8 = w.matrix(name, part)  # [out, K] float32
    if fp8:
        x = quantize_activations(g, x, w.shape(name)[-1])
    return g.op("MatMul", x, g.op("Transpose", weight, perm=[1, 0]))


def quantize_activations(g: GraphBuilder, x: str, k: int) -> str:
    """x [N, K] -> e4m3-rounded x [N, K] float32, one scale per token per 128 channels (the
    runtime's quantize_act_ref: scale = max(amax, 1e-12) / 448, q = saturate(round(x / scale)))."""
    groups = -(-k // BLOCK)
    padded = x if k % BLOCK == 0 else g.op("Pad", x, g.ints(0, 0, 0, groups * BLOCK - k))  # zeros: no amax
    groups = g.reshape(padded, g.dim(x, 0), g.ints(groups, BLOCK))  # [N, K/128, 128]
    amax = g.op("ReduceMax", g.op("Abs", groups), g.ints(2), keepdims=0)  # [N, K/128]
    scale = g.op("Div", g.op("Max", amax, g.const(1e-12)), g.const(FP8_MAX))
    e4m3 = TensorProto.FLOAT8E4M3FN
    q = g.op("QuantizeLinear", x, scale, axis=1, block_size=BLOCK, output_dtype=e4m3, saturate=1)
    return g.op("DequantizeLinear", q, scale, axis=1, block_size=BLOCK)


def rms_norm(g: GraphBuilder, w: ArtifactWeights, name: str, x: str, eps: float) -> str:
    """x [..., D] -> x / sqrt(mean(x²) + eps) * weight."""
    ms = g.op("ReduceMean", g.op("Mul", x, x), g.ints(-1), keepdims=1)
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", ms, g.const(eps))))
    return g.op("Mul", g.op("Mul", x, inv), w.float32(name))


def rope(g: GraphBuilder, x: str, cos: str, sin: str) -> str:
    """Rotate-half rope: x [..., T, (H,) R] with cos/sin broadcast to it -> x·cos + rotate_half(x)·sin."""
    x1, x2 = g.ops("Split", x, outputs=2, axis=-1)
    rotated = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
    return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rotated, sin))


def silu_mul(g: GraphBuilder, h: str, inter: int) -> str:
    """h [N, 2I] = gate ‖ up -> silu(gate) · up [N, I]."""
    gate, up = g.split(h, 1, [inter, inter])
    return g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)


def mlp(g: GraphBuilder, w: ArtifactWeights, prefix: str, x: str, part: int | None = None) -> str:
    """w2(silu(gate) · up), gate ‖ up = w13(x): dense layers, shared and routed experts."""
    h = linear(g, w, f"{prefix}.w13", x, part)
    inter = w.shape(f"{prefix}.w13")[-2] // 2
    return linear(g, w, f"{prefix}.w2", silu_mul(g, h, inter), part)


def attention(
    g: GraphBuilder, w: ArtifactWeights, c: ModelConfig, layer: int, x: str, past: str, step: Step
) -> tuple[str, str]:
    """MLA in absorbed form: x [N, D], past latents [B, P, C + R] -> (out [N, D], present [B, P + T, C + R]).

    Each new token's cache entry is kv_norm(latent) ‖ rope(k_rope), as the runtime caches it; the
    queries attend to the latents themselves (MQA with K = latent ‖ rope, V = latent), causally."""
    p = f"layers.{layer}.attn"
    q_nope, q_rope, entry = project(g, w, c, p, x, step)
    present = g.op("Concat", past, entry, axis=1)  # [B, S = P + T, C + R]
    q_lat = g.op("MatMul", q_nope, w.float32(f"{p}.w_kc"))  # [B, H, T, C]
    keys = g.op("Unsqueeze", g.op("Transpose", present, perm=[0, 2, 1]), g.ints(1))  # [B, 1, C + R, S]
    scores = g.op("MatMul", g.op("Concat", q_lat, q_rope, axis=-1), keys)  # [B, H, T, S]
    scores = g.op("Add", g.op("Mul", scores, g.const(c.softmax_scale)), step.mask)
    values = g.op("Unsqueeze", g.slice(present, 2, 0, c.kv_lora_rank), g.ints(1))  # [B, 1, S, C]
    o_lat = g.op("MatMul", g.op("Softmax", scores, axis=-1), values)  # [B, H, T, C]
    o = g.op("MatMul", o_lat, w.float32(f"{p}.w_vc"))  # [B, H, T, v]
    o = g.reshape(g.op("Transpose", o, perm=[0, 2, 1, 3]), -1, c.num_attention_heads * c.v_head_dim)
    return linear(g, w, f"{p}.wo", o), present  # [N, D]


def project(
    g: GraphBuilder, w: ArtifactWeights, c: ModelConfig, p: str, x: str, step: Step
) -> tuple[str, str, str]:
    """x [N, D] -> q_nope [B, H, T, nope], roped q_rope [B, H, T, R], and the new cache entries
    kv_norm(latent) ‖ rope(k_rope) [B, T, C + R] (the runtime's mla_prep)."""
    h, nope, r, cl = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
    if c.q_lora_rank is not None:
        q_a, kv = g.split(
            linear(g, w, f"{p}.w_qkv_a", x), 1, [c.q_lora_rank, cl + r]
        )  # q_a ‖ latent ‖ k_rope
        q = linear(g, w, f"{p}.wq_b", rms_norm(g, w, f"{p}.q_norm", q_a, LATENT_NORM_EPS))
    else:
        q, kv = linear(g, w, f"{p}.wq", x), linear(g, w, f"{p}.w_kv_a", x)  # kv [N, C + R]
    q = g.op(
        "Transpose", g.reshape(q, step.bt, g.ints(h, nope + r)), perm=[0, 2, 1, 3]
    )  # [B, H, T, nope + R]
    q_nope, q_rope = g.split(q, 3, [nope, r])
    cos_h, sin_h = (g.op("Unsqueeze", t, g.ints(0)) for t in (step.cos, step.sin))  # [1, T, R]
    latent, k_rope = g.split(g.reshape(kv, step.bt, g.ints(cl + r)), 2, [cl, r])  # [B, T, C], [B, T, R]
    normed = rms_norm(g, w, f"{p}.kv_norm", latent, LATENT_NORM_EPS)
    entry = g.op("Concat", normed, rope(g, k_rope, step.cos, step.sin), axis=-1)
    return q_nope, rope(g, q_rope, cos_h, sin_h), entry
