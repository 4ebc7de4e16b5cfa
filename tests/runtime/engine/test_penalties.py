"""Penalties, logit_bias and min_tokens (penalties.py): the batched device ops against a per-row
reference written from vLLM's definitions; through the engine, greedy decoding under penalties
equals a reference loop over teacher-forced logits (Engine.score), with and without overlap
scheduling; the validation of each field names it."""

from __future__ import annotations

import math

import pytest
import torch

from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.params import InvalidSamplingParams, SamplingParams
from mlac.runtime.engine.penalties import Penalties, PenaltyStep
from mlac.runtime.engine.scheduler import SchedulerConfig

EOS = (1,)


def reference(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row [V] under p, token by token as vLLM defines it: bias, min_tokens, repetition,
    frequency, presence."""
    x = logits.clone()
    for t, b in p.logit_bias:
        x[t] += b
    if len(output) < p.min_tokens:
        for t in {*p.stop_token_ids, *(() if p.ignore_eos else EOS)}:
            x[t] = -math.inf
    for t in set(prompt) | set(output):
        if p.repetition_penalty != 1:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


CASES = [
    SamplingParams(max_tokens=8, presence_penalty=1.5),
    SamplingParams(max_tokens=8, frequency_penalty=-0.7),
    SamplingParams(max_tokens=8, repetition_penalty=1.3),
    SamplingParams(max_tokens=8, repetition_penalty=0.8, frequency_penalty=0.4, presence_penalty=-0.2),
    SamplingParams(max_tokens=8, logit_bias={3: 5.0, 7: -100}),
    SamplingParams(max_tokens=8, min_tokens=4, stop_token_ids=[9]),
    SamplingParams(max_tokens=8, min_tokens=4, ignore_eos=True, stop_token_ids=[9]),
    None,  # a row without any: untouched
]


def test_a_step_matches_the_reference_row_by_row():
    torch.manual_seed(0)
    vocab, prompts = 16, [[2, 5, 5, 11], [4], [6, 6], [3, 1], [8, 9, 2], [5], [1, 2], [7]]
    states = [None if p is None else Penalties.of(p, pr, EOS) for p, pr in zip(CASES, prompts, strict=True)]
    outputs: list[list[int]] = [[] for _ in CASES]
    for _ in range(6):  # several steps: the counts grow on the device
        logits = torch.randn(len(CASES), vocab) * 3
        step = PenaltyStep.of(states, logits)
        got = step.apply(logits)
        for i, p in enumerate(CASES):
            want = logits[i] if p is None else reference(logits[i], p, prompts[i], outputs[i])
            torch.testing.assert_close(got[i], want)
        tokens = torch.randint(0, vocab, (len(CASES),))
        step.count(tokens)
        for out, t in zip(outputs, tokens.tolist(), strict=True):
            out.append(t)
    assert [None if st is None else st.counts[5].item() for st in states] == [
        None if p is None else float(out.count(5)) for p, out in zip(CASES, outputs, strict=True)
    ]


def test_no_penalized_row_no_step_and_logits_kept():
    logits = torch.randn(2, 8)
    assert PenaltyStep.of([None, None], logits) is None
    assert Penalties.of(SamplingParams(repetition_penalty=1.0, logit_bias={}), [1], EOS) is None
    st = Penalties.of(SamplingParams(presence_penalty=1.0), [1], EOS)
    before = logits.clone()
    PenaltyStep.of([None, st], logits).apply(logits)
    assert torch.equal(logits, before)  # logprobs read the model's logits


@pytest.mark.parametrize(
    "kwargs, param",
    [({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
     ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": math.nan}, "repetition_penalty"),
     ({"logit_bias": {3: 101}}, "logit_bias"), ({"logit_bias": {-1: 1}}, "logit_bias"),
     ({"min_tokens": 17}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
     ({"prompt_logprobs": 21}, "prompt_logprobs")],
)  # fmt: skip
def test_out_of_range_values_name_their_field(kwargs, param):
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams(max_tokens=16, **kwargs)
    assert e.value.param == param


@pytest.fixture(scope="module")
def engine(artifact) -> Engine:
    return Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False, num_blocks=160)


def greedy_reference(engine: Engine, prompt: list[int], p: SamplingParams) -> list[int]:
    """Greedy tokens under p from teacher-forced logits: the last row of score(prompt + output)."""
    out: list[int] = []
    eos = set(engine.config.eos_token_ids)
    while len(out) < p.max_tokens:
        row = engine.score(prompt + out)[-1]
        row = row.clone()
        for t, b in p.logit_bias:
            row[t] += b
        if len(out) < p.min_tokens:
            row[list(eos | set(p.stop_token_ids))] = -math.inf
        for t in set(prompt) | set(out):
            if p.repetition_penalty != 1:
                row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        for t in set(out):
            row[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
        t = int(row.argmax())
        out.append(t)
        if t in eos:
            break
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_under_penalties_follows_the_reference(engine, overlap, steady):
    prompt = engine.encode_prompt("The morning train left the station")
    bias = {17: 10.0}  # enough for token 17 to win most steps: each penalty must then push it back
    params = [
        SamplingParams(max_tokens=10, logit_bias=bias),
        SamplingParams(max_tokens=10, logit_bias=bias, repetition_penalty=1.8),
        SamplingParams(max_tokens=10, logit_bias=bias, frequency_penalty=2.0),
        SamplingParams(max_tokens=10, logit_bias=bias, presence_penalty=2.0),
        SamplingParams(max_tokens=10, logit_bias={engine.config.eos_token_ids[0]: 100.0}, min_tokens=3),
        SamplingParams(max_tokens=10),  # a plain row in the same batch
    ]
    sched = engine.scheduler(SchedulerConfig(overlap=overlap))
    seqs = [engine.new_sequence(prompt, p) for p in params]
    for s in seqs:
        sched.add(s)
    while sched.has_unfinished:
        sched.step()
    got = [s.output_ids for s in seqs]
    assert got == [greedy_reference(engine, prompt, p) for p in params]
    assert got[0].count(17) >= 8  # the bias wins
    assert all(got[i].count(17) < got[0].count(17) for i in (1, 2, 3))  # each penalty pushes it back
    assert len(got[4]) == 4 and got[4][-1] in engine.config.eos_token_ids  # eos held back 3 tokens
    assert seqs[4].finish_reason == "stop"
    assert got[5] == engine.generate(prompt, SamplingParams(max_tokens=10)).token_ids
    assert any(steady) == overlap  # overlap's steady state sampled penalized rows on the device


def test_seeded_sampling_under_penalties_is_the_same_with_overlap(engine, steady):
    prompt = engine.encode_prompt("A compiler reads a program")
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=5, frequency_penalty=1.0, repetition_penalty=1.2)

    def run(overlap: bool) -> list[int]:
        sched = engine.scheduler(SchedulerConfig(overlap=overlap))
        seq = engine.new_sequence(prompt, p)
        sched.add(seq)
        while sched.has_unfinished:
            sched.step()
        return seq.output_ids

    assert run(True) == run(False) and any(steady)


def test_min_tokens_holds_stop_strings_back(engine):
    prompt = engine.encode_prompt("Numbers and lists: one, two")
    free = engine.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    stop = free.text[:1]  # stops at once without min_tokens
    assert (
        engine.generate(prompt, SamplingParams(max_tokens=12, stop=[stop], ignore_eos=True)).completion_tokens
        == 1
    )
    held = engine.generate(prompt, SamplingParams(max_tokens=12, stop=[stop], ignore_eos=True, min_tokens=5))
    assert held.completion_tokens >= 5


def test_a_bias_outside_the_vocabulary_is_refused(engine):
    with pytest.raises(InvalidSamplingParams, match="logit_bias: token id") as e:
        engine.new_sequence([3, 4], SamplingParams(logit_bias={engine.config.vocab_size: 1.0}))
    assert e.value.param == "logit_bias"
