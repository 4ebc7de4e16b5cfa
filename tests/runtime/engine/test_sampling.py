"""SamplingParams validation, top-k / top-p masks, greedy and seeded sampling."""

from __future__ import annotations

import pytest
import torch

import mlac
from mlac.core.errors import MlacError
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.engine.sampling import apply_top_k, apply_top_p, make_generator, sample


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
    ],
)
def test_out_of_range_parameters_are_refused(kwargs, field):
    with pytest.raises(MlacError, match=field) as e:
        SamplingParams(**kwargs)
    assert isinstance(e.value, ValueError)


def test_params_normalize_and_export():
    p = SamplingParams(stop="###", stop_token_ids=[5])
    assert p.stop == ("###",) and p.stop_token_ids == (5,)
    assert SamplingParams().greedy and not SamplingParams(temperature=0.7).greedy
    assert mlac.SamplingParams is SamplingParams


def test_top_k_mask_keeps_the_k_largest():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 2.5], [5.0, 4.0, 3.0, 2.0, 1.0]])
    out = apply_top_k(logits, torch.tensor([2, 0]))
    assert torch.isfinite(out[0]).tolist() == [False, True, False, False, True]
    assert torch.isfinite(out[1]).all()  # 0 = off
    assert torch.equal(out[0, [1, 4]], logits[0, [1, 4]])


def test_top_p_mask_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().expand(4, 4).clone()
    out = apply_top_p(logits, torch.tensor([0.7, 0.5, 0.81, 1.0]))
    kept = torch.isfinite(out)
    assert kept[0].tolist() == [False, True, False, True]  # 0.5 + 0.3 >= 0.7
    assert kept[1].tolist() == [False, True, False, False]  # the top token alone reaches 0.5
    assert kept[2].tolist() == [False, True, True, True]
    assert kept[3].all()


def test_greedy_is_argmax_and_ignores_generators():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    got = sample(logits, [SamplingParams()] * 3, [None, make_generator(1), None])
    assert torch.equal(got, logits.argmax(-1))


def test_same_seed_same_tokens_different_seed_different_tokens():
    logits = torch.zeros(1, 1000)  # uniform: every draw is up to the generator

    def draws(seed: int) -> list[int]:
        g = make_generator(seed)
        return [sample(logits, [SamplingParams(temperature=1.0)], [g]).item() for _ in range(10)]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)


def test_seeded_row_does_not_depend_on_its_batch():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, seed=7)
    alone = sample(logits[1:2], [p], [make_generator(7)])
    batched = sample(
        logits, [SamplingParams(), p, SamplingParams(temperature=2.0)], [None, make_generator(7), None]
    )
    assert batched[1] == alone[0]
    assert batched[0] == logits[0].argmax()


def test_sampling_respects_top_k_and_top_p():
    logits = torch.tensor([[1.0, 0.9, 0.8, 0.7, 0.6, 0.5]])
    g = make_generator(0)
    seen_k = {sample(logits, [SamplingParams(temperature=1.0, top_k=2)], [g]).item() for _ in range(200)}
    assert seen_k == {0, 1}
    peaked = torch.tensor([[5.0, 4.0, 0.0, 0.0]])  # probs ~ 0.72, 0.27, 0.005, 0.005
    seen_p = {sample(peaked, [SamplingParams(temperature=1.0, top_p=0.9)], [g]).item() for _ in range(200)}
    assert seen_p == {0, 1}
    low_temp = {sample(logits, [SamplingParams(temperature=1e-4)], [g]).item() for _ in range(20)}
    assert low_temp == {0}
