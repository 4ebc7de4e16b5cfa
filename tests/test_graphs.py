"""CUDA-graph decode: bucket choice, the static inputs and their padding, and same tokens as the
eager path. On CPU nothing is captured: DecodeGraphs runs its padded static-buffer step eagerly,
which checks everything but the capture itself; on CUDA the graphs are captured and replayed."""

from __future__ import annotations

import pytest
import torch

from mlac.errors import MlacError
from mlac.runtime.engine import Engine
from mlac.runtime.graphs import DecodeGraphs, DecodeInputs, pick_bucket
from mlac.runtime.kv_cache import PagedKVCache
from mlac.runtime.runner import RuntimeOptions
from mlac.runtime.sampling import SamplingParams
from mlac.runtime.step import Step


def test_pick_bucket():
    buckets = [1, 2, 4, 8, 16, 32]
    assert [pick_bucket(buckets, b) for b in (1, 2, 3, 5, 8, 9, 32)] == [1, 2, 4, 8, 8, 16, 32]
    assert pick_bucket(buckets, 33) is None


def test_runtime_options_buckets(artifact):
    from mlac.artifact import Manifest

    manifest = Manifest.load(artifact("tiny-v3"))
    assert RuntimeOptions(cuda_graph_max_bs=8).graph_buckets(manifest) == [1, 2, 4, 8]
    assert RuntimeOptions(cuda_graph_max_bs=40).graph_buckets(manifest) == [1, 2, 4, 8, 16, 32, 40]
    with pytest.raises(MlacError, match="cuda_graph_max_bs=0"):
        RuntimeOptions(cuda_graph_max_bs=0)


def test_inputs_fill_real_rows_then_padding(artifact):
    cfg = Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False).config
    cache = PagedKVCache(cfg, num_blocks=10, block_size=4, dtype=torch.float32)
    inputs = DecodeInputs(max_bs=8, max_blocks=5, cache=cache, device=torch.device("cpu"))
    step = Step.of([[7], [9]], [5, 0], [[3, 6], [2]])  # token 5 of seq 0 is block 6, offset 1
    inputs.fill(step, 4)
    ids, batch = inputs.batch(4)
    assert ids.tolist() == [7, 9, 0, 0]
    assert batch.positions.tolist() == [5, 0, 0, 0]
    scratch = cache.scratch_slot
    assert batch.slots.tolist() == [6 * 4 + 1, 2 * 4, scratch, scratch]
    assert batch.seq_lens.tolist() == [6, 1, 1, 1]
    assert batch.block_tables[:, :2].tolist() == [[3, 6], [2, 0], [10, 0], [10, 0]]
    assert batch.is_decode and batch.num_seqs == 4
    with pytest.raises(MlacError, match="6 blocks is longer than the graphs' 5"):
        inputs.fill(Step.of([[1]], [20], [[0, 1, 2, 3, 4, 5]]), 1)


def spy(run, calls: list[int]):
    def wrapped(step: Step):
        calls.append(step.num_seqs)
        return run(step)

    return wrapped


def test_padded_static_step_gives_the_eager_tokens(artifact):
    """Batches of 3, 5 and 7 pad to buckets 4 and 8; greedy and seeded sampling agree."""
    engine = Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False, num_blocks=64)
    prompts = [[5 + i, 9, 13 + 2 * i, 4][: 2 + i % 3] for i in range(7)]
    params = [
        SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.7 * (i % 2), seed=i) for i in range(7)
    ]
    for n in (3, 5, 7):
        engine.runner.graphs = None
        eager = engine.generate(prompts[:n], params[:n])
        graphs = DecodeGraphs(engine.runner.model, engine.cache, [1, 2, 4, 8], engine.max_context)
        engine.runner.graphs = graphs
        calls = []
        graphs.run = spy(graphs.run, calls)
        padded = engine.generate(prompts[:n], params[:n])
        assert [c.token_ids for c in padded] == [c.token_ids for c in eager]
        assert calls and max(calls) == n  # the decode steps went through the static buffers
    assert engine.cache.allocator.num_free == engine.cache.num_blocks


def test_scratch_block_is_never_allocated(artifact):
    engine = Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False, num_blocks=4)
    alloc = engine.cache.allocator
    assert engine.cache.scratch_block not in alloc.alloc(alloc.num_free)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset,fp8", [("tiny-v2-lite", False), ("tiny-v3", True)])
def test_cuda_graphs_give_the_tokens_of_the_same_step_run_eagerly(artifact, preset, fp8):
    """Greedy outputs of the replayed graphs equal those of the same padded steps run eagerly, at
    batch sizes that pad to a bucket (the CPU tests check that padding changes nothing). Against
    unpadded eager steps the kernels pick other tiles for other batch sizes, so the first decode
    step's logits agree to bf16 (FP8) rounding only: measured up to 0.05 (0.09) in a top logprob."""
    path = artifact(preset, fp8=fp8)
    kw = dict(device="cuda", dtype=torch.bfloat16, verify=False, num_blocks=256, cuda_graph_max_bs=16)
    engine = Engine.from_artifact(path, **kw)
    graphs = engine.runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8, 16]
    unpadded = Engine.from_artifact(path, cuda_graph=False, **kw)
    assert unpadded.runner.graphs is None
    g = torch.Generator().manual_seed(3)
    for n in (1, 3, 6, 13, 20):  # 20 > 16: runs eagerly
        prompts = [torch.randint(3, 200, (4 + 3 * i,), generator=g).tolist() for i in range(n)]
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        replayed = [c.token_ids for c in engine.generate(prompts, params)]
        captured, graphs.graphs = graphs.graphs, {}  # the same padded steps, eagerly
        try:
            padded_eager = [c.token_ids for c in engine.generate(prompts, params)]
        finally:
            graphs.graphs = captured
        assert replayed == padded_eager, f"batch {n}"
        one_step = SamplingParams(max_tokens=2, ignore_eos=True, logprobs=5)
        a = engine.generate(prompts, one_step)
        b = unpadded.generate(prompts, one_step)
        for x, y in zip(a, b, strict=True):
            assert x.token_ids[0] == y.token_ids[0]  # the prefill is the same eager step
            assert abs(x.logprobs[1].top[0][1] - y.logprobs[1].top[0][1]) < 0.3, f"batch {n}"  # bf16/FP8
