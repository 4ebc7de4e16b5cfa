"""OpenAI response rendering: completion and chat bodies, their stream chunks, and server-sent events.

A Render accumulates the choices of one response from Deltas; `body()` is the non-streaming
response, `chunk_event()` one streamed event (the envelope, the same for every chunk of a
response, is rendered once: only the choice goes through the JSON encoder per chunk). `sse()`
turns a Submission into the event stream: chunks (those of the deltas that arrived together in
one write), then usage when asked, then `data: [DONE]`; an error mid-stream (a failed step, the
drain timeout) is one `data: {"error": {...}}` event, then `data: [DONE]`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from mlac.runtime.engine.sampling import TokenLogprob
from mlac.runtime.engine.sequence import Delta
from mlac.runtime.serve.protocol import ApiError
from mlac.runtime.serve.reasoning import DeepSeekR1Parser, split
from mlac.runtime.serve.submission import Submission
from mlac.runtime.serve.tools import DeepSeekToolParser, ToolFormat, parse

DONE = "data: [DONE]\n\n"
ENCODE = json.JSONEncoder(ensure_ascii=False).encode  # json.dumps(x, ensure_ascii=False), built once


async def sse(sub: Submission, render: Render, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per delta, usage when asked, then [DONE]. The events of the
    deltas that arrived together go out in one write. A client that disconnects cancels the
    generator (starlette), and with it the requests."""
    try:
        for chunk in render.start():
            yield event(chunk)
        async for batch in sub.batches():
            events = []
            for index, delta in batch:
                if render.needs_event(index, delta):
                    events.append(render.chunk_event(index, delta, include_usage))
                else:
                    render.add(index, delta)  # a token whose text is held back: nothing to send yet
            if events:
                yield "".join(events)  # one write for what arrived together
        if include_usage:
            yield event(render.usage_chunk())
    except ApiError as e:
        yield event(e.body())
    finally:
        sub.cancel_unfinished()
    yield DONE


def event(obj: dict) -> str:
    return f"data: {ENCODE(obj)}\n\n"


def _lp(x: float) -> float:
    return max(x, -9999.0)  # JSON has no -inf


