"""The skinny decode GEMM's configs (gemv.py): the measured table, the rules, and where it applies.

`SkinnyConfig` is one launch's tile and options. `TUNED` holds the configs measured on an H200 per
(weight kind, N, K, M class), and None where the path the skinny GEMM replaces was faster;
`default_config` is the rule for shapes not measured, `pick_config` the choice between the two.
`skinny_applies` decides per product whether the skinny GEMM runs at all (rows, dtypes, TUNED).
No kernel here: step_variants.py plans the warm-up from these alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mlac.core.fp8 import BLOCK, FP8
from mlac.kernels.fp8_quant import Fp8Act
from mlac.kernels.gemm.fp8_gemm import sm_count

MAX_ROWS = 16  # the largest M the skinny GEMM takes (its tensor-core form pads M to this)
M_CLASSES = (1, 4, MAX_ROWS)  # tuned configs are keyed by the smallest class >= M
DENSE_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class SkinnyConfig:
    """Tile and launch options. FP8 weights need block_k == 128 and block_n dividing 128 (one
    weight scale per tile and K step); `dot` needs block_n, block_k >= 16."""

    block_n: int
    block_k: int
    split_k: int = 1  # K ranges reduced in-launch by the last program of each N tile
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = False  # tensor-core W_tile @ x.T (M padded to 16) instead of CUDA-core rows


# Measured configs, keyed by (kind, N, K, m_class): kind "bf16" (also fp16) or "fp8", m_class
# from M_CLASSES; None where the path the skinny GEMM replaces (cuBLAS, fp8_gemm) measured faster
# (skinny_applies then declines). bf16 shapes not here use default_config. From
# benchmarks/kernels/gemv.py on one H200 (benchmarks/results/kernels_gemv_h200.json): a config is
# kept where it beat the baseline by >= 3% summed over the class's M; the comment gives the mean time
# per call, skinny vs baseline (bf16 in the V2-Lite decode step: 328.0 against 314.9 tok/s at batch
# 1 with it on, H200). FP8: None throughout, and an FP8 shape not here does not take it either
# (skinny_applies). Alone the skinny GEMM won most FP8 shapes by 3-20%, but inside the V2-Lite decode
# step fp8_gemm on the norm's Fp8Act was faster (batch 1: 330.7 against 317.3 tok/s, batch 32 equal),
# and with the fused launches since, equal (every FP8 shape through it: 365.5 / 4,528 against
# 367.6 / 4,526 tok/s at batch 1 / 32, benchmarks/results/kernels_mla_out_router_h200.txt). The
# kernel keeps its FP8 form: a shape whose entry here holds a config takes it.
_C = SkinnyConfig  # (block_n, block_k, split_k, num_warps, num_stages, dot)
TUNED: dict[tuple[str, int, int, int], SkinnyConfig | None] = {
    ("bf16", 576, 2048, 1): _C(16, 256, 8, 4, 4, False),  # M=1: 4.36 us vs 6.05
    ("bf16", 576, 2048, 4): _C(64, 256, 8, 4, 3, True),  # M=2,4: 4.67 us vs 5.83
    ("bf16", 576, 2048, 16): _C(64, 256, 8, 4, 3, True),  # M=8,16: 5.06 us vs 5.79
    ("bf16", 576, 7168, 1): _C(16, 256, 8, 4, 4, False),  # M=1: 6.16 us vs 6.90
    ("bf16", 576, 7168, 4): _C(64, 256, 8, 4, 3, True),  # M=2,4: 6.70 us vs 7.01
    ("bf16", 576, 7168, 16): _C(32, 128, 16, 4, 4, True),  # M=8,16: 6.60 us vs 7.18
    ("bf16", 1536, 7168, 1): _C(32, 256, 8, 4, 4, False),  # M=1: 9.24 us vs 9.82
    ("bf16", 1536, 7168, 4): _C(32, 128, 8, 4, 4, True),  # M=2,4: 9.58 us vs 9.87
    ("bf16", 1536, 7168, 16): None,  # M=8,16: cublas 9.93 us, skinny 9.73
    ("bf16", 2048, 1408, 1): _C(16, 512, 1, 4, 4, False),  # M=1: 4.31 us vs 5.16
    ("bf16", 2048, 1408, 4): None,  # M=2,4: cublas 5.18 us, skinny 5.40
    ("bf16", 2048, 1408, 16): None,  # M=8,16: cublas 5.19 us, skinny 5.56
    ("bf16", 2048, 2048, 1): None,  # M=1: cublas 6.07 us, skinny 5.90
    ("bf16", 2048, 2048, 4): None,  # M=2,4: cublas 6.06 us, skinny 6.00
    ("bf16", 2048, 2048, 16): None,  # M=8,16: cublas 6.08 us, skinny 6.19
    ("bf16", 2048, 10944, 1): _C(32, 128, 8, 4, 4, True),  # M=1: 15.32 us vs 15.89
    ("bf16", 2048, 10944, 4): None,  # M=2,4: cublas 15.78 us, skinny 15.51
    ("bf16", 2048, 10944, 16): None,  # M=8,16: cublas 15.84 us, skinny 15.88
    ("bf16", 2816, 2048, 1): None,  # M=1: cublas 6.25 us, skinny 6.76
    ("bf16", 2816, 2048, 4): None,  # M=2,4: cublas 6.23 us, skinny 7.03
    ("bf16", 2816, 2048, 16): None,  # M=8,16: cublas 6.26 us, skinny 7.11
    ("bf16", 3072, 2048, 1): None,  # M=1: cublas 6.10 us, skinny 6.72
    ("bf16", 3072, 2048, 4): None,  # M=2,4: cublas 6.41 us, skinny 7.17
    ("bf16", 3072, 2048, 16): None,  # M=8,16: cublas 6.43 us, skinny 7.36
    ("bf16", 4096, 7168, 1): _C(32, 128, 4, 4, 4, True),  # M=1: 18.04 us vs 19.07
    ("bf16", 4096, 7168, 4): _C(32, 128, 4, 4, 4, True),  # M=2,4: 18.28 us vs 19.15
    ("bf16", 4096, 7168, 16): _C(32, 128, 4, 4, 4, True),  # M=8,16: 18.80 us vs 19.46
    ("bf16", 7168, 2048, 1): None,  # M=1: cublas 10.17 us, skinny 11.13
    ("bf16", 7168, 2048, 4): None,  # M=2,4: cublas 10.01 us, skinny 11.22
    ("bf16", 7168, 2048, 16): None,  # M=8,16: cublas 9.95 us, skinny 11.54
    ("bf16", 7168, 16384, 1): None,  # M=1: cublas 59.38 us, skinny 58.32
    ("bf16", 7168, 16384, 4): None,  # M=2,4: cublas 60.18 us, skinny 58.70
    ("bf16", 7168, 16384, 16): _C(64, 128, 4, 4, 4, True),  # M=8,16: 59.80 us vs 64.92
    ("bf16", 21888, 2048, 1): None,  # M=1: cublas 24.26 us, skinny 23.98
    ("bf16", 21888, 2048, 4): None,  # M=2,4: cublas 24.74 us, skinny 24.84
    ("bf16", 21888, 2048, 16): None,  # M=8,16: cublas 24.88 us, skinny 25.21
    ("bf16", 24576, 1536, 1): _C(64, 128, 1, 4, 4, False),  # M=1: 20.56 us vs 21.58
    ("bf16", 24576, 1536, 4): _C(64, 128, 1, 4, 4, True),  # M=2,4: 20.91 us vs 21.77
    ("bf16", 24576, 1536, 16): None,  # M=8,16: cublas 21.55 us, skinny 21.35
    ("fp8", 576, 2048, 1): None,  # alone M=1: 4.25 us vs 5.02
    ("fp8", 576, 2048, 4): None,  # alone M=2,4: 4.43 us vs 5.08
    ("fp8", 576, 2048, 16): None,  # alone M=8,16: 4.62 us vs 5.27
    ("fp8", 576, 7168, 1): None,  # alone M=1: 5.79 us vs 6.68
    ("fp8", 576, 7168, 4): None,  # alone M=2,4: 5.86 us vs 6.83
    ("fp8", 576, 7168, 16): None,  # alone M=8,16: 6.06 us vs 7.14
    ("fp8", 1536, 7168, 1): None,  # alone M=1: 7.34 us vs 7.81
    ("fp8", 1536, 7168, 4): None,  # alone M=2,4: 7.45 us vs 7.93
    ("fp8", 1536, 7168, 16): None,  # alone M=8,16: 7.65 us vs 8.47
    ("fp8", 2048, 1408, 1): None,  # alone M=1: 4.75 us vs 5.89
    ("fp8", 2048, 1408, 4): None,  # alone M=2,4: 4.83 us vs 6.04
    ("fp8", 2048, 1408, 16): None,  # alone M=8,16: 4.99 us vs 6.38
    ("fp8", 2048, 2048, 1): None,  # alone M=1: 5.25 us vs 5.53
    ("fp8", 2048, 2048, 4): None,  # alone M=2,4: 5.33 us vs 5.61
    ("fp8", 2048, 2048, 16): None,  # M=8,16: fp8_gemm 5.77 us, skinny 5.80
    ("fp8", 2048, 10944, 1): None,  # alone M=1: 10.54 us vs 11.12
    ("fp8", 2048, 10944, 4): None,  # alone M=2,4: 10.92 us vs 11.29
    ("fp8", 2048, 10944, 16): None,  # alone M=8,16: 11.14 us vs 12.25
    ("fp8", 2816, 2048, 1): None,  # alone M=1: 5.85 us vs 6.07
    ("fp8", 2816, 2048, 4): None,  # alone M=2,4: 6.00 us vs 6.20
    ("fp8", 2816, 2048, 16): None,  # M=8,16: fp8_gemm 6.42 us, skinny 6.29
    ("fp8", 3072, 2048, 1): None,  # alone M=1: 5.94 us vs 6.15
    ("fp8", 3072, 2048, 4): None,  # M=2,4: fp8_gemm 6.25 us, skinny 6.12
    ("fp8", 3072, 2048, 16): None,  # M=8,16: fp8_gemm 6.49 us, skinny 6.42
    ("fp8", 4096, 7168, 1): None,  # M=1: fp8_gemm 11.55 us, skinny 11.25
    ("fp8", 4096, 7168, 4): None,  # M=2,4: fp8_gemm 11.66 us, skinny 11.40
    ("fp8", 4096, 7168, 16): None,  # M=8,16: fp8_gemm 12.27 us, skinny 12.24
    ("fp8", 7168, 2048, 1): None,  # alone M=1: 8.02 us vs 8.53
    ("fp8", 7168, 2048, 4): None,  # alone M=2,4: 8.18 us vs 8.69
    ("fp8", 7168, 2048, 16): None,  # alone M=8,16: 8.76 us vs 9.07
    ("fp8", 7168, 16384, 1): None,  # alone M=1: 31.81 us vs 32.97
    ("fp8", 7168, 16384, 4): None,  # alone M=2,4: 32.16 us vs 33.30
    ("fp8", 7168, 16384, 16): None,  # M=8,16: fp8_gemm 34.48 us, skinny 33.49
    ("fp8", 21888, 2048, 1): None,  # alone M=1: 13.34 us vs 14.33
    ("fp8", 21888, 2048, 4): None,  # alone M=2,4: 13.56 us vs 14.53
    ("fp8", 21888, 2048, 16): None,  # alone M=8,16: 13.94 us vs 14.73
    ("fp8", 24576, 1536, 1): None,  # alone M=1: 11.50 us vs 12.32
    ("fp8", 24576, 1536, 4): None,  # alone M=2,4: 11.58 us vs 12.30
    ("fp8", 24576, 1536, 16): None,  # alone M=8,16: 11.81 us vs 12.50
}


def m_class(m: int) -> int:
    """The smallest of M_CLASSES that is >= m (m <= MAX_ROWS)."""
    return next(c for c in M_CLASSES if c >= m)


def split_for(n_tiles: int, k_blocks: int, sms: int, min_blocks: int = 2) -> int:
    """Power-of-two split of K that brings the grid to about 2 programs per SM, keeping at least
    `min_blocks` K steps per split (1 when N alone fills the machine)."""
    split = 1
    while n_tiles * split < 2 * sms and k_blocks >= 2 * split * min_blocks:
        split *= 2
    return split


def default_config(kind: str, n: int, k: int, m: int, sms: int) -> SkinnyConfig:
    """A config by rule: CUDA cores up to 4 rows (each W element feeds <= 4 FMAs), tensor cores
    above; one row keeps a [BN, BK] float32 accumulator, 2-4 rows reduce each step (narrower
    tiles: registers); narrow N tiles for narrow N; split-K up to about 2 programs per SM."""
    dot = m > 4
    block_k = BLOCK if dot or kind == "fp8" else 2 * BLOCK
    block_n = 64 if dot else 32 if m == 1 else 16
    if n <= 1024:
        block_n = max(16, block_n // 2)
    split = split_for(-(-n // block_n), -(-k // block_k), sms)
    return SkinnyConfig(block_n, block_k, split_k=split, num_warps=4, num_stages=4, dot=dot)


@functools.cache
def pick_config(kind: str, n: int, k: int, m: int, device: torch.device) -> SkinnyConfig:
    """TUNED's entry for (kind, N, K, m_class(M)), else default_config (cached: eager steps call
    this per Linear)."""
    tuned = TUNED.get((kind, n, k, m_class(m)))
    return tuned if tuned is not None else default_config(kind, n, k, m, sm_count(device))


def skinny_applies(x: torch.Tensor | Fp8Act, w: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """Whether `skinny_linear` takes this product: at most MAX_ROWS rows, and dtypes it handles
    (FP8 weights with a scale; else bf16/fp16 weights with x of the same dtype), where it is the
    faster path: bf16 unless TUNED says None; FP8 only where TUNED holds a config (none today:
    see TUNED's comment)."""
    a = x.q if isinstance(x, Fp8Act) else x
    k = a.shape[-1]
    if k == 0 or a.numel() // k > MAX_ROWS:
        return False
    kind = "fp8" if scale is not None else "bf16"
    key = (kind, w.shape[0], k, m_class(max(1, a.numel() // k)))
    if scale is not None:  # FP8: only where TUNED holds a config (it lost inside the decode step)
        return w.dtype == FP8 and TUNED.get(key) is not None
    if key in TUNED and TUNED[key] is None:
        return False  # measured slower than cuBLAS (unmeasured shapes take it)
    return not isinstance(x, Fp8Act) and w.dtype in DENSE_DTYPES and x.dtype == w.dtype
