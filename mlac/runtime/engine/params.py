"""What a request asks of its generation: SamplingParams (validated, frozen) and the GrammarSpec its
output must follow. Plain data without torch: the server's process checks the request bodies and
--generation-config (generation_config.py) with these before it imports torch; the sampler
(sampling.py) and structured output (constrain.py) act on them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from mlac.core.errors import MlacError

GrammarKind = Literal["json_object", "json_schema", "regex", "lark"]
KINDS = ("json_object", "json_schema", "regex", "lark")


class InvalidGrammar(MlacError, ValueError):
    """A schema or grammar that cannot be compiled; `param` names the request field (a 400)."""

    def __init__(self, message: str, param: str = "response_format"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    """What a completion must match. `source`: the JSON schema as a JSON string (json_schema),
    "" (json_object: any JSON object), a regular expression (regex), or a Lark grammar's text (lark)."""

    kind: GrammarKind
    source: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS or not isinstance(self.source, str):
            raise InvalidGrammar(
                f"grammar kind {self.kind!r} with a {type(self.source).__name__} source: "
                f"the kind must be one of {', '.join(KINDS)}, the source a string"
            )


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
