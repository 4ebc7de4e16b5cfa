"""The radix prefix cache (kvcache/radix.py) alone and through the Scheduler.

CPU, float32, the tiny-v3 artifact with 4-token blocks. A request's greedy output must be the same
with the prefix cache on and off; after every step each KV block is accounted for exactly once
(Scheduler.check_blocks), and the cache reports the hits it should.
"""

from __future__ import annotations

import pytest
import torch

from mlac.core.errors import MlacError
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.engine.scheduler import SchedulerConfig
from mlac.runtime.kvcache.blocks import BlockAllocator
from mlac.runtime.kvcache.radix import PrefixCache

BS = 4
ON = SchedulerConfig(max_running_requests=8, chunked_prefill_size=16)
OFF = SchedulerConfig(max_running_requests=8, chunked_prefill_size=16, prefix_cache=False)
SYSTEM = list(range(40, 62))  # 22 tokens: 5 full blocks and half of one


@pytest.fixture(scope="module")
def engine(artifact) -> Engine:
    return Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False, block_size=BS)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def run(engine: Engine, prompts, config: SchedulerConfig, max_tokens: int = 5, abort_at=None):
    """Run `prompts` together through a fresh scheduler, checking the block accounting after every
    step; `abort_at=(step, index)` aborts one request. Returns (sequences, scheduler)."""
    sched = engine.scheduler(config)
    seqs = [engine.new_sequence(p, greedy(max_tokens)) for p in prompts]
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_unfinished:
        if abort_at is not None and steps == abort_at[0]:
            sched.abort(seqs[abort_at[1]].seq_id)
        sched.step()
        sched.check_blocks()
        steps += 1
    return seqs, sched


def outputs(seqs) -> list[list[int]]:
    return [s.output_ids for s in seqs]


def settled(engine: Engine, sched) -> dict[str, int]:
    """After a run: nothing in use, free + cached == every block."""
    counts = sched.check_blocks()
    assert counts["in_use"] == 0 and counts["free"] + counts["cached"] == engine.cache.num_blocks
    assert engine.pool.allocator.num_free == engine.cache.num_blocks
    return counts


# ---- the tree alone ----------------------------------------------------------------------------


