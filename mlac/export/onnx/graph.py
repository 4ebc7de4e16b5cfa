"""The whole model as one ONNX graph with dynamic batch, sequence and past lengths.

    inputs   input_ids             int64   [batch, seq]
             past_latents.{i}      float32 [batch, past, kv_lora + rope]   (i = 0 .. layers-1)
    outputs  logits                float32 [batch, seq, vocab]
             present_latents.{i}   float32 [batch, past + seq, kv_lora + rope]

Prefill is a call with past = 0 (empty past latents), decode a call with seq = 1 that feeds back
the previous call's present latents: the MLA latent cache is explicit, in the runtime's layout
(kv_norm(latent) ‖ roped k_rope per token). Token t of a call sits at position past + t; every
sequence of a batch has the same past length (no padding inside the graph). The rope tables
cos/sin are computed inside the graph from those positions and the stored inv_freq.
"""

from __future__ import annotations

from typing import Any

from onnx import ModelProto, TensorProto, helper

from mlac.core.config import ModelConfig
from mlac.core.rope import rope_parameters
from mlac.export.onnx.builder import IR_VERSION, OPSET, GraphBuilder, value_info
from mlac.export.onnx.layers import Step, attention, mlp, rms_norm
from mlac.export.onnx.moe import moe
from mlac.export.onnx.weights import ArtifactWeights

INPUT_IDS, LOGITS = "input_ids", "logits"


def past_name(layer: int) -> str:
    return f"past_latents.{layer}"


def present_name(layer: int) -> str:
    return f"present_latents.{layer}"


def build_model(c: ModelConfig, w: ArtifactWeights) -> ModelProto:
    """The graph over the artifact's tensors (external data); `w.copies` then says what to write."""
    g = w.g
    step = step_tensors(g, c)
    embed, _ = w.stored("embed")
    x = g.op("Cast", g.op("Gather", embed, g.reshape(INPUT_IDS, -1), axis=0), to=TensorProto.FLOAT)  # [N, D]
    for i in range(c.num_hidden_layers):
        with g.scope(f"layers.{i}"):
            x = decoder_layer(g, w, c, i, x, step)
    x = rms_norm(g, w, "norm", x, c.rms_norm_eps)
    logits = g.op("MatMul", x, g.op("Transpose", w.float32("head"), perm=[1, 0]))  # [N, V]
    g.nodes.append(
        helper.make_node("Reshape", [logits, g.op("Concat", step.bt, g.ints(-1), axis=0)], [LOGITS])
    )
    w.finish()
    graph = helper.make_graph(g.nodes, "mlac_deepseek", *graph_io(c), g.initializers)
    opset = helper.make_opsetid("", OPSET)
    return helper.make_model(graph, opset_imports=[opset], ir_version=IR_VERSION, producer_name="mlac")


def decoder_layer(g: GraphBuilder, w: ArtifactWeights, c: ModelConfig, i: int, x: str, step: Step) -> str:
    """x [N, D] -> x + attn(attn_norm(x)), then + mlp or moe(ffn_norm(.)); names present_latents.{i}."""
    h, present = attention(
        g, w, c, i, rms_norm(g, w, f"layers.{i}.attn_norm", x, c.rms_norm_eps), past_name(i), step
    )
    g.nodes.append(helper.make_node("Identity", [present], [present_name(i)]))
    x = g.op("Add", x, h)
    h = rms_norm(g, w, f"layers.{i}.ffn_norm", x, c.rms_norm_eps)
    return g.op("Add", x, moe(g, w, c, i, h) if c.is_moe_layer(i) else mlp(g, w, f"layers.{i}.mlp", h))


def graph_io(c: ModelConfig) -> tuple[list, list]:
    """(inputs, outputs) value infos; io_spec says the same for the JSON."""
    width, layers = c.kv_latent_dim, range(c.num_hidden_layers)
    inputs = [value_info(INPUT_IDS, TensorProto.INT64, ["batch", "seq"])]
    inputs += [value_info(past_name(i), TensorProto.FLOAT, ["batch", "past", width]) for i in layers]
    outputs = [value_info(LOGITS, TensorProto.FLOAT, ["batch", "seq", c.vocab_size])]
    outputs += [value_info(present_name(i), TensorProto.FLOAT, ["batch", "total", width]) for i in layers]
    return inputs, outputs


def step_tensors(g: GraphBuilder, c: ModelConfig) -> Step:
    """Positions past + [0, seq), their rope cos/sin [seq, R] and the causal mask [seq, past + seq]."""
    inv_freq, attention_factor = rope_parameters(c)
    bt = g.op("Shape", INPUT_IDS)
    past = g.op("Squeeze", g.dim(past_name(0), 1))  # scalar int64
    total = g.op("Add", past, g.op("Squeeze", g.dim(INPUT_IDS, 1)))
    positions = g.op("Range", past, total, g.const(1, "int64"))  # [T]
    freqs = g.op("Mul", g.op("Unsqueeze", g.op("Cast", positions, to=TensorProto.FLOAT), g.ints(1)),
                 g.const(inv_freq.tolist()))  # fmt: skip  # [T, R/2]
    emb = g.op("Concat", freqs, freqs, axis=-1)  # [T, R]
    factor = g.const(attention_factor)
    cos, sin = g.op("Mul", g.op("Cos", emb), factor), g.op("Mul", g.op("Sin", emb), factor)
    keys = g.op("Range", g.const(0, "int64"), total, g.const(1, "int64"))  # [S]
    future = g.op("Greater", g.op("Unsqueeze", keys, g.ints(0)), g.op("Unsqueeze", positions, g.ints(1)))
    mask = g.op("Where", future, g.const(float("-inf")), g.const(0.0))  # [T, S]
    return Step(bt=bt, cos=cos, sin=sin, mask=mask)


def io_spec(c: ModelConfig) -> dict[str, Any]:
    """How to feed the graph: names, dtypes and shapes, the cache layout, the rope tables."""
    inv_freq, attention_factor = rope_parameters(c)
    width = c.kv_latent_dim
    layers = range(c.num_hidden_layers)
    return {
        "inputs": [{"name": INPUT_IDS, "dtype": "int64", "shape": ["batch", "seq"]}]
        + [{"name": past_name(i), "dtype": "float32", "shape": ["batch", "past", width]} for i in layers],
        "outputs": [{"name": LOGITS, "dtype": "float32", "shape": ["batch", "seq", c.vocab_size]}]
        + [
            {"name": present_name(i), "dtype": "float32", "shape": ["batch", "past + seq", width]}
            for i in layers
        ],
        "cache": {
            "layers": c.num_hidden_layers,
            "width": width,
            "layout": f"per token: kv_norm(latent) [{c.kv_lora_rank}] then roped k_rope [{c.qk_rope_head_dim}]",
            "prefill": "past = 0: feed past_latents.{i} of shape [batch, 0, width]",
            "decode": "feed the previous call's present_latents.{i} as past_latents.{i}",
        },
        "positions": "token t of a call is at position past + t (computed in the graph)",
        "rope": {
            "inv_freq": inv_freq.tolist(),
            "attention_factor": attention_factor,
            "cos_sin": "cos/sin = cat(p·inv_freq, p·inv_freq).cos()/.sin() · attention_factor, rotate-half",
        },
        "softmax_scale": c.softmax_scale,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_ids": list(c.eos_token_ids),
    }
