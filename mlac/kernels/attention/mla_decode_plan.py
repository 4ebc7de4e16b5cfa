"""Launch plan of MLA decode (mla_decode.py): tiles per form, the split count, and the grouped form's rows.

Two forms of the one split-KV kernel: per row (one decode row per program) and grouped (`row_groups`:
consecutive rows of one sequence, a flattened extend or a speculative verify, share a program and
each KV tile). `default_config` holds the tuned launch settings of both; `decode_num_splits` (from
`choose_num_splits`) fixes the split count from static sizes only, so a CUDA graph can hold it;
`prefer_row_groups` is the rule between the forms and `row_groups_host` / `row_groups` the grouped
form's per-row table.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import torch

FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


# Launch configurations (H200, Triton 3.6; benchmarks/kernels/attention.py). BLOCK_H >= 16
# (tl.dot). ctas_per_sm (from registers and shared memory) feeds the split heuristic.
# Few heads: memory-bound; a 16-head tile on mma.sync, num_stages=5 so that the pipeliner keeps two
# KV tiles in flight behind the block-table lookups (3 or 4 stages give one). Many heads: a 64-head
# tile for wgmma (M = 64 per warpgroup, the 512-wide accumulator split over 2 warpgroups).
# num_splits is chosen for the longest sequence the block table can hold (a CUDA graph captures
# it for the whole context); a request uses only the splits its own length fills with at least
# min_split_tiles tiles each, so short sequences in a graph sized for 160k tokens neither write nor
# merge dozens of empty partials.
# Grouped form (`row_groups`): ROWS rows of one sequence x BLOCK_H heads fill M = GROUP_M, "many"'s
# wgmma tile, with its launch settings. 64 heads or more already fill it: those never group.
_CONFIGS = {  # the same for a bf16 and an FP8 cache
    "few": dict(BLOCK_H=16, ROWS=1, BLOCK_N=32, num_warps=4, num_stages=5, ctas_per_sm=2, tile_in_page=True, min_split_tiles=2),
    "many": dict(BLOCK_H=64, ROWS=1, BLOCK_N=32, num_warps=8, num_stages=2, ctas_per_sm=1, tile_in_page=True, min_split_tiles=2),
    "rows16": dict(BLOCK_H=16, ROWS=4, BLOCK_N=64, num_warps=8, num_stages=2, ctas_per_sm=1, tile_in_page=True, min_split_tiles=2),
    "rows16_fp8": dict(BLOCK_H=16, ROWS=2, BLOCK_N=64, num_warps=8, num_stages=2, ctas_per_sm=1, tile_in_page=True, min_split_tiles=2),
    "rows32": dict(BLOCK_H=32, ROWS=2, BLOCK_N=64, num_warps=8, num_stages=2, ctas_per_sm=1, tile_in_page=True, min_split_tiles=2),
}  # fmt: skip
# The grouped tiles (rows16*): the fastest of `benchmarks/kernels/mla_rows.py --sweep` on an H200 (16 heads,
# graph-wide tables of 163,840 tokens; benchmarks/results/kernels_mla_rows_h200.json): 64 rows after a
# 2,000-token prefix 91.2 -> 50.1 us per layer (bf16 cache, 4 rows a program), 110.9 -> 79.1 (FP8, 2 rows a
# program: no 4-row variant with 64-key tiles ran); 4 verify rows over 4,096 tokens 26.3 -> 21.8 (bf16).
# rows32 (17-32 heads) is not measured.
GROUP_M = 64
_CONFIG_INTERPRET = dict(
    BLOCK_H=16,
    ROWS=1,
    BLOCK_N=16,
    num_warps=4,
    num_stages=1,
    ctas_per_sm=1,
    tile_in_page=True,
    min_split_tiles=1,
)
INTERPRET_ROWS = 4  # rows per program of the grouped form under the interpreter (tests)


def default_config(
    n_heads: int, device: torch.device, kv_dtype: torch.dtype = torch.bfloat16, grouped: bool = False
) -> dict:
    """Launch settings of the per-row form, or (`grouped`) of the grouped form: ROWS = 1 where
    rows do not group (n_heads >= GROUP_M)."""
    if device.type != "cuda":
        return {**_CONFIG_INTERPRET, "ROWS": INTERPRET_ROWS if grouped and n_heads < GROUP_M else 1}
    if n_heads >= GROUP_M:
        return dict(_CONFIGS["many"])
    if grouped:
        fp8 = kv_dtype in FP8_KV_DTYPES
        return dict(_CONFIGS["rows32" if n_heads > 16 else "rows16_fp8" if fp8 else "rows16"])
    return dict(_CONFIGS["few"])


def decode_group_rows(n_heads: int, device: torch.device, kv_dtype: torch.dtype = torch.bfloat16) -> int:
    """Rows of one sequence that one program of the grouped form takes (its ROWS) over a cache of
    `kv_dtype`; 1 where grouping gains nothing (a head tile of 64 or more already fills the dots' M)."""
    return default_config(n_heads, device, kv_dtype, grouped=True)["ROWS"]


def prefer_row_groups(
    q_lens: Sequence[int], n_heads: int, device: torch.device, kv_dtype: torch.dtype = torch.bfloat16
) -> bool:
    """The form rule: the grouped form when some sequence runs more than one row (a flattened
    extend, a speculative verify) and rows group at all; pure decode (every q_len 1) keeps the
    per-row form and its own tuned launch (a group of one would waste most of the grouped M)."""
    return decode_group_rows(n_heads, device, kv_dtype) > 1 and any(q > 1 for q in q_lens)


def row_groups_host(
    ctx_lens: Sequence[int], q_lens: Sequence[int], rows: int, pad: int = 0
) -> tuple[list[int], list[int]]:
    """The grouped form's per-row table, as host lists, for the flattened rows of B sequences
    (sequence i: q_lens[i] rows, row j at position ctx_lens[i] + j, attending over ctx + j + 1
    tokens) and then `pad` padding rows (one token each): (lead [T], kv_len [T]).
    lead[r]: rows of the group row r leads (1..rows), 0 when r is not a group's first row; groups
    are runs of at most `rows` consecutive rows of one sequence. kv_len[r]: the seq_len of the
    last (longest) row of r's group, which sets the split partition of every row of the group."""
    lead, kv_len = [], []
    for c, q in zip(ctx_lens, q_lens, strict=True):
        for g0 in range(0, q, rows):
            n = min(rows, q - g0)
            lead += [n] + [0] * (n - 1)
            kv_len += [c + g0 + n] * n
    return lead + [1] * pad, kv_len + [1] * pad


def row_groups(
    ctx_lens: Sequence[int], q_lens: Sequence[int], rows: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[2, T] int32 on `device`: `row_groups_host` as mla_decode's `row_groups` input."""
    return torch.tensor(row_groups_host(ctx_lens, q_lens, rows), dtype=torch.int32, device=device)


@cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(batch: int, head_blocks: int, max_len: int, block_n: int, slots: int) -> int:
    """Splits that minimize (waves x tiles per split), a tile's worth of cost added per split for
    the prologue, the partial write and the merge. Depends only on static sizes (graph-safe)."""
    tiles = max(1, -(-max_len // block_n))
    best, best_cost = 1, float("inf")
    for s in range(1, min(tiles, 64) + 1):
        waves = -(-(batch * head_blocks * s) // slots)
        cost = waves * (-(-tiles // s) + 1) + (1 if s > 1 else 0)
        if cost < best_cost:
            best, best_cost = s, cost
    return best


def decode_num_splits(
    q_nope_lat: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    config: dict | None = None,
    grouped: bool = False,
) -> int:
    """The split count `mla_decode_triton` takes for these sizes (static ones only: a CUDA graph's).
    `grouped`: for the grouped form, counted as if every program took ROWS rows."""
    b, h, _ = q_nope_lat.shape
    dev = q_nope_lat.device
    cfg = {**default_config(h, dev, kv_cache.dtype, grouped), **(config or {})}
    slots = (_sm_count(dev.index or 0) if dev.type == "cuda" else 8) * cfg["ctas_per_sm"]
    max_len = block_table.shape[1] * kv_cache.shape[1]
    programs = -(-b // cfg["ROWS"]) if grouped else b
    return choose_num_splits(programs, -(-h // cfg["BLOCK_H"]), max_len, cfg["BLOCK_N"], slots)
