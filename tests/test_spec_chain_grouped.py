"""The speculative chain's verify in mla_decode's grouped form (spec_chain.py), on CPU, float32, tiny-v3.

The grouped form's kernel runs here under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1): the attention's mla_decode is replaced by the Triton path, which records the
row groups it was given. A chain run with the grouped verify (sequence-major rows, row groups) must
give the `out`, `nxt` and state rows of the per-row verify (j-major, no row groups), and the greedy
tokens of the plain engine.
"""

from __future__ import annotations

import pytest
import torch
from test_mtp_spec import prompts, run, spec_engine
from test_mtp_spec_chain import graph_engine

import mlac.runtime.attention_forms as forms
import mlac.runtime.spec_chain as spec_chain
from mlac.kernels.mla_decode import decode_group_rows, mla_decode, row_groups_device, row_groups_host
from mlac.runtime.engine import Engine
from mlac.runtime.kv_cache import PagedKVCache
from mlac.runtime.sampling import SamplingParams
from mlac.runtime.spec_chain import ChainGraphs, ChainInputs, chain_batches, transpose_rows

BLOCK = 16


@pytest.fixture(scope="module")
def model(artifact):
    return spec_engine(artifact("tiny-v3"), 1).runner.model


@pytest.fixture
def seen(monkeypatch) -> list:
    """The row groups given to each decode attention ([2, R] shapes, None for the per-row form),
    its mla_decode forced onto the Triton path (the interpreter on CPU)."""
    calls: list = []

    def triton_attention(*args, row_groups=None, **kwargs):
        calls.append(None if row_groups is None else tuple(row_groups.shape))
        return mla_decode(*args, row_groups=row_groups, use_triton=True, **kwargs)

    monkeypatch.setattr(forms, "mla_decode", triton_attention)
    return calls


@pytest.mark.parametrize("ctx,q,rows", [([0, 7, 40], 4, 4), ([3, 9], 5, 2), ([5], 1, 4), ([2, 30], 3, 4)])
def test_row_groups_device_is_the_host_table(ctx, q, rows):
    got = row_groups_device(torch.tensor(ctx), q, rows)
    assert got.dtype == torch.int32 and got.is_contiguous()
    assert got.tolist() == list(row_groups_host(ctx, [q] * len(ctx), rows))


def test_transpose_rows_moves_between_j_major_and_sequence_major():
    x = torch.arange(12).view(12, 1) * torch.tensor([1, -1])  # [12, 2], row j * 4 + i, K + 1 = 3
    y = transpose_rows(x, 3, 4)
    assert y[:, 0].tolist() == [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11] and (y[:, 1] == -y[:, 0]).all()
    assert torch.equal(transpose_rows(y, 4, 3), x)


def test_grouped_verify_batch_is_the_per_row_one_sequence_major(model):
    """The same rows (positions, slots, lengths, tables) transposed, with the row groups of K + 1
    rows per sequence, padding sequences included; the draft batches do not change."""
    k, bs = 3, 4
    cache = PagedKVCache(model.config, 12, BLOCK, torch.float32, extra_layers=1)
    inputs = ChainInputs(bs, 3, cache, torch.device("cpu"))
    inputs.fill([11, 12, 13], [BLOCK - 2, 3, 2 * BLOCK - 1], [[4, 7], [2], [5, 1, 9]], bs)  # 0, 2 cross
    _, ctx, (every, *drafts) = chain_batches(inputs, bs, k, BLOCK)
    _, _, (grouped, *grouped_drafts) = chain_batches(inputs, bs, k, BLOCK, group_rows=2)
    assert every.row_groups is None
    for name in ("positions", "slots", "seq_lens", "block_tables"):
        want = transpose_rows(getattr(every, name), k + 1, bs)
        assert torch.equal(getattr(grouped, name), want), name
    scratch = cache.scratch_block
    assert grouped.slots[:4].tolist() == [
        4 * BLOCK + BLOCK - 2,
        4 * BLOCK + BLOCK - 1,
        7 * BLOCK,
        7 * BLOCK + 1,
    ]
    assert grouped.slots[12:].tolist() == [scratch * BLOCK + j for j in range(4)]  # a padding sequence
    lead, kv_len = row_groups_host(ctx.tolist(), [k + 1] * bs, 2)
    assert grouped.row_groups.tolist() == [lead, kv_len] and lead[:4] == [2, 0, 2, 0]
    for a, b in zip(drafts, grouped_drafts, strict=True):
        assert (
            b.row_groups is None and torch.equal(a.positions, b.positions) and torch.equal(a.slots, b.slots)
        )


