"""A request inside the engine: its Sequence (prompt, output, sampling state, block table), the
Delta it streams, and the sampling of its next token.

`Sequence.append_token` decides when a sequence finishes (stop token, stop string, grammar
complete, max_tokens, context full); `take_delta` hands out what is new, holding back text that
could still become a stop string.

One request never fails another: what is done per row (its sampling, its grammar's mask and
matcher, its detokenizer, its stop strings) fails only that row's sequence (`Sequence.fail`:
finish_reason "error", `error` says why); the step goes on for the others.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Literal

import torch

from mlac.runtime.engine.constrain import Matcher, mask_logits
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.engine.penalties import Penalties, PenaltyStep
from mlac.runtime.engine.sampling import TokenLogprob, sample_apart, token_logprobs
from mlac.runtime.engine.tokenizer import IncrementalDetokenizer
from mlac.runtime.kvcache.radix import Node

FinishReason = Literal["stop", "length", "abort", "error"]  # error: Sequence.fail


@dataclass(frozen=True)
class Delta:
    """What one request produced since the last delta (a streaming chunk)."""

    seq_id: int
    text: str  # new text, held back while it could still become a stop string
    token_ids: list[int]  # new tokens (a final eos / stop token included)
    logprobs: list[TokenLogprob]  # one per new token when logprobs were asked, else empty
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int  # so far
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first token, when asked


@dataclass(eq=False)
class Sequence:
    """One request's state. `seq_id` orders priority (lower = older = higher priority)."""

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    detok: IncrementalDetokenizer | None = None
    matcher: Matcher | None = None  # its grammar's state when params.grammar is set (constrain.py)
    penalties: Penalties | None = None  # its token counts when params.penalized (penalties.py)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked (prompt_logprobs.py)
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose latents are in the cache
    finish_reason: FinishReason | None = None
    stop_at: int | None = None  # where a stop string starts in detok.text
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache at first admission
    prefix: Node | None = None  # its matched prefix-cache node while it holds blocks
    dp_rank: int = 0  # DP attention: the rank whose KV cache holds its blocks (Scheduler.pools)
    request_id: str | None = None  # the server's name of it (X-Request-Id), for its log lines
    error: str | None = None  # why it failed alone (Sequence.fail): its request's error
    first_token_time: float | None = None
    last_token_time: float | None = None
    _sent_tokens: int = 0
    _sent_chars: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def decoding(self) -> bool:
        """Past its prompt, with only the last sampled token left to run."""
        return bool(self.output_ids) and self.num_tokens - self.num_computed == 1

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output."""
        n = len(self.prompt_ids)
        return (self.prompt_ids[start:end] if start < n else []) + self.output_ids[
            max(0, start - n) : max(0, end - n)
        ]

    def append_token(
        self, token: int, logprob: TokenLogprob | None, eos_ids: Seq[int], max_context: int
    ) -> None:
        """Record a sampled token; decide whether the sequence finishes (stop token, stop string,
        grammar complete, max_tokens, context full)."""
        now = time.monotonic()
        self.first_token_time = self.first_token_time or now
        self.last_token_time = now
        self.output_ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        p = self.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in eos_ids):
            self.finish_reason = "stop"  # the stop token's text is not part of the completion
            return
        try:
            self._follow(token)
        except Exception as e:  # noqa: BLE001  (its grammar or detokenizer: this request's failure)
            self.fail(e)
            return
        if self.stop_at is not None or (self.matcher is not None and self.matcher.done):
            self.finish_reason = "stop"
        elif len(self.output_ids) >= p.max_tokens or self.num_tokens >= max_context:
            self.finish_reason = "length"

    def _follow(self, token: int) -> None:
        """The grammar and the text take `token`; a stop string it completes sets stop_at."""
        if self.matcher is not None:
            self.matcher.advance(token)
        new = self.detok.add(token) if self.detok is not None else ""
        p = self.params
        if new and p.stop and len(self.output_ids) >= p.min_tokens:  # min_tokens holds stop strings back too
            self.stop_at = find_stop(self.detok.text, len(new), p.stop)

    def fail(self, error: BaseException) -> None:
        """End this sequence alone (finish_reason "error"): something done for its row alone raised.
        The scheduler releases it as a finished one; its request answers `error`."""
        self.error = f"{type(error).__name__}: {error}"
        self.finish_reason = "error"

    def text(self) -> str:
        """The completion's text so far; once finished, final (flushed, cut before a stop string)."""
        if self.detok is None:
            return ""
        if self.stop_at is not None:
            return self.detok.text[: self.stop_at]
        if self.finished:
            self.detok.flush()
        return self.detok.text

    def take_delta(self) -> Delta:
        """What is new since the last call. While running, the last len(longest stop) - 1
        characters are held back: they could still turn out to start a stop string."""
        text = self.text()
        if not self.finished and self.params.stop:
            text = text[: max(0, len(text) - max(len(s) for s in self.params.stop) + 1)]
        new_text = text[self._sent_chars :]
        self._sent_chars = max(self._sent_chars, len(text))
        ids, lps = self.output_ids[self._sent_tokens :], self.logprobs[self._sent_tokens :]
        first = self._sent_tokens == 0 and bool(ids)  # the prompt's logprobs travel with it
        self._sent_tokens = len(self.output_ids)
        return Delta(
            self.seq_id,
            new_text,
            ids,
            lps,
            self.finish_reason,
            len(self.prompt_ids),
            len(self.output_ids),
            self.num_cached_tokens,
            self.prompt_logprobs if first else None,
        )


