"""A cached prefix that several sequences of an extend step share (runtime/shared_prefix.py), and
the cascade attention over it (model/attention.extend_shared): the same attention as each sequence
over all of its tokens, the rule that picks it, its warm-up, and the same greedy tokens end to end."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import mlac.runtime.model.model as model_mod
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.engine.scheduler import SchedulerConfig
from mlac.runtime.kvcache import shared_prefix
from mlac.runtime.kvcache.batch import ForwardBatch
from mlac.runtime.model.attention import extend_absorbed, extend_mha, extend_shared, prefer_shared

BS = 4


def test_find_takes_the_largest_group_and_whole_cached_blocks():
    tables = [[1, 2, 3, 9], [1, 2, 3, 8], [1, 2, 4], [5, 6], [5, 6, 7]]
    ctx = [14, 13, 9, 8, 8]
    # group 1: three sequences, 5 new tokens in all; group 5: two, 8 new tokens
    assert shared_prefix.find(ctx, [1, 2, 2, 4, 4], tables, BS) == ((3, 4), 2)
    # group 1 wins on new tokens; sequence 2 differs at its third block, so two blocks are shared
    assert shared_prefix.find(ctx, [8, 8, 8, 1, 1], tables, BS) == ((0, 1, 2), 2)
    # without sequence 2: three blocks (13 cached tokens hold 3 whole blocks, not 4)
    assert shared_prefix.find(ctx[:2], [1, 1], tables[:2], BS) == ((0, 1), 3)
    # a first block that is not yet cached for one of them (3 tokens) is not shared
    assert shared_prefix.find([3, 14], [5, 5], [[1, 2], [1, 2, 3, 9]], BS) is None
    assert shared_prefix.find([14], [3], [[1, 2, 3, 9]], BS) is None  # one sequence


def test_build_lays_out_the_prefix_once_then_each_sequences_own_tokens():
    tables = [[1, 2, 3, 9, 10], [1, 2, 3, 8], [7, 6]]
    ctx, q = [14, 12, 3], [3, 2, 4]
    full = ForwardBatch.build(ctx, q, tables, BS)
    sp = full.shared
    assert sp is not None and sp.sharers == (0, 1) and sp.length == 12 and sp.num_rows == 5
    assert sp.rest_ctx_lens == (2, 0, 3) and sp.shares.tolist() == [1, 1, 0]
    assert sp.sums == (17 + 14 + 7, 5 + 2 + 7, 3 * 17 + 2 * 14 + 4 * 7)  # keys, own keys, pairs
    starts = full.cu_seqlens_kv.tolist()
    want = torch.cat([full.kv_slots[:12], full.kv_slots[starts[0] + 12 : starts[1]],
                      full.kv_slots[starts[1] + 12 : starts[2]], full.kv_slots[starts[2] : starts[3]]])  # fmt: skip
    assert sp.kv_slots.tolist() == want.tolist()
    assert sp.cu_seqlens_kv.tolist() == [12, 17, 19, 26]  # each one's own rows, after the prefix's 12
    assert ForwardBatch.build([14, 12], [1, 1], tables[:2], BS).shared is None  # decode: never


def test_rule_at_deepseek_dims():
    """A 2,000-token prefix: from 3 sequences of 64 new tokens the prefix decompressed once costs
    less than each sequence's absorbed attention; a long private context of its own (8,000
    tokens past the prefix, decompressed in the MHA form) tips it back."""
    dims = torch.empty(16, 128, 512), torch.empty(16, 512, 128), 64

    def rule(n, own=0):
        sums = shared_prefix.step_sums([64] * n, [2000 + own] + [2000] * (n - 1), [own] + [0] * (n - 1))
        return prefer_shared(2000, sums, *dims)

    assert not rule(2) and rule(3) and rule(32)
    assert not rule(3, own=8000)


@pytest.mark.parametrize("q_lens", [[3, 5, 4], [40, 60, 4]])
def test_cascade_equals_each_sequence_over_all_of_its_tokens(q_lens):
    """Three sequences, two of them sharing 12 cached tokens (one with 2 cached tokens of its own
    past them), the third sharing nothing. Against the absorbed and the MHA form over every
    sequence's own copy of all its tokens."""
    g = torch.Generator().manual_seed(0)
    h, nope, rope, c, v = 3, 16, 8, 32, 12
    tables = [[1, 2, 3, 9, 10], [1, 2, 3, 8, 11], [7, 6]]
    ctx = [14, 12, 3]
    tables = [
        t + list(range(20 + 30 * i, 20 + 30 * i + 20)) for i, t in enumerate(tables)
    ]  # room for new tokens
    batch = ForwardBatch.build(ctx, q_lens, tables, BS)
    pool = torch.randn(200 * BS, c + rope, generator=g)  # the cache, by slot
    t = sum(q_lens)
    q_nope, q_rope = torch.randn(t, h, nope + rope, generator=g).split([nope, rope], dim=-1)
    w_kc, w_vc = torch.randn(h, nope, c, generator=g) / c**0.5, torch.randn(h, c, v, generator=g) / c**0.5
    plain = (pool[batch.kv_slots], w_kc, w_vc, batch.cu_seqlens_q, batch.cu_seqlens_kv, max(q_lens), 0.2)
    sp = batch.shared
    assert sp is not None and sp.sharers == (0, 1) and sp.length == 12
    got = extend_shared(
        q_nope, q_rope, pool[sp.kv_slots], w_kc, w_vc, sp, batch.cu_seqlens_q, max(q_lens), 0.2
    )
    torch.testing.assert_close(got, extend_absorbed(q_nope, q_rope, *plain), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, extend_mha(q_nope, q_rope, *plain), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", ["tiny-v3", "tiny-v2-lite"])
def test_same_tokens_through_the_engine(artifact, monkeypatch, preset):
    """A system prompt cached, then four requests after it in one step: greedy tokens and top
    logprobs with the cascade (forced, whatever the rule says) are those of the plain extend."""
    config = SchedulerConfig(max_running_requests=8, chunked_prefill_size=64)
    kw = dict(dtype=torch.float32, verify=False, block_size=BS, scheduler=config)
    system = list(range(40, 62))  # 5 whole blocks and half of one
    prompts = [system + [7 + i] * (3 + i) for i in range(4)]
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)
    monkeypatch.setattr(model_mod, "prefer_shared", lambda *a: True)

    def generate(cascade: bool):
        engine = Engine.from_artifact(artifact(preset), shared_prefix=cascade, **kw)
        engine.pool.prefix.clear()  # what the warm-up cached
        engine.generate([system + [3]], SamplingParams(max_tokens=1))  # caches it
        return engine.generate(prompts, params)

    calls = []
    real = model_mod.extend_shared
    monkeypatch.setattr(model_mod, "extend_shared", lambda *a: (calls.append(a[5]), real(*a))[1])
    plain = generate(False)
    assert not calls
    cascade = generate(True)
    assert calls and calls[0].sharers == (0, 1, 2, 3) and calls[0].length == 20
    assert [c.token_ids for c in cascade] == [c.token_ids for c in plain]
    for a, b in zip(cascade, plain, strict=True):
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert all(abs(p - r) < 1e-4 for (_, p), (_, r) in zip(x.top, y.top, strict=True))


