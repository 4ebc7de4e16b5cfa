"""DeepSeek's tool-call parsers (`--tool-call-parser deepseek_v3 | deepseek_v31`): split a chat
answer's text into content and OpenAI tool calls, as vLLM's parsers of those names read DeepSeek's
two formats. V3 (and R1):

    content<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {ARGS}
    ```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 (the name before the separator, the JSON arguments after it, no type and no fence):

    content<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{ARGS}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

Content is the text before `<｜tool▁calls▁begin｜>`; inside the block each call is a header (V3: a
type and a name; V3.1: a name) and JSON arguments; text between calls and after
`<｜tool▁calls▁end｜>` is dropped. A call is made when its header is whole (V3: its name line and
the opening fence; V3.1: its name and the separator); its arguments stream as they come, up to
their end marker. An answer cut off inside a call keeps what had come (finish_reason `length`).

Pure text logic, streaming: `feed(delta) -> (content, call deltas)` per delta, `finish()` at the
end; a marker split across deltas is held back until it is whole or cannot be one. Call deltas are
OpenAI's stream shape: the first of a call `{"index", "id", "type", "function": {"name",
"arguments": ""}}`, then `{"index", "function": {"arguments": fragment}}`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

from mlac.core.errors import MlacError

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


@dataclass(frozen=True)
class ToolFormat:
    """How one DeepSeek version writes a call inside the block (the module doc)."""

    name: str  # the --tool-call-parser that reads it
    header_end: str  # ends a call's header
    args_end: str  # ends its arguments
    typed: bool  # the header is `type<｜tool▁sep｜>name` (V3), else the name alone (V3.1)


V3 = ToolFormat("deepseek_v3", "\n```json\n", "\n```" + CALL_END, typed=True)
V31 = ToolFormat("deepseek_v31", SEP, CALL_END, typed=False)
TOOL_FORMATS = {f.name: f for f in (V3, V31)}
TOOL_CALL_PARSERS = tuple(TOOL_FORMATS)

_CONTENT, _BLOCK, _HEADER, _ARGS, _DONE = "content", "block", "header", "args", "done"


def check_tool_call_parser(name: str | None, auto_tool_choice: bool) -> None:
    """None (no parser) or one of TOOL_CALL_PARSERS; --enable-auto-tool-choice needs a parser."""
    if name is not None and name not in TOOL_CALL_PARSERS:
        raise MlacError(f"--tool-call-parser {name}: must be one of {', '.join(TOOL_CALL_PARSERS)}")
    if auto_tool_choice and name is None:
        raise MlacError(
            f"--enable-auto-tool-choice needs --tool-call-parser ({' or '.join(TOOL_CALL_PARSERS)})"
        )


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _held_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker (it could still become it)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class DeepSeekToolParser:
    """One choice's stream of text in `fmt`, split into content and tool-call deltas.

    The concatenation of every `feed` and the `finish` result, the call deltas merged (`merge`),
    equals `parse(whole text)`, however the text was cut into deltas (ids aside).
    """

    def __init__(self, fmt: ToolFormat = V3, new_id: Callable[[], str] = new_call_id):
        self.fmt, self.new_id = fmt, new_id
        self.state = _CONTENT
        self.buf = ""  # text held back: a possible marker, a header not yet whole
        self.calls = 0  # calls begun so far: the next one's index

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """The content and call deltas that `text`, appended to what came before, makes certain."""
        self.buf += text
        content, deltas = "", []
        step = {_CONTENT: self._content, _BLOCK: self._block, _HEADER: self._header, _ARGS: self._args}
        while True:
            if self.state == _DONE:
                self.buf = ""
                return content, deltas
            piece, delta, progressed = step[self.state]()
            content += piece
            deltas += [delta] if delta else []
            if not progressed:
                return content, deltas

    def finish(self) -> tuple[str, list[dict]]:
        """The end of the output: held-back content is content; a cut-off call keeps its arguments."""
        out, self.buf = self.buf, ""
        if self.state == _CONTENT:
            return out, []
        if self.state == _ARGS and out:
            return "", [{"index": self.calls - 1, "function": {"arguments": out}}]
        return "", []

    # Each step consumes what it can of self.buf: (content, call delta or None, moved to a new state).

    def _content(self) -> tuple[str, dict | None, bool]:
        at = self.buf.find(CALLS_BEGIN)
        if at >= 0:
            out, self.buf, self.state = self.buf[:at], self.buf[at + len(CALLS_BEGIN) :], _BLOCK
            return out, None, True
        keep = _held_suffix(self.buf, CALLS_BEGIN)
        out, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
        return out, None, False

    def _block(self) -> tuple[str, dict | None, bool]:
        """Between calls: wait for the next call or the block's end; drop what lies between."""
        begin, end = self.buf.find(CALL_BEGIN), self.buf.find(CALLS_END)
        if end >= 0 and (begin < 0 or end < begin):
            self.state = _DONE
            return "", None, True
        if begin >= 0:
            self.buf, self.state = self.buf[begin + len(CALL_BEGIN) :], _HEADER
            return "", None, True
        keep = max(_held_suffix(self.buf, CALL_BEGIN), _held_suffix(self.buf, CALLS_END))
        self.buf = self.buf[len(self.buf) - keep :]
        return "", None, False

    def _header(self) -> tuple[str, dict | None, bool]:
        """The header up to its end (V3: `type<｜tool▁sep｜>name` and the opening fence; V3.1:
        `name<｜tool▁sep｜>`): the call's first delta."""
        at = self.buf.find(self.fmt.header_end)
        if at < 0:
            return "", None, False
        header, self.buf = self.buf[:at], self.buf[at + len(self.fmt.header_end) :]
        kind, _, name = header.rpartition(SEP) if self.fmt.typed else ("", "", header)
        index, self.calls, self.state = self.calls, self.calls + 1, _ARGS
        function = {"name": name.strip(), "arguments": ""}
        delta = {
            "index": index,
            "id": self.new_id(),
            "type": kind.strip() or "function",
            "function": function,
        }
        return "", delta, True

    def _args(self) -> tuple[str, dict | None, bool]:
        end = self.fmt.args_end
        at = self.buf.find(end)
        done = at >= 0
        if done:
            args, self.buf, self.state = self.buf[:at], self.buf[at + len(end) :], _BLOCK
        else:
            keep = _held_suffix(self.buf, end)
            args, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
        delta = {"index": self.calls - 1, "function": {"arguments": args}} if args else None
        return "", delta, done


def merge(deltas: list[dict]) -> list[dict]:
    """Whole tool calls (OpenAI's message shape) from their stream deltas."""
    calls: list[dict] = []
    for d in deltas:
        if "id" in d:
            calls.append({"id": d["id"], "type": d["type"], "function": dict(d["function"])})
        else:
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return calls


def parse(text: str, fmt: ToolFormat = V3, new_id: Callable[[], str] = new_call_id) -> tuple[str, list[dict]]:
    """A whole output's (content, tool calls) in `fmt`."""
    parser = DeepSeekToolParser(fmt, new_id)
    c1, d1 = parser.feed(text)
    c2, d2 = parser.finish()
    return c1 + c2, merge(d1 + d2)
