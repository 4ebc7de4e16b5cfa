"""DP attention (runtime/dp_attention.py) on CPU (gloo): a `--tp 2 --dp-attention` artifact gives
the 1-rank logits and greedy tokens for uneven loads (one rank idle, several requests of different
lengths on each rank), each rank's KV cache is its own (twice the tokens), the prefix cache stays
correct per rank, and a launch that disagrees with the plan is refused.

Each multi-rank engine lives inside one test (a `with` block): one multi-rank runner per process.
"""

from __future__ import annotations

import pytest
import torch

from mlac.compiler.pipeline import check_options, compile_checkpoint
from mlac.core.artifact import CompileOptions, Manifest
from mlac.core.config import ModelConfig
from mlac.core.errors import MlacError
from mlac.runtime.engine.dp_route import route
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.engine.scheduler import SchedulerConfig
from mlac.runtime.kvcache.pool import BlockPool
from mlac.runtime.model.dp_attention import rows_per_rank
from mlac.runtime.step import Step
from mlac.runtime.worker.distributed import DistributedRunner
from mlac.runtime.worker.loader import load_artifact
from tests._cli import invoke, one_line_error

CACHE = {"num_blocks": 32, "block_size": 16}
PROMPT = torch.randint(0, 1024, (40,), generator=torch.Generator().manual_seed(0)).tolist()
LENGTHS = [PROMPT[:9], PROMPT[3:28], PROMPT[20:23], PROMPT[1:18]]  # 9, 25, 3, 17 tokens
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
NO_PREFIX = SchedulerConfig(prefix_cache=False)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, checkpoint):
    """compiled(preset, tp=1, dp=False) -> artifact path."""
    made = {}

    def get(preset: str, tp: int = 1, dp: bool = False):
        if (preset, tp, dp) not in made:
            out = tmp_path_factory.mktemp("dp") / f"{preset}-tp{tp}{'-dp' if dp else ''}"
            options = CompileOptions(tp=tp, dp_attention=dp, accuracy_check=False)
            compile_checkpoint(checkpoint(preset), out, options)
            made[preset, tp, dp] = out
        return made[preset, tp, dp]

    return get


def start(path, **kw) -> Engine:
    return Engine.from_artifact(path, dtype=torch.float32, **{**CACHE, **kw})


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def run_requests(engine: Engine, prompts, config: SchedulerConfig | None = None):
    """Greedy tokens of `prompts` through one scheduler, and the scheduler (for its counts)."""
    sched = engine.scheduler(config)
    seqs = [engine.new_sequence(p, GREEDY) for p in prompts]
    for s in seqs:
        sched.add(s)
    while sched.has_unfinished:
        sched.step()
    return [s.output_ids for s in seqs], sched


def tables(pools, ranks, lengths) -> list[list[int]]:
    out = []
    for r, n in zip(ranks, lengths, strict=True):
        out.append([])
        pools[r].allocator.reserve(out[-1], n)
    return out


def uneven_steps(engine: Engine, ranks: list[int]) -> list[torch.Tensor]:
    """Logits of a prefill of LENGTHS, then one decode step, each sequence on `ranks[i]`'s cache."""
    pools = engine.runner.kv_pools
    ts = tables(pools, ranks, [len(p) + 1 for p in LENGTHS])
    dp = ranks if len(pools) > 1 else []
    try:
        prefill = engine.runner.run(Step.of(LENGTHS, [0] * len(LENGTHS), ts, ranks=dp)).clone()
        nxt = [[int(t)] for t in prefill.argmax(-1)]
        decode = engine.runner.run(Step.of(nxt, [len(p) for p in LENGTHS], ts, ranks=dp)).clone()
    finally:
        for r, t in zip(ranks, ts, strict=True):
            pools[r].allocator.free(t)
    return [prefill, decode]


