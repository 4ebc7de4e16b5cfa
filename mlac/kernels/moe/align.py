"""moe_align: token-expert pairs grouped by expert, each expert padded to whole BLOCK_M-row blocks.

The grouped expert GEMMs (grouped.py) take their rows in these blocks: block b holds BLOCK_M pairs
of one expert (`block_expert[b]`), padded with the pair index P = T * top_k (a row no GEMM reads or
writes). Sizes depend on T, top_k, E and BLOCK_M only (`align_sizes`), so a CUDA graph can hold
them; the blocks past `num_padded` are marked -1. One program of one launch: counts per expert,
their padded prefix sums, then each pair's slot. The order of pairs inside an expert is
unspecified, so the tests check the contract's invariants rather than compare with a reference.
"""

from __future__ import annotations

import torch

from mlac.kernels.fp8_quant import HAS_TRITON, jit, pdl_launch, pdl_start, tl, triton


@jit(dynamic=("P", "max_padded", "max_blocks"))
def _moe_align_kernel(
    ids_ptr,
    counts_ptr,
    rank_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    P,
    E,
    max_padded,
    max_blocks,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    BCHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    # One program. counts_ptr [E_PAD] and rank_ptr [P] are scratch.
    e_offs = tl.arange(0, E_PAD)
    tl.store(counts_ptr + e_offs, tl.zeros([E_PAD], dtype=tl.int32))
    tl.debug_barrier()
    for start in range(0, P, CHUNK):  # rank of each pair within its expert (any order will do)
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
        valid = (ids >= 0) & (ids < E)
        rank = tl.atomic_add(counts_ptr + tl.where(valid, ids, 0), 1, mask=valid)
        tl.store(rank_ptr + offs, rank, mask=valid)
    tl.debug_barrier()
    counts = tl.load(counts_ptr + e_offs, cache_modifier=".cg")
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # [E_PAD] inclusive
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    tl.debug_barrier()
    tl.store(counts_ptr + e_offs, ends - padded)  # counts_ptr now holds each expert's first slot
    for start in range(0, max_padded, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + offs, tl.zeros([CHUNK], dtype=tl.int32) + P, mask=offs < max_padded)
    for start in range(0, max_blocks, BCHUNK):
        blk = start + tl.arange(0, BCHUNK)
        first = blk * BLOCK_M
        expert = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)  # [BCHUNK]
        expert = tl.where(first < total, expert, -1)
        tl.store(block_expert_ptr + blk, expert, mask=blk < max_blocks)
    tl.debug_barrier()
    for start in range(0, P, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
        valid = (ids >= 0) & (ids < E)
        rank = tl.load(rank_ptr + offs, mask=valid, other=0, cache_modifier=".cg")
        first = tl.load(counts_ptr + tl.where(valid, ids, 0), mask=valid, other=0, cache_modifier=".cg")
        tl.store(sorted_ptr + first + rank, offs, mask=valid)


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group token-expert pairs by expert, each expert padded to a multiple of block_m rows.

    topk_ids [T, k] -> (sorted_pairs [max_padded] int32: pair index t * k + j, or T * k as
    padding; block_expert [max_blocks] int32: expert of each block, -1 past the end;
    num_padded [1] int32). Sizes depend on T, k, E and block_m only (CUDA-graph safe):
    max_padded = T*k + min(T*k, E) * (block_m - 1). Ids outside [0, E) are left out.
    Order inside an expert is unspecified.
    """
    assert HAS_TRITON, "moe_align needs triton"
    assert topk_ids.dim() == 2 and topk_ids.is_contiguous(), topk_ids.shape
    p = topk_ids.numel()
    max_padded, max_blocks = align_sizes(p, num_experts, block_m)
    dev = topk_ids.device
    e_pad = triton.next_power_of_2(num_experts)
    counts = torch.empty(e_pad, dtype=torch.int32, device=dev)
    rank = torch.empty(max(p, 1), dtype=torch.int32, device=dev)
    sorted_pairs = torch.empty(max_padded, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    _moe_align_kernel[(1,)](
        topk_ids,
        counts,
        rank,
        sorted_pairs,
        block_expert,
        num_padded,
        p,
        num_experts,
        max_padded,
        max_blocks,
        BLOCK_M=block_m,
        E_PAD=e_pad,
        CHUNK=1024,
        BCHUNK=max(16, 8192 // e_pad),
        num_warps=8,
        **pdl_launch(),
    )
    return sorted_pairs, block_expert, num_padded


def align_sizes(num_pairs: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """`moe_align`'s (max_padded, max_blocks) for num_pairs token-expert pairs: each expert that can
    hold a pair padded by up to block_m - 1 rows."""
    max_padded = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return max_padded, -(-max_padded // block_m)
