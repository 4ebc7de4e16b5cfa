"""Fused MoE at decode: the routed experts' GEMMs when each expert gets a few rows.

At decode (batch 1: 6 pairs over 64 experts) the grouped GEMMs of `moe.py` pad every expert to a
16-row tile holding one real row, and their few tiles need split-K (lock counters) to fill the GPU.
Here each program streams a [BLOCK_N, K] slice of one expert's weight against the few rows routed
to that expert, so the grid is (pairs, N / BLOCK_N): enough programs to fill the SMs with no split
of K, no `moe_align` and (FP8) no separate activation quantization. Results are deterministic (no
atomics, fixed summation order). Two forms of the product:

- CUDA cores (`_moe_decode_kernel`): the weight tile [1, BN, SUB, 128] times ROWS rows, float32.
- tensor cores, "swap AB" (`_moe_decode_dot_kernel`, MoeDecodeConfig.dot): W tile @ rows.T with the
  rows padded to 16, e4m3 MMA with FP8 weights; Triton pipelines the loads that feed tl.dot.

GEMM1 (gate/up + SiLU*up) and GEMM2 per expert: a program is indexed by a pair p = t * top_k + j;
only the first pair of each expert (its "leader") works, and it takes every pair of that expert,
ROWS (or 16) at a time; the others return at once. A weight slice is read once per pass.
GEMM2 per token (`fuse_sum`, CUDA cores, about one row per expert): a program takes one token's
top_k experts and writes the weighted sum, so the top-k reduce launch of moe.py goes away.

Shared experts (`SharedExperts`) ride in the same launches: this rank's shared MLP, intermediate
S = n * I (I the routed experts' local intermediate), is the sum of n experts of intermediate I with
routing weight 1.0 for every token, so GEMM1 and GEMM2 take n more work items (programs P .. P + n - 1,
each over all T tokens: rows P + c * T + t of h and y) read through strided views of the shared
weights, and the top-k sum adds them. Their outputs then meet the routed ones in float32 and are
rounded once, where the separate MLP rounded its output to x's dtype before that sum (and each
chunk's GEMM2 output is rounded on its own): equal up to that, and to float32 summation order.

Launches per MoE layer: 2 (GEMM1, GEMM2 + sum: FP8) or 3 (GEMM1, GEMM2, moe.py's reduce: bf16), shared
experts included, against the grouped path's 5 ([act_quant], moe_align, GEMM1, GEMM2, reduce) plus
the shared MLP's 3. Switches, read at import, for A/B runs: MLAC_MOE_DECODE_KERNEL=0 sends every shape
to the grouped path; MLAC_MOE_SHARED_FUSED=0 runs the shared experts as their own MLP;
MLAC_MOE_DECODE_CONFIG replaces the tiles `pick_moe_decode_config` picks (see `config_override`).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mlac.core.errors import MlacError
from mlac.core.fp8 import BLOCK, FP8, FP8_MAX
from mlac.kernels.fp8_quant import (
    Fp8Act,
    cast_out,
    interpreting,
    jit,
    pdl_launch,
    pdl_start,
    quant_groups,
    round_bf16,
    round_e4m3,
    tl,
    triton,
)

MAX_PAIRS = 256  # token-expert pairs a decode launch takes
# The PAIRS constexpr (ids each program scans) takes two values, so that the variants a server
# compiles stay few (`Engine.warmup` meets both): one warp's worth at batch 1-5, else MAX_PAIRS.
SMALL_PAIRS = 32
# A/B switch, read once: MLAC_MOE_DECODE_KERNEL=0 sends decode shapes to the grouped GEMMs of moe.py.
ENABLED = os.environ.get("MLAC_MOE_DECODE_KERNEL", "1") != "0"
# A/B switch, read once: MLAC_MOE_SHARED_FUSED=0 runs the shared experts as their own MLP at decode too.
SHARED_FUSED = os.environ.get("MLAC_MOE_SHARED_FUSED", "1") != "0"


@dataclass(frozen=True)
class MoeDecodeConfig:
    """Tiles and form of the decode GEMMs."""

    block_n1: int = 32  # GEMM1 columns of each half (gate, up) per program
    block_n2: int = 32  # GEMM2 output columns per program
    block_k: int = 256  # K columns per step: 128 * 2^n (more bytes in flight per program)
    rows: int = 2  # an expert's rows taken per pass over its weight slice (power of two)
    num_warps: int = 4
    num_stages: int = 2
    fuse_sum: bool = False  # GEMM2 per token: all top_k experts' slices and the weighted sum in one launch
    # per-expert GEMMs on tensor cores (W tile @ rows.T, 16 rows a pass, K steps of 128 with FP8
    # weights, else block_k); `rows` and (FP8) block_k then apply to the CUDA-core fused sum only
    dot: bool = False


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
    the shared experts as, or 0 where these run apart: none, MLAC_MOE_SHARED_FUSED=0, another weight
    format, S not a multiple of I (expert parallel with the shared experts sliced finer than I), or
    FP8 with I not a multiple of 128 (a chunk would split 128x128 scale blocks and the 128-channel
    groups the intermediate is quantized in)."""
    if shared is None or not SHARED_FUSED:
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
    of two). Then the shared experts run apart: on an H200 (benchmarks/bench_moe_shared.py) a V3 slice
    (top-8 + 1 shared, FP8) took 270.1 us with them inside (8 -> 16 slots) against 217.7 us apart, where
    V2-Lite (top-6 + 2: 8 slots either way) took 41.8 against 56.5."""
    return (top_k + n_shared - 1).bit_length() > (top_k - 1).bit_length()  # next powers of two differ


def _shared_view(shared: SharedExperts, gated: bool, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
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


ONE_TOKEN_PAIRS = 8  # the decode kernel runs one token's top-k pairs (top-k <= 8)


def pick_moe_decode_config(num_pairs: int, num_experts: int, fp8: bool) -> MoeDecodeConfig | None:
    """The decode kernel's tiles, or None where the grouped GEMMs of `moe.py` should run: measured on
    an H200 (benchmarks/bench_moe_decode.py), the decode kernel wins for one token's top-k pairs only
    (at most ONE_TOKEN_PAIRS), so batch-1 decode steps take it and everything larger the grouped
    path. Off when MLAC_MOE_DECODE_KERNEL=0. `fuse_sum`: GEMM2 runs per token and sums the top-k in
    its launch (one launch fewer)."""
    if not ENABLED or num_pairs > ONE_TOKEN_PAIRS or num_pairs > num_experts:
        return None
    # one token's top-k (benchmarks/results/moe_decode_h200.json, V2-Lite shapes, 20 calls in a
    # CUDA graph): FP8 31.5 us against the grouped path's 37.5, bf16 33.3 against 38.1. From 4 tokens
    # on the grouped GEMMs won every measured shape (FP8 66.5 against 101.7 us at 4 tokens).
    # The tiles: the fastest of the sweep with the shared experts inside (benchmarks/run_moe_sweep_h200.sh,
    # results/moe_sweep_h200/): FP8 on tensor cores 32.0 us (51% of copy bandwidth) against 41.8 for the
    # CUDA-core tiles before, and in the decode step 375.7 -> 414.1 tok/s at batch 1; bf16 42.9 against
    # 44.4 us, 388.3 -> 393.3 tok/s.
    if fp8:
        return config_override(CONFIG_TEXT).get("fp8") or MoeDecodeConfig(
            64, 16, 512, 1, num_warps=8, num_stages=3, fuse_sum=True, dot=True
        )
    return config_override(CONFIG_TEXT).get("bf16") or MoeDecodeConfig(
        64, 32, 128, 1, num_warps=4, num_stages=3, fuse_sum=False, dot=True
    )


CONFIG_ENV = "MLAC_MOE_DECODE_CONFIG"
CONFIG_TEXT = os.environ.get(CONFIG_ENV, "")  # read once, at import; parsed at the first pick


@functools.cache
def config_override(text: str | None) -> dict[str, MoeDecodeConfig]:
    """MLAC_MOE_DECODE_CONFIG, for A/B runs of a config found by a sweep without a code change: JSON
    {"fp8": {MoeDecodeConfig fields}, "bf16": {...}} (either key may be left out). Anything else is
    a one-line MlacError that names the variable."""
    if not text:
        return {}
    try:
        kinds = json.loads(text)
        if not isinstance(kinds, dict) or not set(kinds) <= {"fp8", "bf16"}:
            raise ValueError('expected an object with the keys "fp8" and/or "bf16"')
        return {kind: MoeDecodeConfig(**fields) for kind, fields in kinds.items()}
    except (ValueError, TypeError) as e:
        raise MlacError(f"{CONFIG_ENV}={text!r}: {e}") from None


@jit
def _expert_of(ids_ptr, pair0, P, E, PAIRS: tl.constexpr):
    """(pair0's expert, how many pairs it has): the count is 0 where pair0 is not its expert's first
    pair or the expert is not in [0, E)."""
    offs = tl.arange(0, PAIRS)
    ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1)  # [PAIRS]
    expert = tl.load(ids_ptr + pair0)
    mine = (ids == expert) & (expert >= 0) & (expert < E)  # [PAIRS]
    earlier = tl.sum((mine & (offs < pair0)).to(tl.int32), axis=0)
    count = tl.sum(mine.to(tl.int32), axis=0)
    return expert, tl.where(earlier == 0, count, 0)


@jit
def _pairs_of(ids_ptr, expert, P, r0, ROWS: tl.constexpr, PAIRS: tl.constexpr):
    """[ROWS] pairs of `expert` ranked r0 .. r0 + ROWS - 1 in pair order (0 past its last pair).
    Recomputed per chunk of rows so that no [PAIRS] vector stays live across the K loop."""
    offs = tl.arange(0, PAIRS)
    mine = tl.load(ids_ptr + offs, mask=offs < P, other=-1) == expert  # [PAIRS]
    rank = tl.cumsum(mine.to(tl.int32), axis=0) - 1  # [PAIRS]
    sel = mine[None, :] & (rank[None, :] == (r0 + tl.arange(0, ROWS))[:, None])  # [ROWS, PAIRS]
    return tl.sum(tl.where(sel, offs[None, :], 0), axis=1)


@jit
def _work_item(item, ids_ptr, P, T, N, E, b_ptr, bs_ptr, sb_ptr, sbs_ptr, stride_be, stride_bn, stride_bse,
               stride_bsn, stride_sbe, stride_sbn, stride_sbse, stride_sbsn, N_SHARED: tl.constexpr,
               PAIRS: tl.constexpr):  # fmt: skip
    """What program `item` of a GEMM1/GEMM2 launch computes: items [0, P) are routed pairs (the work of
    their expert, done by its first pair), items P + c the shared chunk c. -> (expert, rows (0 where
    a pair is not its expert's first, T for a chunk), weight base, scale base, weight row stride,
    scale row stride, first up row (GATED: N for an expert, S = N_SHARED * N for a chunk))."""
    shared = item >= P
    expert, count = _expert_of(ids_ptr, tl.minimum(item, P - 1), P, E, PAIRS)
    count = tl.where(shared, T, count)
    e64 = expert.to(tl.int64)
    chunk = (item - P).to(tl.int64)
    w = tl.where(shared, sb_ptr + chunk * stride_sbe, b_ptr + e64 * stride_be)
    ws = tl.where(shared, sbs_ptr + chunk * stride_sbse, bs_ptr + e64 * stride_bse)
    stride_n = tl.where(shared, stride_sbn, stride_bn).to(tl.int64)
    stride_sn = tl.where(shared, stride_sbsn, stride_bsn).to(tl.int64)
    up = tl.where(shared, N_SHARED * N, N)
    return expert, count, w, ws, stride_n, stride_sn, up


@jit
def _rows_of(pair, r, item, P, T, A_ROW_DIV, GATED: tl.constexpr):
    """(rows of c, rows of a) of a pass: a routed pair p writes row p and reads a[p // A_ROW_DIV];
    rank r of shared chunk c = item - P writes row P + c * T + r and reads token r (GATED: x) or
    its own row (GEMM2: h)."""
    shared = item >= P
    c_shared = P + (item - P) * T + r
    if GATED:
        a_shared = r
    else:
        a_shared = c_shared
    c_row = tl.where(shared, c_shared, pair)
    return c_row.to(tl.int64), tl.where(shared, a_shared, pair // A_ROW_DIV).to(tl.int64)


@jit
def _k_step(k0, K, SUB: tl.constexpr):
    """Columns of one K step: (k [SUB, 128], k_ok [SUB, 128], kb [SUB] their 128-blocks, kb_ok [SUB])."""
    kb = k0 // 128 + tl.arange(0, SUB)  # [SUB]
    k = kb[:, None] * 128 + tl.arange(0, 128)[None, :]  # [SUB, 128]
    return k, k < K, kb, kb * 128 < K


@jit
def _load_a(a_ptr, as_ptr, a_row, row_ok, k, k_ok, kb, kb_ok, stride_am, stride_asm,
            A_MODE: tl.constexpr, FP8_MAX_C: tl.constexpr):  # fmt: skip
    """[R, SUB, 128] activations of rows a_row [R] at columns k [SUB, 128], as float32: A_MODE 0 as
    stored; 1 e4m3 times its scale (as_ptr [rows, ceil(K/128)]); 2 quantized here per 128 columns
    with quantize_act_ref's arithmetic (IEEE division, ties-to-even e4m3)."""
    mask = row_ok[:, None, None] & k_ok[None, :, :]
    a = tl.load(a_ptr + a_row[:, None, None] * stride_am + k[None, :, :], mask=mask, other=0.0).to(tl.float32)
    if A_MODE == 1:
        s_mask = row_ok[:, None] & kb_ok[None, :]
        a_s = tl.load(as_ptr + a_row[:, None] * stride_asm + kb[None, :], mask=s_mask, other=0.0)  # [R, SUB]
        a = a * a_s[:, :, None]
    elif A_MODE == 2:
        a_s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(a), axis=2), 1e-12), FP8_MAX_C)  # [R, SUB]
        q = round_e4m3(tl.clamp(tl.math.div_rn(a, a_s[:, :, None]), -FP8_MAX_C, FP8_MAX_C))
        a = q * a_s[:, :, None]
    return a