# ---- the same numbers as one rank ------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny-v3", "tiny-v2-lite"])
def test_dp_attention_gives_the_one_rank_logits_and_tokens(preset, compiled):
    ref = start(compiled(preset))
    with start(compiled(preset, tp=2, dp=True)) as engine:
        assert isinstance(engine.runner, DistributedRunner) and len(engine.runner.kv_pools) == 2
        # one request: rank 1 idle, joining every collective
        want = ref.score(PROMPT)
        assert rel(engine.score(PROMPT), want) < 1e-5
        assert rel(engine.score(PROMPT, chunk_size=16), want) < 1e-5  # extends after a cached prefix
        got = engine.generate(PROMPT, max_tokens=16, ignore_eos=True).token_ids
        assert got == ref.generate(PROMPT, max_tokens=16, ignore_eos=True).token_ids
        # uneven loads in one step: 3 sequences on rank 0 and 1 on rank 1, then all on rank 1
        for ranks in ([0, 1, 0, 0], [1, 1, 1, 1]):
            for g, w in zip(uneven_steps(engine, ranks), uneven_steps(ref, [0] * 4), strict=True):
                assert rel(g, w) < 1e-5
        # through the scheduler: requests of different lengths spread over the ranks
        got, sched = run_requests(engine, LENGTHS, NO_PREFIX)
        assert got == run_requests(ref, LENGTHS, NO_PREFIX)[0]
        counts = sched.check_blocks()  # (generate above left its prompt in the prefix cache)
        assert counts["in_use"] == 0 and counts["free"] + counts["cached"] == 2 * CACHE["num_blocks"]


def test_four_ranks_with_one_idle(compiled):
    ref = start(compiled("tiny-v3"))
    with start(compiled("tiny-v3", tp=4, dp=True)) as engine:
        got, sched = run_requests(engine, LENGTHS[:3], NO_PREFIX)  # ranks 0, 1, 2; rank 3 idle
        assert got == run_requests(ref, LENGTHS[:3], NO_PREFIX)[0]
        assert sum(p.capacity_tokens for p in engine.runner.kv_pools) == 4 * ref.cache.capacity_tokens


def test_each_rank_holds_its_own_kv_cache(compiled):
    """Twice the KV tokens of one rank; requests are balanced by free blocks; a load that needs
    both caches at once (more than one rank's blocks) runs."""
    ref = start(compiled("tiny-v3"))
    with start(compiled("tiny-v3", tp=2, dp=True)) as engine:
        pools = engine.runner.kv_pools
        assert sum(p.capacity_tokens for p in pools) == 2 * ref.cache.capacity_tokens
        assert pools[0].allocator is not pools[1].allocator
        # 6 requests of 90 tokens + 8: 7 blocks each, 42 > 32 blocks of one rank, all at once
        long = [PROMPT * 2 + PROMPT[: 10 + i] for i in range(6)]
        sched = engine.scheduler(SchedulerConfig(prefix_cache=False, max_running_requests=6))
        seqs = [engine.new_sequence(p, GREEDY) for p in long]
        for s in seqs:
            sched.add(s)
        sched.step()  # admits all six: three per rank
        assert sorted(s.dp_rank for s in sched.running) == [0, 0, 0, 1, 1, 1]
        assert sched.kv_usage == 36 / 64  # 6 blocks each (90-95 prompt tokens), over both ranks' 64
        assert sched.num_preemptions == 0
        while sched.has_unfinished:
            sched.step()
        assert sched.num_preemptions == 0
        want = run_requests(ref, long, SchedulerConfig(prefix_cache=False, max_running_requests=6))[0]
        assert [s.output_ids for s in seqs] == want


