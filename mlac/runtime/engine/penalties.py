"""What changes a request's logits by what it has seen, as vLLM applies it, before temperature and
the filters (sampling.py): `logit_bias` (added), `min_tokens` (eos, unless ignore_eos, and the
stop token ids at -inf until that many tokens were generated), then the repetition penalty
(over the prompt and the generated tokens: a positive logit divided by it, a negative one
multiplied), the frequency penalty (times each token was generated) and the presence penalty
(once per token generated).

A sequence that asks for any of them holds a `Penalties`: on the device, how often it generated
each token (`counts` [V]) and, for the repetition penalty, which tokens its prompt holds [V].
The counts grow on the device from each step's sampled ids (`PenaltyStep.count`), so nothing
per token crosses to the host, and the overlap scheduler, which samples step N + 1 before the
host has read step N's ids, sees them right. A step's rows are stacked once ([R, V]), changed by
batched ops, and their counts written back by one foreach copy. Rows that ask for none of it cost
nothing: a step without such a row returns the logits as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mlac.runtime.device_copy import to_device
from mlac.runtime.engine.params import InvalidSamplingParams, SamplingParams


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """InvalidSamplingParams (param logit_bias) for a biased token id outside the vocabulary."""
    bad = next((t for t, _ in params.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise InvalidSamplingParams(
            f"logit_bias: token id {bad} is not in the vocabulary ({vocab_size} ids)", param="logit_bias"
        )


@dataclass(eq=False)
class Penalties:
    """One sequence's state of its penalties (module doc). The device tensors are made on the
    first step that samples it (on the engine's thread and device)."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    held: tuple[int, ...]  # ids min_tokens holds back: the stop token ids, and eos unless ignore_eos
    counts: torch.Tensor | None = None  # [V] float32: times each token was sampled
    in_prompt: torch.Tensor | None = None  # [V] bool, with a repetition penalty only
    sampled: int = 0  # tokens counted (overlap: one ahead of the sequence's appended tokens)

    @classmethod
    def of(
        cls, params: SamplingParams, prompt_ids: Sequence[int], eos_ids: Sequence[int]
    ) -> Penalties | None:
        """The state of a request that asks for penalties, logit_bias or min_tokens; else None."""
        if not params.penalized:
            return None
        eos = () if params.ignore_eos else tuple(eos_ids)
        return cls(params, prompt_ids, tuple(dict.fromkeys((*params.stop_token_ids, *eos))))

    def _ready(self, vocab: int, device: torch.device) -> None:
        if self.counts is not None:
            return
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        if self.params.repetition_penalty != 1:
            ids = to_device(self.prompt_ids, torch.int64, device).clamp(max=vocab - 1)
            self.in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device).index_fill_(0, ids, True)


class PenaltyStep:
    """The rows of one step that hold Penalties: `apply` changes their logits, `count` adds the
    tokens sampled from them."""

    def __init__(self, rows: list[int], states: list[Penalties], batch: int, logits: torch.Tensor):
        self.rows, self.states, self.batch = rows, states, batch
        dev, vocab = logits.device, logits.shape[1]
        for st in states:
            st._ready(vocab, dev)
        self.index = None if len(rows) == batch else to_device(rows, torch.int64, dev)  # [R]
        self.counts = torch.stack([st.counts for st in states])  # [R, V]

    @classmethod
    def of(cls, states: Sequence[Penalties | None], logits: torch.Tensor) -> PenaltyStep | None:
        """The step's rows with Penalties (one entry per row of logits [B, V]); None when none."""
        rows = [i for i, st in enumerate(states) if st is not None]
        return cls(rows, [states[i] for i in rows], len(states), logits) if rows else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> a copy with these rows changed (the module doc's order); `logits`
        itself is left as it is (logprobs are the model's)."""
        x = logits.clone() if self.index is None else logits.index_select(0, self.index)  # [R, V]
        self._bias(x)
        self._hold(x)
        x = self._penalize(x)
        if self.index is None:
            return x
        return logits.clone().index_copy_(0, self.index, x)

    def count(self, tokens: torch.Tensor) -> None:
        """Add the sampled tokens [B] (on the device) to the rows' counts: one scatter, one copy."""
        picked = tokens if self.index is None else tokens.index_select(0, self.index)  # [R]
        rows = torch.arange(len(self.rows), device=self.counts.device)
        self.counts[rows, picked] += 1  # one (row, token) pair per row: no collisions
        torch._foreach_copy_([st.counts for st in self.states], list(self.counts.unbind(0)))
        for st in self.states:
            st.sampled += 1

    def _per_row(self, name: str) -> torch.Tensor:
        """[R, 1] float32 on the device: each row's SamplingParams field `name`."""
        return to_device([getattr(st.params, name) for st in self.states], torch.float32, self.counts.device)[
            :, None
        ]

    def _scatter(self, x: torch.Tensor, pairs: list[tuple[int, int, float]], accumulate: bool) -> None:
        """x[r, t] += v (accumulate) or = v, for (r, t, v) in pairs; one transfer of each column."""
        if not pairs:
            return
        dev = x.device
        r, t, v = zip(*pairs, strict=True)
        where = (to_device(r, torch.int64, dev), to_device(t, torch.int64, dev))
        x.index_put_(where, to_device(v, torch.float32, dev), accumulate=accumulate)

    def _bias(self, x: torch.Tensor) -> None:
        pairs = [(j, t, b) for j, st in enumerate(self.states) for t, b in st.params.logit_bias]
        self._scatter(x, pairs, accumulate=True)

    def _hold(self, x: torch.Tensor) -> None:
        """min_tokens: a row short of them cannot sample what would stop it."""
        short = [(j, st) for j, st in enumerate(self.states) if st.sampled < st.params.min_tokens]
        self._scatter(x, [(j, t, float("-inf")) for j, st in short for t in st.held], accumulate=False)

    def _penalize(self, x: torch.Tensor) -> torch.Tensor:
        params = [st.params for st in self.states]
        counts = self.counts  # [R, V]
        if any(p.repetition_penalty != 1 for p in params):
            seen = counts > 0  # [R, V]
            with_prompt = [j for j, st in enumerate(self.states) if st.in_prompt is not None]
            prompts = torch.stack([self.states[j].in_prompt for j in with_prompt])
            seen[to_device(with_prompt, torch.int64, x.device)] |= prompts
            r = self._per_row("repetition_penalty")
            x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)  # -inf stays -inf
        if any(p.frequency_penalty for p in params):
            x = x - self._per_row("frequency_penalty") * counts
        if any(p.presence_penalty for p in params):
            x = x - self._per_row("presence_penalty") * (counts > 0)
        return x
