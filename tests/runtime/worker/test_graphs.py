"""CUDA-graph decode: bucket choice, the static inputs and their padding, and same tokens as the
eager path. On CPU nothing is captured: DecodeGraphs runs its padded static-buffer step eagerly,
which checks everything but the capture itself; on CUDA the graphs are captured and replayed."""

from __future__ import annotations

import pytest
import torch
from test_fp8_cublas import small_weights  # noqa: F401  (a fixture)
from test_fp8_cublas_model import wide_fp8  # noqa: F401  (a fixture)

from mlac.core.errors import MlacError
from mlac.kernels._triton import tl, triton
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.engine.scheduler import SchedulerConfig
from mlac.runtime.kvcache.paged import PagedKVCache
from mlac.runtime.model.layers import Linear
from mlac.runtime.step import Step
from mlac.runtime.worker.graphs import DecodeGraphs, DecodeInputs, capture_buckets, pick_bucket
from mlac.runtime.worker.options import RuntimeOptions


def test_pick_bucket():
    buckets = [1, 2, 4, 8, 16, 32]
    assert [pick_bucket(buckets, b) for b in (1, 2, 3, 5, 8, 9, 32)] == [1, 2, 4, 8, 8, 16, 32]
    assert pick_bucket(buckets, 33) is None


def test_runtime_options_buckets(artifact):
    from mlac.core.artifact import Manifest

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


def test_inputs_fill_flattens_an_extend_into_rows(artifact):
    """Token j of a sequence with c cached tokens: a row at position c + j over c + j + 1 tokens."""
    cfg = Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False).config
    cache = PagedKVCache(cfg, num_blocks=10, block_size=4, dtype=torch.float32)
    inputs = DecodeInputs(max_bs=8, max_blocks=5, cache=cache, device=torch.device("cpu"))
    step = Step.of([[7, 8, 9], [4]], [5, 0], [[3, 6], [2]])  # seq 0: tokens 5..7, all in block 6
    inputs.fill(step, 8)
    ids, batch = inputs.batch(8)
    assert ids.tolist()[:4] == [7, 8, 9, 4]
    assert batch.positions.tolist()[:5] == [5, 6, 7, 0, 0]
    assert batch.slots.tolist()[:5] == [25, 26, 27, 8, cache.scratch_slot]
    assert batch.seq_lens.tolist() == [6, 7, 8, 1, 1, 1, 1, 1]
    assert batch.block_tables[:5, :2].tolist() == [[3, 6], [3, 6], [3, 6], [2, 0], [10, 0]]


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
    assert engine.pool.allocator.num_free == engine.cache.num_blocks


def test_extends_through_the_static_step_give_the_eager_tokens(artifact):
    """Prompts, prefix-cache suffixes (a shared prefix that ends mid-block) and decode rows mixed
    with a prefill chunk run as flattened rows of the static step: same greedy tokens as eager."""
    engine = Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False, num_blocks=96)
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 200, (21,), generator=g).tolist()  # ends inside the second block of 16
    prompts = [shared + torch.randint(3, 200, (1 + i,), generator=g).tolist() for i in range(5)]
    prompts += [torch.randint(3, 200, (3,), generator=g).tolist()]
    params = SamplingParams(max_tokens=5, ignore_eos=True)

    def run_all() -> list[list[int]]:
        first = engine.generate(prompts[:1], params)  # fills the prefix cache
        sched = engine.scheduler()
        seqs = [engine.new_sequence(p, params) for p in prompts[1:]]
        for s in seqs[:2]:
            sched.add(s)
        sched.step()
        sched.step()  # seqs 0 and 1 decode while the others' prompts arrive
        for s in seqs[2:]:
            sched.add(s)
        while sched.has_unfinished:
            sched.step()
        return [first[0].token_ids] + [s.output_ids for s in seqs]

    engine.runner.graphs = None
    eager = run_all()
    graphs = DecodeGraphs(engine.runner.model, engine.cache, [1, 2, 4, 8, 16, 32], engine.max_context)
    engine.runner.graphs = graphs
    steps: list[Step] = []
    run = graphs.run
    graphs.run = lambda step: (steps.append(step), run(step))[1]
    assert run_all() == eager
    extends = [s for s in steps if not s.is_decode]
    assert extends, "no extend went through the static step"
    assert any(c > 0 for s in extends for c in s.ctx_lens), "no prefix-cache suffix went through it"
    assert any(1 in s.q_lens and max(s.q_lens) > 1 for s in extends), "no mixed decode + prefill step"