def test_prefix_cache_per_rank_gives_the_same_tokens(compiled):
    """Two system prompts (mid-block ends), two rounds: a request waits while another prefills its
    system prompt, then takes it from its rank's cache; the second round reuses each rank's cached
    blocks; greedy tokens equal one rank's without any prefix cache; every block is accounted for
    afterwards, on both ranks (each system prompt lives on one)."""
    systems = [PROMPT[:37], [(t + 100) % 1024 for t in PROMPT[:37]]]
    prompts = [systems[i % 2] + PROMPT[i : i + 5] for i in range(4)]
    ref = start(compiled("tiny-v3"))
    want = run_requests(ref, prompts, NO_PREFIX)[0]
    with start(compiled("tiny-v3", tp=2, dp=True)) as engine:
        first, sched = run_requests(engine, prompts)
        assert first == want
        second, sched = run_requests(engine, prompts)
        assert second == want
        assert sched.prefix_hit_tokens >= 4 * 32  # two full blocks of the system prompt each
        counts = sched.check_blocks()
        assert counts["in_use"] == 0 and counts["free"] + counts["cached"] == 2 * CACHE["num_blocks"]
        assert all(p.prefix.num_evictable > 0 for p in engine.runner.kv_pools)  # both ranks cached


def test_preemption_stays_within_a_rank(compiled):
    """8 blocks per rank, 4 requests that need 5 blocks each at the end: each rank preempts its own
    newest request (never the other rank's), and the tokens are one rank's with room for all."""
    prompts = [PROMPT[i : i + 40] for i in range(4)]
    params = SamplingParams(max_tokens=36, ignore_eos=True)
    want = [c.token_ids for c in start(compiled("tiny-v3")).generate(prompts, params)]
    with start(compiled("tiny-v3", tp=2, dp=True), num_blocks=8) as engine:
        sched = engine.scheduler(NO_PREFIX)
        seqs = [engine.new_sequence(p, params) for p in prompts]
        for s in seqs:
            sched.add(s)
        sched.step()
        assert [s.dp_rank for s in seqs] == [0, 1, 0, 1]
        while sched.has_unfinished:
            sched.step()
            sched.check_blocks()
        assert [s.num_preemptions for s in seqs] == [0, 0, 1, 1]  # each rank's newest
        assert [s.output_ids for s in seqs] == want


def two_gloo_ranks(target, *args, timeout: float = 120) -> dict:
    """target(rank, *args, port, queue) in two spawned processes joined over gloo on a free local
    port; each puts (rank, result) on the queue. Returns {rank: result}, both having exited 0."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    assert [p.exitcode for p in procs] == [0, 0]
    return dict(out.get(timeout=5) for _ in procs)


def graph_rank(rank: int, path: str, port: int, out) -> None:
    """One rank of test_decode_graphs_match_the_eager_dp_step (a spawned process): eager DP steps
    against DPDecodeGraphs' padded static-buffer step (not captured on CPU), on the same Steps."""
    import torch.distributed as dist

    from mlac.runtime.worker.build import RankJob, build_runner
    from mlac.runtime.worker.dp_graphs import DPDecodeGraphs
    from mlac.runtime.worker.options import RuntimeOptions

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        job = RankJob(path, RuntimeOptions(device="cpu", dtype=torch.float32, verify=False, **CACHE))
        runner = build_runner(job, rank, dist.group.WORLD)
        graphs = DPDecodeGraphs(runner.model, runner.cache, [1, 2, 4, 8], 512, runner.dp)
        prompts, ranks = LENGTHS[:3], [0, 1, 0]  # 9, 25, 3 tokens; rank 0 holds two
        tables = [[4 * i + b for b in range(4)] for i in range(3)]  # rank-local block ids
        runner.run(Step.of(prompts, [0, 0, 0], tables, ranks=ranks))  # eager prefill
        ctx = [len(p) for p in prompts]
        steps = [
            Step.of([[5], [6], [7]], ctx, tables, ranks=ranks),  # decode, 2 rows on rank 0
            Step.of([[5], [7]], [ctx[0], ctx[2]], [tables[0], tables[2]], ranks=[0, 0]),  # rank 1 idle
            Step.of([[5, 8, 9], [6]], ctx[:2], tables[:2], ranks=[1, 1]),  # flattened extend; rank 0 idle
            Step.of([[5, 8], [6, 1, 2, 3, 4], [7]], ctx, tables, ranks=ranks),  # bucket 8
        ]
        errors = []
        for step in steps:
            assert graphs.can_run(step)
            got = graphs.run(step).clone()
            want = runner.dp.run(runner.model, runner.cache, step)  # rewrites the same latents
            errors.append(rel(got, want))
        # above the largest bucket (1 row per rank): rank 0's two rows in two pieces, rank 1 idle in
        # the second; the first piece's rows are not contiguous in the step
        small = DPDecodeGraphs(runner.model, runner.cache, [1], 512, runner.dp)
        step = Step.of(
            [[5], [7], [6]], [ctx[0], ctx[2], ctx[1]], [tables[0], tables[2], tables[1]], ranks=[0, 0, 1]
        )
        assert not small.fits(step) and small.can_run(step)
        assert small.pieces(step) == [[0, 2], [1]]
        got = small.run(step).clone()
        errors.append(rel(got, runner.dp.run(runner.model, runner.cache, step)))
        # overlap scheduling's decode steps: the ids on the device in step order (not rank order)
        for g, decode in ((graphs, steps[0]), (graphs, steps[1]), (small, step)):
            ids = torch.tensor(decode.token_ids)
            errors.append(rel(g.run(decode, ids=ids).clone(), g.run(decode).clone()))
            fed = runner.dp.run(runner.model, runner.cache, decode, ids)
            errors.append(rel(fed, runner.dp.run(runner.model, runner.cache, decode)))
        out.put((rank, errors))
    finally:
        dist.destroy_process_group()


