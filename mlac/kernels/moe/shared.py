"""The shared experts of a MoE layer as the decode GEMVs take them: chunks that look like experts.

This rank's shared MLP, intermediate S = n * I (I the routed experts' local intermediate), is the
sum of n experts of intermediate I with routing weight 1.0 for every token, so the decode GEMVs
(decode.py, decode_sum.py) take n more work items (programs P .. P + n - 1, each over all T tokens:
rows P + c * T + t of h and y) read through strided views of the shared weights (`shared_view`),
and the top-k sum adds them. Their outputs then meet the routed ones in float32 and are rounded
once, where the separate MLP rounded its output to x's dtype before that sum (and each chunk's
GEMM2 output is rounded on its own): equal up to that, and to float32 summation order.

`shared_chunks` says whether the chunks fit (else the shared MLP runs apart, `SharedExperts.mlp`), and
`shared_widens_sum` whether they would slow the fused sum. Inside, one V2-Lite MoE layer at batch 1
took 41.8 us FP8 / 44.2 us bf16 on an H200 against 56.5 / 51.7 apart, and the decode step 367.6
against 327.0 tok/s FP8 (benchmarks/results/kernels_moe_shared_h200.json,
kernels_mla_out_router_h200.txt). A caller that wants the MLP apart gives fused_moe its output
(`shared_out`) instead of `shared`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mlac.core.fp8 import BLOCK
from mlac.kernels.fp8_quant import Fp8Act


@dataclass(frozen=True, eq=False)
class SharedExperts:
    """One MoE layer's shared experts on this rank, for `fused_moe`: their weights and their MLP.

    As experts of the routed experts' local intermediate I (S = n * I): chunk c is gate rows
    [c*I, (c+1)*I) of w13 with the matching up rows [S + c*I, S + (c+1)*I), and columns
    [c*I, (c+1)*I) of w2; the decode kernels read them so, in place. `mlp(x, x_act)` is the
    separate path: this rank's partial [T, D] in x's dtype, the shared MLP as the model runs it
    (taken where the chunks are not: other shapes, the reference, a layout that does not fit)."""

    w13: torch.Tensor  # [2S, D]: gate rows, then up rows
    w2: torch.Tensor  # [D, S]
    w13_scale: torch.Tensor | None  # [2S/128, ceil(D/128)] float32 with FP8 weights
    w2_scale: torch.Tensor | None  # [ceil(D/128), S/128]
    mlp: Callable[[torch.Tensor, Fp8Act | None], torch.Tensor]


def shared_chunks(shared: SharedExperts | None, w13: torch.Tensor, w13_scale: torch.Tensor | None) -> int:
    """How many experts of the routed experts' intermediate I (w13 [E, 2I, D]) the decode kernels take
    the shared experts as, or 0 where these run apart: none, another weight format, S not a multiple
    of I (expert parallel with the shared experts sliced finer than I), or FP8 with I not a multiple
    of 128 (a chunk would split 128x128 scale blocks and the 128-channel groups the intermediate is
    quantized in)."""
    if shared is None:
        return 0
    _, two_i, d = w13.shape
    i, s = two_i // 2, shared.w2.shape[-1]
    fp8 = w13_scale is not None
    if shared.w13.dtype != w13.dtype or (shared.w13_scale is not None) != fp8 or (fp8 and i % BLOCK):
        return 0
    if s % i or tuple(shared.w13.shape) != (2 * s, d) or tuple(shared.w2.shape) != (d, s):
        return 0
    tensors = (shared.w13, shared.w2) + ((shared.w13_scale, shared.w2_scale) if fp8 else ())
    return s // i if all(x.stride(-1) == 1 for x in tensors) else 0


def shared_widens_sum(top_k: int, n_shared: int) -> bool:
    """Whether n shared chunks widen the fused sum's slot tile (KPAD: top_k + n rounded up to a power
    of two). Then the shared experts run apart: on an H200 (benchmarks/kernels/moe_decode.py
    --shared) a V3 slice (top-8 + 1 shared, FP8) took 270.1 us with them inside (8 -> 16 slots)
    against 217.7 us apart, where V2-Lite (top-6 + 2: 8 slots either way) took 41.8 against 56.5."""
    return (top_k + n_shared - 1).bit_length() > (top_k - 1).bit_length()  # next powers of two differ


def shared_view(shared: SharedExperts, gated: bool, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The shared chunks stacked like experts (views, no copy): gated, the gate rows [n, I, D] (the up
    rows sit S rows further) and their scales [n, I/128, ceil(D/128)]; else w2 [n, D, I] and its
    scales [n, ceil(D/128), I/128]."""
    n = shared.w2.shape[-1] // i
    if gated:
        w = shared.w13.unflatten(0, (2, n, i))[0]
        s = None if shared.w13_scale is None else shared.w13_scale.unflatten(0, (2, n, i // BLOCK))[0]
        return w, s
    w = shared.w2.unflatten(1, (n, i)).permute(1, 0, 2)
    s = None if shared.w2_scale is None else shared.w2_scale.unflatten(1, (n, i // BLOCK)).permute(1, 0, 2)
    return w, s