@jit
def _load_scales(ptrs, mask, FP8_W: tl.constexpr):
    """The weight's block scales at ptrs (FP8_W), else 1.0 (unused)."""
    scale = tl.full(mask.shape, 1.0, tl.float32)
    if FP8_W:
        scale = tl.load(ptrs, mask=mask, other=0.0)
    return scale


@jit
def _slice_dot(a, b, b_scale, FP8_W: tl.constexpr):
    """sum_k a * dequant(b) over one K step: a [R or 1, 1 or J, SUB, 128] float32, b [1 or J, BN, SUB, 128]
    (either may broadcast), b_scale [.., BN, SUB] (FP8_W: one per 128-block) -> [R or J, BN] float32."""
    part = tl.sum(a * b.to(tl.float32), axis=3)  # [., BN, SUB]
    if FP8_W:
        part = part * b_scale
    return tl.sum(part, axis=2)


@jit
def _silu_mul(gate, up, ROUND_BF16: tl.constexpr):
    """silu(gate) * up with the reference's roundings to bf16 (else fp16), in float32."""
    if ROUND_BF16:
        gate = round_bf16(gate)
        up = round_bf16(up)
        return round_bf16(round_bf16(gate / (1.0 + tl.exp(-gate))) * up)
    gate = gate.to(tl.float16).to(tl.float32)
    up = up.to(tl.float16).to(tl.float32)
    h = ((gate / (1.0 + tl.exp(-gate))).to(tl.float16).to(tl.float32) * up).to(tl.float16)
    return h.to(tl.float32)


