"""API defaults and extras: n > 1 (completions and chat, streaming too), /tokenize and /detokenize
in vLLM's shapes, generation_config.json as the default sampling (--generation-config), chat
tools and chat_template_kwargs through the server, and a 400 naming each unsupported field
(the vLLM sampling fields mlac implements: test_vllm_fields.py)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from mlac.runtime.engine.generation_config import SamplingDefaults, sampling_defaults
from mlac.runtime.serve import ServerConfig, ServerThread
from mlac.runtime.serve.protocol import ChatBody, parse_body, sampling_params

KEY, MODEL = "sk-test", "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(art):
    cfg = ServerConfig.of(artifact=art, api_key=KEY, dtype="float32", verify=False, served_model_name=MODEL)
    with ServerThread(cfg) as srv:
        yield srv


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_n4_completions_and_chat(server, ref):
    c = client(server)
    r = c.completions.create(model=MODEL, prompt="The quick", n=4, max_tokens=5, temperature=1.0, seed=3,
                             extra_body={"ignore_eos": True})  # fmt: skip
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert len({ch.text for ch in r.choices}) > 1  # seed + j per choice: different samples
    prompt_len = len(ref.tokenizer.encode("The quick"))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_len, 20)  # prompt counted once
    again = c.completions.create(model=MODEL, prompt="The quick", n=4, max_tokens=5, temperature=1.0, seed=3,
                                 extra_body={"ignore_eos": True})  # fmt: skip
    assert [ch.text for ch in again.choices] == [ch.text for ch in r.choices]
    greedy = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=4,
                                       max_tokens=4, temperature=0)  # fmt: skip
    assert [ch.index for ch in greedy.choices] == [0, 1, 2, 3]
    assert len({ch.message.content for ch in greedy.choices}) == 1  # greedy: all four the same


def test_n_two_prompts_index_prompt_major(server):
    r = client(server).completions.create(
        model=MODEL, prompt=["a b", "c d"], n=2, max_tokens=3, temperature=0
    )
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text


def test_n4_streaming_chat(server):
    stream = client(server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        n=4,
        max_tokens=4,
        temperature=0,
        stream=True,
    )
    text, roles, finish = {}, set(), {}
    for chunk in stream:
        for ch in chunk.choices:
            text[ch.index] = text.get(ch.index, "") + (ch.delta.content or "")
            roles |= {ch.index} if ch.delta.role == "assistant" else set()
            finish[ch.index] = ch.finish_reason or finish.get(ch.index)
    assert roles == {0, 1, 2, 3} and set(finish) == {0, 1, 2, 3} and all(finish.values())
    assert len(set(text.values())) == 1


def test_tokenize_and_detokenize(server, ref):
    tok = ref.tokenizer
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "hello world"}, headers=AUTH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == ref.max_context
    bare = {"model": MODEL, "prompt": "hello world", "add_special_tokens": False}
    assert (
        httpx.post(f"{server.url}/tokenize", json=bare, headers=AUTH).json()["tokens"] == body["tokens"][1:]
    )
    msgs = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": msgs}, headers=AUTH).json()
    assert chat["tokens"] == tok.encode_chat(msgs)
    d = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": body["tokens"]}, headers=AUTH)
    assert d.status_code == 200 and d.json() == {
        "prompt": tok.decode(body["tokens"], skip_special_tokens=False)
    }
    assert d.json()["prompt"].endswith("hello world")


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/tokenize", {"model": MODEL}, "prompt"),
        (
            "/tokenize",
            {"model": MODEL, "prompt": "x", "messages": [{"role": "user", "content": "x"}]},
            "prompt",
        ),
        ("/detokenize", {"model": MODEL, "tokens": [10**7]}, "tokens"),
        ("/detokenize", {"model": MODEL, "tokens": "abc"}, "tokens"),
    ],
)
def test_tokenize_bad_input_is_400(server, route, body, param):
    r = httpx.post(f"{server.url}{route}", json=body, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "x"}).status_code == 401


@pytest.mark.parametrize(
    "field, value",
    [("use_beam_search", True), ("length_penalty", 0.5), ("n", 17), ("functions", [{"name": "f"}]),
     ("guided_whitespace_pattern", r"\s*")],
)  # fmt: skip
def test_unsupported_fields_are_400_naming_them(server, field, value):
    c = client(server)
    for call in (
        lambda: c.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={field: value}),
        lambda: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                          extra_body={field: value}),
    ):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == field and field in e.value.body["message"]


def test_neutral_values_of_unsupported_fields_are_accepted(server):
    extra = {"length_penalty": 1.0, "use_beam_search": False, "functions": [], "function_call": "none"}
    r = client(server).completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body=extra)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_tools_and_template_kwargs_reach_the_template(server, art, tmp_path):
    template = (
        "{{ bos_token }}{{ tools | tojson }}|{{ flag }}|{{ messages[1]['content'] is none }}<|Assistant|>"
    )
    (tmp_path / "t.jinja").write_text(template)
    cfg = ServerConfig.of(artifact=art, api_key=KEY, dtype="float32", verify=False, served_model_name=MODEL,
                       chat_template=tmp_path / "t.jinja")  # fmt: skip
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    with ServerThread(cfg) as srv:
        body = {"model": MODEL, "messages": msgs, "tools": tools, "chat_template_kwargs": {"flag": "on"}}
        ids = httpx.post(f"{srv.url}/tokenize", json=body, headers=AUTH).json()["tokens"]
        text = srv.state.loop.engine.tokenizer.decode(ids)
        assert text.startswith(f"{json.dumps(tools)}|on|True")  # tools, kwargs, null content kept
        r = client(srv).chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=1,
                                                extra_body={"chat_template_kwargs": {"flag": "on"}})  # fmt: skip
        assert r.usage.prompt_tokens == len(ids)


def test_generation_config_modes(art, tmp_path):
    assert sampling_defaults(art, "auto") == SamplingDefaults(temperature=0.6, top_p=0.95)  # synth's file
    assert sampling_defaults(art, "vllm") == sampling_defaults(art, "none") == SamplingDefaults()
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.3, "top_k": -1, "top_p": 0.5}')
    assert sampling_defaults(art, str(tmp_path)) == SamplingDefaults(temperature=0.3, top_p=0.5)
    from mlac.core.errors import MlacError

    with pytest.raises(MlacError, match="generation_config.json"):
        sampling_defaults(art, str(tmp_path / "nowhere"))
    (tmp_path / "generation_config.json").write_text('{"temperature": "hot"}')
    with pytest.raises(MlacError, match="temperature"):
        sampling_defaults(art, str(tmp_path))


def test_request_fields_win_over_generation_config():
    defaults = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)
    body = parse_body(ChatBody, {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 0.5})
    p = sampling_params(body, 8, None, defaults)
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.5, 20)
    body = parse_body(
        ChatBody, {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0}
    )
    assert sampling_params(body, 8, None, defaults).temperature == 0


def test_generate_uses_generation_config(art):
    from click.testing import CliRunner

    from mlac.cli import main

    base = ["generate", str(art), "--prompt", "The quick", "--max-tokens", "6", "--device", "cpu",
            "--dtype", "float32", "--no-verify", "--seed", "1"]  # fmt: skip
    runs = {mode: CliRunner().invoke(main, [*base, "--generation-config", mode]) for mode in ("auto", "none")}
    explicit = CliRunner().invoke(main, [*base, "--temperature", "0.6", "--top-p", "0.95"])
    assert all(r.exit_code == 0 for r in (*runs.values(), explicit)), [r.output for r in runs.values()]
    assert runs["auto"].output == explicit.output  # auto = the artifact's temperature 0.6, top_p 0.95
