"""KV cache sizing at start-up from the compile-time memory plan: arithmetic, warnings, refusals."""

from __future__ import annotations

import pytest

from mlac.core.artifact import BucketPlan
from mlac.core.errors import MlacError
from mlac.runtime.worker.memory_plan import RESERVE_BYTES, plan_kv_cache, plan_ranks

GiB, MiB = 1 << 30, 1 << 20
V3_CONTEXT = 163840
# 64 KiB per token: a 16-token block is exactly 1 MiB
PLAN = BucketPlan(
    decode_batch_sizes=[1, 2, 4], cuda_graph_max_bs=4, weight_bytes=[10 * GiB, 9 * GiB],
    kv_bytes_per_token=64 * 1024, activation_bytes=[128 * MiB, 256 * MiB, 512 * MiB],
    graph_pool_bytes=512 * MiB, prefill_tokens=2048, prefill_activation_bytes=1 * GiB, safety_factor=2.0,
)  # fmt: skip


def kv(total=80 * GiB, rank=0, **kw):
    return plan_kv_cache(
        PLAN, rank, total_bytes=total, max_position_embeddings=V3_CONTEXT, block_size=16, **kw
    )


def test_reserve_is_one_gib():
    assert RESERVE_BYTES == GiB


def test_blocks_from_what_is_left_per_rank():
    # 0.9 x 80 = 72 GiB - weights 10 - graph pool 0.5 - prefill 1 - reserve 1 = 59.5 GiB = 60,928 MiB,
    # one of them the pools' scratch block
    p = kv()
    assert (p.num_blocks, p.kv_tokens, p.max_context) == (60927, 60927 * 16, V3_CONTEXT)
    assert p.kv_bytes == 60928 * MiB and p.warnings == () and p.graph_buckets == 3
    assert kv(rank=1).num_blocks == 61951  # 9 GiB of weights on rank 1: 1 GiB more for the cache


def test_without_cuda_graphs_the_pool_is_not_held():
    # 72 - 10 - max(prefill 1, decode 0.5) - 1 = 60 GiB
    p = kv(cuda_graphs=False)
    assert p.num_blocks == 60 * 1024 - 1 and p.graph_buckets == 0


def test_utilization_one_uses_all_memory():
    assert kv(gpu_memory_utilization=1.0).num_blocks == (80 - 12.5) * 1024 - 1


def test_small_cache_caps_the_context_with_a_warning():
    # int(16 GiB x 0.9) = 15,461,882,265 bytes - 12.5 GiB = 2,040,109,465 -> 1,945 whole MiB blocks,
    # one of them the scratch block
    p = kv(total=16 * GiB)
    assert p.num_blocks == (15461882265 - 12.5 * GiB) // MiB - 1 == 1944
    assert p.max_context == 1944 * 16 == 31104
    assert p.warnings == (
        "the KV cache holds 31,104 tokens, less than one full context of 163,840: max context capped at "
        "31,104; lower --max-model-len or raise --gpu-memory-utilization",
    )


def test_max_model_len_caps_the_context_and_silences_the_warning():
    p = kv(total=16 * GiB, max_model_len=8192)
    assert p.max_context == 8192 and p.num_blocks == 1944 and p.warnings == ()


def test_less_free_memory_than_the_budget_sizes_on_what_is_free():
    p = kv(free_bytes=40 * GiB)  # 40 - 12.5 = 27.5 GiB
    assert p.num_blocks == 27.5 * 1024 - 1
    assert p.warnings == (
        "only 40.00 GiB free of 80.00 GiB (another process holds the rest): the KV cache is sized on the "
        "free memory, not on 0.9 of the total",
    )
    assert kv(free_bytes=79 * GiB).warnings == ()  # more free than the 72 GiB budget: no change


def test_does_not_fit_names_the_numbers():
    # 0.9 x 12 GiB = 10.8 GiB < 10 + 0.5 + 1 + 1
    with pytest.raises(MlacError) as e:
        kv(total=12 * GiB)
    msg = str(e.value)
    assert msg.startswith(
        "rank 0: weights 10.00 GiB + CUDA graphs 0.50 GiB + prefill activations 1.00 GiB + reserve 1.00 GiB "
        "= 12.50 GiB leave no room for one KV block (1.0 MiB) in a budget of 10.80 GiB "
        "(--gpu-memory-utilization 0.9); raise --gpu-memory-utilization"
    )
    assert "\n" not in msg and "--no-cuda-graph" in msg


def test_exactly_one_block_fits():
    total = 12.5 * GiB + 2 * MiB  # utilization 1: room for one 1 MiB block and the scratch block
    assert kv(total=int(total), gpu_memory_utilization=1.0).num_blocks == 1
    with pytest.raises(MlacError, match="leave no room"):
        kv(total=int(total) - 1, gpu_memory_utilization=1.0)


@pytest.mark.parametrize("util", [0.0, -0.1, 1.01])
def test_bad_utilization(util):
    with pytest.raises(MlacError, match=rf"--gpu-memory-utilization {util}: must be in \(0, 1\]"):
        kv(gpu_memory_utilization=util)


def test_bad_max_model_len_and_rank():
    with pytest.raises(MlacError, match=r"--max-model-len 200000: must be in 1\.\.163,840"):
        kv(max_model_len=200000)
    with pytest.raises(MlacError, match="rank 2: the artifact's memory plan has 2 rank"):
        kv(rank=2)


def test_summary_line():
    assert kv(total=16 * GiB).summary() == (
        "KV cache: 31,104 tokens (1,944 blocks of 16, 1.90 GiB), max context 31,104, CUDA graphs: 3 buckets"
    )
    assert "CUDA graphs: off" in kv(cuda_graphs=False).summary()


def test_every_rank_gets_the_smallest_ranks_plan():
    # rank 0 holds 1 GiB more weights than rank 1: its 60,927 blocks bind both (see above)
    p = plan_ranks(PLAN, 80 * GiB, max_position_embeddings=V3_CONTEXT, block_size=16)
    assert p == kv(rank=0) and p.num_blocks < kv(rank=1).num_blocks
    heavy_rank_1 = PLAN.model_copy(update={"weight_bytes": [9 * GiB, 10 * GiB]})
    q = plan_ranks(heavy_rank_1, 80 * GiB, max_position_embeddings=V3_CONTEXT, block_size=16)
    assert q.num_blocks == 60927


def test_blocks_are_sized_on_the_bytes_the_pools_take():
    # a bf16 cache under float32 compute stores 4-byte elements: twice the plan's 64 KiB a token
    p = kv(kv_bytes_per_token=2 * PLAN.kv_bytes_per_token)
    assert p.num_blocks == 60928 // 2 - 1 and p.kv_bytes == 60928 * MiB
    assert p.kv_bytes == (p.num_blocks + 1) * 16 * 2 * PLAN.kv_bytes_per_token  # the scratch block too
