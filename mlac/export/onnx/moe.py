"""The MoE layer as standard ONNX ops: the router (kernels/moe/routing.route_ref's rule) and the experts.

Routing: float32 logits [N, E] -> softmax or sigmoid scores -> (+ correction bias, noaux_tc) the
choice values -> group selection (TopK over group scores, ScatterElements into a group mask,
Where) -> TopK(top_k) expert ids [N, k] (ties: the lower index, as torch.topk) -> GatherElements of
the unbiased scores -> renormalize and scale as the method says.

Experts: one subgraph per routed expert, unrolled. Expert e gathers only the tokens that chose it
(NonZero over ids == e), runs its MLP on them, weighs the rows and adds them back with ScatterND
(reduction add). Each expert's weights are their own initializers, slices of the stacked
`moe.w13` [E, 2I, D] / `moe.w2` [E, D, I] at their byte offsets in the data file (no copies).
"""

from __future__ import annotations

from onnx import TensorProto

from mlac.core.config import ModelConfig
from mlac.export.onnx.builder import GraphBuilder
from mlac.export.onnx.layers import mlp
from mlac.export.onnx.weights import ArtifactWeights


def moe(g: GraphBuilder, w: ArtifactWeights, c: ModelConfig, layer: int, x: str) -> str:
    """x [N, D] -> routed experts + shared experts [N, D]."""
    p = f"layers.{layer}.moe"
    logits = g.op("MatMul", x, g.op("Transpose", w.float32(f"{p}.gate"), perm=[1, 0]))  # [N, E]
    bias = w.float32(f"{p}.gate_bias") if c.topk_method == "noaux_tc" else None
    weights, ids = route(g, c, logits, bias)  # [N, k] each
    out = (
        mlp(g, w, f"{p}.shared", x)
        if c.n_shared_experts > 0
        else g.op("Expand", g.const(0.0), g.op("Shape", x))
    )
    for e in range(c.n_routed_experts or 0):
        with g.scope(f"expert{e}"):
            out = add_expert(g, w, p, e, x, weights, ids, out)
    return out


def route(g: GraphBuilder, c: ModelConfig, logits: str, bias: str | None) -> tuple[str, str]:
    """logits [N, E] float32 -> (weights [N, k] float32, ids [N, k] int64), as route_ref."""
    scores = g.op("Softmax", logits, axis=-1) if c.scoring_func == "softmax" else g.op("Sigmoid", logits)
    choice = scores if bias is None else g.op("Add", scores, bias)
    if c.topk_method != "greedy" and c.n_group > 1:
        choice = keep_groups(g, c, choice)
    _, ids = g.ops("TopK", choice, g.ints(c.num_experts_per_tok), outputs=2, axis=-1, largest=1, sorted=1)
    weights = g.op("GatherElements", scores, ids, axis=1)
    renorm, factor = weight_rule(c)
    if renorm:
        total = g.op("ReduceSum", weights, g.ints(-1), keepdims=1)
        weights = g.op("Div", weights, g.op("Add", total, g.const(1e-20)))
    return (weights if factor == 1.0 else g.op("Mul", weights, g.const(factor))), ids


def weight_rule(c: ModelConfig) -> tuple[bool, float]:
    """(renormalize, then multiply by), as route_ref: noaux_tc renormalizes if asked, then scales;
    the V2 methods renormalize (top_k > 1) instead of scaling."""
    if c.topk_method == "noaux_tc":
        return c.norm_topk_prob, c.routed_scaling_factor
    if c.norm_topk_prob and c.num_experts_per_tok > 1:
        return True, 1.0
    return False, c.routed_scaling_factor


def keep_groups(g: GraphBuilder, c: ModelConfig, choice: str) -> str:
    """choice [N, E] -> the same with the experts outside the `topk_group` best groups set to -inf
    (noaux_tc: groups scored by their top-2 sum) or 0 (group_limited_greedy: by their max)."""
    e = c.n_routed_experts or 0
    grouped = g.reshape(choice, -1, c.n_group, e // c.n_group)  # [N, G, E/G]
    if c.topk_method == "noaux_tc":
        top2, _ = g.ops("TopK", grouped, g.ints(2), outputs=2, axis=-1)
        group_score = g.op("ReduceSum", top2, g.ints(-1), keepdims=0)  # [N, G]
    else:
        group_score = g.op("ReduceMax", grouped, g.ints(-1), keepdims=0)
    _, keep = g.ops("TopK", group_score, g.ints(c.topk_group), outputs=2, axis=-1)  # [N, topk_group]
    zeros = g.op("Expand", g.const(0.0), g.op("Shape", group_score))  # [N, G]
    ones = g.op("Expand", g.const(1.0), g.op("Shape", keep))  # [N, topk_group]
    mask = g.op("ScatterElements", zeros, keep, ones, axis=1)  # [N, G]: 1 for a kept group
    mask = g.op("Expand", g.op("Unsqueeze", mask, g.ints(-1)), g.op("Shape", grouped))
    mask = g.op("Cast", g.reshape(mask, -1, e), to=TensorProto.BOOL)  # [N, E]
    fill = float("-inf") if c.topk_method == "noaux_tc" else 0.0
    return g.op("Where", mask, choice, g.const(fill))


def add_expert(
    g: GraphBuilder, w: ArtifactWeights, p: str, e: int, x: str, weights: str, ids: str, out: str
) -> str:
    """out [N, D] + weight · expert_e(x) on the rows of the tokens that chose expert e."""
    hits = g.op("Transpose", g.op("NonZero", g.op("Equal", ids, g.const(e, "int64"))), perm=[1, 0])  # [n, 2]
    rows = g.slice(hits, 1, 0, 1)  # [n, 1] token index (each token picks an expert at most once)
    tokens = g.op("GatherND", x, rows)  # [n, D]
    y = mlp(g, w, p, tokens, part=e)  # [n, D]
    y = g.op("Mul", y, g.op("Unsqueeze", g.op("GatherND", weights, hits), g.ints(1)))
    return g.op("ScatterND", out, rows, y, reduction="add")
