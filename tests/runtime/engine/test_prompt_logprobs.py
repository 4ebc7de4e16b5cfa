"""Prompt logprobs (prompt_logprobs.py): each prompt token's logprob, rank and top alternatives
equal those of the teacher-forced logits (Engine.score), whatever the chunking of the prefill and
whatever the prefix cache holds; they travel with the first delta; refused under speculation."""

from __future__ import annotations

import pytest
import torch

from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.params import InvalidSamplingParams, SamplingParams
from mlac.runtime.engine.prompt_logprobs import check_prompt_logprobs
from mlac.runtime.engine.scheduler import SchedulerConfig

TEXT = (
    "The library was quiet except for the sound of pages turning. On the long table in the middle of "
    "the room there were maps of old cities, a box of letters tied with string"
)


@pytest.fixture(scope="module")
def engine(artifact) -> Engine:
    return Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False, num_blocks=160)


def run(engine: Engine, prompt: list[int], params: SamplingParams, **config):
    sched = engine.scheduler(SchedulerConfig(**config))
    seq = engine.new_sequence(prompt, params)
    sched.add(seq)
    while sched.has_unfinished:
        sched.step()
    return seq


@pytest.mark.parametrize("chunk", [2048, 5])
def test_prompt_logprobs_are_the_teacher_forced_ones(engine, chunk):
    prompt = engine.encode_prompt(TEXT)
    assert len(prompt) > 2 * 16  # two full blocks: the prefix cache could serve them
    run(engine, prompt, SamplingParams(max_tokens=1))  # caches the prompt's full blocks
    seq = run(engine, prompt, SamplingParams(max_tokens=2, prompt_logprobs=3), chunked_prefill_size=chunk)
    assert seq.num_cached_tokens == 0  # prefilled whole: cached tokens have no logits
    lp = torch.log_softmax(engine.score(prompt), dim=-1)  # [T, V]
    got = seq.prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        row, x = lp[i - 1], got[i]
        assert x.token_id == prompt[i]
        assert x.logprob == pytest.approx(row[prompt[i]].item(), abs=1e-4)
        assert x.rank == int((row > row[prompt[i]]).sum()) + 1
        assert [t for t, _ in x.top] == row.topk(3).indices.tolist()
    plain = engine.generate(prompt, SamplingParams(max_tokens=2))
    assert seq.output_ids == plain.token_ids  # sampling is unchanged
    assert plain.prompt_logprobs is None
    api = engine.generate(prompt, max_tokens=2, prompt_logprobs=3).prompt_logprobs  # the Python API
    assert api[0] is None
    assert [(x.token_id, x.rank) for x in api[1:]] == [(x.token_id, x.rank) for x in got[1:]]
    assert [x.logprob for x in api[1:]] == pytest.approx([x.logprob for x in got[1:]], abs=1e-4)


def test_they_come_with_the_first_delta(engine):
    deltas = list(engine.stream(engine.encode_prompt("Hello there"), max_tokens=3, prompt_logprobs=0,
                                ignore_eos=True))  # fmt: skip
    assert deltas[0].prompt_logprobs is not None and len(deltas[0].prompt_logprobs) == deltas[0].prompt_tokens
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    assert deltas[0].prompt_logprobs[1].top == ()  # 0 alternatives asked


def test_not_under_speculative_decoding():
    check_prompt_logprobs(SamplingParams(prompt_logprobs=2), 0)
    check_prompt_logprobs(SamplingParams(), 3)
    with pytest.raises(InvalidSamplingParams, match="not with speculative decoding") as e:
        check_prompt_logprobs(SamplingParams(prompt_logprobs=2), 3)
    assert e.value.param == "prompt_logprobs"
