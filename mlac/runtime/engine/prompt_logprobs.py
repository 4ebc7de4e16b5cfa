"""Prompt logprobs (vLLM's `prompt_logprobs`, and what `echo` with `logprobs` returns): the
log-probability of each prompt token given the tokens before it, its rank, and its most likely
alternatives, from the logits of the prefill steps that run the prompt.

A sequence that asks for them is prefilled from its start: it takes nothing from the prefix cache
(a cached token's logits are never computed). A step that runs some of its prompt computes the
logits of every token ([T, V] float32 instead of [B, V]: more memory, for those steps only),
scores the prompt tokens its rows predict (row p predicts token p + 1), and hands the scheduler
each sequence's last row, to sample from as any step does. The first prompt token has no
logprob (None). Not under speculative decoding: its verify step computes the logits of drafts only.
"""

from __future__ import annotations

import itertools

import torch

from mlac.runtime.device_copy import to_device
from mlac.runtime.engine.params import InvalidSamplingParams, SamplingParams
from mlac.runtime.engine.sampling import TokenLogprob


def check_prompt_logprobs(params: SamplingParams, speculative_num_steps: int) -> None:
    """InvalidSamplingParams (param prompt_logprobs) when asked under speculative decoding."""
    if params.prompt_logprobs is not None and speculative_num_steps:
        raise InvalidSamplingParams(
            "prompt_logprobs: not with speculative decoding (the server runs --speculative-num-steps "
            f"{speculative_num_steps})",
            param="prompt_logprobs",
        )


def scoring(seq) -> bool:
    """Whether `seq` asks for prompt logprobs and has prompt tokens left to run."""
    return seq.params.prompt_logprobs is not None and seq.num_computed < len(seq.prompt_ids)


def every_token(plan: list) -> bool:
    """Whether a step of `plan` [(sequence, new tokens)] needs the logits of every token."""
    return any(scoring(s) for s, _ in plan)


def score_prompts(plan: list, logits: torch.Tensor) -> torch.Tensor:
    """The logits [T, V] of a step of `plan` (every token's, step order; the sequences'
    num_computed not advanced yet) -> each sequence's last row [B, V]. Appends to each scoring
    sequence's `prompt_logprobs` the prompt tokens its rows predict (those not scored before: a
    preempted sequence recomputes its prompt)."""
    starts = [0, *itertools.accumulate(n for _, n in plan)]
    rows, targets, owners = [], [], []
    for j, (s, n) in enumerate(plan):
        if not scoring(s):
            continue
        if s.prompt_logprobs is None:
            s.prompt_logprobs = [None]  # the first token: nothing before it
        for r in range(n):
            at = s.num_computed + r + 1  # the token row r predicts
            if len(s.prompt_logprobs) <= at < len(s.prompt_ids):
                rows.append(starts[j] + r)
                targets.append(s.prompt_ids[at])
                owners.append(s)
    if rows:
        for s, lp in zip(owners, _logprobs(logits, rows, targets, owners), strict=True):
            s.prompt_logprobs.append(lp)
    last = to_device([e - 1 for e in starts[1:]], torch.int64, logits.device)
    return logits.index_select(0, last)


def _logprobs(logits: torch.Tensor, rows: list[int], targets: list[int], owners: list) -> list[TokenLogprob]:
    """TokenLogprob (logprob, rank, top alternatives) of token targets[i] at logits row rows[i]."""
    dev = logits.device
    lp = torch.log_softmax(
        logits.index_select(0, to_device(rows, torch.int64, dev)).float(), dim=-1
    )  # [R, V]
    chosen = lp.gather(1, to_device(targets, torch.int64, dev)[:, None])  # [R, 1]
    rank = (lp > chosen).sum(dim=-1) + 1  # [R]
    k = max(s.params.prompt_logprobs for s in owners)
    top_vals, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], rank[:, None][:, :0])
    chosen_h, rank_h, vals_h, ids_h = (x.tolist() for x in (chosen[:, 0], rank, top_vals, top_ids))
    out = []
    for i, s in enumerate(owners):
        n = s.params.prompt_logprobs
        top = tuple(zip(ids_h[i][:n], vals_h[i][:n], strict=True))
        out.append(TokenLogprob(targets[i], chosen_h[i], top, rank_h[i]))
    return out