def vllm_prompt_logprobs(lps: list[TokenLogprob | None], token_text) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None (the first) or {"token id": {"logprob",
    "rank", "decoded_token"}} of the token itself, then its most likely alternatives."""
    out: list[dict | None] = []
    for x in lps:
        if x is None:
            out.append(None)
            continue
        entry = {
            str(x.token_id): {
                "logprob": _lp(x.logprob),
                "rank": x.rank,
                "decoded_token": token_text(x.token_id),
            }
        }
        for rank, (t, v) in enumerate(x.top, start=1):
            entry.setdefault(str(t), {"logprob": _lp(v), "rank": rank, "decoded_token": token_text(t)})
        out.append(entry)
    return out


class Render:
    """Accumulates the choices of one response; renders chunks and the final body."""

    object = ""
    chunk_object = ""
    id_prefix = ""
    want_logprobs = False
    choices_per_prompt = 1  # n: choices i*n .. i*n+n-1 share prompt i

    def __init__(self, tokenizer, model: str, n: int = 1):
        self.tok, self.model = tokenizer, model
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.text = [""] * n
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.prompt_tokens = [0] * n
        self.completion_tokens = [0] * n
        self.cached_tokens = [0] * n  # prompt tokens served from the prefix cache
        self.prompt_lps: list[list[TokenLogprob | None] | None] = [None] * n  # when asked
        self._chunk_head: str | None = None

    def needs_event(self, i: int, d: Delta) -> bool:
        """Whether choice i's delta d makes a stream chunk (else it is only added: held-back text)."""
        return bool(d.text or d.finish_reason or (self.want_logprobs and d.logprobs))

    def add(self, i: int, d: Delta) -> None:
        if d.prompt_logprobs is not None:
            self.prompt_lps[i] = d.prompt_logprobs
        self.text[i] += d.text
        self.logprobs[i] += d.logprobs
        self.finish[i] = d.finish_reason
        self.prompt_tokens[i], self.completion_tokens[i] = d.prompt_tokens, d.completion_tokens
        self.cached_tokens[i] = d.cached_tokens

    def usage(self) -> dict:
        """Token counts; a prompt's tokens count once however many choices (n) it has, and so do its
        cached tokens (the most any of its choices found in the prefix cache)."""
        n = self.choices_per_prompt
        p, c = sum(self.prompt_tokens[::n]), sum(self.completion_tokens)
        cached = sum(max(self.cached_tokens[i : i + n]) for i in range(0, len(self.cached_tokens), n))
        return {
            "prompt_tokens": p,
            "completion_tokens": c,
            "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def chunk_event(self, i: int, d: Delta, include_usage: bool) -> str:
        """The event of choice i's delta d: exactly `event({**envelope, "choices": [choice],
        "usage": None if include_usage})`, with the envelope's JSON rendered once per response."""
        if self._chunk_head is None:
            empty = ENCODE(self.envelope([], self.chunk_object))
            self._chunk_head = "data: " + empty[:-2]  # without the final ']}': ends in '"choices": ['
        choice = ENCODE(self.chunk_choice(i, d))
        tail = ', "usage": null}' if include_usage else "}"
        return f"{self._chunk_head}{choice}]{tail}\n\n"

    def chunk_choice(self, i: int, d: Delta) -> dict:
        """Add d to choice i; the choice object of its stream chunk."""
        raise NotImplementedError

    def envelope(self, choices: list, object: str | None = None) -> dict:
        return {"id": self.id, "object": object or self.object, "created": self.created, "model": self.model,
                "choices": choices}  # fmt: skip

    def start(self) -> list[dict]:
        return []

    def usage_chunk(self) -> dict:
        return {**self.envelope([], self.chunk_object), "usage": self.usage()}

    def token_text(self, token_id: int) -> str:
        return self.tok.token_text(token_id) if self.tok is not None else ""


class CompletionRender(Render):
    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, tokenizer, model: str, n: int, logprobs: bool, echo: list[str] | None = None,
                 prompt_ids: list[list[int]] | None = None, prompt_logprobs: bool = False,
                 echo_only: bool = False):  # fmt: skip
        """`echo`: each choice's prompt text, put before its completion (with `logprobs`, its
        `prompt_ids` lead the logprobs, scored by the engine: the first has none); `echo_only`
        (max_tokens 0): the prompt alone, what was generated dropped; `prompt_logprobs`: each
        choice carries vLLM's `prompt_logprobs`."""
        super().__init__(tokenizer, model, n)
        self.want_logprobs = logprobs
        self.echo, self.prompt_ids, self.echo_only = echo, prompt_ids, echo_only
        self.show_prompt_logprobs = prompt_logprobs
        self.offset = [0] * n
        self.opened = [False] * n  # choice i's first chunk (its echo, its prompt logprobs) was sent

    def add(self, i: int, d: Delta) -> None:
        if self.echo_only:  # the token generated to run the prompt is not part of the answer
            d = replace(d, text="", token_ids=[], logprobs=[], completion_tokens=0, finish_reason=d.finish_reason
                        and "length")  # fmt: skip
        super().add(i, d)

    def needs_event(self, i: int, d: Delta) -> bool:
        leads = self.echo is not None or self.show_prompt_logprobs
        return super().needs_event(i, d) or (leads and not self.opened[i] and bool(d.token_ids))

    def _prompt_entries(self, i: int) -> list[tuple]:
        """(token id, logprob, top) of choice i's prompt tokens (logprob and top None: not scored)."""
        ids = self.prompt_ids[i] if self.prompt_ids is not None else []
        lps = self.prompt_lps[i] or [None] * len(ids)
        return [
            (t, None, None) if x is None else (t, x.logprob, x.top) for t, x in zip(ids, lps, strict=False)
        ]

    def _logprobs(self, i: int, entries: list[tuple]) -> dict | None:
        """OpenAI's legacy logprobs of `entries` [(token id, logprob | None, top | None)]."""
        if not self.want_logprobs:
            return None
        tokens = [self.token_text(t) for t, _, _ in entries]
        offsets = []
        for t in tokens:
            offsets.append(self.offset[i])
            self.offset[i] += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [None if v is None else _lp(v) for _, v, _ in entries],
            "top_logprobs": [
                None if top is None else {self.token_text(t): _lp(v) for t, v in top} for _, _, top in entries
            ],  # fmt: skip
            "text_offset": offsets,
        }

    def _choice(self, i: int, text: str, entries: list[tuple], finish: str | None, lead: bool) -> dict:
        """Choice i's object; `lead`: its echo and prompt logprobs go first (the body, a first chunk)."""
        if lead and self.echo is not None:
            text, entries = self.echo[i] + text, self._prompt_entries(i) + entries
        choice = {"index": i, "text": text, "logprobs": self._logprobs(i, entries), "finish_reason": finish}
        if lead and self.show_prompt_logprobs:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(self.prompt_lps[i] or [], self.token_text)
        return choice

    def chunk_choice(self, i: int, d: Delta) -> dict:
        self.add(i, d)
        lead = not self.opened[i] and bool(d.token_ids)
        self.opened[i] = self.opened[i] or lead
        text, lps = ("", []) if self.echo_only else (d.text, d.logprobs)
        finish = d.finish_reason and "length" if self.echo_only else d.finish_reason
        return self._choice(i, text, [(x.token_id, x.logprob, x.top) for x in lps], finish, lead)

    def body(self) -> dict:
        choices = [
            self._choice(i, self.text[i], [(x.token_id, x.logprob, x.top) for x in self.logprobs[i]],
                         self.finish[i], True)
            for i in range(len(self.text))
        ]  # fmt: skip
        return {**self.envelope(choices), "usage": self.usage()}