def test_a_decode_step_above_the_largest_bucket_splits_into_pieces(artifact):
    """max_bs sequences at a time, in step order, the rest padded to its bucket; only decode steps."""
    engine = Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False, num_blocks=16)
    graphs = DecodeGraphs(engine.runner.model, engine.cache, [1, 2, 4, 8], engine.max_context)
    decode = lambda n: Step.of([[1]] * n, [0] * n, [[0]] * n)  # noqa: E731
    assert graphs.pieces(decode(20)) == [list(range(0, 8)), list(range(8, 16)), [16, 17, 18, 19]]
    assert graphs.pieces(decode(16)) == [list(range(0, 8)), list(range(8, 16))]
    assert graphs.fits(decode(8)) and not graphs.fits(decode(9)) and graphs.can_run(decode(9))
    extend = Step.of([[1, 2]] * 5, [0] * 5, [[0]] * 5)  # 10 tokens: flattened rows above max_bs
    scoring = Step.of([[1]] * 9, [0] * 9, [[0]] * 9, every_token=True)
    assert not graphs.can_run(extend) and not graphs.can_run(scoring)
    assert graphs.can_run(Step.of([[1, 2]] * 4, [0] * 4, [[0]] * 4))  # 8 flattened rows: one replay
    step = Step.of([[7], [8, 9], [6]], [3, 0, 5], [[0], [1], [2, 3]], ranks=[1, 0, 1])
    part = step.select([2, 0])
    assert part.token_ids == (6, 7) and part.ctx_lens == (5, 3) and part.q_lens == (1, 1)
    assert part.block_tables == ((2, 3), (0,)) and part.ranks == (1, 1)
    assert step.select([1]).token_ids == (8, 9)


def count_replays(graphs: DecodeGraphs) -> list[int]:
    """The sequences of every decode step that `graphs` replays from now on (0 for an extend)."""
    seen, replay = [], graphs._replay

    def counted(step: Step, ids: torch.Tensor | None = None) -> torch.Tensor:
        seen.append(step.num_seqs if step.is_decode else 0)
        return replay(step, ids)

    graphs._replay = counted
    return seen


def _mixed_params(n: int) -> list[SamplingParams]:
    """Per-row sampling that differs row to row: greedy and seeded draws, penalties, a logit bias,
    min_tokens, logprobs."""
    return [
        SamplingParams(
            max_tokens=6,
            ignore_eos=True,
            temperature=0.8 * (i % 2),
            seed=i,
            logprobs=2,
            repetition_penalty=1.3 if i % 3 == 0 else 1.0,
            frequency_penalty=0.5 if i % 3 == 1 else 0.0,
            logit_bias={(11 + i) % 200: 5.0} if i % 4 == 0 else {},
            min_tokens=3 if i == 2 else 0,
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_decode_step_above_the_largest_bucket_runs_in_pieces_with_the_eager_tokens(artifact, overlap):
    """Batches of 7 and 11 over buckets [1, 2, 4]: every decode step replays 4-sequence pieces (the
    last padded), and every row's tokens and logprobs are those of the one eager step, with
    per-row sampling, penalties and, under overlap scheduling, the token ids fed on the device."""
    engine = Engine.from_artifact(
        artifact("tiny-v3"), dtype=torch.float32, verify=False, num_blocks=96, overlap=overlap
    )
    prompts = [[5 + i, 9, 13 + 2 * i, 4, 7 + i][: 2 + i % 4] for i in range(11)]
    for n in (7, 11):
        engine.runner.graphs = None
        eager = engine.generate(prompts[:n], _mixed_params(n))
        graphs = DecodeGraphs(engine.runner.model, engine.cache, [1, 2, 4], engine.max_context)
        engine.runner.graphs = graphs
        replays = count_replays(graphs)
        pieces = engine.generate(prompts[:n], _mixed_params(n))
        assert [c.token_ids for c in pieces] == [c.token_ids for c in eager], f"batch {n}"
        for a, b in zip(pieces, eager, strict=True):
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert [t for t, _ in x.top] == [t for t, _ in y.top]
                assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
        full, rest = divmod(n, 4)
        assert replays.count(4) >= 5 * full and rest in replays, replays  # 5 decode steps in pieces
        assert max(replays) == 4
    assert engine.pool.allocator.num_free == engine.cache.num_blocks


def test_pieces_give_the_logits_of_one_eager_step(artifact):
    """ModelRunner.run of one decode step of 10 sequences over buckets [1, 2, 4] (pieces 4 + 4 + 2)
    against the same step run eagerly: the same logits, row for row."""
    engine = Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False, num_blocks=64)
    runner, g = engine.runner, torch.Generator().manual_seed(1)
    lens = [3 + 2 * i for i in range(10)]
    tables = [[2 * i, 2 * i + 1] for i in range(10)]  # 2 blocks of 16 each
    runner.graphs = None
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in lens]
    runner.run(Step.of(prompts, [0] * 10, tables))  # the prompts' KV
    step = Step.of([[5 + i] for i in range(10)], lens, tables)
    want = runner.run(step).clone()
    runner.graphs = DecodeGraphs(runner.model, engine.cache, [1, 2, 4], engine.max_context)
    got = runner.run(step)  # rewrites the same latents
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_scratch_block_is_never_allocated(artifact):
    engine = Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False, num_blocks=4)
    alloc = engine.pool.allocator
    assert engine.cache.scratch_block not in alloc.alloc(alloc.num_free)


