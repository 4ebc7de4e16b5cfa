"""Overlap scheduling over a multi-rank artifact (overlap.py, step_link.FedStep): rank 0 launches
step N + 1 on every rank, its token ids broadcast from rank 0's device, before it reads step N's.

CPU, float32, tiny-v3 compiled at tp=2, two processes over gloo, the step messages through the
shared-memory channel (one node) and over gloo (as between nodes). Every run is compared with the
same requests through the same tp-2 engine without overlap (test_overlap.run: tokens, finish
reasons, texts; every KV block accounted for); each test checks that the steady state was reached
and that steps really went to the other rank as fed steps.
"""

from __future__ import annotations

import pytest
import torch
from test_overlap import admissions_and_aborts, both_fed, matches_one_rank, prompts

from mlac.compiler.pipeline import compile_checkpoint
from mlac.core.artifact import CompileOptions
from mlac.runtime.dist.step_link import FedStep, decode, encode_step
from mlac.runtime.dist.world import LaunchSpec
from mlac.runtime.engine import overlap as overlap_mod
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.overlap import can_overlap
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.engine.scheduler import SchedulerConfig
from mlac.runtime.step import Step
from mlac.runtime.worker import distributed as distributed_mod
from mlac.runtime.worker.distributed import DistributedRunner

CACHE = {"num_blocks": 160, "block_size": 16}


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, checkpoint):
    out = tmp_path_factory.mktemp("overlap-mr") / "tiny-v3-tp2"
    compile_checkpoint(checkpoint("tiny-v3"), out, CompileOptions(tp=2, accuracy_check=False))
    return out


@pytest.fixture(scope="module", params=["shm", "gloo"])
def engine(request, tp2):
    """The tp-2 engine (one multi-rank runner per process at a time: pytest finishes the tests of
    one param before it starts the next): its steps through the shared-memory channel, or over
    gloo as between nodes (--nnodes)."""
    launch = LaunchSpec(step_channel=request.param)
    with Engine.from_artifact(tp2, dtype=torch.float32, verify=False, launch=launch, **CACHE) as e:
        assert (e.runner.group.control.channel is None) == (request.param == "gloo")
        yield e


@pytest.fixture
def fed(monkeypatch) -> list[int]:
    """The batch size of every step rank 0 sent as a fed step (ids from its device)."""
    sizes: list[int] = []
    send = distributed_mod.send_fed

    def spy(link, ids, step):
        sizes.append(len(step.token_ids))
        return send(link, ids, step)

    monkeypatch.setattr(distributed_mod, "send_fed", spy)
    return sizes


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_tokens_are_those_without_overlap(engine, steady, fed, batch):
    """Requests of different lengths finish at different steps: the fed steps shrink."""
    reqs = [(p, SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True)) for i, p in enumerate(prompts(batch))]
    out = both_fed(engine, reqs, steady, fed)
    assert [len(o[0]) for o in out] == [4 + 3 * i for i in range(batch)]
    if batch > 1:
        assert len(set(fed)) > 1, "every fed step had the same rows"


def test_the_one_rank_tokens(engine, artifact, steady, fed):
    """The tp-2 tokens with overlap are the 1-rank engine's (the ids reached rank 1 intact)."""
    one = Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False, **CACHE)
    reqs = [(p, SamplingParams(max_tokens=10, ignore_eos=True)) for p in prompts(3)]
    matches_one_rank(engine, one, reqs, steady, fed)


def test_admissions_aborts_and_stops_mid_run(engine, steady, fed):
    admissions_and_aborts(engine, lambda reqs, **kw: both_fed(engine, reqs, steady, fed, **kw), steady)


def test_stop_tokens_and_logprobs(engine, steady, fed):
    greedy = engine.generate(prompts(3)[1], max_tokens=16, ignore_eos=True).token_ids
    reqs = [
        (prompts(3)[1], SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=[greedy[6]])),
        (prompts(3)[2], SamplingParams(max_tokens=9, ignore_eos=True, logprobs=3)),
        (prompts(3)[0], SamplingParams(max_tokens=14, ignore_eos=True)),
    ]
    out = both_fed(engine, reqs, steady, fed)
    assert out[0][1] == "stop" and out[0][0] == greedy[: greedy.index(greedy[6]) + 1]
    assert len(out[1][3]) == 9 and all(len(lp.top) == 3 for lp in out[1][3])


def test_seeded_sampling_is_that_without_overlap(engine, steady, fed):
    """Only rank 0 samples: seeded rows give the tokens they give without overlap."""
    reqs = [
        (
            p,
            SamplingParams(
                max_tokens=8 + i, temperature=0.9, top_p=0.9, top_k=30, seed=100 + i, ignore_eos=True
            ),
        )
        for i, p in enumerate(prompts(4))
    ]
    reqs.append((prompts(5)[4], SamplingParams(max_tokens=10, ignore_eos=True)))  # greedy with them
    both_fed(engine, reqs, steady, fed, prefix_cache=False)


def test_on_for_multi_rank_unless_disabled(engine, fed):
    """--disable-overlap-schedule (overlap=False) turns it off for multi-rank too; CPU default off;
    DP attention overlaps too (test_overlap_dp.py)."""
    assert isinstance(engine.runner, DistributedRunner) and can_overlap(engine.runner)
    assert engine.scheduler(SchedulerConfig(overlap=True)).overlap is not None
    assert engine.scheduler(SchedulerConfig(overlap=False)).overlap is None
    assert engine.scheduler(SchedulerConfig()).overlap is None  # CPU: nothing to overlap

    class DPRank0:  # a DistributedRunner under DP attention
        dp = object()

        def run_decode(self, step, ids=None): ...

    assert can_overlap(DPRank0())
    engine.generate(prompts(2)[1], max_tokens=6, ignore_eos=True)  # the default: no fed step
    assert not fed


def test_a_fed_step_message_round_trips():
    step = Step.of([[0], [0], [0]], [4, 17, 2], [[3], [5, 6], [9]])
    assert decode(encode_step(step, fed=True)) == FedStep(step)
    assert decode(encode_step(step)) == step


def test_overlap_is_on_by_default_on_cuda_for_one_rank_or_several():
    """Where the config does not say, a runner on CUDA overlaps, one rank or a group of ranks (it
    ran on 2xH200: tests/runtime/dist/test_overlap_multirank_gpu.py); CPU does not."""
    import types

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert overlap_mod.on_by_default(types.SimpleNamespace(device=cuda))
    assert overlap_mod.on_by_default(types.SimpleNamespace(device=cuda, group=object()))
    assert not overlap_mod.on_by_default(types.SimpleNamespace(device=cpu))