def test_decode_graphs_match_the_eager_dp_step(compiled):
    """The DP-attention graph step (rows per rank padded to one bucket, exchange inside) gives the
    eager DP step's logits, with one rank idle, uneven rows, flattened extends, and a decode step
    above the largest bucket in pieces (every rank the same pieces); and with the token ids on the
    device in step order (overlap scheduling), graphs and eager alike, the logits of the host ids."""
    results = two_gloo_ranks(graph_rank, str(compiled("tiny-v3", tp=2, dp=True)))
    assert results[0] == results[1] and len(results[0]) == 11
    assert max(results[0]) < 1e-5


# ---- the plan: compile, shard, launch ----------------------------------------------------------


def test_attention_weights_are_whole_on_every_rank(compiled):
    one = load_artifact(compiled("tiny-v3"), rank=0, dtype=torch.float32).tensors
    dp = compiled("tiny-v3", tp=2, dp=True)
    assert Manifest.load(dp).plan.dp_attention
    for rank in (0, 1):
        t = load_artifact(dp, rank=rank, dtype=torch.float32).tensors
        for name in ("layers.1.attn.wq_b", "layers.1.attn.w_kc", "layers.1.attn.w_vc", "layers.1.attn.wo"):
            assert torch.equal(t[name], one[name]), name
        assert t["layers.1.moe.w13"].shape[1] * 2 == one["layers.1.moe.w13"].shape[1]  # still sharded
        assert t["layers.0.mlp.w2"].shape[1] * 2 == one["layers.0.mlp.w2"].shape[1]


def test_compile_measures_the_dp_artifact_against_one_rank(checkpoint, tmp_path):
    """The compile's accuracy check runs the DP-attention artifact on its ranks (and builds its
    1-rank reference without DP attention)."""
    out = tmp_path / "dp"
    compile_checkpoint(checkpoint("tiny-v3"), out, CompileOptions(tp=2, dp_attention=True))
    report = Manifest.load(out).accuracy
    assert report.status == "measured" and report.rel_l2 < 1e-5 and report.top1_agreement == 1.0


def test_a_launch_that_disagrees_with_the_plan_is_refused(compiled):
    with pytest.raises(MlacError, match="compiled with --dp-attention"):
        start(compiled("tiny-v3", tp=2, dp=True), dp_attention=False)
    with pytest.raises(MlacError, match="compiled without --dp-attention"):
        start(compiled("tiny-v3", tp=2), dp_attention=True)
    with pytest.raises(MlacError, match="not with a --dp-attention artifact"):  # MTP: not under DP attention
        start(compiled("tiny-v3", tp=2, dp=True), scheduler=SchedulerConfig(speculative_num_steps=1))


