"""The sampler runs its rows together (sampling.filter_rows, draw): the same tokens as filtering each
row with apply_top_k / apply_top_p and drawing it with torch.multinomial from its own generator, a
number of operations that does not grow with the batch, and a bad row refused by name."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mlac.kernels import top_p
from mlac.runtime.engine import sampling
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.engine.sampling import apply_min_p, apply_top_k, apply_top_p, draw, filter_rows, sample

V = 1000


def per_row_reference(logits, params, generators) -> list[int]:
    """Each row alone: temperature, apply_top_k, apply_top_p, min-p, softmax, torch.multinomial."""
    out = []
    for row, p, g in zip(logits, params, generators, strict=True):
        if p.greedy:
            out.append(int(row.argmax()))
            continue
        x = row[None].float() / p.temperature
        x = apply_top_k(x, torch.tensor([p.top_k], device=x.device))
        if p.top_p < 1:  # 1 is off (apply_top_p would drop tail tokens whose mass before rounds to 1)
            x = apply_top_p(x, torch.tensor([p.top_p], device=x.device))
        if p.min_p > 0:
            x = apply_min_p(x, torch.tensor([p.min_p], device=x.device))
        out.append(int(torch.multinomial(x.softmax(dim=-1)[0], 1, generator=g)))
    return out


# (temperature, top_k, top_p, min_p): OpenAI's defaults, each filter, their mixes, a k past V
MIX = [(1.0, 0, 1.0, 0.0), (0.7, 50, 1.0, 0.0), (0.9, 0, 0.9, 0.0), (1.2, 20, 0.8, 0.0), (0.0, 0, 1.0, 0.0),
       (1.0, 10**20, 0.95, 0.0), (0.8, 5, 1.0, 0.1), (1.0, 0, 1.0, 0.05)]  # fmt: skip


@pytest.mark.parametrize("rows", [[0], [1], [2], [3], [5], list(range(8)), [1, 3, 6], [0, 2, 7]])
@pytest.mark.parametrize("candidates", [1024, 8])  # 8: a top_k of 20 or 50 sorts instead of torch.topk
def test_seeded_rows_draw_the_tokens_of_each_row_sampled_alone(rows, candidates, monkeypatch):
    monkeypatch.setattr(sampling, "TOP_K_CANDIDATES", candidates)
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in (MIX[r] for r in rows)
    ]
    for seed in range(6):
        logits = 3 * torch.randn(len(rows), V, generator=torch.Generator().manual_seed(seed))
        want = per_row_reference(
            logits, params, [torch.Generator().manual_seed(seed * 10 + j) for j in range(len(rows))]
        )
        got = sample(logits, params, [torch.Generator().manual_seed(seed * 10 + j) for j in range(len(rows))])
        assert got.tolist() == want, (rows, seed)


@pytest.mark.parametrize("candidates", [1024, 8])
def test_filter_rows_keeps_what_apply_top_k_then_apply_top_p_keep(candidates, monkeypatch):
    monkeypatch.setattr(sampling, "TOP_K_CANDIDATES", candidates)
    ks, ps = [0, 50, 0, 20, 999, 1000, 5, 0], [1.0, 1.0, 0.9, 0.8, 0.5, 0.95, 0.3, 1.0]
    x = 3 * torch.randn(len(ks), V, generator=torch.Generator().manual_seed(1))

    def want(rows):
        y = apply_top_k(x[rows], torch.tensor([ks[j] for j in rows]))
        return torch.stack([apply_top_p(y[i : i + 1], torch.tensor([ps[j]]))[0] if ps[j] < 1 else y[i]
                            for i, j in enumerate(rows)])  # fmt: skip

    every = list(range(len(ks)))
    assert torch.equal(filter_rows(x, ks, ps).isinf(), want(every).isinf())
    kp = [j for j in every if 0 < ks[j] < V and ps[j] < 1]  # every top-p row with a top-k: its candidates
    assert torch.equal(filter_rows(x[kp], [ks[j] for j in kp], [ps[j] for j in kp]).isinf(), want(kp).isinf())
    assert filter_rows(x, ks, ps)[[0, 7]].isinf().sum() == 0  # top_p 1 drops nothing, not even the tail


def test_filters_that_keep_every_token_sort_nothing(monkeypatch):
    """OpenAI's defaults (top_k 0, top_p 1), and a top_k of V or more: no sort, no topk."""

    def refuse(*args, **kwargs):
        raise AssertionError("sorted")

    monkeypatch.setattr(torch.Tensor, "sort", refuse)
    monkeypatch.setattr(torch.Tensor, "topk", refuse)
    x = torch.randn(3, V)
    assert torch.equal(filter_rows(x, [0, V, 10**20], [1.0, 1.0, 1.0]), x)


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mix", [[0], [1, 2, 3], list(range(8))])
def test_the_operations_do_not_grow_with_the_batch(mix):
    """Unseeded rows: the same operations for one row of each kind as for 16 of each (no per-row
    launch, no per-row wait)."""

    def ops(b: int) -> Counter:
        fields = ("temperature", "top_k", "top_p", "min_p")
        params = [SamplingParams(**dict(zip(fields, MIX[mix[i % len(mix)]], strict=True))) for i in range(b)]
        logits = torch.randn(b, V)
        with Ops() as seen:
            sample(logits, params, [None] * b)
        return seen.seen

    assert ops(len(mix)) == ops(16 * len(mix))


