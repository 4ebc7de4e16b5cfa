"""Sampling beyond the basics: min_p, logprobs with top alternatives, per-request seeds inside a
batch, and the validation messages (sampling.py)."""

from __future__ import annotations

import math

import pytest
import torch

from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.params import MAX_LOGPROBS, InvalidSamplingParams, SamplingParams
from mlac.runtime.engine.sampling import apply_min_p, make_generator, sample, token_logprobs


@pytest.mark.parametrize(
    "kwargs, param, says",
    [
        ({"min_p": 1.5}, "min_p", "in [0, 1]"),
        ({"min_p": -0.1}, "min_p", "in [0, 1]"),
        ({"temperature": math.nan}, "temperature", ">= 0"),
        ({"temperature": math.inf}, "temperature", ">= 0"),
        ({"top_p": True}, "top_p", "in (0, 1]"),
        ({"max_tokens": 2.5}, "max_tokens", "an integer"),
        ({"max_tokens": -3}, "max_tokens", ">= 1"),
        ({"top_k": 1.0}, "top_k", "an integer"),
        ({"seed": "7"}, "seed", "an integer"),
        ({"seed": 2**64}, "seed", "an integer"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids", "non-negative"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs", f"in [0, {MAX_LOGPROBS}]"),
        ({"logprobs": -1}, "logprobs", "in [0,"),
    ],
)
def test_invalid_parameters_name_the_parameter(kwargs, param, says):
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param
    assert f"sampling parameter {param}=" in str(e.value) and says in str(e.value)


def test_valid_extremes_are_accepted():
    SamplingParams(min_p=0.0, logprobs=0, seed=-(2**63), temperature=0.0, top_p=1.0)
    SamplingParams(min_p=1.0, logprobs=MAX_LOGPROBS, seed=2**64 - 1, stop=("a", "bc"), stop_token_ids=[0])


def test_min_p_keeps_tokens_near_the_most_likely():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    out = apply_min_p(probs.log(), torch.tensor([0.5, 0.9]))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]  # >= 0.5 * 0.5
    assert torch.isfinite(out[1]).all()


def test_min_p_restricts_what_is_sampled():
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0, -1.0]])
    g = make_generator(0)
    seen = {sample(logits, [SamplingParams(temperature=1.0, min_p=0.5)], [g]).item() for _ in range(200)}
    assert seen == {0, 1}


def test_seeded_rows_ignore_their_neighbours_filters():
    logits = torch.randn(4, 200, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=11)
    others = [
        SamplingParams(temperature=1.3, min_p=0.2),
        SamplingParams(),
        SamplingParams(temperature=0.5, top_k=3),
    ]
    alone = [sample(logits[1:2], [p], [g]).item() for g in [make_generator(11)] for _ in range(5)]
    g = make_generator(11)
    batched = [sample(logits, [others[0], p, *others[1:]], [None, g, None, None])[1].item() for _ in range(5)]
    assert batched == alone


def test_token_logprobs_shapes_and_values():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    tokens = torch.tensor([4, 7, 9])
    out = token_logprobs(logits, tokens, [2, None, 0])
    lsm = torch.log_softmax(logits, dim=-1)
    assert out[1] is None
    assert out[0].token_id == 4 and out[0].logprob == pytest.approx(lsm[0, 4].item())
    top = lsm[0].topk(2)
    assert [t for t, _ in out[0].top] == top.indices.tolist()
    assert [v for _, v in out[0].top] == pytest.approx(top.values.tolist())
    assert out[2].top == () and out[2].logprob == pytest.approx(lsm[2, 9].item())
    assert token_logprobs(logits, tokens, [None] * 3) == [None] * 3


@pytest.fixture(scope="module")
def engine(artifact) -> Engine:
    return Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False)


def test_same_seed_same_output_inside_a_batch(engine):
    prompt = "Seeds make sampling repeatable"
    params = [
        SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=s, ignore_eos=True) for s in (5, 5, 6)
    ]
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    out = engine.generate(
        [prompt, prompt, "another prompt", prompt], [params[0], params[1], greedy, params[2]]
    )
    alone = engine.generate(prompt, params[0])
    assert out[0].token_ids == out[1].token_ids == alone.token_ids
    assert out[3].token_ids != out[0].token_ids


def test_stop_token_ids_max_tokens_and_ignore_eos_through_the_scheduler(engine):
    ids = engine.generate("Stop here", max_tokens=8, ignore_eos=True).token_ids
    out = engine.generate(
        ["Stop here", "Stop here"],
        [
            SamplingParams(max_tokens=8, stop_token_ids=[ids[2]], ignore_eos=True),
            SamplingParams(max_tokens=3, ignore_eos=True),
        ],
    )
    k = ids.index(ids[2])
    assert (out[0].finish_reason, out[0].token_ids) == ("stop", ids[: k + 1])
    assert (out[1].finish_reason, out[1].token_ids) == ("length", ids[:3])