@pytest.mark.gpu
@pytest.mark.parametrize("preset,fp8", [("tiny-v2-lite", False), ("tiny-v3", True)])
def test_cuda_graphs_give_the_tokens_of_the_same_step_run_eagerly(artifact, preset, fp8):
    """Greedy outputs of the replayed graphs equal those of the same padded steps run eagerly, at
    batch sizes that pad to a bucket (the CPU tests check that padding changes nothing). Against
    unpadded eager steps the kernels pick other tiles for other batch sizes, so the first decode
    step's logits agree to bf16 (FP8) rounding only: measured up to 0.05 (0.09) in a top logprob."""
    path = artifact(preset, fp8=fp8)
    # No prefix cache: the second run of the same prompts would prefill only their last tokens.
    kw = dict(device="cuda", dtype=torch.bfloat16, verify=False, num_blocks=256, cuda_graph_max_bs=16,
              scheduler=SchedulerConfig(prefix_cache=False))  # fmt: skip
    engine = Engine.from_artifact(path, **kw)
    graphs = engine.runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8, 16]
    phases = {"graphs_eager_s", "graphs_capture_s", "graphs_eager_runs"} | (
        {"graphs_grouped_eager_s", "graphs_grouped_capture_s"} if graphs.grouped_buckets else set()
    )
    assert phases <= set(engine.runner.startup) and all(engine.runner.startup[k] > 0 for k in phases)
    # warm_once: the largest bucket runs eagerly, and a later one only if it meets a new kernel variant
    assert 1 <= engine.runner.startup["graphs_eager_runs"] <= len(graphs.graphs)
    unpadded = Engine.from_artifact(path, cuda_graph=False, **kw)
    assert unpadded.runner.graphs is None
    g = torch.Generator().manual_seed(3)
    for n in (1, 3, 6, 13, 20):  # 20 > 16: two replays (16 + 4), tested on its own below
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
        for x, y in zip(a, b, strict=True):  # prefill: flattened rows (absorbed) against eager
            for i in (0, 1):
                assert abs(x.logprobs[i].top[0][1] - y.logprobs[i].top[0][1]) < 0.3, f"batch {n}"  # bf16/FP8


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_graph_pieces_give_the_tokens_of_the_same_pieces_run_eagerly(artifact, overlap):
    """A decode batch of 40 over buckets up to 16 replays captured graphs in pieces (16 + 16 + 8)
    and gives exactly the greedy tokens of the same pieces run eagerly; against one unpadded eager
    step its first decode logprobs agree to bf16 rounding (other tiles for other batch sizes)."""
    path = artifact("tiny-v2-lite")
    kw = dict(device="cuda", dtype=torch.bfloat16, verify=False, num_blocks=512, cuda_graph_max_bs=16,
              scheduler=SchedulerConfig(prefix_cache=False, overlap=overlap, max_running_requests=64))  # fmt: skip
    engine = Engine.from_artifact(path, **kw)
    graphs = engine.runner.graphs
    assert graphs is not None and max(graphs.graphs) == 16
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 200, (4 + i % 9,), generator=g).tolist() for i in range(40)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    replays, eager_steps = count_replays(graphs), []
    step = graphs._step
    graphs._step = lambda bs, grouped=False: (eager_steps.append(bs), step(bs, grouped))[1]
    replayed = [c.token_ids for c in engine.generate(prompts, params)]
    assert replays.count(16) >= 2 * 9 and 8 in replays, replays  # 9 decode steps of 40 in pieces
    assert not eager_steps, "a piece ran eagerly instead of replaying its graph"
    captured, graphs.graphs = graphs.graphs, {}  # the same pieces, eagerly
    try:
        padded_eager = [c.token_ids for c in engine.generate(prompts, params)]
    finally:
        graphs.graphs = captured
    assert replayed == padded_eager
    unpadded = Engine.from_artifact(path, cuda_graph=False, **kw)
    one_step = SamplingParams(max_tokens=2, ignore_eos=True, logprobs=5)
    for x, y in zip(engine.generate(prompts, one_step), unpadded.generate(prompts, one_step), strict=True):
        assert abs(x.logprobs[1].top[0][1] - y.logprobs[1].top[0][1]) < 0.3  # the decode step, bf16


