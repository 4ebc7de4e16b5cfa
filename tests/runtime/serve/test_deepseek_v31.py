"""DeepSeek-V3.1's formats beside V3's and R1's: the `deepseek_v31` tool-call parser over every way
of cutting a text into deltas, its forced-call grammar, and the `deepseek_v3` reasoning parser
(V3.1's hybrid thinking, switched by chat_template_kwargs); through the server with V3.1's
published chat template, the engine's text scripted, then sampled for real under the grammar."""

from __future__ import annotations

import itertools
import json

import openai
import pytest
from _deepseek_tokenizer import TEMPLATES
from test_tool_calls import TOOLS, fixed_ids, matcher, pieces, script  # noqa: F401  (fixtures)

from mlac.runtime.serve import ServerConfig, ServerThread
from mlac.runtime.serve.reasoning import splits
from mlac.runtime.serve.tool_choice import tool_choice_grammar
from mlac.runtime.serve.tools import V31, DeepSeekToolParser, merge, parse

KEY, MODEL = "sk-test", "tiny"
BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def call_text(name: str, args: str) -> str:
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"


WEATHER = call_text("weather", '{"city": "Paris"}')
TIME = call_text("time", '{"zone": "CET"}')
CASES = [
    ("Paris is sunny.", ("Paris is sunny.", [])),
    (BEGIN + WEATHER + END, ("", [("weather", '{"city": "Paris"}')])),
    ("Let me check." + BEGIN + WEATHER + TIME + END,
     ("Let me check.", [("weather", '{"city": "Paris"}'), ("time", '{"zone": "CET"}')])),
    (BEGIN + WEATHER + END + "ignored", ("", [("weather", '{"city": "Paris"}')])),
    (BEGIN + WEATHER[: WEATHER.index('is"')], ("", [("weather", '{"city": "Par')])),  # cut off in the arguments
    (BEGIN + "<｜tool▁call▁begin｜>weath", ("", [])),  # cut off in the name: no call yet
    (BEGIN + call_text("f", '{"s": "```"}') + END, ("", [("f", '{"s": "```"}')])),  # no fence in V3.1
]  # fmt: skip


def calls_of(expected: list[tuple[str, str]]) -> list[dict]:
    return [{"id": f"call_{k}", "type": "function", "function": {"name": name, "arguments": args}}
            for k, (name, args) in enumerate(expected)]  # fmt: skip


def run_stream(parts: list[str]) -> tuple[str, list[dict]]:
    parser = DeepSeekToolParser(V31, fixed_ids())
    out = [parser.feed(p) for p in parts] + [parser.finish()]
    return "".join(c for c, _ in out), merge([d for _, ds in out for d in ds])


@pytest.mark.parametrize("text, expected", CASES)
def test_v31_calls_whole_and_cut_every_way(text, expected):
    want = (expected[0], calls_of(expected[1]))
    assert parse(text, V31, fixed_ids()) == want
    for i, j in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        assert run_stream([text[:i], text[i:j], text[j:]]) == want, (i, j)


def test_v31_grammar(matcher):  # noqa: F811
    required = matcher(tool_choice_grammar(TOOLS, "required", fmt=V31))
    assert required(BEGIN + WEATHER + END) and required(BEGIN + WEATHER + TIME + END)
    assert not required(
        BEGIN + "<｜tool▁call▁begin｜>function<｜tool▁sep｜>weather\n```json\n"
        '{"city": "Paris"}\n```<｜tool▁call▁end｜>' + END
    )  # V3's form
    assert not required(BEGIN + call_text("weather", '{"city":"Paris"}') + END)  # one JSON layout
    named = matcher(tool_choice_grammar(TOOLS, {"type": "function", "function": {"name": "time"}}, fmt=V31))
    assert (
        named(BEGIN + TIME + END)
        and not named(BEGIN + WEATHER + END)
        and not named(BEGIN + TIME + TIME + END)
    )


def test_the_deepseek_v3_reasoning_parser_follows_thinking():
    assert splits("deepseek_r1", None) and splits("deepseek_r1", {"thinking": False})
    assert splits("deepseek_v3", {"thinking": True}) and splits("deepseek_v3", {"enable_thinking": True})
    assert not splits("deepseek_v3", None) and not splits("deepseek_v3", {"thinking": False})
    assert not splits(None, {"thinking": True})


