"""Block allocator, paged latent cache and ForwardBatch metadata."""

from __future__ import annotations

import pytest
import torch
from _hf_convert import raw_config

from mlac.core.config import ModelConfig
from mlac.core.errors import MlacError
from mlac.runtime.kvcache.batch import ForwardBatch
from mlac.runtime.kvcache.blocks import BlockAllocator
from mlac.runtime.kvcache.paged import PagedKVCache

CONFIG = ModelConfig.from_hf(raw_config("v3"))


def test_allocator_alloc_free_and_reuse():
    a = BlockAllocator(num_blocks=6, block_size=4)
    assert a.num_free == 6
    x = a.alloc(4)
    assert sorted(x) == [0, 1, 2, 3] and a.num_free == 2
    a.free(x[:2])
    assert a.num_free == 4
    y = a.alloc(4)
    assert set(y) & set(x[2:]) == set()  # never hands out a block in use
    assert a.num_free == 0


def test_allocator_refuses_over_allocation_without_partial_effect():
    a = BlockAllocator(3, 4)
    a.alloc(2)
    with pytest.raises(MlacError, match="KV cache full"):
        a.alloc(2)
    assert a.num_free == 1


def test_allocator_refuses_double_free():
    a = BlockAllocator(3, 4)
    blocks = a.alloc(1)
    a.free(blocks)
    with pytest.raises(MlacError, match="freed twice"):
        a.free(blocks)


def test_reserve_grows_a_table_to_cover_tokens():
    a = BlockAllocator(10, 4)
    table: list[int] = []
    a.reserve(table, 1)
    assert len(table) == 1
    a.reserve(table, 4)
    assert len(table) == 1
    a.reserve(table, 9)
    assert len(table) == 3 and a.num_free == 7
    assert a.blocks_for(0) == 0 and a.blocks_for(8) == 2


def test_cache_sizing_from_blocks_and_budget():
    c = PagedKVCache(CONFIG, num_blocks=5, block_size=4, dtype=torch.float32)
    assert len(c.layers) == CONFIG.num_hidden_layers
    assert c.layers[0].shape == (6, 4, CONFIG.kv_lora_rank + CONFIG.qk_rope_head_dim)  # + scratch block
    assert c.scratch_block == 5 and c.num_blocks == 5
    assert c.capacity_tokens == 20
    per_block = PagedKVCache.bytes_per_block(CONFIG, 4, torch.bfloat16)
    assert per_block == CONFIG.num_hidden_layers * 4 * CONFIG.kv_latent_dim * 2
    b = PagedKVCache.from_budget(CONFIG, 3 * per_block + per_block // 2, block_size=4)
    assert b.num_blocks == 2 and b.layers[0].dtype == torch.bfloat16  # 3 blocks, one the scratch block
    with pytest.raises(MlacError, match="holds no block"):
        PagedKVCache.from_budget(CONFIG, 2 * per_block - 1, block_size=4)


def test_write_then_read_slots():
    c = PagedKVCache(CONFIG, num_blocks=4, block_size=4, dtype=torch.float32)
    x = torch.randn(3, CONFIG.kv_latent_dim)
    slots = torch.tensor([13, 2, 7])
    c.write(1, slots, x)
    assert torch.equal(c.read(1, slots), x)
    assert torch.equal(c.layers[1][3, 1], x[0])  # slot 13 = block 3, offset 1
    assert c.layers[0].abs().sum() == 0  # other layers untouched


def test_forward_batch_for_extend_with_cached_prefixes():
    # seq 0: 3 cached + 2 new in blocks [5, 1]; seq 1: fresh prefill of 4 in block [2]
    b = ForwardBatch.build(ctx_lens=[3, 0], q_lens=[2, 4], block_tables=[[5, 1], [2]], block_size=4)
    assert not b.is_decode
    assert b.num_tokens == 6 and b.num_seqs == 2
    assert b.positions.tolist() == [3, 4, 0, 1, 2, 3]
    assert b.slots.tolist() == [5 * 4 + 3, 1 * 4 + 0, 8, 9, 10, 11]
    assert b.block_tables.tolist() == [[5, 1], [2, 0]] and b.block_tables.dtype == torch.int32
    assert b.seq_lens.tolist() == [5, 4] and b.seq_lens.dtype == torch.int32
    assert b.cu_seqlens_q.tolist() == [0, 2, 6]
    assert b.cu_seqlens_kv.tolist() == [0, 5, 9]
    assert b.kv_slots.tolist() == [20, 21, 22, 23, 4, 8, 9, 10, 11]
    assert b.last_token_indices.tolist() == [1, 5]


def test_forward_batch_for_decode():
    b = ForwardBatch.build(
        ctx_lens=[7, 0, 4], q_lens=[1, 1, 1], block_tables=[[3, 4], [0], [1, 2]], block_size=4
    )
    assert b.is_decode
    assert b.positions.tolist() == [7, 0, 4]
    assert b.slots.tolist() == [4 * 4 + 3, 0, 2 * 4 + 0]
    assert b.block_tables.tolist() == [[3, 4], [0, 0], [1, 2]]
    assert b.seq_lens.tolist() == [8, 1, 5]
    assert b.kv_slots.numel() == 0  # decode reads the paged cache directly
    assert b.last_token_indices.tolist() == [0, 1, 2]


def test_forward_batch_refuses_a_table_too_short():
    with pytest.raises(MlacError, match="cannot hold 5 tokens"):
        ForwardBatch.build([4], [1], [[0]], block_size=4)
    with pytest.raises(MlacError, match="bad sequence"):
        ForwardBatch.build([0], [0], [[0]], block_size=4)
