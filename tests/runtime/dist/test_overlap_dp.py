"""Overlap scheduling under DP attention (overlap.py, dp_attention.py, dp_graphs.py): rank 0 launches
decode step N + 1 on every rank, its token ids broadcast from rank 0's device in step order and laid
out by rank on each rank, before it reads step N's; each sequence's next block comes from its own
rank's pool.

CPU, float32, tiny-v3 compiled `--tp 2 --dp-attention`, two processes over gloo. Every run is
compared with the same requests through the same engine without overlap (test_overlap.run: tokens,
finish reasons, texts, logprobs; every KV block of both ranks' pools accounted for after each step),
and with the one-rank engine; each test checks that the steady state was reached through fed steps
whose rows sat on both ranks.
"""

from __future__ import annotations

import pytest
import torch
from test_overlap import admissions_and_aborts, both_fed, matches_one_rank, prompts

from mlac.compiler.pipeline import compile_checkpoint
from mlac.core.artifact import CompileOptions
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.worker import distributed as distributed_mod

CACHE = {"num_blocks": 48, "block_size": 16}  # per rank: a load of 8 sequences needs both ranks


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, checkpoint):
    out = tmp_path_factory.mktemp("overlap-dp") / "tiny-v3-tp2-dp"
    compile_checkpoint(checkpoint("tiny-v3"), out, CompileOptions(tp=2, dp_attention=True, accuracy_check=False))
    return out


@pytest.fixture(scope="module")
def engine(dp2):
    with Engine.from_artifact(dp2, dtype=torch.float32, verify=False, **CACHE) as e:
        assert e.runner.dp is not None and len(e.runner.kv_pools) == 2
        yield e


@pytest.fixture
def fed(monkeypatch) -> list[tuple[int, ...]]:
    """The ranks of the rows of every step rank 0 sent as a fed step (ids from its device)."""
    seen: list[tuple[int, ...]] = []
    send = distributed_mod.send_fed

    def spy(link, ids, step):
        seen.append(step.ranks)
        return send(link, ids, step)

    monkeypatch.setattr(distributed_mod, "send_fed", spy)
    return seen


def both(engine: Engine, reqs, steady: list[bool], fed: list, **kw):
    """test_overlap.both_fed, and some fed step had rows on both ranks."""
    plain = both_fed(engine, reqs, steady, fed, **kw)
    assert any(set(ranks) == {0, 1} for ranks in fed), fed
    return plain


@pytest.mark.parametrize("batch", [2, 5, 8])
def test_greedy_tokens_are_those_without_overlap(engine, steady, fed, batch):
    """Requests of different lengths on both ranks finish at different steps: the fed steps shrink,
    and a rank may run out of rows while the other decodes on."""
    reqs = [(p, SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True)) for i, p in enumerate(prompts(batch))]
    out = both(engine, reqs, steady, fed, prefix_cache=False)
    assert [len(o[0]) for o in out] == [4 + 3 * i for i in range(batch)]


def test_the_one_rank_tokens(engine, artifact, steady, fed):
    one = Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False, num_blocks=96)
    reqs = [(p, SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)) for p in prompts(4)]
    matches_one_rank(engine, one, reqs, steady, fed)


def test_admissions_aborts_and_the_prefix_cache_mid_run(engine, steady, fed):
    admissions_and_aborts(engine, lambda reqs, **kw: both(engine, reqs, steady, fed, **kw), steady)


def test_seeded_sampling_is_that_without_overlap(engine, steady, fed):
    reqs = [(p, SamplingParams(max_tokens=8 + i, temperature=0.9, top_k=30, seed=100 + i, ignore_eos=True))
            for i, p in enumerate(prompts(4))]  # fmt: skip
    reqs.append((prompts(5)[4], SamplingParams(max_tokens=10, ignore_eos=True)))  # greedy with them
    both(engine, reqs, steady, fed, prefix_cache=False)


def test_a_full_rank_stops_the_steady_state_not_the_run(engine, steady, fed):
    """Requests that need more blocks than both ranks' pools hold: a sequence whose rank has no block
    for its next token ends the steady state (the scheduler waits or preempts), and the results stay
    those without overlap."""
    ps = [p * 12 for p in prompts(8, start=30)]
    reqs = [(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in ps]
    blocks = sum(-(-(len(p) + 40) // CACHE["block_size"]) for p in ps)
    assert blocks > 2 * CACHE["num_blocks"], blocks
    both(engine, reqs, steady, fed, prefix_cache=False)