class ChatRender(Render):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, tokenizer, model: str, logprobs: bool, n: int = 1, reasoning: bool = False,
                 think_opened: bool = False, tool_calls: ToolFormat | None = None,
                 prompt_logprobs: bool = False, echo: str | None = None):  # fmt: skip
        """`reasoning`: split each choice's text into reasoning_content and content (reasoning.py);
        `think_opened`: the chat template ended the prompt in `<think>`; `tool_calls`: parse tool
        calls of that format out of the content (tools.py);
        `prompt_logprobs`: the body carries vLLM's `prompt_logprobs` (the prompt is the choices');
        `echo`: text put before each choice's content (the message's, and the stream's first
        delta: the one that opens the message)."""
        super().__init__(tokenizer, model, n)
        self.echo = echo or ""
        self.want_logprobs = logprobs
        self.show_prompt_logprobs = prompt_logprobs
        self.think_opened = think_opened
        self.parsers = [DeepSeekR1Parser(think_opened) for _ in range(n)] if reasoning else None
        self.tool_format = tool_calls
        self.tool_parsers = [DeepSeekToolParser(tool_calls) for _ in range(n)] if tool_calls else None
        self.called = [False] * n  # choice i streamed a tool call

    def _entry(self, token_id: int, logprob: float) -> dict:
        t = self.token_text(token_id)
        return {"token": t, "logprob": _lp(logprob), "bytes": list(t.encode("utf-8"))}

    def _logprobs(self, lps: list[TokenLogprob]) -> dict | None:
        if not self.want_logprobs:
            return None
        content = []
        for lp in lps:
            top = [self._entry(t, v) for t, v in lp.top]
            content.append({**self._entry(lp.token_id, lp.logprob), "top_logprobs": top})
        return {"content": content}

    def start(self) -> list[dict]:
        """One chunk per choice that opens its assistant message."""
        return [
            self.envelope(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": self.echo},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
                self.chunk_object,
            )
            for i in range(len(self.text))
        ]

    def chunk_choice(self, i: int, d: Delta) -> dict:
        self.add(i, d)
        delta = self._delta(i, d)
        self.called[i] = self.called[i] or "tool_calls" in delta
        return {"index": i, "delta": delta, "logprobs": self._logprobs(d.logprobs),
                "finish_reason": _finish(d.finish_reason, self.called[i])}  # fmt: skip

    def _delta(self, i: int, d: Delta) -> dict:
        """Choice i's stream delta, split by its parsers (flushed at the finish)."""
        reasoning, content = self._split(i, d)
        calls: list[dict] = []
        if self.tool_parsers is not None:
            content, calls = self.tool_parsers[i].feed(content)
            if d.finish_reason is not None:
                c, more = self.tool_parsers[i].finish()
                content, calls = content + c, calls + more
        delta = {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning else {}
        delta = {**delta, "content": content} if content else delta
        return {**delta, "tool_calls": calls} if calls else delta

    def _split(self, i: int, d: Delta) -> tuple[str, str]:
        """Choice i's (reasoning, content) of d by its reasoning parser; all content without one."""
        if self.parsers is None:
            return "", d.text
        reasoning, content = self.parsers[i].feed(d.text)
        if d.finish_reason is not None:
            r, c = self.parsers[i].finish()
            reasoning, content = reasoning + r, content + c
        return reasoning, content

    def _message(self, i: int) -> dict:
        """Choice i's whole message; with a parser, an empty part is null (as vLLM)."""
        if self.parsers is None and self.tool_parsers is None:
            return {"role": "assistant", "content": self.text[i]}
        reasoning, content = split(self.text[i], self.think_opened) if self.parsers else ("", self.text[i])
        message = {"role": "assistant", "content": content or None}
        if self.parsers is not None:
            message = {**message, "reasoning_content": reasoning or None, "reasoning": reasoning or None}
        if self.tool_parsers is None:
            return message
        content, calls = parse(content, self.tool_format)
        return {**message, "content": content or None, "tool_calls": calls}

    def body(self) -> dict:
        choices = [self._choice(i) for i in range(len(self.text))]
        out = {**self.envelope(choices), "usage": self.usage()}
        if self.show_prompt_logprobs:
            out["prompt_logprobs"] = vllm_prompt_logprobs(self.prompt_lps[0] or [], self.token_text)
        return out

    def _choice(self, i: int) -> dict:
        message = self._message(i)
        if self.echo:
            message["content"] = self.echo + (message["content"] or "")
        return {"index": i, "message": message, "logprobs": self._logprobs(self.logprobs[i]),
                "finish_reason": _finish(self.finish[i], bool(message.get("tool_calls")))}  # fmt: skip


def _finish(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish_reason: "tool_calls" for an answer that stopped after making tool calls."""
    return "tool_calls" if called and reason == "stop" else reason
