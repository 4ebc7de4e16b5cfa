"""The decode path of fused MoE: when it runs, and its tiles.

At decode (batch 1: 6 pairs over 64 experts) the grouped GEMMs (grouped.py) pad every expert to a
16-row tile holding one real row, and their few tiles need split-K (lock counters) to fill the GPU.
The decode GEMVs instead stream each expert's weight slices against the few rows routed to it:
GEMM1 and GEMM2 per expert (decode.py), or GEMM2 per token with the top-k sum in its launch
(decode_sum.py, `MoeDecodeConfig.fuse_sum`). `pick_moe_decode_config` is the rule between the two
paths (fused.py asks it first); `MoeDecodeConfig` holds the tiles and the form of the product.

Launches per MoE layer: 2 (GEMM1, GEMM2 + sum: FP8) or 3 (GEMM1, GEMM2, reduce.py's reduce: bf16), shared
experts included (shared.py), against the grouped path's 5 ([act_quant], moe_align, GEMM1, GEMM2,
reduce) plus the shared MLP's 3. The setting MLAC_MOE_DECODE_CONFIG (mlac/settings.py) replaces
the tiles `pick_moe_decode_config` picks (`config_override`: a sweep's result run without a code
change). A caller that wants the grouped path at a decode shape gives fused_moe a grouped config
(grouped.pick_moe_config).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import torch

from mlac import settings
from mlac.core.errors import MlacError
from mlac.core.fp8 import BLOCK

MAX_PAIRS = 256  # token-expert pairs a decode launch takes
# The PAIRS constexpr (ids each program scans) takes two values, so that the variants a server
# compiles stay few (`Engine.warmup` meets both): one warp's worth at batch 1-5, else MAX_PAIRS.
SMALL_PAIRS = 32


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


ONE_TOKEN_PAIRS = 8  # the decode kernel runs one token's top-k pairs (top-k <= 8)


def pick_moe_decode_config(num_pairs: int, num_experts: int, fp8: bool) -> MoeDecodeConfig | None:
    """The decode kernel's tiles, or None where the grouped GEMMs (grouped.py) should run: measured on
    an H200 (benchmarks/kernels/moe_decode.py), the decode kernel wins for one token's top-k pairs only
    (at most ONE_TOKEN_PAIRS), so batch-1 decode steps take it and everything larger the grouped
    path. `fuse_sum`: GEMM2 runs per token and sums the top-k in its launch (one launch fewer)."""
    if num_pairs > ONE_TOKEN_PAIRS or num_pairs > num_experts:
        return None
    # one token's top-k (benchmarks/results/kernels_moe_decode_h200.json, V2-Lite shapes, 20 calls in a
    # CUDA graph): FP8 31.5 us against the grouped path's 37.5, bf16 33.3 against 38.1. From 4 tokens
    # on the grouped GEMMs won every measured shape (FP8 66.5 against 101.7 us at 4 tokens).
    # The tiles: the fastest of the sweep with the shared experts inside (benchmarks/kernels/moe_tune.sh,
    # results/kernels_moe_shared_h200.json): FP8 on tensor cores 32.0 us (51% of copy bandwidth)
    # against 41.8 for the CUDA-core tiles before, and in the decode step 375.7 -> 414.1 tok/s at
    # batch 1; bf16 42.9 against 44.4 us, 388.3 -> 393.3 tok/s.
    override = config_override(settings.MOE_DECODE_CONFIG.get())
    if fp8:
        return override.get("fp8") or MoeDecodeConfig(
            64, 16, 512, 1, num_warps=8, num_stages=3, fuse_sum=True, dot=True
        )
    return override.get("bf16") or MoeDecodeConfig(
        64, 32, 128, 1, num_warps=4, num_stages=3, fuse_sum=False, dot=True
    )


@functools.cache
def config_override(text: str | None) -> dict[str, MoeDecodeConfig]:
    """The setting MLAC_MOE_DECODE_CONFIG, to run a config found by a sweep without a code change:
    JSON {"fp8": {MoeDecodeConfig fields}, "bf16": {...}} (either key may be left out). Anything
    else is a one-line MlacError that names the variable."""
    if not text:
        return {}
    try:
        kinds = json.loads(text)
        if not isinstance(kinds, dict) or not set(kinds) <= {"fp8", "bf16"}:
            raise ValueError('expected an object with the keys "fp8" and/or "bf16"')
        return {kind: MoeDecodeConfig(**fields) for kind, fields in kinds.items()}
    except (ValueError, TypeError) as e:
        raise MlacError(f"{settings.MOE_DECODE_CONFIG.name}={text!r}: {e}") from None


def check_decode(p: int, topk_ids: torch.Tensor, cfg: MoeDecodeConfig) -> None:
    """What every decode launch takes: 1..MAX_PAIRS pairs with contiguous ids, `cfg.rows` a power of
    two and `cfg.block_k` 128 * 2^n (n <= 3)."""
    assert 0 < p <= MAX_PAIRS and topk_ids.is_contiguous(), (p, MAX_PAIRS)
    assert cfg.rows & (cfg.rows - 1) == 0, f"rows must be a power of two: {cfg}"
    assert cfg.block_k % BLOCK == 0 and cfg.block_k // BLOCK in (1, 2, 4, 8), f"block_k: 128 * 2^n: {cfg}"