def test_the_form_follows_the_rule_and_the_switch(model, monkeypatch):
    cache = PagedKVCache(model.config, 4, BLOCK, torch.float32, extra_layers=1)
    heads = model.layers[0].attn.n_local_heads
    rows = decode_group_rows(heads, model.device)
    assert rows > 1  # tiny-v3's heads group: the grouped tests below are not vacuous
    assert ChainGraphs(model, cache, [1, 2], 64, 2).group_rows == rows
    assert ChainGraphs(model, cache, [1, 2], 64, 2, row_groups=False).group_rows == 1
    monkeypatch.setattr(spec_chain, "prefer_row_groups", lambda *a: False)  # e.g. 64 heads or more
    assert ChainGraphs(model, cache, [1, 2], 64, 2).group_rows == 1
    monkeypatch.undo()
    monkeypatch.setattr(spec_chain, "ROW_GROUPS", False)  # MLAC_MLA_ROW_GROUPS=0
    assert ChainGraphs(model, cache, [1, 2], 64, 2).group_rows == 1


def chain_steps(model, k: int, grouped: bool, group_rows: int | None, steps: int = 3) -> list:
    """`steps` chain steps of 3 sequences in bucket 4 (one padding sequence) from the same random
    caches and states, each next step from the last one's nxt: [(out, nxt, g, d_0)] per step.
    Contexts 15, 3, 30: K + 1 rows that cross a block boundary from the first step on."""
    gen = torch.Generator().manual_seed(k)
    cache = PagedKVCache(model.config, 20, BLOCK, torch.float32, extra_layers=1)
    for pool in cache.layers:
        pool.copy_(torch.randn(pool.shape, generator=gen))
    chain = ChainGraphs(model, cache, [1, 2, 4], 6 * BLOCK, k, row_groups=grouped)
    if group_rows is not None and grouped:
        chain.group_rows = group_rows  # fewer rows a group than the kernel's ROWS: runs per sequence
    d = model.config.hidden_size
    chain.load(torch.randn(3, d, generator=gen), torch.randint(3, 200, (3,), generator=gen))
    last, ctx = [17, 40, 99], [BLOCK - 1, 3, 2 * BLOCK - 2]
    tables = [[7, 2, 11, 5], [0, 13], [9, 4, 16, 1, 8]]
    results = []
    for _ in range(steps):
        out = chain.run(last, ctx, tables).clone()
        nxt = chain.nxt[:, :3].clone()
        results.append((out, nxt, chain.g[:3].clone(), chain.tokens[:3].clone()))
        last, ctx = nxt.tolist()
    return results


@pytest.mark.parametrize("k,group_rows", [(1, None), (2, None), (3, None), (3, 2)])
def test_grouped_verify_gives_the_per_row_outputs_and_states(model, seen, k, group_rows):
    per_row = chain_steps(model, k, grouped=False, group_rows=None)
    assert seen and all(s is None for s in seen)
    seen.clear()
    grouped = chain_steps(model, k, grouped=True, group_rows=group_rows)
    # the verify and the refresh of every step (bucket 4: 4 (K + 1) rows) ran grouped, the drafts not
    n_layers = model.config.num_hidden_layers
    assert seen.count((2, 4 * (k + 1))) == 3 * (n_layers + 1)
    assert all(s is None for s in seen if s != (2, 4 * (k + 1)))
    for (out, nxt, g, d0), (out2, nxt2, g2, d02) in zip(per_row, grouped, strict=True):
        assert torch.equal(out, out2) and torch.equal(nxt, nxt2) and torch.equal(d0, d02)
        torch.testing.assert_close(g, g2, rtol=1e-4, atol=1e-4)
    assert per_row[0][1][1].tolist() != per_row[-1][1][1].tolist()  # the contexts advanced


@pytest.mark.parametrize("k", [1, 3])
def test_engine_tokens_are_the_plain_ones_with_the_grouped_verify_on_and_off(artifact, seen, monkeypatch, k):
    """Scheduler-driven chain steps (3 prompts of uneven lengths: bucket 4, one padding sequence;
    16 tokens each cross block boundaries): the plain greedy tokens with the grouped verify on and
    under MLAC_MLA_ROW_GROUPS=0 (the chain's switch)."""
    ps, params = prompts(3), SamplingParams(max_tokens=16, ignore_eos=True)
    plain = Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False)
    want, _ = run(plain, ps, params)
    chain_calls: list[list] = []  # per chain step: the row groups its attentions got
    step = ChainGraphs._step

    def recorded(self, bs):
        start = len(seen)
        step(self, bs)
        chain_calls.append(seen[start:])

    monkeypatch.setattr(ChainGraphs, "_step", recorded)
    got, _ = run(graph_engine(artifact, k), ps, params)
    assert got == want and chain_calls
    n_layers = plain.config.num_hidden_layers
    assert all(c.count((2, 4 * (k + 1))) == n_layers + 1 for c in chain_calls)
    chain_calls.clear()
    monkeypatch.setattr(spec_chain, "ROW_GROUPS", False)
    got, _ = run(graph_engine(artifact, k), ps, params)
    assert got == want and chain_calls and all(s is None for c in chain_calls for s in c)
