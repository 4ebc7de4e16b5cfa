"""Perplexity of token ids through the runtime that serves them (`mlac eval`, the compiler's
accuracy check).

The text is encoded with the artifact's tokenizer (bos prepended) and cut into windows of at most
`context_len` tokens that start every `stride` tokens (default: `context_len`, i.e. non-overlapping).
Each window runs through `Engine.score` (teacher-forced logits, prefill chunked as the server chunks
it); a window scores only the tokens that no earlier window scored, each from the tokens before it
in the window, as in Hugging Face's perplexity guide. So with non-overlapping windows the first token
of every window is context only, and with a smaller stride every token after the first is scored once.

    perplexity = exp(sum of NLL / scored tokens)        bits per byte = sum of NLL / ln 2 / bytes
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mlac.core.errors import MlacError
from mlac.runtime.engine.engine import Engine

DEFAULT_CONTEXT = 2048


@dataclass(frozen=True)
class Window:
    begin: int  # first token of the window (context)
    first: int  # first token scored (begin < first: every scored token has a token before it)
    end: int  # one past the last token of the window, and of the scored tokens


@dataclass(frozen=True)
class EvalResult:
    tokens: int  # tokens scored (predicted), each once
    nll: float  # summed negative log-likelihood of those tokens, in nats
    mean_nll: float
    perplexity: float  # exp(mean_nll)
    windows: int
    context_len: int
    stride: int
    seconds: float
    tokens_per_s: float


def plan_windows(n_tokens: int, context_len: int, stride: int, max_context: int) -> list[Window]:
    """The windows of an evaluation (see windows) after checking its input: MlacError for fewer than
    2 tokens, a context_len below 2 or above max_context, a stride outside 1..context_len."""
    if n_tokens < 2:
        raise MlacError(f"the text is {n_tokens} token(s): perplexity needs at least 2")
    if context_len < 2:
        raise MlacError(f"--context-len {context_len}: a window needs at least 2 tokens")
    if context_len > max_context:
        raise MlacError(f"--context-len {context_len} exceeds the engine's context ({max_context} tokens)")
    if not 1 <= stride <= context_len:
        raise MlacError(f"--stride {stride}: must be between 1 and --context-len ({context_len})")
    return windows(n_tokens, context_len, stride)


def windows(n_tokens: int, context_len: int, stride: int) -> list[Window]:
    """The windows over `n_tokens` tokens that score at least one token, in order."""
    out, scored_end = [], 1  # token 0 has nothing before it
    for begin in range(0, n_tokens, stride):
        end = min(begin + context_len, n_tokens)
        first = max(scored_end, begin + 1)
        if first < end:
            out.append(Window(begin, first, end))
            scored_end = end
        if end == n_tokens:
            break
    return out


def window_nll(logits: torch.Tensor, ids: torch.Tensor, skip: int) -> float:
    """Summed NLL (float32 log_softmax) of ids[1:] under logits[:-1], leaving out the first `skip`
    targets (scored by an earlier window). logits [T, V], ids [T]."""
    logp = torch.log_softmax(logits[skip:-1].float(), dim=-1)  # [n, V]
    targets = ids[skip + 1 :].to(logp.device)  # [n]
    return float(-logp.gather(1, targets[:, None]).double().sum())


def perplexity(
    engine: Engine,
    token_ids: Sequence[int],
    context_len: int,
    stride: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> EvalResult:
    """Token-weighted perplexity of `token_ids` under `engine`, over windows of `context_len` tokens
    every `stride` (default `context_len`) tokens (see the module docstring). `progress(n)` is called
    after each window with the number of tokens it scored. MlacError for fewer than 2 tokens, a
    context_len below 2 or above the engine's context, a stride outside 1..context_len."""
    ids = [int(t) for t in token_ids]
    stride = context_len if stride is None else stride
    plan = plan_windows(len(ids), context_len, stride, engine.max_context)
    chunk = engine.scheduler_config.chunked_prefill_size  # prefill chunks as the server runs them
    nll, tokens = 0.0, 0
    start = time.perf_counter()
    for w in plan:
        window = torch.tensor(ids[w.begin : w.end])  # [T]
        nll += window_nll(engine.score(window, chunk_size=chunk), window, w.first - w.begin - 1)
        tokens += w.end - w.first
        if progress is not None:
            progress(w.end - w.first)
    seconds = time.perf_counter() - start
    mean = nll / tokens
    return EvalResult(
        tokens=tokens, nll=nll, mean_nll=mean, perplexity=math.exp(mean), windows=len(plan),
        context_len=context_len, stride=stride, seconds=seconds, tokens_per_s=tokens / seconds,
    )  # fmt: skip
