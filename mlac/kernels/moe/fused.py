"""Fused MoE, the front: the pure-torch reference, and the dispatch between the two Triton paths.

    x            [T, D]            bf16/fp16 on the Triton path (float32 too on the reference)
    w13          [E, 2I, D]        experts stacked: gate rows, then up rows
    w2           [E, D, I]         x's dtype, or e4m3 with block scales [E, ceil(rows/128), ceil(cols/128)]
    topk_weights [T, top_k], topk_ids [T, top_k]   the routing (routing.py); ids outside [0, E) skipped
    out          [T, D] = sum_k topk_weights[t, k] * expert_{ids[t, k]}(x[t])  (+ the shared experts)

`fused_moe` dispatches on device: Triton on CUDA, `fused_moe_ref` on CPU. On the Triton path
`fused_moe_triton` takes one of two paths per step, by rows per expert:
- grouped (grouped.py, after align.py): the pairs grouped by expert into GEMM tiles, then the
  top-k reduce (reduce.py);
- decode (decode_config.py picks it: one token's top-k): GEMVs per expert (decode.py), then the
  reduce or GEMM2 per token with the sum in its launch (decode_sum.py); the shared experts
  (shared.py) ride in the same launches where they fit.
`moe_variants` names the kernel variants that choice launches, for the warm-up (step_variants.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mlac.core.fp8 import BLOCK, FP8
from mlac.kernels.fp8_quant import Fp8Act
from mlac.kernels.fp8_quant import use_triton as _use_triton
from mlac.kernels.gemm.fp8_gemm import fp8_act_linear_ref, fp8_linear_ref
from mlac.kernels.moe.align import align_sizes
from mlac.kernels.moe.decode import moe_decode_down, moe_decode_gate_up
from mlac.kernels.moe.decode_config import MoeDecodeConfig, pick_moe_decode_config
from mlac.kernels.moe.decode_sum import moe_decode_down_sum
from mlac.kernels.moe.grouped import MoeConfig, moe_grouped_gemms, pick_moe_config, split_of
from mlac.kernels.moe.reduce import reduce_blocks, reduce_top_k
from mlac.kernels.moe.shared import SharedExperts, shared_chunks, shared_widens_sum


def _expert_linear(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, x_act: Fp8Act | None = None
) -> torch.Tensor:
    if scale is None:
        return F.linear(x, w.to(x.dtype))
    if x_act is not None:  # x's quantization, made by its producer
        return fp8_act_linear_ref(x_act, w, scale, x.dtype)
    return fp8_linear_ref(x, w, scale)


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    shared_out: torch.Tensor | None = None,
    x_act: Fp8Act | None = None,
) -> torch.Tensor:
    """x [T, D] -> sum_k topk_weights[t, k] * expert_{ids[t, k]}(x[t]), [T, D] in x's dtype.

    expert(x) = w2 @ (silu(gate) * up), gate/up = halves of w13 @ x. Expert ids outside
    [0, E) are skipped (they belong to another rank under expert parallelism). shared_out
    [T, D] in x's dtype (the shared experts' output) is added to the float32 sum before its one
    rounding: (routed_f32 + shared_out.float()).to(x.dtype). x_act: see `fused_moe`.
    """
    t, d = x.shape
    e, two_i, _ = w13.shape
    out = torch.zeros(t, d, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    for expert in torch.unique(flat_ids).tolist():
        if not 0 <= expert < e:
            continue
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        x_rows = None if x_act is None else Fp8Act(x_act.q[token], x_act.scale[token], x.dtype)
        h = _expert_linear(x[token], w13[expert], None if w13_scale is None else w13_scale[expert], x_rows)
        gate, up = h.split(two_i // 2, dim=-1)
        y = _expert_linear(F.silu(gate) * up, w2[expert], None if w2_scale is None else w2_scale[expert])
        out.index_add_(0, token, y.to(torch.float32) * topk_weights[token, slot, None].to(torch.float32))
    if shared_out is not None:
        out += shared_out.to(torch.float32)
    return out.to(x.dtype)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    *,
    use_triton: bool | None = None,
    config: MoeConfig | MoeDecodeConfig | None = None,
    shared_out: torch.Tensor | None = None,
    x_act: Fp8Act | None = None,
    shared: SharedExperts | None = None,
) -> torch.Tensor:
    """Dispatching entry point (Triton on CUDA, reference on CPU); contract as fused_moe_ref
    (shared_out [T, D] in x's dtype: returns routed + shared_out with one rounding).

    shared: the shared experts (their weights and their MLP) in place of shared_out: at decode
    shapes on the Triton path they run inside the routed experts' launches (`fused_moe_triton`),
    elsewhere `shared.mlp(x, x_act)` gives shared_out.

    x_act: with FP8 weights, x already quantized by its producer (must be `quantize_act_ref(x)`'s
    bits, an `rms_norm_quant` say): GEMM1 reads it instead of quantizing x again. x is still
    needed (the output's shape and dtype; the reference's bf16 path). Ignored with bf16 weights.

    The Triton path takes bf16/fp16 x with weights in x's dtype or e4m3 + scales; other dtype
    mixes (float32 x, say) run the reference on any device. `use_triton` forces the choice.
    """
    triton_ok = x.dtype in (torch.bfloat16, torch.float16) and (
        w13.dtype == FP8 if w13_scale is not None else w13.dtype == x.dtype
    )
    if use_triton and not triton_ok:
        raise ValueError(f"no Triton MoE for x {x.dtype} with weights {w13.dtype}")
    if triton_ok and _use_triton(x, use_triton):
        return fused_moe_triton(
            x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, config, shared_out, x_act, shared
        )
    if shared is not None:
        assert shared_out is None, "give the shared experts as shared_out or as shared, not both"
        shared_out = shared.mlp(x, x_act)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, shared_out, x_act)


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    config: MoeConfig | MoeDecodeConfig | None = None,
    shared_out: torch.Tensor | None = None,
    x_act: Fp8Act | None = None,
    shared: SharedExperts | None = None,
) -> torch.Tensor:
    """Triton fused MoE; contract as `fused_moe_ref` (x bf16/fp16; weights in x's dtype or e4m3).

    Launches: the grouped GEMMs (`moe_grouped_gemms`: moe_align, [act_quant, unless x_act is given],
    GEMM1 (+SiLU*up, +FP8 re-quant), GEMM2), then the top-k reduce (+ shared_out, added in float32
    before the one rounding). Decode shapes (a few rows per expert: `pick_moe_decode_config`, or a
    MoeDecodeConfig given) run the decode GEMVs instead: GEMM1, GEMM2 and top-k reduce, or GEMM2
    with the top-k sum in one launch (MoeDecodeConfig.fuse_sum).
    `shared` (instead of shared_out): the shared experts, inside the decode GEMVs' launches where
    `shared_chunks` takes them, else their own MLP (`shared.mlp`, run first) as shared_out.
    """
    _check_moe_args(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    t, d = x.shape
    e = w13.shape[0]
    top_k = topk_ids.shape[1]
    p = t * top_k
    fp8 = w13_scale is not None
    cfg = config or pick_moe_decode_config(p, e, fp8) or pick_moe_config(p, e, fp8)
    n_shared = shared_chunks(shared, w13, w13_scale) if isinstance(cfg, MoeDecodeConfig) and p > 0 else 0
    widens = n_shared and cfg.fuse_sum and shared_widens_sum(top_k, n_shared)
    fused = shared if n_shared and not widens else None
    if shared is not None:
        assert shared_out is None, "give the shared experts as shared_out or as shared, not both"
        shared_out = None if fused is not None else shared.mlp(x, x_act)
    if shared_out is not None:
        assert shared_out.shape == x.shape and shared_out.dtype == x.dtype, tuple(shared_out.shape)
        assert shared_out.stride(-1) == 1 and shared_out.device == x.device, "shared_out: contiguous rows"
    out = torch.empty(t, d, dtype=x.dtype, device=x.device)
    if p == 0:
        return out.zero_() if shared_out is None else out.copy_(shared_out)
    topk_ids = topk_ids.contiguous()
    if isinstance(cfg, MoeDecodeConfig):
        args = (x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
        return _decode_moe(*args, cfg, shared_out, x_act if fp8 else None, fused, out)
    y = moe_grouped_gemms(x, w13, w2, topk_ids, w13_scale, w2_scale, x_act, cfg)  # [P, D]
    return reduce_top_k(y, topk_weights, topk_ids, e, out, _as_rows(shared_out))


def _check_moe_args(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale) -> None:
    t, d = x.shape
    e, two_i, d1 = w13.shape
    i = two_i // 2
    assert d1 == d and two_i == 2 * i, f"w13 {tuple(w13.shape)} vs x [*, {d}]"
    assert tuple(w2.shape) == (e, d, i), f"w2 {tuple(w2.shape)}, expected {(e, d, i)}"
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == t, (topk_ids.shape, t)
    assert not topk_ids.is_floating_point(), topk_ids.dtype
    assert x.dtype in (torch.bfloat16, torch.float16), f"Triton MoE takes bf16/fp16 x, got {x.dtype}"
    assert w13.stride(-1) == 1 and w2.stride(-1) == 1, "expert weights need contiguous rows"
    if w13_scale is None:
        assert w2_scale is None and w13.dtype == w2.dtype == x.dtype, (w13.dtype, w2.dtype, x.dtype)
        return
    assert w2_scale is not None and w13.dtype == w2.dtype == FP8, (w13.dtype, w2.dtype)
    assert w13_scale.dtype == w2_scale.dtype == torch.float32
    assert tuple(w13_scale.shape) == (e, math.ceil(two_i / BLOCK), math.ceil(d / BLOCK)), w13_scale.shape
    assert tuple(w2_scale.shape) == (e, math.ceil(d / BLOCK), math.ceil(i / BLOCK)), w2_scale.shape
    assert w13_scale.stride(-1) == 1 and w2_scale.stride(-1) == 1


def _decode_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    cfg: MoeDecodeConfig,
    shared_out: torch.Tensor | None,
    x_act: Fp8Act | None,
    shared: SharedExperts | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """The decode GEMVs into out [T, D]: GEMM1, then GEMM2 with the top-k sum or
    GEMM2 and `reduce_top_k`; with `shared` (fitting: `shared_chunks`) its chunks ride along in
    each launch and are summed with weight 1.0 (shared_out is then None)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    h = moe_decode_gate_up(x, w13, topk_ids, w13_scale, x_act, cfg, shared)
    if cfg.fuse_sum:
        return moe_decode_down_sum(h, w2, topk_weights, topk_ids, w2_scale, shared_out, out, cfg, shared)
    y = moe_decode_down(h, w2, topk_ids, w2_scale, cfg, shared)  # [P + n * T, D]
    p = topk_ids.numel()
    rows = _as_rows(shared_out) if shared is None else y[p:].unflatten(0, (-1, x.shape[0]))  # [n, T, D]
    return reduce_top_k(y, topk_weights, topk_ids, w13.shape[0], out, rows)


def _as_rows(shared_out: torch.Tensor | None) -> torch.Tensor | None:
    """The shared MLP's output [T, D] as `reduce_top_k`'s shared rows [1, T, D]."""
    return None if shared_out is None else shared_out.unsqueeze(0)


def moe_variants(t: int, top_k: int, num_experts: int, d: int, i: int, fp8: bool, sms: int) -> list[tuple]:
    """The kernel variants (one tuple per kernel: its name and the integers Triton compiles it for)
    that `fused_moe_triton` launches for a step of t tokens: x [t, d], w13 [num_experts, 2i, d], on
    a GPU of `sms` SMs. What the warm-up must meet (step_variants.py)."""
    p = t * top_k
    decode = pick_moe_decode_config(p, num_experts, fp8)
    if decode is not None:  # the decode GEMVs, and the top-k reduce unless GEMM2 sums
        return [("moe_decode", decode)] + ([] if decode.fuse_sum else [("moe_reduce", *reduce_blocks(t, d))])
    cfg = pick_moe_config(p, num_experts, fp8)
    num_blocks = align_sizes(p, num_experts, cfg.block_m)[1]
    split1 = split_of(cfg, num_blocks * -(-i // cfg.block_n1), d, sms)
    split2 = split_of(cfg, num_blocks * -(-d // cfg.block_n2), i, sms)
    return [
        ("moe_align", cfg.block_m),
        ("moe_gemm1", cfg, split1),
        ("moe_gemm2", cfg, split2),
        ("moe_reduce", *reduce_blocks(t, d)),
    ]
