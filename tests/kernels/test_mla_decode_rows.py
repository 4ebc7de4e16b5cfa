"""MLA decode's grouped form (rows of one sequence share a program and its KV tiles): the Triton
kernel under TRITON_INTERPRET=1 against the float32 reference, the host's row-group table, the
form rule, and the CUDA-graph runner's flattened extends with the grouping on and off.

A case is B sequences, sequence i with q_lens[i] decode rows after ctx_lens[i] cached tokens
(row j attends over ctx + j + 1 tokens: the flattened-extend layout of graphs.py), their pages
scattered over one cache; every slot that holds no token is NaN, so a read past a row's own
sequence fails the comparison.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from mlac.kernels._triton import HAS_TRITON
from mlac.kernels.attention.head_bmm import head_bmm, head_bmm_ref
from mlac.kernels.attention.mla_decode import mla_decode, mla_decode_ref, mla_decode_triton
from mlac.kernels.attention.mla_decode_plan import (
    decode_group_rows,
    prefer_row_groups,
    row_groups,
    row_groups_host,
)
from mlac.kernels.attention.split_kv import SplitKV, merge_ref

KV_LORA, ROPE = 32, 16
needs_triton = pytest.mark.skipif(
    not HAS_TRITON or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton (CUDA or TRITON_INTERPRET=1)",
)


def make_rows(ctx_lens, q_lens, heads, page, q_dtype=torch.float32, kv_dtype=torch.float32, pad=0, seed=0):
    """(args of mla_decode for the flattened rows, kv_scale, row_groups input builder inputs).
    `pad` padding rows follow: one token each, in a scratch block of their own."""
    g = torch.Generator().manual_seed(seed)
    totals = [c + q for c, q in zip(ctx_lens, q_lens, strict=True)]
    pages = [-(-n // page) for n in totals]
    num_blocks = sum(pages) + 2
    scratch = num_blocks - 1
    cache = torch.randn(num_blocks, page, KV_LORA + ROPE, generator=g)
    perm = torch.randperm(num_blocks - 1, generator=g).tolist()
    used = torch.zeros(num_blocks, page, dtype=torch.bool)
    used[scratch, 0] = True
    tables, nxt = [], 0
    for n, p in zip(totals, pages, strict=True):
        tables.append(perm[nxt : nxt + p])
        for j, blk in enumerate(tables[-1]):
            used[blk, : min(page, n - j * page)] = True
        nxt += p
    cache[~used] = float("nan")
    kv_scale = None
    if kv_dtype == torch.float8_e4m3fn:
        kv_scale = torch.tensor([0.05], dtype=torch.float32)
        cache = (cache / kv_scale).to(kv_dtype)
    else:
        cache = cache.to(kv_dtype)
    width = max(pages)
    rows = [(t, c + j + 1) for t, c, q in zip(tables, ctx_lens, q_lens, strict=True) for j in range(q)]
    rows += [([scratch], 1)] * pad
    table = torch.tensor([t + [0] * (width - len(t)) for t, _ in rows], dtype=torch.int32)
    seq_lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    t = len(rows)
    q_nope = torch.randn(t, heads, KV_LORA, generator=g).to(q_dtype)
    q_rope = torch.randn(t, heads, ROPE, generator=g).to(q_dtype)
    args = (q_nope, q_rope, cache, table, seq_lens, 1.0 / math.sqrt(KV_LORA + ROPE))
    return args, kv_scale


def groups_of(ctx_lens, q_lens, rows, pad=0) -> torch.Tensor:
    return torch.tensor(row_groups_host(ctx_lens, q_lens, rows, pad), dtype=torch.int32)


def check(args, kv_scale, groups, num_splits, config=None, tol=1e-5):
    o_ref, lse_ref = mla_decode_ref(*args, kv_scale=kv_scale)
    out = torch.full_like(args[0], float("nan"))
    lse = torch.full(args[0].shape[:2], float("nan"))
    o, lse = mla_decode_triton(
        *args, kv_scale=kv_scale, return_lse=True, num_splits=num_splits, config=config,
        out=out, lse_out=lse, row_groups=groups,
    )  # fmt: skip
    err = ((o.double() - o_ref.double()).norm() / o_ref.double().norm()).item()
    assert torch.isfinite(o).all() and err < tol, f"o rel err {err}"
    torch.testing.assert_close(lse, lse_ref, rtol=1e-4, atol=1e-3 if tol < 1e-4 else 2e-2)


# --------------------------------------------------------------------------------------------
# Host side: the table and the rule
# --------------------------------------------------------------------------------------------


def test_row_groups_host_splits_sequences_into_runs_of_at_most_rows():
    lead, kv_len = row_groups_host([7, 40, 3], [1, 5, 3], rows=4, pad=2)
    # a decode row; a group of 4 and one of 1; a group of 3; two padding rows
    assert lead == [1, 4, 0, 0, 0, 1, 3, 0, 0, 1, 1]
    assert kv_len == [8, 44, 44, 44, 44, 45, 6, 6, 6, 1, 1]
    assert row_groups([0], [2], rows=1).tolist() == [[1, 1], [1, 2]]


def test_prefer_row_groups_is_for_rows_of_one_sequence_and_few_heads():
    cpu = torch.device("cpu")
    assert decode_group_rows(16, cpu) > 1 and decode_group_rows(64, cpu) == 1
    assert prefer_row_groups([1, 5, 1], 16, cpu)
    assert not prefer_row_groups([1, 1, 1], 16, cpu)  # pure decode keeps the per-row form
    assert not prefer_row_groups([64], 64, cpu)  # 64 heads already fill the dots' M


# --------------------------------------------------------------------------------------------
# Kernel (interpreter) against the reference
# --------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("page", [4, 16])  # 16: tiles inside one page (one lookup per tile)
def test_groups_of_one_to_rows_rows(page):
    ctx, q = [5, 16, 30, 0], [1, 2, 3, 4]  # groups of 1, 2, 3 and 4 rows (ROWS = 4)
    args, kv_scale = make_rows(ctx, q, heads=3, page=page, seed=1)
    for splits in (1, 2, 3):
        check(args, kv_scale, groups_of(ctx, q, 4), splits)


@needs_triton
@pytest.mark.parametrize("splits", [2, 4, 9])
def test_groups_straddle_split_boundaries(splits):
    # A group's partition is set by its longest row: its shorter rows end inside (or before) the
    # last splits, which they must write as empty and merge as nothing.
    ctx, q = [31, 14, 62], [4, 4, 3]
    args, kv_scale = make_rows(ctx, q, heads=5, page=8, seed=2)
    check(args, kv_scale, groups_of(ctx, q, 4), splits)


@needs_triton
@pytest.mark.parametrize("rows", [4, 8])
def test_mixed_batch_with_padding_rows(rows):
    """A decode row, a group of 5 (two groups under ROWS 4), a group of 3, then graph padding rows
    on the scratch block; 20 heads: two head tiles."""
    ctx, q = [40, 23, 9], [1, 5, 3]
    args, kv_scale = make_rows(ctx, q, heads=20, page=8, pad=3, seed=3)
    cfg = {"ROWS": rows}
    check(args, kv_scale, groups_of(ctx, q, rows, pad=3), 3, config=cfg)


@needs_triton
def test_fp8_cache():  # the dots run in fp16 (q cast by the wrapper)
    ctx, q = [33, 0], [5, 3]
    args, kv_scale = make_rows(ctx, q, heads=4, page=16, q_dtype=torch.float16, kv_dtype=torch.float8_e4m3fn)
    check(args, kv_scale, groups_of(ctx, q, 4), 2, tol=1e-2)


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the per-row form's NaN reads, in numpy
def test_rows_read_their_group_leaders_block_table():
    """Non-leading rows' own tables point at a NaN block: the grouped form never reads them (the
    group's KV tiles come through its first row's table), the per-row form does."""
    ctx, q = [20], [4]
    args, kv_scale = make_rows(ctx, q, heads=3, page=8, seed=4)
    o_ref = mla_decode_ref(*args)[0]
    cache, table = args[2].clone(), args[3].clone()
    cache[-1] = float("nan")  # the scratch block: nothing reads it here
    table[1:] = cache.shape[0] - 1
    bad = (args[0], args[1], cache, table, args[4], args[5])
    o = mla_decode_triton(*bad, num_splits=2, row_groups=groups_of(ctx, q, 4))
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    assert torch.isnan(mla_decode_triton(*bad, num_splits=2)[1:]).any()


@needs_triton
def test_split_partials_merge_per_row_in_head_bmm():
    """merge=False: the SplitKV partials carry each row's group length, so that merge_ref and
    head_bmm's merging load use the splits the group wrote. fp16: the interpreter's bf16 dots
    need tests/kernels' conftest patch."""
    ctx, q = [45, 3], [4, 2]
    args, _ = make_rows(ctx, q, heads=4, page=8, q_dtype=torch.float16, kv_dtype=torch.float16, seed=5)
    groups = groups_of(ctx, q, 4)
    o_ref = mla_decode_ref(*args)[0]
    parts = mla_decode_triton(*args, num_splits=4, merge=False, row_groups=groups)
    assert isinstance(parts, SplitKV) and parts.seq_lens.tolist() == groups[1].tolist()
    torch.testing.assert_close(merge_ref(parts).float(), o_ref.float(), rtol=2e-2, atol=2e-2)
    w = torch.randn(4, KV_LORA, 128, generator=torch.Generator().manual_seed(6)).to(torch.float16)
    out = head_bmm(parts, w, use_triton=True)  # [T, H, 128]
    ref = head_bmm_ref(o_ref, w)
    assert ((out.double() - ref.double()).norm() / ref.double().norm()).item() < 2e-2


