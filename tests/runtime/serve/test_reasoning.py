"""The DeepSeek-R1 reasoning parser: the parser alone over every way of cutting the
same text into deltas, and through the server with the official openai client (streaming and not),
the engine's text replaced by a scripted one so that the split is known."""

from __future__ import annotations

import itertools
from pathlib import Path

import openai
import pytest

from mlac.core.errors import MlacError
from mlac.runtime.engine.sequence import Delta
from mlac.runtime.serve import ServerConfig, ServerThread
from mlac.runtime.serve import app as app_module
from mlac.runtime.serve.reasoning import DeepSeekR1Parser, prompt_opens_think, split

KEY, MODEL = "sk-test", "tiny"

# (output text, template opened <think>) -> (reasoning, content)
CASES = [
    ("<think>\nLet me think.</think>\n\nParis.", False, ("\nLet me think.", "\n\nParis.")),
    ("<think>\nLet me think.</think>\n\nParis.", True, ("\nLet me think.", "\n\nParis.")),
    ("\nLet me think.</think>\n\nParis.", True, ("\nLet me think.", "\n\nParis.")),
    ("\nLet me think.</think>\n\nParis.", False, ("", "\nLet me think.</think>\n\nParis.")),
    ("Let me think... still", True, ("Let me think... still", "")),  # cut off while thinking
    ("<think>Let me think... still", False, ("Let me think... still", "")),
    ("Paris.", False, ("", "Paris.")),
    ("<thi", False, ("", "<thi")),  # a prefix of <think> that never completed
    ("<thi", True, ("<thi", "")),
    ("a </thin b </think> c </think>", True, ("a </thin b ", " c </think>")),
    ("<think></think>", False, ("", "")),
    ("", True, ("", "")),
    ("  <think>x</think>y", False, ("x", "y")),
    ("<<think>x</think>y", True, ("<<think>x", "y")),
]


def run_stream(pieces: list[str], think_opened: bool) -> tuple[str, str]:
    parser = DeepSeekR1Parser(think_opened)
    parts = [parser.feed(p) for p in pieces] + [parser.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


@pytest.mark.parametrize("text,opened,expected", CASES)
def test_split_whole_text(text, opened, expected):
    assert split(text, opened) == expected


@pytest.mark.parametrize("text,opened,expected", CASES)
def test_every_two_and_three_way_cut_gives_the_same_split(text, opened, expected):
    """Every cut point (tags split across deltas included), and every pair of cut points."""
    n = len(text)
    for i, j in itertools.combinations_with_replacement(range(n + 1), 2):
        assert run_stream([text[:i], text[i:j], text[j:]], opened) == expected, (i, j)
    assert run_stream(list(text), opened) == expected  # one character per delta


def test_a_split_close_tag_is_held_back_not_sent_as_reasoning():
    parser = DeepSeekR1Parser(think_opened=True)
    assert parser.feed("thinking</th") == ("thinking", "")
    assert parser.feed("ink>answer") == ("", "answer")
    assert parser.feed(" more") == ("", " more")
    assert parser.finish() == ("", "")


def test_prompt_opens_think():
    assert prompt_opens_think("<｜Assistant｜><think>\n")
    assert prompt_opens_think("...<think>")
    assert not prompt_opens_think("<｜Assistant｜>")
    assert not prompt_opens_think("<think>x</think>")


def test_unknown_parser_is_a_one_line_error(tmp_path):
    with pytest.raises(MlacError, match="--reasoning-parser qwen3: must be one of deepseek_r1"):
        ServerConfig.of(artifact=tmp_path, reasoning_parser="qwen3")


# --- through the server --------------------------------------------------------------------------

PIECES = ["<th", "ink>\nLet me", " think</th", "ink>\n\nPar", "is."]


class ScriptedSubmission:
    """Stands in for submission.Submission: submits nothing, answers every choice with PIECES."""

    def __init__(self, loop, seqs):
        self.seqs = seqs

    async def batches(self):
        for k, piece in enumerate(PIECES):
            last = k == len(PIECES) - 1
            yield [
                (i, Delta(s.seq_id, piece, [k], [], "stop" if last else None, len(s.prompt_ids), k + 1))
                for i, s in enumerate(self.seqs)
            ]

    async def deltas(self):
        async for batch in self.batches():
            for item in batch:
                yield item

    def cancel_unfinished(self) -> None:
        pass


def serve(art: Path, tmp_path: Path, template: str | None = None, parser: str | None = "deepseek_r1"):
    chat_template = None
    if template is not None:
        chat_template = tmp_path / "t.jinja"
        chat_template.write_text(template)
    cfg = ServerConfig.of(artifact=art, api_key=KEY, dtype="float32", verify=False, served_model_name=MODEL,
                       reasoning_parser=parser, chat_template=chat_template)  # fmt: skip
    return ServerThread(cfg)


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def ask(srv, stream: bool):
    """(reasoning, content) of one chat answer; streamed deltas are checked to carry no tag."""
    msgs = [{"role": "user", "content": "Capital of France?"}]
    c = client(srv)
    if not stream:
        m = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8).choices[0].message
        assert m.model_extra["reasoning"] == m.model_extra["reasoning_content"]
        return m.model_extra["reasoning_content"], m.content
    reasoning, content = [], []
    for chunk in c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, stream=True):
        d = chunk.choices[0].delta
        r = (d.model_extra or {}).get("reasoning_content")
        assert r == (d.model_extra or {}).get("reasoning")
        assert "<" not in (r or "") + (d.content or "")  # no tag, nor part of one, is ever sent
        reasoning.append(r or "")
        content.append(d.content or "")
    return "".join(reasoning), "".join(content)


@pytest.mark.parametrize("stream", [False, True])
def test_server_splits_reasoning(art, tmp_path, monkeypatch, stream):
    monkeypatch.setattr(app_module, "Submission", ScriptedSubmission)
    with serve(art, tmp_path) as srv:
        assert ask(srv, stream) == ("\nLet me think", "\n\nParis.")


@pytest.mark.parametrize("stream", [False, True])
def test_template_opened_think_and_no_close_tag_is_all_reasoning(art, tmp_path, monkeypatch, stream):
    monkeypatch.setattr(app_module, "Submission", ScriptedSubmission)
    monkeypatch.setitem(globals(), "PIECES", ["Let me", " think", "…"])
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}<think>\n"
    with serve(art, tmp_path, template) as srv:
        reasoning, content = ask(srv, stream)
    assert reasoning == "Let me think…" and not content


@pytest.mark.parametrize("stream", [False, True])
def test_without_parser_the_text_stays_in_content(art, tmp_path, monkeypatch, stream):
    monkeypatch.setattr(app_module, "Submission", ScriptedSubmission)
    with serve(art, tmp_path, parser=None) as srv:
        msgs = [{"role": "user", "content": "Capital of France?"}]
        c = client(srv)
        if stream:
            chunks = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, stream=True)
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        else:
            m = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8).choices[0].message
            assert "reasoning_content" not in (m.model_extra or {})
            text = m.content
    assert text == "".join(PIECES)
