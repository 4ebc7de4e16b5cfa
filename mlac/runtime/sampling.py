"""Sampling parameters (validated, frozen) and the sampler: greedy, temperature, top-k, top-p.

Each request may carry a seed: its own torch.Generator then makes the same request give the same
tokens whatever else shares the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mlac.errors import MlacError


class InvalidSamplingParams(MlacError, ValueError):
    """A sampling parameter out of range (a ValueError for Python callers, an MlacError for the CLI)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off. `stop` strings end
    the completion (the text is cut before the stop string); `stop_token_ids` and the model's
    eos tokens (unless ignore_eos) end it too.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        checks = [
            (
                isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                "max_tokens",
                self.max_tokens,
                ">= 1",
            ),
            (self.temperature >= 0, "temperature", self.temperature, ">= 0"),
            (0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k, ">= 0 (0 turns it off)"),
            (all(s for s in stop), "stop", stop, "non-empty strings"),
        ]
        for ok, name, value, want in checks:
            if not ok:
                raise InvalidSamplingParams(f"sampling parameter {name}={value!r}: must be {want}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """logits [B, V], top_k [B] (0 = off) -> logits with all but each row's k largest at -inf."""
    v = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v))
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])  # [B, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [B, V], top_p [B] -> keep the smallest set of most likely tokens with mass >= top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
    drop_sorted = mass_before >= top_p[:, None]
    drop_sorted[:, 0] = False  # always keep the most likely token
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """logits [B, V] float32, one SamplingParams and generator per row -> token ids [B] int64."""
    if not (logits.shape[0] == len(params) == len(generators)):
        raise ValueError(
            f"sample: {logits.shape[0]} rows, {len(params)} params, {len(generators)} generators"
        )
    out = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    dev = logits.device
    x = logits[rows].float() / torch.tensor([params[i].temperature for i in rows], device=dev)[:, None]
    x = apply_top_k(x, torch.tensor([params[i].top_k for i in rows], device=dev))
    x = apply_top_p(x, torch.tensor([params[i].top_p for i in rows], device=dev))
    probs = x.softmax(dim=-1)
    for j, i in enumerate(rows):
        out[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    return out