def test_reference_path_ignores_row_groups():
    ctx, q = [10], [3]
    args, _ = make_rows(ctx, q, heads=2, page=4)
    o = mla_decode(*args, use_triton=False, row_groups=groups_of(ctx, q, 4))
    torch.testing.assert_close(o, mla_decode_ref(*args)[0])


# --------------------------------------------------------------------------------------------
# The runner: flattened extends through the static step, grouping on and off
# --------------------------------------------------------------------------------------------


def test_static_inputs_carry_the_row_groups(artifact):
    """DecodeInputs writes the group table beside seq_lens; batch(grouped=True) hands it over."""
    from mlac.runtime.engine.engine import Engine
    from mlac.runtime.kvcache.paged import PagedKVCache
    from mlac.runtime.step import Step
    from mlac.runtime.worker.graphs import DecodeInputs

    cfg = Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False).config
    cache = PagedKVCache(cfg, num_blocks=10, block_size=4, dtype=torch.float32)
    inputs = DecodeInputs(max_bs=8, max_blocks=5, cache=cache, device=torch.device("cpu"), group_rows=2)
    inputs.fill(Step.of([[7, 8, 9], [4]], [5, 0], [[3, 6], [2]]), 8)
    _, batch = inputs.batch(8, grouped=True)
    assert batch.seq_lens.tolist() == [6, 7, 8, 1, 1, 1, 1, 1]
    assert batch.row_groups.tolist() == [[2, 0, 1, 1, 1, 1, 1, 1], [7, 7, 8, 1, 1, 1, 1, 1]]
    assert inputs.batch(8)[1].row_groups is None