# --- through the server -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(artifact):
    cfg = ServerConfig.of(artifact=artifact("tiny-v3"), api_key=KEY, dtype="float32", verify=False,
                          served_model_name=MODEL, chat_template=TEMPLATES / "deepseek_v31.jinja",
                          tool_call_parser="deepseek_v31", reasoning_parser="deepseek_v3",
                          enable_auto_tool_choice=True)  # fmt: skip
    with ServerThread(cfg) as srv:
        yield srv


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=120)


ASK = [{"role": "user", "content": "Weather in Paris?"}]


def answer(srv, stream: bool, **kwargs) -> dict:
    """The chat answer's reasoning, content, tool calls (name, arguments) and finish_reason."""
    c, out = client(srv), {"reasoning": "", "content": "", "calls": [], "finish": None}
    if not stream:
        ch = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, **kwargs).choices[0]
        m = ch.message
        calls = [(t.function.name, t.function.arguments) for t in m.tool_calls or []]
        extra = m.model_extra or {}
        return {"reasoning": extra.get("reasoning_content") or "", "content": m.content or "", "calls": calls,
                "finish": ch.finish_reason}  # fmt: skip
    deltas = []
    for chunk in c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, stream=True, **kwargs):
        d = chunk.choices[0].delta
        out["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
        out["content"] += d.content or ""
        deltas += [t.model_dump(exclude_none=True) for t in d.tool_calls or []]
        out["finish"] = chunk.choices[0].finish_reason or out["finish"]
    out["calls"] = [(x["function"]["name"], x["function"]["arguments"]) for x in merge(deltas)]
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_on_splits_reasoning_off_leaves_content(server, script, stream):  # noqa: F811
    script.answers = [pieces("Weighing it.</think>Sunny."), pieces("Plainly</think> sunny.")]
    on = answer(server, stream, extra_body={"chat_template_kwargs": {"thinking": True}})
    assert (on["reasoning"], on["content"], on["finish"]) == ("Weighing it.", "Sunny.", "stop")
    off = answer(server, stream)
    assert (off["reasoning"], off["content"]) == ("", "Plainly</think> sunny.")  # not thinking: as it came
    tok = server.state.loop.engine.tokenizer
    tails = [tok.decode(r[0].prompt_ids[-2:], skip_special_tokens=False) for r in script.requests]
    assert tails[0].endswith("<｜Assistant｜><think>") and tails[1].endswith("<｜Assistant｜></think>")


@pytest.mark.parametrize("stream", [False, True])
def test_v31_tool_call_round_trip(server, script, stream):  # noqa: F811
    script.answers = [pieces("Checking." + BEGIN + WEATHER + END), pieces("It is sunny.")]
    got = answer(server, stream)
    assert (got["content"], got["calls"], got["finish"]) == ("Checking.", [("weather", '{"city": "Paris"}')],
                                                             "tool_calls")  # fmt: skip
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    turn = [{"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"}]  # fmt: skip
    client(server).chat.completions.create(model=MODEL, messages=[*ASK, *turn], tools=TOOLS)
    tok = server.state.loop.engine.tokenizer
    prompt = tok.decode(script.requests[1][0].prompt_ids, skip_special_tokens=False)
    assert WEATHER in prompt and "<｜tool▁output▁begin｜>sunny, 21 C<｜tool▁output▁end｜>" in prompt


def test_a_forced_v31_call_from_random_weights_is_valid(server):
    pick = {"type": "function", "function": {"name": "pick", "parameters": {"type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
            "additionalProperties": False}}}  # fmt: skip
    for seed in range(3):
        ch = client(server).chat.completions.create(
            model=MODEL, messages=ASK, tools=[pick], tool_choice={"type": "function", "function": {"name": "pick"}},
            max_tokens=60, temperature=1.0, seed=seed,
        ).choices[0]  # fmt: skip
        assert ch.finish_reason == "tool_calls", ch
        (call,) = ch.message.tool_calls
        assert call.function.name == "pick" and 0 <= json.loads(call.function.arguments)["n"] <= 9
    grammar = tool_choice_grammar([pick], "required", fmt=V31)
    assert '<｜tool▁call▁begin｜> "pick" <｜tool▁sep｜>' in grammar and "```" not in grammar
