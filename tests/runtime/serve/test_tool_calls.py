"""Tool calling: the DeepSeek-V3 tool-call parser alone over every way of cutting
the same text into deltas; tool_choice and its Lark grammar, checked with llguidance over a
tokenizer with DeepSeek's tool tokens; and a round trip (call, result, answer) through the server
with the official openai client, streaming and not, the engine's text replaced by a scripted one."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import openai
import pytest
from _deepseek_tokenizer import TEMPLATES, deepseek_tokenizer_dir, template

from mlac.core.errors import MlacError
from mlac.runtime.engine.sequence import Delta
from mlac.runtime.serve import ServerConfig, ServerThread
from mlac.runtime.serve import app as app_module
from mlac.runtime.serve.protocol import ApiError
from mlac.runtime.serve.tool_choice import ToolPlan, plan_tools, tool_choice_grammar
from mlac.runtime.serve.tools import V3, DeepSeekToolParser, merge, parse

KEY, MODEL = "sk-test", "tiny"
BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def call_text(name: str, args: str) -> str:
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"


WEATHER = call_text("weather", '{"city": "Paris"}')
TIME = call_text("time", '{"zone": "CET"}')

# output text -> (content, [(name, arguments)])
CASES = [
    ("Paris is sunny.", ("Paris is sunny.", [])),
    (BEGIN + WEATHER + END, ("", [("weather", '{"city": "Paris"}')])),
    (
        "Let me check." + BEGIN + WEATHER + "\n" + TIME + END,
        ("Let me check.", [("weather", '{"city": "Paris"}'), ("time", '{"zone": "CET"}')]),
    ),  # fmt: skip
    (BEGIN + WEATHER, ("", [("weather", '{"city": "Paris"}')])),  # V3's template never wrote the end
    (BEGIN + WEATHER + END + "ignored", ("", [("weather", '{"city": "Paris"}')])),
    (BEGIN + call_text("f", '{"s": "a\\n```b"}') + END, ("", [("f", '{"s": "a\\n```b"}')])),
    (
        BEGIN + WEATHER[: WEATHER.index('is"')],
        ("", [("weather", '{"city": "Par')]),
    ),  # cut off inside the arguments
    (BEGIN + WEATHER[:30], ("", [])),  # cut off inside the header: no call yet
    ("a <｜tool▁calls▁beg b", ("a <｜tool▁calls▁beg b", [])),  # a prefix of the marker that never completed
    ("x <｜tool▁calls▁beg", ("x <｜tool▁calls▁beg", [])),
    ("", ("", [])),
]


def fixed_ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def run_stream(pieces: list[str]) -> tuple[str, list[dict], list[dict]]:
    parser = DeepSeekToolParser(V3, fixed_ids())
    parts = [parser.feed(p) for p in pieces] + [parser.finish()]
    deltas = [d for _, ds in parts for d in ds]
    return "".join(c for c, _ in parts), merge(deltas), deltas


def calls_of(expected: list[tuple[str, str]]) -> list[dict]:
    return [{"id": f"call_{k}", "type": "function", "function": {"name": name, "arguments": args}}
            for k, (name, args) in enumerate(expected)]  # fmt: skip


@pytest.mark.parametrize("text,expected", CASES)
def test_parse_whole_text(text, expected):
    content, calls = parse(text, V3, fixed_ids())
    assert (content, calls) == (expected[0], calls_of(expected[1]))


@pytest.mark.parametrize("text,expected", CASES)
def test_every_two_and_three_way_cut_gives_the_same_result(text, expected):
    """Every cut point (markers split across deltas included), and every pair of cut points."""
    want = (expected[0], calls_of(expected[1]))
    n = len(text)
    for i, j in itertools.combinations_with_replacement(range(n + 1), 2):
        assert run_stream([text[:i], text[i:j], text[j:]])[:2] == want, (i, j)
    assert run_stream(list(text))[:2] == want  # one character per delta


def test_stream_deltas_have_openai_shape():
    """A call's first delta carries index, id, type and the name with empty arguments; then only
    argument fragments of that index; no marker, nor part of one, reaches content."""
    text = "Checking." + BEGIN + WEATHER + "\n" + TIME + END
    content, _, deltas = run_stream(list(text))
    assert content == "Checking."
    firsts = [d for d in deltas if "id" in d]
    assert firsts == [
        {"index": 0, "id": "call_0", "type": "function", "function": {"name": "weather", "arguments": ""}},
        {"index": 1, "id": "call_1", "type": "function", "function": {"name": "time", "arguments": ""}},
    ]
    rest = [d for d in deltas if "id" not in d]
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in rest)
    assert all(d["function"]["arguments"] for d in rest)  # no empty fragment is sent
    assert "".join(d["function"]["arguments"] for d in rest if d["index"] == 0) == '{"city": "Paris"}'


def test_held_back_marker_is_released_as_content():
    parser = DeepSeekToolParser()
    assert parser.feed("a <｜tool▁") == ("a ", [])
    assert parser.feed("x") == ("<｜tool▁x", [])
    assert parser.finish() == ("", [])


def render_both(text: str, size: int) -> tuple[dict, dict]:
    """(the stream's deltas put together, the body's message) of one answer through ChatRender with
    both parsers (R1's reasoning, then tool calls in the content)."""
    from mlac.runtime.serve.render import ChatRender

    stream, whole = (ChatRender(None, MODEL, False, 1, True, False, V3) for _ in range(2))
    parts = pieces(text, size)
    got = {"reasoning_content": "", "content": "", "tool_calls": [], "finish_reason": None}
    for k, piece in enumerate(parts):
        d = Delta(0, piece, [k], [], "stop" if k == len(parts) - 1 else None, 3, k + 1)
        whole.add(0, d)
        choice = stream.chunk_choice(0, d)
        for key in ("reasoning_content", "content"):
            got[key] += choice["delta"].get(key, "")
        got["tool_calls"] += choice["delta"].get("tool_calls", [])
        got["finish_reason"] = choice["finish_reason"] or got["finish_reason"]
    got["tool_calls"] = [c["function"] for c in merge(got["tool_calls"])]
    choice = whole.body()["choices"][0]
    message = {**choice["message"], "tool_calls": [c["function"] for c in choice["message"]["tool_calls"]]}
    return got, {**message, "finish_reason": choice["finish_reason"]}


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_render_reasoning_then_tool_calls_stream_and_body_agree(size):
    text = "<think>\nNeeds the weather tool.</think>\n\nLet me look." + BEGIN + WEATHER + END
    got, message = render_both(text, size)
    want = {"reasoning_content": "\nNeeds the weather tool.", "content": "\n\nLet me look.",
            "tool_calls": [{"name": "weather", "arguments": '{"city": "Paris"}'}], "finish_reason": "tool_calls"}  # fmt: skip
    assert got == want
    assert {k: message[k] for k in want} == want and message["reasoning"] == want["reasoning_content"]


# --- tool_choice --------------------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "Weather of a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                    "additionalProperties": False}}},
    {"type": "function", "function": {"name": "time", "parameters": {"type": "object",
     "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}},
]  # fmt: skip
NAMED = {"type": "function", "function": {"name": "time"}}


def test_plan_tools_choices():
    assert plan_tools(TOOLS, "none", auto_enabled=True) == ToolPlan()
    assert plan_tools(TOOLS, "auto", auto_enabled=True) == ToolPlan(parse=True)
    assert plan_tools(TOOLS, None, auto_enabled=True) == ToolPlan(parse=True)  # auto by default
    assert plan_tools(TOOLS, None, auto_enabled=False) == ToolPlan()  # tools rendered, answer as it is
    assert plan_tools(None, None, auto_enabled=True) == ToolPlan()
    assert plan_tools(TOOLS, "required", False) == ToolPlan(True, tool_choice_grammar(TOOLS, "required"))
    assert plan_tools(TOOLS, NAMED, False) == ToolPlan(True, tool_choice_grammar(TOOLS, NAMED))


@pytest.mark.parametrize(
    "tools,choice,message",
    [
        (TOOLS, "auto", "--enable-auto-tool-choice"),
        (None, "required", "needs tools"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "'nope' is not one of the tools"),
        (TOOLS, {"type": "function"}, "must be"),
        (TOOLS, "sometimes", "is not one of none, auto, required"),
        ([{"type": "function", "function": {}}], "required", "tools.0.function.name"),
        ([{"type": "retrieval"}], "none", "tools.0: must be"),
    ],
)
def test_plan_tools_refusals(tools, choice, message):
    with pytest.raises(ApiError) as e:
        plan_tools(tools, choice, auto_enabled=False)
    assert e.value.status == 400 and message in e.value.message


@pytest.fixture(scope="module")
def matcher(tmp_path_factory):
    """matcher(grammar)(text) -> whether llguidance accepts `text` whole, over DeepSeek's tokens."""
    import llguidance

    from mlac.runtime.engine.tokenizer import Tokenizer

    root = deepseek_tokenizer_dir(tmp_path_factory.mktemp("tok") / "v3", template("deepseek_v3"))
    tok = Tokenizer(root)
    lltok = llguidance.LLTokenizer((root / "tokenizer.json").read_text(), eos_token=tok.eos_token_id)

    def make(grammar: str):
        is_error, _ = llguidance.LLMatcher.validate_grammar_with_warnings(
            llguidance.LLMatcher.grammar_from_lark(grammar), lltok
        )
        assert not is_error

        def accepts(text: str) -> bool:
            m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
            ok = m.consume_tokens(tok.encode(text, add_bos=False))
            return ok and not m.is_error() and m.is_accepting()

        return accepts

    return make


def test_required_grammar_accepts_calls_of_the_tools(matcher):
    accepts = matcher(tool_choice_grammar(TOOLS, "required"))
    assert accepts(BEGIN + WEATHER + END)
    assert accepts(BEGIN + WEATHER + "\n" + TIME + END)
    # the arguments in response_format's one JSON layout: no free whitespace to spend tokens on
    assert not accepts(BEGIN + call_text("weather", '{"city":"Paris"}') + END)
    assert not accepts(BEGIN + call_text("weather", '{ "city" : "Paris" }') + END)
    assert not accepts("Paris is sunny.")  # no call
    assert not accepts(BEGIN + call_text("nope", "{}") + END)  # not a tool
    assert not accepts(BEGIN + call_text("weather", '{"town": "Paris"}') + END)  # off the schema
    assert not accepts(BEGIN + call_text("weather", '{"city": 3}') + END)
    assert not accepts(BEGIN + WEATHER)  # unfinished block
    assert not accepts(BEGIN + WEATHER + END + "more")


def test_named_and_single_call_grammars(matcher):
    named = matcher(tool_choice_grammar(TOOLS, NAMED))
    assert named(BEGIN + TIME + END)
    assert not named(BEGIN + WEATHER + END)
    assert not named(BEGIN + TIME + "\n" + TIME + END)  # one call
    single = matcher(tool_choice_grammar(TOOLS, "required", parallel=False))
    assert single(BEGIN + WEATHER + END) and not single(BEGIN + WEATHER + "\n" + TIME + END)


def test_server_config_checks_the_flags(tmp_path):
    with pytest.raises(MlacError, match="--tool-call-parser hermes: must be one of deepseek_v3"):
        ServerConfig.of(artifact=tmp_path, tool_call_parser="hermes")
    with pytest.raises(MlacError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        ServerConfig.of(artifact=tmp_path, enable_auto_tool_choice=True)


# --- through the server ----------------------------------------------------------------------------


class Script:
    """Stands in for submission.Submission: submits nothing, answers each request with the next of
    `answers` (a list of text pieces) and records its sequences."""

    answers: list[list[str]] = []
    requests: list[list] = []

    def __init__(self, loop, seqs):
        self.seqs = seqs
        self.pieces = Script.answers.pop(0)
        Script.requests.append(seqs)

    async def batches(self):
        for k, piece in enumerate(self.pieces):
            last = k == len(self.pieces) - 1
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


def pieces(text: str, size: int = 7) -> list[str]:
    return [text[k : k + size] for k in range(0, len(text), size)]


@pytest.fixture
def script(monkeypatch):
    monkeypatch.setattr(app_module, "Submission", Script)
    Script.answers, Script.requests = [], []
    return Script


def serve(art: Path, auto: bool = True, template: str = "deepseek_v3") -> ServerThread:
    cfg = ServerConfig.of(artifact=art, api_key=KEY, dtype="float32", verify=False, served_model_name=MODEL,
                       chat_template=TEMPLATES / f"{template}.jinja", tool_call_parser="deepseek_v3",
                       enable_auto_tool_choice=auto)  # fmt: skip
    return ServerThread(cfg)


@pytest.fixture(scope="module")
def server(artifact):
    with serve(artifact("tiny-v3")) as srv:
        yield srv


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=120)


ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL_OUTPUT = "Let me look." + BEGIN + WEATHER + END


def ask(srv, messages, stream: bool, **kwargs) -> tuple[str | None, list[dict], str]:
    """(content, tool calls as dicts, finish_reason) of one chat answer, put together from the
    stream as a client does when `stream`."""
    c = client(srv)
    if not stream:
        choice = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, **kwargs).choices[0]
        calls = [t.model_dump() for t in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in c.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, stream=True, **kwargs
    ):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for t in choice.delta.tool_calls or []:
            if t.id is not None:  # a call's first delta: id, type, name
                assert t.index == len(calls) and t.type == "function" and t.function.name
                calls[t.index] = {
                    "id": t.id,
                    "type": t.type,
                    "function": {"name": t.function.name, "arguments": ""},
                }
            calls[t.index]["function"]["arguments"] += t.function.arguments or ""
        finish = choice.finish_reason or finish
    return content or None, list(calls.values()), finish


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(server, script, stream):
    """Call, result, answer: the call comes back as tool_calls, and goes back through the template
    with its result."""
    script.answers = [pieces(CALL_OUTPUT), pieces("It is sunny in Paris.")]
    content, calls, finish = ask(server, ASK, stream)
    assert (content, finish) == ("Let me look.", "tool_calls")
    assert [c["function"]["name"] for c in calls] == ["weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["type"] == "function"

    turn = {"role": "assistant", "content": None, "tool_calls": calls}
    result = {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny, 21 C"}
    content, calls2, finish = ask(server, [*ASK, turn, result], stream)
    assert (content, calls2, finish) == ("It is sunny in Paris.", [], "stop")
    tok = server.state.loop.engine.tokenizer
    prompt = tok.decode(script.requests[1][0].prompt_ids, skip_special_tokens=False)
    rendered = tok.apply_chat_template([*ASK, turn, result])
    assert prompt == rendered and WEATHER in prompt and "<｜tool▁output▁begin｜>sunny, 21 C" in prompt


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_none_leaves_the_text_alone(server, script, stream):
    script.answers = [pieces(CALL_OUTPUT)]
    content, calls, finish = ask(server, ASK, stream, tool_choice="none")
    assert (content, calls, finish) == (CALL_OUTPUT, [], "stop")


def test_auto_needs_the_flag(artifact, script):
    with serve(artifact("tiny-v3"), auto=False) as srv:
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
            ask(srv, ASK, False, tool_choice="auto")
        script.answers = [pieces(CALL_OUTPUT)]
        assert ask(srv, ASK, False) == (CALL_OUTPUT, [], "stop")  # tools given, no choice: not parsed


def test_a_template_that_fails_on_the_messages_is_a_400(artifact, script):
    """vLLM's R1 tool template tests `'</think>' in content` of a tool-call turn whose content is null."""
    turn = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": "{}"}}]}  # fmt: skip
    with serve(artifact("tiny-v3"), template="vllm_tool_chat_template_deepseekr1") as srv:
        with pytest.raises(openai.BadRequestError, match="chat template refused the messages"):
            ask(srv, [*ASK, turn, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], False)


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_required_and_named_set_the_grammar(server, script, choice):
    """Each choice samples under the tool-call grammar; response_format cannot come with it."""
    from mlac.runtime.engine.params import GrammarSpec

    with pytest.raises(openai.BadRequestError, match="cannot be combined with tool_choice"):
        ask(server, ASK, False, tool_choice=choice, response_format={"type": "json_object"})
    script.answers = [pieces(BEGIN + TIME + END)]
    content, calls, finish = ask(server, ASK, False, tool_choice=choice)
    assert (content, finish, calls[0]["function"]["name"]) == (None, "tool_calls", "time")
    grammar = script.requests[0][0].params.grammar
    assert grammar == GrammarSpec("lark", tool_choice_grammar(TOOLS, choice))


PICK = {"type": "function", "function": {"name": "pick", "parameters": {"type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"], "additionalProperties": False}}}  # fmt: skip


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "pick"}}])
def test_a_forced_call_sampled_from_random_weights_is_a_valid_call(server, choice):
    """The real engine (the synthetic tokenizer: DeepSeek's tool tokens are among its added ones)
    under the grammar of tool_choice required or naming the function: whatever random weights
    prefer, the answer is one complete call of the offered tool with arguments valid under its
    schema, in response_format's one JSON layout, for several seeds."""
    c = client(server)
    for seed in range(4):
        answer = c.chat.completions.create(
            model=MODEL, messages=ASK, tools=[PICK], tool_choice=choice, max_tokens=200,
            temperature=1.0, seed=seed, parallel_tool_calls=False,
        ).choices[0]  # fmt: skip
        assert answer.finish_reason == "tool_calls", (seed, answer)
        (call,) = answer.message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name == "pick" and set(args) == {"n", "ok"}
        assert 0 <= args["n"] <= 9 and isinstance(args["ok"], bool)
        assert call.function.arguments == json.dumps(args)  # no free whitespace


def test_a_tool_schema_may_ask_for_its_own_json_layout(matcher):
    free = {"type": "function", "function": {"name": "weather", "parameters": {
            "x-guidance": {"whitespace_flexible": True}, "type": "object",
            "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
    accepts = matcher(tool_choice_grammar([free], "required"))
    assert accepts(BEGIN + call_text("weather", '{"city":"Paris"}') + END)
    assert accepts(BEGIN + call_text("weather", '{ "city" : "Paris" }') + END)


def test_a_parameters_schema_that_cannot_compile_is_a_400_naming_tools(server):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(model=MODEL, messages=ASK, tools=[bad], tool_choice="required")
    assert e.value.body["param"] == "tools" and "tools: cannot compile" in e.value.body["message"]