@needs_triton
def test_flattened_extends_give_the_same_tokens_grouped_and_per_row(artifact, monkeypatch):
    """Prefix-cache suffixes and prompts run as flattened rows of DecodeGraphs' static step, the
    decode attention on the Triton path (interpreter): same greedy tokens with row groups on and
    off, and the grouped form did run."""
    import mlac.runtime.model.attention as forms
    from mlac.runtime.engine.engine import Engine
    from mlac.runtime.engine.params import SamplingParams
    from mlac.runtime.worker.graphs import DecodeGraphs

    seen: list[bool] = []

    def triton_attention(*args, row_groups=None, **kwargs):
        seen.append(row_groups is not None)
        return mla_decode(*args, row_groups=row_groups, use_triton=True, **kwargs)

    monkeypatch.setattr(forms, "mla_decode", triton_attention)
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 200, (19,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 200, (2 + 3 * i,), generator=g).tolist() for i in range(3)]
    params = SamplingParams(max_tokens=3, ignore_eos=True)

    def run(grouped: bool) -> list[list[int]]:
        engine = Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False, num_blocks=64)
        buckets = [1, 2, 4, 8, 16, 32]
        graphs = DecodeGraphs(
            engine.runner.model, engine.cache, buckets, engine.max_context, row_groups=grouped
        )
        engine.runner.graphs = graphs
        first = engine.generate(prompts[:1], params)[0].token_ids  # fills the prefix cache
        return [first] + [c.token_ids for c in engine.generate(prompts[1:], params)]

    per_row = run(grouped=False)
    assert seen and not any(seen)
    seen.clear()
    assert run(grouped=True) == per_row
    assert any(seen) and not all(seen), "no step ran grouped, or pure decode did"


def test_grouped_buckets_are_few_and_hold_every_step():
    """Only the powers of two from 8 and the largest bucket are captured grouped (start-up time);
    a grouped step replays the smallest of them that holds its rows."""
    from mlac.core.plan import decode_buckets
    from mlac.runtime.worker.graphs import grouped_buckets

    ladder = decode_buckets(256)
    assert grouped_buckets(ladder) == [8, 16, 32, 64, 128, 256]
    assert grouped_buckets([1, 2, 4, 6]) == [6] and grouped_buckets([1]) == []
    assert grouped_buckets([1, 2, 4, 8, 16, 24]) == [8, 16, 24]