def test_dp_attention_needs_several_ranks(checkpoint, tmp_path):
    cfg = ModelConfig.from_dir(checkpoint("tiny-v3"))
    with pytest.raises(MlacError, match="--dp-attention needs --tp 2 or more"):
        check_options(cfg, CompileOptions(tp=1, dp_attention=True))
    check_options(cfg, CompileOptions(tp=4, dp_attention=True))  # heads need not divide: whole
    one_line_error(invoke("compile", checkpoint("tiny-v3"), tmp_path / "o", "--dp-attention"), "--tp 2")


# ---- the parts: Step, routing ------------------------------------------------------------------


def exchange_rank(rank: int, port: int, out) -> None:
    """One gloo rank of test_token_exchange_...: gather and scatter for even and uneven counts,
    against what every rank's seeded rows say they must be."""
    import torch.distributed as dist

    from mlac.runtime.model.dp_attention import TokenExchange

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        results = []
        for counts in ((3, 3), (1, 4), (2, 0)):
            rows = [
                torch.randn(n, 5, generator=torch.Generator().manual_seed(10 * r + n))
                for r, n in enumerate(counts)
            ]
            partial = [
                torch.randn(sum(counts), 5, generator=torch.Generator().manual_seed(100 + r))
                for r in range(2)
            ]
            ex = TokenExchange(counts, rank, dist.group.WORLD)
            start = sum(counts[:rank])
            gathered_ok = torch.equal(ex.gather(rows[rank]), torch.cat(rows))
            mine = (partial[0] + partial[1])[start : start + counts[rank]]
            scattered_ok = torch.allclose(ex.scatter(partial[rank]), mine, atol=1e-6)
            results.append((ex.even, gathered_ok, scattered_ok))
        out.put((rank, results))
    finally:
        dist.destroy_process_group()


def test_token_exchange_gathers_and_scatters_even_and_uneven_counts():
    """Even counts (a CUDA graph's bucket) take the collectives alone, uneven ones pad: both give
    every rank's rows in rank order, and each rank's rows of the summed partials."""
    results = two_gloo_ranks(exchange_rank, timeout=60)
    assert results[0] == results[1] == [(True, True, True), (False, True, True), (False, True, True)]


def test_step_parts_and_rows_per_rank():
    step = Step.of([[1, 2], [3], [4, 5, 6]], [0, 7, 0], [[0], [1], [2]], ranks=[1, 0, 1])
    assert step.rank_tokens(3) == (1, 5, 0)
    assert step.part(2) is None
    part = step.part(1)
    assert part.token_ids == (1, 2, 4, 5, 6) and part.ctx_lens == (0, 0) and part.block_tables == ((0,), (2,))
    assert rows_per_rank(step, 2) == [[1], [0, 2]]
    every = Step.of([[1, 2], [3]], [0, 0], [[0], [1]], every_token=True, ranks=[1, 0])
    assert rows_per_rank(every, 2) == [[2], [0, 1]]
    with pytest.raises(MlacError, match="2 ranks for 3 sequences"):
        Step.of([[1], [2], [3]], [0, 0, 0], [[0], [1], [2]], ranks=[0, 1])


def test_route_prefers_the_cached_prefix_when_it_has_room():
    pools = [BlockPool(8, 4), BlockPool(8, 4)]
    tokens = list(range(13))
    assert route(pools, tokens, 4, use_prefix=True) == 0  # a tie: the lowest rank
    pools[0].allocator.alloc(1)
    assert route(pools, tokens, 4, use_prefix=True) == 1  # most free
    table = pools[0].allocator.alloc(2)  # rank 0 caches the first two blocks
    leftover = pools[0].prefix.insert(pools[0].prefix.root, tokens[:8], table)
    assert leftover == []
    assert route(pools, tokens, 4, use_prefix=True) == 0  # its prefix, and room for the rest
    assert route(pools, tokens, 4, use_prefix=False) == 1
    pools[0].allocator.alloc(5)  # rank 0 full but for its 2 cached blocks
    assert route(pools, tokens, 4, use_prefix=True) == 1  # no room for the other 2 blocks there
