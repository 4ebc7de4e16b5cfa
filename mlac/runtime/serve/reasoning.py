"""DeepSeek's reasoning parsers: split a chat answer's text into reasoning (`reasoning_content`)
and content, as vLLM's and SGLang's parsers of those names do. `--reasoning-parser deepseek_r1`
splits every answer (R1 always thinks); `deepseek_v3` (vLLM's name for DeepSeek-V3.1's hybrid
thinking) splits the answers of requests that turn thinking on through the chat template
(`chat_template_kwargs` {"thinking": true}, or {"enable_thinking": true}; V3.1's template then ends
the prompt in `<think>`, else in `</think>`) and leaves the others whole in content (`splits`).

Text before `</think>` is reasoning, text after it is content. A leading `<think>` in the output
(after optional whitespace) is dropped and opens the reasoning. When the chat template itself
opened `<think>` (the prompt ends with `<think>`, R1's template does), the output starts in
reasoning. If `</think>` never comes, the whole output is reasoning when some `<think>` opened it
(template or output: the model was cut off while thinking, as vLLM and SGLang report it), and
content otherwise (a model that does not think, such as V3, keeps its answer in `content`).

Pure text logic, streaming: `feed(delta) -> (reasoning, content)` per delta, `finish()` at the end;
a tag split across deltas is held back until it is whole or cannot be one.
"""

from __future__ import annotations

from mlac.core.errors import MlacError

OPEN, CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "deepseek_v3")
THINKING_KWARGS = ("thinking", "enable_thinking")  # the chat template variables that turn it on

_START, _REASONING, _CONTENT = "start", "reasoning", "content"


def prompt_opens_think(prompt_text: str) -> bool:
    """Whether the chat template ended the prompt inside a `<think>` (`...<think>` or `...<think>\\n`)."""
    return prompt_text.rstrip().endswith(OPEN)


def splits(parser: str | None, template_kwargs: dict | None) -> bool:
    """Whether a request's answer is split into reasoning and content under `parser` (module doc)."""
    if parser == "deepseek_v3":
        return any(bool((template_kwargs or {}).get(k)) for k in THINKING_KWARGS)
    return parser is not None


def check_reasoning_parser(name: str | None) -> None:
    """None (no parser) or one of REASONING_PARSERS; else a one-line error."""
    if name is not None and name not in REASONING_PARSERS:
        raise MlacError(f"--reasoning-parser {name}: must be one of {', '.join(REASONING_PARSERS)}")


def _held_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (it could still become tag)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class DeepSeekR1Parser:
    """One choice's stream of text, split into (reasoning, content) deltas.

    The concatenation of every `feed` and the `finish` result equals `split(whole text)`, however the
    text was cut into deltas.
    """

    def __init__(self, think_opened: bool):
        self.think_opened = think_opened  # the template opened <think>: the output starts in reasoning
        self.state = _START
        self.buf = ""  # text held back: a possible tag, or the start before it is known

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) that `text`, appended to what came before, makes certain."""
        self.buf += text
        if self.state == _START and not self._leave_start():
            return "", ""
        if self.state == _REASONING:
            return self._reasoning()
        out, self.buf = self.buf, ""
        return "", out

    def finish(self) -> tuple[str, str]:
        """The end of the output: what was held back, in the part it belongs to."""
        out, self.buf = self.buf, ""
        if self.state == _CONTENT or (self.state == _START and not self.think_opened):
            return "", out
        return out, ""

    def _leave_start(self) -> bool:
        """Decide whether the output opens with `<think>`; False while the held text could still."""
        head = self.buf.lstrip()
        if head.startswith(OPEN):
            self.buf, self.state = head[len(OPEN) :], _REASONING
            return True
        if OPEN.startswith(head):
            return False  # empty, whitespace, or a prefix of <think>: not known yet
        self.state = _REASONING if self.think_opened else _CONTENT
        return True

    def _reasoning(self) -> tuple[str, str]:
        at = self.buf.find(CLOSE)
        if at >= 0:
            reasoning, content = self.buf[:at], self.buf[at + len(CLOSE) :]
            self.buf, self.state = "", _CONTENT
            return reasoning, content
        keep = _held_suffix(self.buf, CLOSE)
        reasoning, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
        return reasoning, ""


def split(text: str, think_opened: bool) -> tuple[str, str]:
    """A whole output's (reasoning, content)."""
    parser = DeepSeekR1Parser(think_opened)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    return r1 + r2, c1 + c2