def test_match_takes_full_blocks_and_insert_shares_them():
    alloc = BlockAllocator(8, BS)
    tree = PrefixCache(alloc)
    tokens = list(range(10))  # 2 full blocks and 2 tokens
    node = tree.match(tokens, 9 // BS)
    assert node is tree.root and tree.blocks(node) == []
    table = alloc.alloc(3)
    assert tree.insert(node, tokens, table) == [table[2]]  # the partial block goes back
    alloc.free([table[2]])
    assert tree.num_evictable == 2 and alloc.num_free == 8 and alloc.num_unused == 6

    again = tree.match(tokens, 9 // BS)
    assert tree.blocks(again) == table[:2] and tree.num_evictable == 0 and alloc.num_free == 6
    short = tree.match(tokens[:8], 7 // BS)
    assert tree.blocks(short) == table[:1]  # never the whole prompt
    other = tree.match([0, 1, 2, 3, 9, 9, 9, 9], 1)
    assert tree.blocks(other) == table[:1]
    tree.release(other)
    own = alloc.alloc(1)  # `short` computed block 1 itself: the cached copy stays, its own goes back
    assert tree.insert(short, tokens[:8], table[:1] + own) == own
    alloc.free(own)
    assert tree.num_evictable == 0  # both still held by `again`
    tree.release(again)
    assert tree.num_evictable == 2 and alloc.num_free == 8


def test_a_running_sequences_prompt_joins_the_tree_and_keeps_its_reference():
    alloc = BlockAllocator(8, BS)
    tree = PrefixCache(alloc)
    prompt = list(range(10))  # 2 full blocks and 2 tokens
    node = tree.match(prompt, 9 // BS)
    table = alloc.alloc(3)
    node, replaced = tree.insert_running(node, prompt, table)
    assert replaced == [] and tree.blocks(node) == table[:2] and node.refs == 1 and tree.num_evictable == 0
    other = tree.match(prompt + [5], 10 // BS)  # another request now shares both blocks
    assert tree.blocks(other) == table[:2]
    late = tree.match([0, 1, 2, 3], 0)  # a third request computed block 1 itself meanwhile
    own = table[:1] + alloc.alloc(1)
    late, replaced = tree.insert_running(late, prompt[:8], own)
    assert own == table[:2] and len(replaced) == 1  # it switches to the cached copy and frees its own
    alloc.free(replaced)
    alloc.free(tree.insert(node, prompt + [7, 8], table))  # it ends with 12 tokens: 3 full blocks cached
    tree.release(other)
    tree.release(late)
    assert tree.num_evictable == 3 and alloc.num_free == 8


def test_eviction_frees_least_recently_used_leaves_first():
    alloc = BlockAllocator(6, BS)
    tree = PrefixCache(alloc)
    paths = {}
    for name, first in (("a", 0), ("b", 100)):  # two 2-block paths: a, then b
        tokens = list(range(first, first + 2 * BS))
        paths[name] = alloc.alloc(2)
        alloc.free(tree.insert(tree.match(tokens, 1), tokens, paths[name]))
    tree.release(tree.match(list(range(9)), 2))  # touch a: b is now the least recently used
    assert alloc.num_unused == 2 and alloc.num_free == 6
    got = alloc.alloc(3)  # one more than the free list: evicts b's leaf, not b's root or a
    assert paths["b"][1] in got and tree.num_evictable == 3
    assert {x.block for x in tree.nodes()} == {*paths["a"], paths["b"][0]}
    held = tree.match(list(range(9)), 2)  # a referenced: only b's root can go
    assert alloc.num_free == 1
    assert alloc.alloc(1) == [paths["b"][0]]
    with pytest.raises(MlacError, match="KV cache full"):
        alloc.alloc(1)
    tree.release(held)
    assert tree.clear() == 2 and alloc.num_unused == 2


# ---- through the scheduler ---------------------------------------------------------------------


def test_shared_system_prompt(engine):
    prompts = [SYSTEM + [7 + i] * (1 + i) for i in range(4)]
    engine.pool.prefix.clear()
    want, _ = run(engine, prompts, OFF)
    first, _ = run(engine, prompts[:1], ON)  # caches the system prompt
    rest, sched = run(engine, prompts[1:], ON)
    assert outputs(first + rest) == outputs(want)
    assert [s.num_cached_tokens for s in rest] == [20, 20, 20]  # 5 full blocks; the 6th ends mid-block
    assert sched.prefix_hit_tokens == 60 and sched.prefix_query_tokens == sum(len(p) for p in prompts[1:])
    settled(engine, sched)


def test_requests_that_share_a_prompt_prefill_it_once(engine):
    """The n choices of one request, or a burst with one system prompt, sent together: the first
    prefills the shared blocks, the others wait until its prompt is cached, then take them from
    the cache (same outputs as without the cache)."""
    prompts = [SYSTEM + [7 + i] for i in range(4)]  # 23 tokens: 5 full blocks shared
    engine.pool.prefix.clear()
    want, _ = run(engine, prompts, OFF)
    got, sched = run(engine, prompts, ON)
    assert outputs(got) == outputs(want)
    assert [s.num_cached_tokens for s in got] == [0, 20, 20, 20]
    settled(engine, sched)


def test_identical_prompt_recomputes_at_least_its_last_token(engine, monkeypatch):
    prompt = list(range(200, 212))  # exactly 3 blocks
    engine.pool.prefix.clear()
    want, _ = run(engine, [prompt], OFF)
    run(engine, [prompt], ON)
    steps = []
    real = engine.runner.run
    monkeypatch.setattr(engine.runner, "run", lambda step: steps.append(step) or real(step))
    again, _ = run(engine, [prompt], ON)
    assert outputs(again) == outputs(want) and again[0].num_cached_tokens == 8
    assert (steps[0].ctx_lens, steps[0].q_lens) == ((8,), (4,))  # the last block runs again


def test_multi_turn_chat(engine):
    turn1 = SYSTEM + [5, 6, 7]
    engine.pool.prefix.clear()
    (a,), _ = run(engine, [turn1], ON, max_tokens=6)
    turn2 = turn1 + a.output_ids + [8, 9, 10, 11, 12]
    want, _ = run(engine, [turn1, turn2], OFF, max_tokens=6)
    (b,), sched = run(engine, [turn2], ON, max_tokens=6)
    assert [a.output_ids, b.output_ids] == outputs(want)
    computed = len(turn1) + len(a.output_ids) - 1  # the last sampled token never ran
    assert b.num_cached_tokens == computed // BS * BS > len(turn1) - BS
    settled(engine, sched)


def test_concurrent_requests_sharing_a_prefix_while_one_is_aborted(engine):
    prompts = [SYSTEM + [9, 9, 9 + i] for i in range(5)]
    engine.pool.prefix.clear()
    want, _ = run(engine, prompts, OFF, max_tokens=8)
    got, sched = run(engine, prompts, ON, max_tokens=8, abort_at=(3, 1))
    assert got[1].finish_reason == "abort"
    keep = [0, 2, 3, 4]
    assert [got[i].output_ids for i in keep] == [want[i].output_ids for i in keep]
    assert got[1].output_ids == want[1].output_ids[: len(got[1].output_ids)]
    settled(engine, sched)
    (again,), _ = run(engine, prompts[1:2], ON, max_tokens=8)  # the aborted prefix stayed cached
    assert again.num_cached_tokens == 24 and again.output_ids == want[1].output_ids


def test_eviction_under_a_small_pool_comes_before_preemption(artifact, engine):
    small = Engine.from_artifact(
        artifact("tiny-v3"), dtype=torch.float32, verify=False, block_size=BS, num_blocks=16
    )
    waves = [[SYSTEM + [3 + w, 4 + i] for i in range(2)] for w in range(4)]  # 7 blocks each prompt
    for w, prompts in enumerate(waves):
        want, _ = run(engine, prompts, OFF, max_tokens=4)
        got, sched = run(small, prompts, ON, max_tokens=4)
        assert outputs(got) == outputs(want), f"wave {w}"
        assert sched.num_preemptions == 0  # cached blocks were evicted instead
        if w:
            assert all(s.num_cached_tokens == 20 for s in got)  # the system prompt survived eviction
        counts = settled(small, sched)
    assert counts["cached"] <= small.cache.num_blocks
    tree_blocks = {x.block for x in small.pool.prefix.nodes()}
    assert len(tree_blocks) < sum(len(p) + 3 for ps in waves for p in ps) // BS  # some were evicted


def test_preemption_gives_blocks_to_the_cache_and_changes_no_output(artifact, engine):
    small = Engine.from_artifact(
        artifact("tiny-v3"), dtype=torch.float32, verify=False, block_size=BS, num_blocks=20
    )
    prompts = [SYSTEM[: 6 + 2 * i] + [i] for i in range(6)]
    want, _ = run(engine, prompts, OFF, max_tokens=16)
    got, sched = run(small, prompts, ON, max_tokens=16)
    assert sched.num_preemptions > 0
    assert outputs(got) == outputs(want)
    settled(small, sched)


def test_off_uses_no_cache(engine):
    engine.pool.prefix.clear()
    run(engine, [SYSTEM], ON)
    (s,), sched = run(engine, [SYSTEM + [1]], OFF)
    assert s.num_cached_tokens == 0 and sched.prefix_query_tokens == 0


# ---- through the server --------------------------------------------------------------------------


def served(art, prefix_cache: bool) -> tuple[list[dict], dict[str, float]]:
    """Usage of the same completion asked twice, and the prefix-cache counters of /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from mlac.runtime.serve import ServerConfig, ServerThread

    limits = SchedulerConfig(prefix_cache=prefix_cache)
    cfg = ServerConfig.of(
        artifact=art, dtype="float32", verify=False, served_model_name="tiny", scheduler=limits
    )
    body = {"model": "tiny", "prompt": list(range(5, 45)), "max_tokens": 3, "ignore_eos": True}
    with ServerThread(cfg) as srv:
        usage = [httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()["usage"] for _ in "ab"]
        text = httpx.get(f"{srv.url}/metrics").text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return usage, {
        k: v for k, v in samples.items() if k.startswith("mlac:prefix_cache") and k.endswith("_total")
    }


def test_usage_and_metrics_report_cached_tokens(artifact):
    art = artifact("tiny-v3")
    usage, counters = served(art, prefix_cache=True)
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usage] == [0, 32]  # 16-token blocks
    assert counters == {
        "mlac:prefix_cache_hits_total": 32,
        "mlac:prefix_cache_queries_total": 80,
    }
    usage, counters = served(art, prefix_cache=False)
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usage] == [0, 0]
    assert counters["mlac:prefix_cache_hits_total"] == 0
