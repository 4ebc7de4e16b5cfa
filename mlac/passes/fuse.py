"""fuse: q_a with kv_a, gate with up, routed experts stacked.

    attn.wq_a [q, D] + attn.w_kv_a [kv+rope, D]     -> attn.w_qkv_a [q+kv+rope, D]
    mlp.w1 [I, D] + mlp.w3 [I, D]                   -> mlp.w13 [2I, D]     (same for moe.shared)
    moe.experts.{e}.w1/w3/w2                        -> moe.w13 [E, 2I, D], moe.w2 [E, D, I]

Fusion is lazy (the writer streams the parts). FP8 scales fuse with their weights when the
first part ends on a 128-row block boundary; otherwise the parts are dequantized (and the fp8
pass requantizes the fused tensor).
"""

from __future__ import annotations

from mlac.core.fp8 import BLOCK, dequantize_lazy
from mlac.core.lazy import LazyTensor, concat_rows, stack
from mlac.passes import PassContext

NAME = "fuse"


def params(ctx: PassContext) -> dict:
    return {"qkv_a": ctx.config.q_lora_rank is not None, "gate_up": True, "experts_stacked": True}


def run(tensors: dict[str, LazyTensor], ctx: PassContext) -> dict[str, LazyTensor]:
    if ctx.layer is None:
        return tensors
    t, pre = dict(tensors), f"layers.{ctx.layer}."
    if ctx.config.q_lora_rank is not None:
        _fuse(t, [pre + "attn.wq_a", pre + "attn.w_kv_a"], pre + "attn.w_qkv_a")
    for mlp in ("mlp.", "moe.shared."):
        if pre + mlp + "w1" in t:
            _fuse(t, [pre + mlp + "w1", pre + mlp + "w3"], pre + mlp + "w13")
    if ctx.config.is_moe_layer(ctx.layer):
        _stack_experts(t, pre, ctx.config.n_routed_experts)
    return t


def _pop(t: dict[str, LazyTensor], name: str) -> tuple[LazyTensor, LazyTensor | None]:
    return t.pop(name), t.pop(name + ".scale", None)


def _dequantized(w: LazyTensor, s: LazyTensor | None) -> LazyTensor:
    return w if s is None else dequantize_lazy(w, s)


def _fuse(t: dict[str, LazyTensor], names: list[str], out: str) -> None:
    pairs = [_pop(t, n) for n in names]
    scales = [s for _, s in pairs]
    aligned = all(w.shape[0] % BLOCK == 0 for w, _ in pairs[:-1])
    if all(s is not None for s in scales) and aligned:
        t[out] = concat_rows([w for w, _ in pairs])
        t[out + ".scale"] = concat_rows(scales)
    else:
        t[out] = concat_rows([_dequantized(w, s) for w, s in pairs])


def _stack_experts(t: dict[str, LazyTensor], pre: str, n_experts: int) -> None:
    for e in range(n_experts):
        ex = f"{pre}moe.experts.{e}."
        _fuse(t, [ex + "w1", ex + "w3"], ex + "w13")
    for w in ("w13", "w2"):
        names = [f"{pre}moe.experts.{e}.{w}" for e in range(n_experts)]
        pairs = [_pop(t, n) for n in names]
        if all(s is not None for _, s in pairs):
            t[f"{pre}moe.{w}"] = stack([v for v, _ in pairs])
            t[f"{pre}moe.{w}.scale"] = stack([s for _, s in pairs])
        else:
            t[f"{pre}moe.{w}"] = stack([_dequantized(v, s) for v, s in pairs])