def test_a_row_that_is_not_a_distribution_is_refused_by_name():
    probs = torch.rand(4, V).softmax(dim=-1)
    probs[2, 5] = float("nan")
    assert draw(probs, [None] * 4)[1].tolist() == [True, True, False, True]  # nothing raised, no wait
    logits = torch.randn(4, V)
    logits[2, 5] = float("nan")
    params = [SamplingParams(temperature=1.0)] * 4
    with pytest.raises(ValueError, match=r"^rows \[2\]: the probabilities hold inf, nan"):
        sample(logits, params, [None, torch.Generator().manual_seed(0), None, None])
    ids, bad = sampling.sample_deferred(logits, params, [None] * 4)
    assert bad.tolist() == [False, False, True, False] and ids.shape == (4,)


def test_sample_apart_fails_the_bad_row_alone():
    logits = torch.randn(3, V)
    logits[1] = float("nan")
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    ids, errors, bad = sampling.sample_apart(logits, params, gens)
    assert list(errors) == [1] and bad is None
    alone = [
        sample(logits[i : i + 1], [params[i]], [torch.Generator().manual_seed(s)])
        for i, s in ((0, 1), (2, 3))
    ]
    assert [ids[0].item(), ids[2].item()] == [int(alone[0]), int(alone[1])]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [list(range(8)), [1, 3, 6], [0, 5]])
def test_seeded_rows_on_cuda_draw_the_tokens_of_each_row_sampled_alone(rows):
    """The engine's generators live on the logits' device (sampling.generator_for): on CUDA the race's
    noise of a seeded row is torch.multinomial's own there too, at V2-Lite's vocabulary."""
    dev, vocab = torch.device("cuda"), 102_400
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in (MIX[r] for r in rows)
    ]

    def gens(seed: int) -> list[torch.Generator]:
        return [torch.Generator(device=dev).manual_seed(seed * 10 + j) for j in range(len(rows))]

    for seed in range(4):
        logits = 3 * torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed)).to(dev)
        want = per_row_reference(logits, params, gens(seed))
        assert sample(logits, params, gens(seed)).tolist() == want, (rows, seed)


def test_top_p_without_a_sort_draws_the_tokens_of_the_sort(monkeypatch):
    """kernels/top_p.py's search (the CUDA path; without CUDA under the interpreter) against the sort
    the CPU path runs: the same seeded tokens for top-p rows without a top-k, beside rows with other
    filters."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in MIX]
    logits = (3 * torch.randn(len(MIX), V, generator=torch.Generator().manual_seed(7))).to(torch.bfloat16)
    logits = logits.float().to(dev)  # bf16 logits: tokens that tie at the cut

    def tokens(search: bool) -> list[int]:
        monkeypatch.setattr(top_p, "_use_triton", lambda x, requested=None: search)
        gens = [torch.Generator(device=dev).manual_seed(j) for j in range(len(MIX))]
        return sample(logits, params, gens).tolist()

    assert tokens(search=True) == tokens(search=False)
