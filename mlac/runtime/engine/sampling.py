"""Sampling parameters (validated, frozen) and the sampler: greedy, temperature, top-k, top-p, min-p,
and log-probabilities with top alternatives. The penalties, logit_bias and min_tokens change a
row's logits before all of this (penalties.py).

Each request may carry a seed: its own torch.Generator then makes the same request give the same
tokens whatever else shares the batch (a row's filters and its draw depend only on its own logits
and generator).

Logprobs are those of the model's distribution (log_softmax of the raw logits, before temperature
and the filters), as vLLM and OpenAI report them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from mlac.core.errors import MlacError
from mlac.runtime.engine.constrain import GrammarSpec

MAX_LOGPROBS = 20  # most top alternatives per token (OpenAI's top_logprobs limit)
# Temperatures below this sample greedily: 1/T of a smaller one overflows float32 logits to inf
# (T = 1e-300 is 0 in float32). vLLM's floor too.
GREEDY_BELOW = 1e-5
TOP_K_MAX = 2**31 - 1  # top_k is capped at the vocabulary when sampling; larger values mean "all"


class InvalidSamplingParams(MlacError, ValueError):
    """A sampling parameter out of range (a ValueError for Python callers, an MlacError for the CLI).

    `param` names the offending field (the OpenAI error's "param")."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 (or under GREEDY_BELOW) is greedy; top_k 0, top_p 1 and min_p 0 switch those
    filters off, and a top_k above the vocabulary keeps every token (min_p keeps
    tokens whose probability is at least min_p times the most likely one's). `stop` strings end
    the completion (the text is cut before the stop string); `stop_token_ids` and the model's
    eos tokens (unless ignore_eos) end it too. `logprobs` = n returns, for every generated
    token, its log-probability and the n most likely alternatives (None: no logprobs).
    `grammar` constrains the completion to a JSON schema, any JSON object or a Lark grammar
    (constrain.py): it ends, finish_reason "stop", when the grammar is complete.

    As vLLM's (penalties.py): `presence_penalty` and `frequency_penalty` (in [-2, 2]) lower the
    logits of tokens already generated, once or per time generated; `repetition_penalty` (> 0,
    1 off) divides the positive logits, and multiplies the negative ones, of tokens in the prompt
    or generated; `logit_bias` ({token id: bias in [-100, 100]}, kept as sorted pairs) is added
    to the logits; `min_tokens` (<= max_tokens) holds back eos (unless ignore_eos), the stop
    token ids and the stop strings until that many tokens were generated. `prompt_logprobs` = n
    returns each prompt token's log-probability (but the first's) and its n most likely
    alternatives (prompt_logprobs.py).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None
    grammar: GrammarSpec | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    min_tokens: int = 0
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias or ()
        object.__setattr__(self, "logit_bias", tuple(sorted((t, b) for t, b in bias)))
        lp, seed = self.logprobs, self.seed
        checks = [
            (_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer >= 1"),
            (_is_real(self.temperature) and self.temperature >= 0, "temperature", ">= 0"),
            (_is_real(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]"),
            (_is_int(self.top_k) and self.top_k >= 0, "top_k", "an integer >= 0 (0 turns it off)"),
            (_is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1] (0 turns it off)"),
            (
                seed is None or (_is_int(seed) and -(2**63) <= seed < 2**64),
                "seed",
                "an integer in [-2**63, 2**64)",
            ),
            (all(isinstance(s, str) and s for s in stop), "stop", "non-empty strings"),
            (
                all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids",
                "non-negative integers",
            ),
            (lp is None or (_is_int(lp) and 0 <= lp <= MAX_LOGPROBS), "logprobs", f"in [0, {MAX_LOGPROBS}]"),
            (self.grammar is None or isinstance(self.grammar, GrammarSpec), "grammar", "a GrammarSpec"),
            *self._penalty_checks(),
        ]
        for ok, name, want in checks:
            if not ok:
                value = getattr(self, name)
                raise InvalidSamplingParams(
                    f"sampling parameter {name}={value!r}: must be {want}", param=name
                )
        self._cap_to_kernels()

    def _penalty_checks(self) -> list[tuple[bool, str, str]]:
        """(holds, field, what it must be) of the penalties, logit_bias, min_tokens, prompt_logprobs."""
        plp = self.prompt_logprobs
        return [
            (_is_real(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]"),
            (_is_real(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
             "in [-2, 2]"),
            (_is_real(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty", "> 0 (1: off)"),
            (all(_is_int(t) and t >= 0 and _is_real(b) and -100 <= b <= 100 for t, b in self.logit_bias),
             "logit_bias", "{token id >= 0: bias in [-100, 100]}"),
            (_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             f"an integer in [0, max_tokens={self.max_tokens}]"),
            (plp is None or (_is_int(plp) and 0 <= plp <= MAX_LOGPROBS), "prompt_logprobs", f"in [0, {MAX_LOGPROBS}]"),
        ]  # fmt: skip

    def _cap_to_kernels(self) -> None:
        """Values inside the accepted range that the kernels cannot honour as given, mapped to what
        they mean (a request's parameters never fail a step)."""
        object.__setattr__(self, "top_k", min(self.top_k, TOP_K_MAX))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether a penalty, logit_bias or min_tokens changes this request's logits (penalties.py)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
            or self.logit_bias or self.min_tokens
        )  # fmt: skip


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the most likely alternatives at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first
    rank: int | None = None  # of token_id in its distribution, 1 the most likely (prompt logprobs)


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


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [B, V], min_p [B] -> drop tokens less likely than min_p x the row's most likely one."""
    probs = logits.softmax(dim=-1)
    keep = probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(~keep, float("-inf"))


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A short host list as a [N] tensor on `device` without waiting for the device: on CUDA through
    pinned memory, non-blocking (a plain torch.tensor(..., device=cuda) waits for every queued kernel,
    which would stall the overlap scheduler's sampling behind the step it just launched)."""
    x = torch.tensor(list(values), dtype=dtype)
    return x.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else x.to(device)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """logits [B, V] float32, one SamplingParams and generator per row -> token ids [B] int64 on the
    logits' device. Queues device work only: nothing here waits for the device."""
    if not (logits.shape[0] == len(params) == len(generators)):
        raise ValueError(
            f"sample: {logits.shape[0]} rows, {len(params)} params, {len(generators)} generators"
        )
    out = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    dev = logits.device

    def per_row(name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return to_device([getattr(params[i], name) for i in rows], dtype, dev)

    x = logits if len(rows) == len(params) else logits.index_select(0, to_device(rows, torch.int64, dev))
    x = x.float() / per_row("temperature")[:, None]  # [R, V]; temperature >= GREEDY_BELOW here
    x = apply_top_k(x, per_row("top_k", torch.int64))  # top_k <= TOP_K_MAX: fits int64, capped at V
    x = apply_top_p(x, per_row("top_p"))
    if any(params[i].min_p > 0 for i in rows):
        x = apply_min_p(x, per_row("min_p"))
    probs = x.softmax(dim=-1)
    for j, i in enumerate(rows):
        out[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    return out


def sample_apart(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> tuple[torch.Tensor, dict[int, Exception]]:
    """As `sample`, but one row's failure does not fail the others: token ids [B], and the rows
    whose draw raised, with their errors (their id is the row's argmax: a placeholder the caller
    drops). The rows go together; only if that raises does each go alone, each seeded generator
    first rewound to where it was (a row draws what it would have drawn without the failure)."""
    states = [g.get_state() if g is not None else None for g in generators]
    try:
        return sample(logits, params, generators), {}
    except Exception:  # noqa: BLE001  (one row's: found below, row by row)
        for g, state in zip(generators, states, strict=True):
            if state is not None:
                g.set_state(state)
    ids, errors = [], {}
    for i, (p, g) in enumerate(zip(params, generators, strict=True)):
        try:
            ids.append(sample(logits[i : i + 1], [p], [g]))
        except Exception as e:  # noqa: BLE001  (this row's failure: its request's error)
            errors[i] = e
            ids.append(logits[i : i + 1].argmax(dim=-1))
    return torch.cat(ids), errors


def logprob_tensors(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int | None]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The device half of token_logprobs: (values [R, 1 + k] float32, ids [R, 1 + k] int64) on the
    logits' device for the R rows that asked (column 0 the sampled token, then the k most likely,
    k the most any row asked); None when no row asked. Nothing here waits for the device."""
    rows = [i for i, n in enumerate(num_top) if n is not None]
    if not rows:
        return None
    index = to_device(rows, torch.int64, logits.device) if len(rows) < len(num_top) else None
    x = logits if index is None else logits.index_select(0, index)
    ids = token_ids.to(logits.device)[:, None]  # [B, 1]
    ids = ids if index is None else ids.index_select(0, index)  # [R, 1]
    lp = torch.log_softmax(x.float(), dim=-1)  # [R, V]
    k = max(num_top[i] for i in rows)
    top_vals, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], ids[:, :0])  # [R, k]
    return torch.cat([lp.gather(1, ids), top_vals], dim=1), torch.cat([ids, top_ids], dim=1)


def read_logprobs(
    vals: list[list[float]], ids: list[list[int]], num_top: Sequence[int | None]
) -> list[TokenLogprob | None]:
    """The host half of token_logprobs: logprob_tensors' rows (as lists) -> each row's
    TokenLogprob (None where not asked)."""
    out: list[TokenLogprob | None] = [None] * len(num_top)
    rows = [i for i, n in enumerate(num_top) if n is not None]
    for j, i in enumerate(rows):
        n = num_top[i]
        top = tuple(zip(ids[j][1 : 1 + n], vals[j][1 : 1 + n], strict=True))
        out[i] = TokenLogprob(ids[j][0], vals[j][0], top)
    return out


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int | None]
) -> list[TokenLogprob | None]:
    """logits [B, V], the sampled token_ids [B], alternatives wanted per row (None: no logprobs)
    -> each row's TokenLogprob (None where not asked). The rows that asked are computed together
    on the logits' device; two transfers to the host in all (values and ids), none per row."""
    found = logprob_tensors(logits, token_ids, num_top)
    if found is None:
        return [None] * len(num_top)
    vals, ids = found
    return read_logprobs(vals.tolist(), ids.tolist(), num_top)
