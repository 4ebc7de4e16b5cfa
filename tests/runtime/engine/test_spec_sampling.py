"""Speculative sampling keeps the target's distribution (engine/spec/sampling.py): chi-square tests.

Directly on synthetic distributions (a vocabulary of 8, many draws): every emitted token, at
every position, follows the target's p, whatever the draft's q; accepting drafts without the
test (emitting q) fails the same check, so the check has the power to fail. End to end on the
tiny model: with top-k 4, the first two sampled tokens of speculative decoding follow the
target's joint distribution, computed by scoring.
"""

from __future__ import annotations

import torch

from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.engine.scheduler import SchedulerConfig
from mlac.runtime.engine.spec.sampling import accept_greedy, accept_sampled, filtered_probs

ALPHA = 1e-3


def p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's chi-square test of counts against probabilities (cells with p > 0)."""
    n = observed.sum()
    keep = expected_probs > 0
    assert observed[~keep].sum() == 0, "a token of probability 0 was emitted"
    exp = expected_probs[keep] * n
    stat = ((observed[keep] - exp) ** 2 / exp).sum()
    df = torch.tensor(float(keep.sum() - 1))
    return float(1 - torch.special.gammainc(df / 2, stat / 2))


def dist(v: int, gen: torch.Generator, zeros: int = 0) -> torch.Tensor:
    p = torch.rand(v, generator=gen, dtype=torch.float64) ** 2
    p[:zeros] = 0  # tokens one side cannot produce
    return p / p.sum()


def test_accept_greedy():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accept_greedy([5, 6], [5, 6, 8]) == [5, 6, 8]
    assert accept_greedy([4], [3, 0]) == [3]
    assert accept_greedy([], [2]) == [2]


def test_every_emitted_token_follows_the_target():
    gen = torch.Generator().manual_seed(0)
    v, k, n = 8, 3, 12000
    p = torch.stack([dist(v, gen, zeros=i) for i in range(k + 1)])  # [k + 1, V]
    q = torch.stack([dist(v, gen) for _ in range(k)])  # [k, V]: more mass where p has none
    counts = torch.zeros(k + 1, v, dtype=torch.float64)
    naive = torch.zeros(v, dtype=torch.float64)
    for _ in range(n):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
        for i, t in enumerate(accept_sampled(p, q, drafts, gen)):
            counts[i, t] += 1
        naive[drafts[0]] += 1
    for i in range(k + 1):
        assert counts[i].sum() > 500, counts.sum(1)
        assert p_value(counts[i], p[i]) > ALPHA, (i, counts[i], p[i])
    assert counts[k].sum() < n  # some drafts were rejected
    naive_keep = naive.clone()
    naive_keep[p[0] == 0] = 0  # (the draft emits tokens p forbids: that alone would fail)
    assert p_value(naive_keep, p[0]) < ALPHA  # emitting the drafts as they are is detected


def test_identical_draft_is_always_accepted():
    gen = torch.Generator().manual_seed(1)
    p = torch.stack([dist(8, gen) for _ in range(3)])
    for _ in range(200):
        drafts = [int(torch.multinomial(p[i], 1, generator=gen)) for i in range(2)]
        assert accept_sampled(p, p[:2], drafts, gen)[:2] == drafts


def test_filtered_probs_match_the_sampler():
    logits = torch.randn(3, 50)
    from mlac.runtime.engine.sampling import sample

    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    probs = filtered_probs(logits, [params] * 3)
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    assert ((probs > 0).sum(-1) <= 5).all()
    gen = torch.Generator().manual_seed(0)
    drawn = [int(sample(logits[:1], [params], [gen])[0]) for _ in range(300)]
    assert all(probs[0, t] > 0 for t in drawn)


def test_end_to_end_first_two_tokens_follow_the_target(artifact):
    """tiny-v3, top-k 4: (t1, t2) over many seeds, speculative K=1, against p(t1) p(t2 | t1) from
    scoring; t2 comes out of a verify step (an accepted or resampled draft)."""
    path = artifact("tiny-v3")
    plain = Engine.from_artifact(path, dtype=torch.float32, verify=False)
    config = SchedulerConfig(speculative_num_steps=1, max_running_requests=256)
    eng = Engine.from_artifact(path, dtype=torch.float32, verify=False, scheduler=config)
    prompt, n = [11, 12, 13, 14, 15], 600
    params = [
        SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=s, ignore_eos=True) for s in range(n)
    ]
    outs = eng.generate([prompt] * n, params)
    p1 = filtered_probs(plain.score(prompt)[-1:], params[:1])[0]
    first = sorted(int(t) for t in torch.nonzero(p1).flatten())
    second = {t: filtered_probs(plain.score(prompt + [t])[-1:], params[:1])[0] for t in first}
    cells = [(a, b) for a in first for b in sorted(int(x) for x in torch.nonzero(second[a]).flatten())]
    expected = torch.tensor([float(p1[a] * second[a][b]) for a, b in cells], dtype=torch.float64)
    index = {c: i for i, c in enumerate(cells)}
    observed = torch.zeros(len(cells), dtype=torch.float64)
    for c in outs:
        observed[index[(c.token_ids[0], c.token_ids[1])]] += 1
    assert p_value(observed, expected / expected.sum()) > ALPHA