@jit(dynamic=("P", "T"))
def _moe_decode_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    sb_ptr,
    sbs_ptr,
    c_ptr,
    ids_ptr,
    P,
    T,
    N,
    K,
    E,
    A_ROW_DIV,
    stride_am,
    stride_asm,
    stride_be,
    stride_bn,
    stride_bse,
    stride_bsn,
    stride_sbe,
    stride_sbn,
    stride_sbse,
    stride_sbsn,
    stride_cm,
    GATED: tl.constexpr,  # b rows [0, N) gate, [N, 2N) up: c = silu(gate) * up
    A_MODE: tl.constexpr,  # 0 a as stored; 1 a e4m3 + as [rows, ceil(K/128)]; 2 quantize a here
    FP8_W: tl.constexpr,  # b e4m3 + bs [E, ceil(rows/128), ceil(K/128)]
    ROUND_BF16: tl.constexpr,  # GATED: intermediates rounded like bf16 (else fp16)
    N_SHARED: tl.constexpr,  # shared chunks: sb [N_SHARED, N, K] (+ up rows S = N_SHARED * N further), sbs
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUB: tl.constexpr,  # 128-column blocks per K step
    PAIRS: tl.constexpr,  # >= P: SMALL_PAIRS or MAX_PAIRS
    FP8_MAX_C: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    # c[p, n] = expert_{ids[p]} row n . a[p // A_ROW_DIV] for every pair p of this program's expert;
    # programs P + c: c[P + c * T + t, n] = shared chunk c's row n . a[t (GATED) or P + c * T + t]
    item = tl.program_id(0)
    expert, count, w, ws, stride_n, stride_sn, up = _work_item(
        item, ids_ptr, P, T, N, E, b_ptr, bs_ptr, sb_ptr, sbs_ptr, stride_be, stride_bn, stride_bse, stride_bsn,
        stride_sbe, stride_sbn, stride_sbse, stride_sbsn, N_SHARED, PAIRS,
    )  # fmt: skip
    if count == 0:
        return
    offs_r = tl.arange(0, ROWS)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = offs_n < N
    # [1, BN, 1, 1] row pointers: the weight tile is loaded as [1, BN, SUB, 128], the layout its
    # product with the activations [ROWS, 1, SUB, 128] keeps (no shuffle of the large operand)
    b_rows = (w + offs_n.to(tl.int64) * stride_n)[None, :, None, None]
    u_rows = (w + (up + offs_n).to(tl.int64) * stride_n)[None, :, None, None]  # up rows (GATED)
    bs_rows = (ws + (offs_n // 128) * stride_sn)[:, None]  # [BN, 1] (FP8_W)
    us_rows = (ws + ((up + offs_n) // 128) * stride_sn)[:, None]
    n_ok4 = n_ok[None, :, None, None]
    for r0 in range(0, count, ROWS):
        pair = _pairs_of(ids_ptr, expert, P, r0, ROWS, PAIRS)  # [ROWS]
        row_ok = r0 + offs_r < count
        c_row, a_row = _rows_of(pair, r0 + offs_r, item, P, T, A_ROW_DIV, GATED)
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, SUB * 128):
            k, k_ok, kb, kb_ok = _k_step(k0, K, SUB)
            a = _load_a(
                a_ptr, as_ptr, a_row, row_ok, k, k_ok, kb, kb_ok, stride_am, stride_asm, A_MODE, FP8_MAX_C
            )
            a = a[:, None, :, :]  # [ROWS, 1, SUB, 128]
            b_mask = n_ok4 & k_ok[None, None, :, :]
            s_mask = n_ok[:, None] & kb_ok[None, :]
            b = tl.load(b_rows + k[None, None, :, :], mask=b_mask, other=0.0)  # [1, BN, SUB, 128]
            b_s = _load_scales(bs_rows + kb[None, :], s_mask, FP8_W)  # [BN, SUB]
            acc += _slice_dot(a, b, b_s, FP8_W)
            if GATED:
                u = tl.load(u_rows + k[None, None, :, :], mask=b_mask, other=0.0)
                acc_u += _slice_dot(a, u, _load_scales(us_rows + kb[None, :], s_mask, FP8_W), FP8_W)
        h = _silu_mul(acc, acc_u, ROUND_BF16) if GATED else acc
        c_ptrs = c_ptr + c_row[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, cast_out(h, c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@jit
def _dot_rows(a_ptr, as_ptr, a_row, row_ok, k, k_ok, kb, stride_am, stride_asm,
              A_MODE: tl.constexpr, FP8_MAX_C: tl.constexpr):  # fmt: skip
    """The dot operand of 16 rows at columns k [128]: (rows [16, BK] as stored (A_MODE 0) or e4m3
    (1: loaded, 2: quantized here as quantize_act_ref does), their scales [16] (1.0 for A_MODE 0))."""
    mask = row_ok[:, None] & k_ok[None, :]
    a = tl.load(a_ptr + a_row[:, None] * stride_am + k[None, :], mask=mask, other=0.0)
    a_s = tl.full(row_ok.shape, 1.0, tl.float32)
    if A_MODE == 1:
        a_s = tl.load(as_ptr + a_row * stride_asm + kb, mask=row_ok, other=0.0)
    elif A_MODE == 2:
        q, a_s = quant_groups(a.to(tl.float32), FP8_MAX_C)
        a = q.to(tl.float8e4nv)
    return a, a_s


@jit
def _dot_part(b, a, a_s, bs_ptrs, n_ok, FP8_W: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """Tensor cores: b [BN, BK] @ a.T [BK, 16] -> [BN, 16] float32, dequantized by the weight's
    row scales (bs_ptrs [BN]) and the rows' scales a_s [16] when FP8_W."""
    if UPCAST_DOT:  # interpreter only (see fp8_quant.interpreting)
        b = b.to(tl.float32)
        a = a.to(tl.float32)
    part = tl.dot(b, tl.trans(a))
    if FP8_W:
        part = part * (tl.load(bs_ptrs, mask=n_ok, other=0.0)[:, None] * a_s[None, :])
    return part


@jit(dynamic=("P", "T"))
def _moe_decode_dot_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    sb_ptr,
    sbs_ptr,
    c_ptr,
    ids_ptr,
    P,
    T,
    N,
    K,
    E,
    A_ROW_DIV,
    stride_am,
    stride_asm,
    stride_be,
    stride_bn,
    stride_bse,
    stride_bsn,
    stride_sbe,
    stride_sbn,
    stride_sbse,
    stride_sbsn,
    stride_cm,
    GATED: tl.constexpr,
    A_MODE: tl.constexpr,
    FP8_W: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    N_SHARED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # 128 with FP8 weights (one scale per step)
    PAIRS: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    # _moe_decode_kernel's contract on tensor cores, "swap AB": the weight tile [BN, BK] is the
    # MMA's M side and the expert's rows (16 a pass, padded) its N side; loads that feed tl.dot are
    # pipelined by Triton (num_stages tiles in flight), which the CUDA-core loop's are not.
    item = tl.program_id(0)
    expert, count, w, ws, stride_n, stride_sn, up = _work_item(
        item, ids_ptr, P, T, N, E, b_ptr, bs_ptr, sb_ptr, sbs_ptr, stride_be, stride_bn, stride_bse, stride_bsn,
        stride_sbe, stride_sbn, stride_sbse, stride_sbsn, N_SHARED, PAIRS,
    )  # fmt: skip
    if count == 0:
        return
    offs_r = tl.arange(0, 16)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    b_rows = w + offs_n.to(tl.int64)[:, None] * stride_n + offs_k[None, :]  # [BN, BK]
    u_rows = w + (up + offs_n).to(tl.int64)[:, None] * stride_n + offs_k[None, :]  # up rows (GATED)
    bs_rows = ws + (offs_n // 128) * stride_sn  # [BN] (FP8_W)
    us_rows = ws + ((up + offs_n) // 128) * stride_sn
    for r0 in range(0, count, 16):
        pair = _pairs_of(ids_ptr, expert, P, r0, 16, PAIRS)  # [16]
        row_ok = r0 + offs_r < count
        c_row, a_row = _rows_of(pair, r0 + offs_r, item, P, T, A_ROW_DIV, GATED)
        acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)  # c.T tile
        acc_u = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < K
            kb = k0 // 128
            a, a_s = _dot_rows(
                a_ptr, as_ptr, a_row, row_ok, k, k_ok, kb, stride_am, stride_asm, A_MODE, FP8_MAX_C
            )
            b_mask = n_ok[:, None] & k_ok[None, :]
            b = tl.load(b_rows + k0, mask=b_mask, other=0.0)
            acc += _dot_part(b, a, a_s, bs_rows + kb, n_ok, FP8_W, UPCAST_DOT)
            if GATED:
                u = tl.load(u_rows + k0, mask=b_mask, other=0.0)
                acc_u += _dot_part(u, a, a_s, us_rows + kb, n_ok, FP8_W, UPCAST_DOT)
        h = _silu_mul(acc, acc_u, ROUND_BF16) if GATED else acc  # [BN, 16]
        c_ptrs = c_ptr + c_row[None, :] * stride_cm + offs_n[:, None]
        tl.store(c_ptrs, cast_out(h, c_ptr.dtype.element_ty), mask=n_ok[:, None] & row_ok[None, :])


@jit(dynamic=("T",))
def _moe_decode_down_sum_kernel(
    h_ptr,
    b_ptr,
    bs_ptr,
    sb_ptr,
    sbs_ptr,
    ids_ptr,
    tw_ptr,
    out_ptr,
    shared_ptr,
    T,
    N,
    K,
    E,
    stride_hm,
    stride_be,
    stride_bn,
    stride_bse,
    stride_bsn,
    stride_sbe,
    stride_sbn,
    stride_sbse,
    stride_sbsn,
    stride_out,
    stride_shared,
    TOP_K: tl.constexpr,
    N_SHARED: tl.constexpr,  # shared chunks: sb [N_SHARED, N, K], their h rows T * TOP_K + c * T + t
    KPAD: tl.constexpr,  # TOP_K + N_SHARED rounded up to a power of two
    A_MODE: tl.constexpr,  # 0 h as stored; 2 quantize h here (FP8 weights)
    FP8_W: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUB: tl.constexpr,  # 128-column blocks per K step
    FP8_MAX_C: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    # out[t, n] = sum_j tw[t, j] * round(w2_{ids[t, j]} row n . h[t * TOP_K + j])
    #             + sum_c round(shared chunk c's row n . h[T * TOP_K + c * T + t]) (+ shared[t, n]),
    # in float32 over the pairs whose expert is in [0, E), rounded once; one program per (t, N block)
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = offs_n < N
    offs_j = tl.arange(0, KPAD)  # slots: TOP_K routed pairs, then N_SHARED shared chunks
    routed = offs_j < TOP_K
    chunk = (offs_j - TOP_K).to(tl.int64)  # [KPAD] (shared slots)
    shared = (offs_j >= TOP_K) & (offs_j < TOP_K + N_SHARED)
    pair = tl.where(shared, T * TOP_K + chunk * T + t, t * TOP_K + offs_j)  # [KPAD] rows of h
    expert = tl.load(ids_ptr + t * TOP_K + offs_j, mask=routed, other=-1)
    ok = (routed & (expert >= 0) & (expert < E)) | shared  # [KPAD]
    e64 = tl.where(ok & routed, expert, 0).to(tl.int64)
    w = tl.where(shared, sb_ptr + chunk * stride_sbe, b_ptr + e64 * stride_be)  # [KPAD]
    stride_n = tl.where(shared, stride_sbn, stride_bn).to(tl.int64)
    rows = w[:, None] + offs_n.to(tl.int64)[None, :] * stride_n[:, None]  # [KPAD, BN]
    b_rows = rows[:, :, None, None]  # [KPAD, BN, 1, 1]
    ws = tl.where(shared, sbs_ptr + chunk * stride_sbse, bs_ptr + e64 * stride_bse)  # [KPAD]
    stride_sn = tl.where(shared, stride_sbsn, stride_bsn).to(tl.int64)
    bs_rows = ws[:, None, None] + (offs_n // 128)[None, :, None] * stride_sn[:, None, None]
    jn_ok = ok[:, None] & n_ok[None, :]  # [KPAD, BN]
    acc = tl.zeros((KPAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, SUB * 128):
        k, k_ok, kb, kb_ok = _k_step(k0, K, SUB)
        a = _load_a(h_ptr, h_ptr, pair, ok, k, k_ok, kb, kb_ok, stride_hm, 0, A_MODE, FP8_MAX_C)
        b_mask = jn_ok[:, :, None, None] & k_ok[None, None, :, :]
        b = tl.load(b_rows + k[None, None, :, :], mask=b_mask, other=0.0)  # [KPAD, BN, SUB, 128]
        s_mask = jn_ok[:, :, None] & kb_ok[None, None, :]
        b_s = _load_scales(bs_rows + kb[None, None, :], s_mask, FP8_W)  # [KPAD, BN, SUB]
        acc += _slice_dot(a[:, None, :, :], b, b_s, FP8_W)
    if out_ptr.dtype.element_ty == tl.bfloat16:  # each expert's output rounded as the reference's
        y = round_bf16(acc)
    else:
        y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    tw = tl.load(tw_ptr + t * TOP_K + offs_j, mask=ok & routed, other=0.0).to(tl.float32)  # [KPAD]
    tw = tl.where(shared, 1.0, tw)
    total = tl.sum(tl.where(jn_ok, y * tw[:, None], 0.0), axis=0)  # [BN]
    if HAS_SHARED:
        total += tl.load(shared_ptr + t * stride_shared + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + offs_n, cast_out(total, out_ptr.dtype.element_ty), mask=n_ok)


def _expert_args(w: torch.Tensor, w_s: torch.Tensor | None) -> tuple:
    """(w, scales, their expert and row strides) as the kernels take them; w stands in for absent
    scales (bf16 weights: never read)."""
    w_s = w if w_s is None else w_s
    return w, w_s, w.stride(0), w.stride(1), w_s.stride(0), w_s.stride(1)


def _shared_args(shared: SharedExperts | None, gated: bool, i: int, w: torch.Tensor, w_s) -> tuple:
    """`_expert_args` of the shared chunks stacked like experts (`_shared_view`), or of the routed
    experts again where there are none (never read: no program takes a shared item)."""
    return _expert_args(*(_shared_view(shared, gated, i) if shared is not None else (w, w_s)))


def _launch(a, a_s, w, w_s, c, ids, p, a_row_div, gated, a_mode, cfg: MoeDecodeConfig, block_n, round_bf16,
            shared: SharedExperts | None, t: int):  # fmt: skip
    """One decode GEMV launch: c [P + n * T, N] (N = w rows, halved when gated) from a and expert
    weights w, the n shared chunks in rows P + c * T + t."""
    e, rows, k = w.shape
    n = rows // 2 if gated else rows
    n_shared = 0 if shared is None else shared.w2.shape[-1] // (n if gated else k)
    fp8_w = w_s is not None
    a_s = a if a_s is None else a_s
    b, b_s, stride_be, stride_bn, stride_bse, stride_bsn = _expert_args(w, w_s)
    sb, sb_s, *shared_strides = _shared_args(shared, gated, n if gated else k, w, w_s)
    args = (
        a, a_s, b, b_s, sb, sb_s, c, ids,
        p, t, n, k, e, a_row_div,
        a.stride(0), a_s.stride(0), stride_be, stride_bn, stride_bse, stride_bsn, *shared_strides, c.stride(0),
    )  # fmt: skip
    common = dict(
        GATED=gated, A_MODE=a_mode, FP8_W=fp8_w, ROUND_BF16=round_bf16, N_SHARED=n_shared, BLOCK_N=block_n,
        PAIRS=SMALL_PAIRS if p <= SMALL_PAIRS else MAX_PAIRS, FP8_MAX_C=FP8_MAX,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    grid = (p + n_shared, triton.cdiv(n, block_n))
    if cfg.dot:
        block_k = BLOCK if fp8_w else cfg.block_k
        _moe_decode_dot_kernel[grid](
            *args, BLOCK_K=block_k, UPCAST_DOT=interpreting(), **common, **pdl_launch()
        )
    else:
        _moe_decode_kernel[grid](*args, ROWS=cfg.rows, SUB=cfg.block_k // BLOCK, **common, **pdl_launch())


def moe_decode_gate_up(
    x: torch.Tensor,
    w13: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None,
    x_act: Fp8Act | None,
    cfg: MoeDecodeConfig,
    shared: SharedExperts | None = None,
) -> torch.Tensor:
    """GEMM1: h [T * top_k + n * T, I] in x's dtype, h[t * top_k + j] = silu(gate) * up of expert
    ids[t, j] on x[t], with fused_moe_ref's roundings (with FP8 weights x is quantized per token per
    128 channels, here or by its producer: x_act); with `shared` (n = shared_chunks(...) > 0, checked
    by the caller), h[T * top_k + c * T + t] the same of shared chunk c on x[t]. Rows of pairs whose
    expert is outside [0, E) are not written. Arguments checked by `fused_moe_triton`; topk_ids
    contiguous, at most MAX_PAIRS pairs."""
    t, d = x.shape
    p = topk_ids.numel()
    i = w13.shape[1] // 2
    _check_decode(p, topk_ids, cfg)
    n_shared = 0 if shared is None else shared.w2.shape[-1] // i
    h = torch.empty(p + n_shared * t, i, dtype=x.dtype, device=x.device)
    if w13_scale is not None and x_act is not None:
        a, a_s, a_mode = x_act.q, x_act.scale, 1
        assert a.shape == x.shape and a.dtype == FP8 and a.stride(-1) == 1, (a.shape, a.dtype)
        assert a_s.shape == (t, triton.cdiv(d, BLOCK)) and a_s.dtype == torch.float32, a_s.shape
    else:
        a, a_s, a_mode = x, None, 2 if w13_scale is not None else 0
    round_bf16 = x.dtype == torch.bfloat16
    top_k = topk_ids.shape[1]
    _launch(
        a, a_s, w13, w13_scale, h, topk_ids, p, top_k, True, a_mode, cfg, cfg.block_n1, round_bf16, shared, t
    )
    return h


def moe_decode_down(
    h: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    w2_scale: torch.Tensor | None,
    cfg: MoeDecodeConfig,
    shared: SharedExperts | None = None,
) -> torch.Tensor:
    """GEMM2 per expert: y [T * top_k + n * T, D] in h's dtype, y[p] = expert_{ids[p]}'s w2 on h[p]
    (h quantized per 128 channels with FP8 weights), and with `shared` the rows of the n shared
    chunks as `moe_decode_gate_up` lays them out, for the top-k reduce of moe.py. Rows of pairs
    whose expert is outside [0, E) are not written."""
    p = topk_ids.numel()
    t = topk_ids.shape[0]
    _check_decode(p, topk_ids, cfg)
    y = torch.empty(h.shape[0], w2.shape[1], dtype=h.dtype, device=h.device)
    mode = 2 if w2_scale is not None else 0
    _launch(h, None, w2, w2_scale, y, topk_ids, p, 1, False, mode, cfg, cfg.block_n2, True, shared, t)
    return y


def moe_decode_down_sum(
    h: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w2_scale: torch.Tensor | None,
    shared_out: torch.Tensor | None,
    out: torch.Tensor,
    cfg: MoeDecodeConfig,
    shared: SharedExperts | None = None,
) -> torch.Tensor:
    """GEMM2 per token with the top-k sum: out [T, D] = sum_j topk_weights[t, j] * y[t * top_k + j]
    over the pairs whose expert is in [0, E) (y rounded to out's dtype as in fused_moe_ref), plus
    with `shared` the n shared chunks' y (weight 1.0, h rows as `moe_decode_gate_up` lays them out),
    plus shared_out, summed in float32 and rounded once. Deterministic. Returns out."""
    t, d = out.shape
    e, _, i = w2.shape
    top_k = topk_ids.shape[1]
    n_shared = 0 if shared is None else shared.w2.shape[-1] // i
    fp8 = w2_scale is not None
    _check_decode(topk_ids.numel(), topk_ids, cfg)
    b, b_s, *strides = _expert_args(w2, w2_scale)
    sb, sb_s, *shared_strides = _shared_args(shared, False, i, w2, w2_scale)
    shared_rows = out if shared_out is None else shared_out  # unused without shared_out
    _moe_decode_down_sum_kernel[(t, triton.cdiv(d, cfg.block_n2))](
        h, b, b_s, sb, sb_s, topk_ids, topk_weights.contiguous(), out, shared_rows,
        t, d, i, e,
        h.stride(0), *strides, *shared_strides, out.stride(0), shared_rows.stride(0),
        TOP_K=top_k, N_SHARED=n_shared, KPAD=triton.next_power_of_2(top_k + n_shared), A_MODE=2 if fp8 else 0,
        FP8_W=fp8, HAS_SHARED=shared_out is not None, BLOCK_N=cfg.block_n2, SUB=cfg.block_k // BLOCK,
        FP8_MAX_C=FP8_MAX, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(),
    )  # fmt: skip
    return out


def _check_decode(p: int, topk_ids: torch.Tensor, cfg: MoeDecodeConfig) -> None:
    assert 0 < p <= MAX_PAIRS and topk_ids.is_contiguous(), (p, MAX_PAIRS)
    assert cfg.rows & (cfg.rows - 1) == 0, f"rows must be a power of two: {cfg}"
    assert cfg.block_k % BLOCK == 0 and cfg.block_k // BLOCK in (1, 2, 4, 8), f"block_k: 128 * 2^n: {cfg}"


__all__ = [
    "MAX_PAIRS",
    "MoeDecodeConfig",
    "SharedExperts",
    "moe_decode_down",
    "moe_decode_down_sum",
    "moe_decode_gate_up",
    "pick_moe_decode_config",
    "shared_chunks",
]