def shares_past(a: Seq[int], b: Seq[int], cached: int, block_size: int) -> bool:
    """Whether token ids `a` and `b` share more full leading blocks than the `cached` tokens cover:
    their first cached // block_size + 1 blocks are equal. The block just past `cached` is compared
    first: requests that share only a cached system prompt differ there, so a burst of them costs a
    short comparison per pair, not a walk over the whole prefix."""
    end = (cached // block_size + 1) * block_size
    if end > min(len(a), len(b)):
        return False
    return a[end - block_size : end] == b[end - block_size : end] and a[:end] == b[:end]


def find_stop(text: str, new_chars: int, stops: Seq[str]) -> int | None:
    """Where the first stop string starts in `text`, looking only where the last `new_chars`
    characters could have completed one (a stop string may straddle tokens)."""
    start = max(0, len(text) - new_chars - max(len(s) for s in stops) + 1)
    hits = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None


def unique(seqs: list[Sequence]) -> list[Sequence]:
    """`seqs` without repeats, in first-seen order."""
    return list(dict.fromkeys(seqs))


def sample_next(seqs: list[Sequence], logits: torch.Tensor, eos_ids: Seq[int], max_context: int) -> None:
    """Sample one token per sequence from its logits [B, V] and append it (with its logprobs). A
    sequence with a grammar samples among the tokens it allows, one with penalties from its
    penalized logits; its logprobs are the model's. A row whose mask or draw raises fails its
    sequence alone (`Sequence.fail`); the others get the tokens they would have got without it."""
    masked, failed = _mask_apart(logits, [s.matcher for s in seqs])
    penalized = PenaltyStep.of([s.penalties for s in seqs], masked)
    if penalized is not None:
        masked = penalized.apply(masked)
    tokens, errors, _ = sample_apart(masked, [s.params for s in seqs], [s.generator for s in seqs])
    if penalized is not None:
        penalized.count(tokens)  # a failed row's placeholder too: that sequence ends
    lps = token_logprobs(logits, tokens, [s.params.logprobs for s in seqs])
    failed.update(errors)
    for j, (s, t, lp) in enumerate(zip(seqs, tokens.tolist(), lps, strict=True)):
        if j in failed:
            s.fail(failed[j])
        else:
            s.append_token(t, lp, eos_ids, max_context)


def _mask_apart(
    logits: torch.Tensor, matchers: list[Matcher | None]
) -> tuple[torch.Tensor, dict[int, Exception]]:
    """mask_logits(logits, matchers) and no errors; if that raises, each row is masked alone: a row
    whose mask raised keeps its logits (its sequence fails), its error comes back by row."""
    try:
        return mask_logits(logits, matchers), {}
    except Exception:  # noqa: BLE001  (one row's grammar: found below, row by row)
        pass
    rows, errors = [], {}
    for i, m in enumerate(matchers):
        try:
            rows.append(mask_logits(logits[i : i + 1], [m]))
        except Exception as e:  # noqa: BLE001  (this row's failure: its request's error)
            errors[i] = e
            rows.append(logits[i : i + 1])
    return torch.cat(rows), errors