def test_warmup_runs_the_cascade(artifact, monkeypatch):
    """Engine warm-up (prepare's too) meets the cascade's kernel when it is on: sharers and a
    sequence that shares nothing in one step, a prefix long enough that the rule takes it."""
    kw = dict(dtype=torch.float32, verify=False)
    plain = Engine.from_artifact(artifact("tiny-v3"), shared_prefix=False, **kw)
    assert plain._warm_shared_prefix() == []
    engine = Engine.from_artifact(artifact("tiny-v3"), **kw)
    calls = []
    real = model_mod.extend_shared
    monkeypatch.setattr(model_mod, "extend_shared", lambda *a: (calls.append(a[5]), real(*a))[1])
    ran = engine._warm_shared_prefix()
    assert len(ran) == 1 and calls and all(sp.shares.tolist() == [1, 1, 1, 0] for sp in calls)
    monkeypatch.setattr(
        engine, "scheduler_config", dataclasses.replace(engine.scheduler_config, prefix_cache=False)
    )
    assert engine._warm_shared_prefix() == []


def test_warmup_step_is_larger_than_the_graphs_take(artifact, monkeypatch):
    """A step of at most the graphs' largest bucket replays a graph, not the eager extend: the
    warm-up's cascade step is larger (here a stand-in for graphs of up to 200 rows)."""
    engine = Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False)
    monkeypatch.setattr(
        engine.runner, "graphs", types.SimpleNamespace(max_bs=200, can_run=lambda step: False)
    )
    calls = []
    real = model_mod.extend_shared
    monkeypatch.setattr(model_mod, "extend_shared", lambda *a: (calls.append(a[5]), real(*a))[1])
    engine._warm_shared_prefix()
    assert calls and calls[0].num_rows == 4 * 64 and len(calls[0].sharers) == 4  # 5 x 64 rows > 200


@pytest.mark.gpu
def test_cascade_on_the_gpu():
    """Triton kernels, bf16, DeepSeek's head dims: 8 sequences of 64 new tokens after a shared
    1,024-token prefix (and 16 more cached tokens of their own), against the plain extend."""
    g = torch.Generator().manual_seed(0)
    h, nope, rope, c, v = 16, 128, 64, 512, 128
    n, own = 8, 64
    prefix = list(range(1, 65))  # 64 blocks of 16
    tables = [
        prefix + [100 + 2 * i, 101 + 2 * i, 200 + 8 * i, 201 + 8 * i, 202 + 8 * i, 203 + 8 * i]
        for i in range(n)
    ]
    ctx, q_lens = [1024 + 16] * n, [own] * n
    batch = ForwardBatch.build(ctx, q_lens, tables, 16, "cuda")
    sp = batch.shared
    assert sp is not None and sp.length == 1024 and sp.num_rows == n * own
    pool = (torch.randn(400 * 16, c + rope, generator=g) / 4).to("cuda", torch.bfloat16)
    t = n * own
    q_nope, q_rope = (
        (torch.randn(t, h, nope + rope, generator=g) / 4).to("cuda", torch.bfloat16).split([nope, rope], -1)
    )
    w_kc = (torch.randn(h, nope, c, generator=g) / c**0.5).to("cuda", torch.bfloat16)
    w_vc = (torch.randn(h, c, v, generator=g) / c**0.5).to("cuda", torch.bfloat16)
    scale = (nope + rope) ** -0.5
    want = extend_absorbed(
        q_nope, q_rope, pool[batch.kv_slots], w_kc, w_vc, batch.cu_seqlens_q, batch.cu_seqlens_kv, own, scale
    )
    got = extend_shared(q_nope, q_rope, pool[sp.kv_slots], w_kc, w_vc, sp, batch.cu_seqlens_q, own, scale)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
