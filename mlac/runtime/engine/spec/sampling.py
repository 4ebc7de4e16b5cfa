"""Speculative sampling: accept draft tokens so that what is emitted follows the target's distribution.

Leviathan et al. 2023, Chen et al. 2023. Draft token x_i was drawn from the draft's distribution
q_i; the target's is p_i (both after the request's temperature, top-k, top-p and min-p: the
distribution a plain step would sample from). x_i is accepted with probability
min(1, p_i(x_i) / q_i(x_i)); the first rejected position emits a token drawn from
norm(max(0, p_i - q_i)) instead, and ends the step. When every draft is accepted, one more token is
drawn from p_k (the bonus). Each emitted token is distributed exactly as p at its position.

Greedy requests need none of this: a draft is accepted when it equals the target's argmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mlac.runtime.engine.sampling import SamplingParams, apply_min_p, filter_rows


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits [N, V] float32, one non-greedy SamplingParams per row -> the probabilities [N, V]
    that `sampling.sample` draws from (temperature, then top-k, top-p, min-p)."""
    dev = logits.device

    def per_row(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in params], device=dev)

    x = logits.float() / per_row("temperature").float()[:, None]
    x = filter_rows(x, [p.top_k for p in params], [p.top_p for p in params])
    if any(p.min_p > 0 for p in params):
        x = apply_min_p(x, per_row("min_p").float())
    return x.softmax(dim=-1)


def accept_greedy(drafts: Sequence[int], target: Sequence[int]) -> list[int]:
    """drafts [k], the target's argmax at each of the k + 1 verified positions -> the tokens to
    emit: the drafts up to the first that differs from the target, then the target's token there."""
    a = 0
    while a < len(drafts) and drafts[a] == target[a]:
        a += 1
    return list(target[: a + 1])


def accept_sampled(
    p: torch.Tensor, q: torch.Tensor, drafts: Sequence[int], generator: torch.Generator | None
) -> list[int]:
    """p [k + 1, V] target probabilities, q [k, V] draft probabilities, drafts [k] drawn from q
    -> the tokens to emit (1 to k + 1): accepted drafts, then a resampled or bonus token."""
    k = len(drafts)
    if p.shape[0] != k + 1 or q.shape[0] != k:
        raise ValueError(f"accept_sampled: p has {p.shape[0]} rows, q {q.shape[0]}, for {k} drafts")
    out: list[int] = []
    for i, x in enumerate(drafts):
        u = torch.rand((), generator=generator, device=p.device)
        if u * q[i, x] <= p[i, x]:  # with probability min(1, p/q)
            out.append(x)
            continue
        residual = (p[i] - q[i]).clamp(min=0)  # > 0 somewhere: a rejection needs q(x) > p(x)
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[k], 1, generator=generator)))
    return out


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator))