@pytest.mark.gpu
def test_cuda_graphs_through_cublas_give_the_tokens_of_the_same_steps_run_eagerly(wide_fp8, small_weights):  # noqa: F811
    """An FP8 model whose linears take cuBLAS's block-scaled GEMM from 32 rows (ModelOptions.fp8_cublas,
    fp8_cublas.cublas_takes): the buckets of 32, 48 and 64 rows capture cuBLAS calls, and their
    replays give exactly the greedy tokens of the same padded steps run eagerly (cuBLAS both ways:
    the route depends on the bucket's rows only)."""
    kw = dict(device="cuda", dtype=torch.bfloat16, verify=False, num_blocks=512, cuda_graph_max_bs=64,
              scheduler=SchedulerConfig(prefix_cache=False, max_running_requests=64))  # fmt: skip
    engine = Engine.from_artifact(wide_fp8, **kw)
    graphs = engine.runner.graphs
    assert graphs is not None and {32, 48, 64} <= set(graphs.graphs)
    assert all(m.cublas for m in engine.runner.model.modules() if isinstance(m, Linear) and m.fp8)
    g = torch.Generator().manual_seed(5)
    for n in (33, 40, 64):
        prompts = [torch.randint(3, 1000, (4 + 3 * (i % 5),), generator=g).tolist() for i in range(n)]
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        replays = count_replays(graphs)
        replayed = [c.token_ids for c in engine.generate(prompts, params)]
        assert any(bs >= 32 for bs in replays), replays  # decode steps of 33 rows and more: cuBLAS
        captured, graphs.graphs = graphs.graphs, {}  # the same padded steps, eagerly
        try:
            padded_eager = [c.token_ids for c in engine.generate(prompts, params)]
        finally:
            graphs.graphs = captured
        assert replayed == padded_eager, f"batch {n}"


if triton is not None:

    @triton.jit
    def _double(x, y, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y + offs, tl.load(x + offs, mask=mask) * 2, mask=mask)


@pytest.mark.gpu
@pytest.mark.parametrize("block_per_bucket", [False, True])
def test_warm_once_runs_eagerly_only_for_new_kernel_variants(block_per_bucket):
    """capture_buckets(warm_once=True): after the largest bucket's eager run, a bucket whose Triton
    variants are all loaded is captured at once; one whose variant is new (here BLOCK = 2 x the bucket)
    drops its capture, runs eagerly and is captured again. Every graph replays the right result."""
    buckets = [16, 32, 48, 64] if not block_per_bucket else [16, 32, 64]
    x = torch.randn(64, device="cuda")
    y = torch.zeros(64, device="cuda")

    def step(bs: int) -> None:  # BLOCK 16 in one case, 2 x the bucket in the other: no variant shared
        block = 2 * bs if block_per_bucket else 16
        _double[(triton.cdiv(bs, block),)](x, y, bs, BLOCK=block)

    timings: dict = {}
    graphs, _ = capture_buckets(buckets, step, timings=timings, warm_once=True)
    assert sorted(graphs) == buckets
    assert timings["eager_runs"] == (len(buckets) if block_per_bucket else 1)
    for bs in buckets:
        y.zero_()
        graphs[bs].replay()
        torch.cuda.synchronize()
        assert torch.equal(y[:bs], x[:bs] * 2) and not y[bs:].any(), bs
