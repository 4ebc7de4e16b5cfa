"""Chat templates rendered as transformers renders them: parity of token ids with
AutoTokenizer.apply_chat_template on the same files, chat_template.jinja over tokenizer_config's,
--chat-template, tools and chat_template_kwargs, null content with tool_calls, bos exactly once."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from mlac.runtime.engine.tokenizer import FinalMessageNotFound, Tokenizer
from mlac.synth.tokenizer import CHAT_TEMPLATE, write_tokenizer

# A DeepSeek-style template that uses what the synthetic one does not: tools (tojson), assistant
# turns of tool calls with null content, tool results, a template variable (`thinking`), loopcontrols.
TOOL_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}{{- 'Tools:' + (tools | tojson) + '\\n' -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{- m['content'] + '\\n' -}}{%- continue -%}{%- endif -%}"
    "{%- if m['role'] == 'user' -%}{{- '<|User|>' + m['content'] -}}"
    "{%- elif m['role'] == 'assistant' and m['content'] is none -%}"
    "{%- for c in m['tool_calls'] -%}"
    "{{- '<|Assistant|>call ' + c['function']['name'] + ' ' + c['function']['arguments'] + eos_token -}}"
    "{%- endfor -%}"
    "{%- elif m['role'] == 'assistant' -%}{{- '<|Assistant|>' + m['content'] + eos_token -}}"
    "{%- elif m['role'] == 'tool' -%}{{- 'result ' + m['tool_call_id'] + ': ' + m['content'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|Assistant|>' -}}"
    "{%- if thinking is defined and thinking -%}{{- '<think>' -}}{%- endif -%}{%- endif -%}"
)

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Météo <now>",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
CONVERSATIONS = {
    "system + user": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
    "multi-turn": [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "how are you?"},
    ],
    "tool round trip": [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ],
}


def _tokenizer_dir(root: Path, template: str, jinja: bool) -> Path:
    """The synthetic tokenizer's files; `template` in chat_template.jinja (jinja) or in the config."""
    root.mkdir()
    write_tokenizer(root, vocab_size=2048, model_max_length=4096)
    cfg_file = root / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    if jinja:
        (root / "chat_template.jinja").write_text(template, encoding="utf-8")
    else:
        cfg["chat_template"] = template
    cfg_file.write_text(json.dumps(cfg))
    return root


@pytest.fixture(scope="module")
def tool_dir(tmp_path_factory) -> Path:
    return _tokenizer_dir(tmp_path_factory.mktemp("t") / "tool", TOOL_TEMPLATE, jinja=True)


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory) -> Path:
    return _tokenizer_dir(tmp_path_factory.mktemp("t") / "synth", CHAT_TEMPLATE, jinja=False)


def _hf_ids(root: Path, messages, **kwargs) -> list[int]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(root))
    out = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    return list(out["input_ids"] if isinstance(out, dict) else out)


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False])
def test_tool_template_ids_match_transformers(tool_dir, name, gen):
    messages = CONVERSATIONS[name]
    mine = Tokenizer(tool_dir).encode_chat(messages, add_generation_prompt=gen, tools=TOOLS)
    assert mine == _hf_ids(tool_dir, messages, add_generation_prompt=gen, tools=TOOLS)


@pytest.mark.parametrize("name", ["system + user", "multi-turn"])
def test_synthetic_template_ids_match_transformers(synth_dir, name):
    messages = CONVERSATIONS[name]
    mine = Tokenizer(synth_dir).encode_chat(messages)
    assert mine == _hf_ids(synth_dir, messages, add_generation_prompt=True)


def test_chat_template_kwargs_reach_the_template(tool_dir):
    tok, messages = Tokenizer(tool_dir), CONVERSATIONS["system + user"]
    assert tok.apply_chat_template(messages, thinking=True).endswith("<|Assistant|><think>")
    assert tok.apply_chat_template(messages).endswith("<|Assistant|>")
    assert tok.encode_chat(messages, thinking=True) == _hf_ids(
        tool_dir, messages, add_generation_prompt=True, thinking=True
    )


def test_tools_reach_the_template_unescaped(tool_dir):
    text = Tokenizer(tool_dir).apply_chat_template(CONVERSATIONS["system + user"], tools=TOOLS)
    assert 'Tools:[{"type": "function"' in text and "Météo <now>" in text  # tojson as transformers'


def test_null_content_with_tool_calls_is_kept(tool_dir):
    text = Tokenizer(tool_dir).apply_chat_template(CONVERSATIONS["tool round trip"])
    assert '<|Assistant|>call weather {"city": "Paris"}' in text and "result call_1: sunny" in text


OPEN_TURN = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Well, hi "}]


@pytest.mark.parametrize("root", ["tool_dir", "synth_dir"])
def test_continue_final_message_matches_transformers(root, request):
    path = request.getfixturevalue(root)
    mine = Tokenizer(path).encode_chat(OPEN_TURN, add_generation_prompt=False, continue_final_message=True)
    want = _hf_ids(path, OPEN_TURN, add_generation_prompt=False, continue_final_message=True)
    assert mine == want
    assert mine != Tokenizer(path).encode_chat(OPEN_TURN, add_generation_prompt=False)  # end of turn cut


def test_continue_final_message_cuts_after_the_last_occurrence(tool_dir):
    tok = Tokenizer(tool_dir)
    msgs = [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "ok"}]
    assert tok.apply_chat_template(msgs, False, continue_final_message=True).endswith(
        "<|User|>ok<|Assistant|>ok"
    )
    with pytest.raises(ValueError, match="add_generation_prompt"):
        tok.apply_chat_template(msgs, True, continue_final_message=True)


def test_continue_final_message_content_not_rendered(tmp_path):
    root = _tokenizer_dir(tmp_path / "drops", "{{ messages[0]['content'] | upper }}", jinja=True)
    tok = Tokenizer(root)
    with pytest.raises(FinalMessageNotFound, match="does not appear"):
        tok.apply_chat_template([{"role": "assistant", "content": "abc"}], False, continue_final_message=True)
    with pytest.raises(FinalMessageNotFound, match="no content"):
        tok.apply_chat_template([{"role": "assistant", "content": None}], False, continue_final_message=True)
    trims = _tokenizer_dir(tmp_path / "trims", "<a>{{ messages[0]['content'] | trim }}</a>", jinja=True)
    out = Tokenizer(trims).apply_chat_template([{"role": "assistant", "content": " x y "}], False,
                                               continue_final_message=True)  # fmt: skip
    assert out == "<a>x y"  # matched by the trimmed text, as transformers does


def test_jinja_file_wins_over_the_config(tmp_path):
    root = _tokenizer_dir(tmp_path / "both", "config says {{ messages[0]['content'] }}", jinja=False)
    assert Tokenizer(root).apply_chat_template([{"role": "user", "content": "x"}]) == "config says x"
    (root / "chat_template.jinja").write_text("jinja says {{ messages[0]['content'] }}")
    assert Tokenizer(root).apply_chat_template([{"role": "user", "content": "x"}]) == "jinja says x"


def test_named_templates_in_the_config_use_default(tmp_path):
    root = _tokenizer_dir(tmp_path / "named", "unused", jinja=False)
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "plain"},
    ]
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer(root).apply_chat_template([{"role": "user", "content": "x"}]) == "plain"


def test_use_chat_template_overrides(tool_dir, tmp_path):
    (tmp_path / "t.jinja").write_text("override {{ messages | length }}")
    tok = Tokenizer(tool_dir)
    tok.apply_chat_template(CONVERSATIONS["multi-turn"])  # compiles the artifact's template first
    tok.use_chat_template(tmp_path / "t.jinja")
    assert tok.apply_chat_template(CONVERSATIONS["multi-turn"]) == "override 3"


def test_bos_exactly_once(tool_dir, synth_dir):
    for root in (tool_dir, synth_dir):
        tok = Tokenizer(root)
        ids = tok.encode_chat(CONVERSATIONS["multi-turn"])
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


@pytest.fixture(scope="module")
def jinja_artifact(tmp_path_factory) -> Path:
    """tiny-v3 compiled from a checkpoint whose template is in chat_template.jinja (transformers 5)."""
    from mlac.compiler.pipeline import compile_checkpoint
    from mlac.core.artifact import CompileOptions
    from mlac.synth import synthesize

    ckpt = synthesize(tmp_path_factory.mktemp("ckpt") / "tiny-v3", preset="tiny-v3", seed=0)
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "chat_template.jinja").write_text(cfg.pop("chat_template"), encoding="utf-8")
    (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    out = tmp_path_factory.mktemp("artifact") / "tiny-v3"
    compile_checkpoint(ckpt, out, CompileOptions())
    return out


def test_compile_copies_chat_template_jinja(jinja_artifact):
    from mlac.core.artifact import Manifest

    assert (jinja_artifact / "tokenizer" / "chat_template.jinja").is_file()
    assert "tokenizer/chat_template.jinja" in {f.path for f in Manifest.load(jinja_artifact).files}
    assert Tokenizer(jinja_artifact / "tokenizer").chat_template == CHAT_TEMPLATE


def test_generate_chat_adds_bos_once(jinja_artifact, tmp_path):
    from click.testing import CliRunner

    from mlac.cli import main

    tok = Tokenizer(jinja_artifact / "tokenizer")
    (tmp_path / "t.jinja").write_text("{{ bos_token }}say: {{ messages[0]['content'] }}")
    for extra in ([], ["--chat-template", str(tmp_path / "t.jinja")]):
        args = ["generate", str(jinja_artifact), "--prompt", "hello", "--chat", "--max-tokens", "1",
                "--device", "cpu", "--dtype", "float32", "--no-verify", *extra]  # fmt: skip
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 0, r.output
        if extra:
            tok.use_chat_template(tmp_path / "t.jinja")
        ids = tok.encode_chat([{"role": "user", "content": "hello"}])
        assert ids.count(tok.bos_token_id) == 1
        assert f"[{len(ids)} prompt tokens" in r.output


# --- DeepSeek's published templates (tests/data/chat_templates, README.md there says whose) -------
# Rendered over a tokenizer that has DeepSeek's tool and think tokens (tests/_deepseek_tokenizer.py).

DS_TEMPLATES = (
    "deepseek_v3",
    "deepseek_r1",
    "deepseek_v31",
    "vllm_tool_chat_template_deepseekv3",
    "vllm_tool_chat_template_deepseekr1",
)
WEATHER = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
}
TIME = {"id": "call_2", "type": "function", "function": {"name": "time", "arguments": '{"zone": "CET"}'}}
ASK = {"role": "user", "content": "Weather and time in Paris?"}
DS_CONVERSATIONS = {
    "system + multi-turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Answer in English."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "how are you?"},
    ],
    "one call, content null": [ASK, {"role": "assistant", "content": None, "tool_calls": [WEATHER]}],
    "two calls, consecutive results, answer": [
        {"role": "system", "content": "Use the tools."},
        ASK,
        {"role": "assistant", "content": None, "tool_calls": [WEATHER, TIME]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
        {"role": "assistant", "content": "Sunny, 21 C, and it is 14:05."},
        {"role": "user", "content": "Thanks!"},
    ],
    "reasoning in an earlier answer": [
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": "<think>\nTwo plus three.\n</think>\n\nFive."},
        {"role": "user", "content": "And 2 + 4?"},
    ],
}


@pytest.fixture(scope="module")
def ds_dirs(tmp_path_factory) -> dict[str, Path]:
    from _deepseek_tokenizer import deepseek_tokenizer_dir, template

    root = tmp_path_factory.mktemp("ds")
    return {name: deepseek_tokenizer_dir(root / name, template(name)) for name in DS_TEMPLATES}


@pytest.mark.parametrize("name", DS_TEMPLATES)
@pytest.mark.parametrize("conversation", list(DS_CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_deepseek_templates_ids_match_transformers(ds_dirs, name, conversation, gen, tools):
    messages = DS_CONVERSATIONS[conversation]
    tok = Tokenizer(ds_dirs[name])
    if name == "vllm_tool_chat_template_deepseekr1" and any(m["content"] is None for m in messages):
        for render in (tok.encode_chat, functools.partial(_hf_ids, ds_dirs[name])):  # `'</think>' in None`
            with pytest.raises(TypeError):
                render(messages, add_generation_prompt=gen, tools=tools)
        return
    mine = tok.encode_chat(messages, add_generation_prompt=gen, tools=tools)
    assert mine == _hf_ids(ds_dirs[name], messages, add_generation_prompt=gen, tools=tools)
    assert mine.count(tok.bos_token_id) == 1  # bos once
    assert mine[0] == tok.bos_token_id or name.startswith("vllm")  # vLLM's template writes "\n" before it


def test_deepseek_templates_render_the_turns_as_published(ds_dirs):
    """What the parity test compares is DeepSeek's format: calls in the tool-call block, results in
    the tool-output block, R1's prompt opening <think> and dropping an earlier answer's reasoning."""
    calls = DS_CONVERSATIONS["two calls, consecutive results, answer"]
    v3 = Tokenizer(ds_dirs["deepseek_v3"]).apply_chat_template(calls)
    assert v3.startswith("<｜begin▁of▁sentence｜>Use the tools.<｜User｜>Weather and time in Paris?")
    assert (
        "<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>weather\n```json\n"
        '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>time' in v3
    )
    assert "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny, 21 C<｜tool▁output▁end｜>\n" in v3
    assert v3.endswith("<｜User｜>Thanks!<｜Assistant｜>")
    r1 = Tokenizer(ds_dirs["deepseek_r1"])
    text = r1.apply_chat_template(DS_CONVERSATIONS["reasoning in an earlier answer"])
    assert "<｜Assistant｜>\n\nFive.<｜end▁of▁sentence｜>" in text and "Two plus three" not in text
    assert text.endswith("<｜Assistant｜><think>\n")
    vllm = Tokenizer(ds_dirs["vllm_tool_chat_template_deepseekv3"]).apply_chat_template(
        calls[:2], tools=TOOLS
    )
    assert "You may call one or more functions" in vllm and '"name": "weather"' in vllm


@pytest.mark.parametrize("thinking", [True, False])
def test_v31_template_switches_thinking_and_writes_v31_calls(ds_dirs, thinking):
    """V3.1's hybrid thinking through chat_template_kwargs: the prompt ends in <think> (thinking)
    or </think>; its tool calls are `NAME<sep>ARGS`, without a type or a fence. Parity too."""
    tok, ask = Tokenizer(ds_dirs["deepseek_v31"]), DS_CONVERSATIONS["system + multi-turn"]
    text = tok.apply_chat_template(ask, thinking=thinking)
    assert text.endswith("<｜User｜>how are you?<｜Assistant｜>" + ("<think>" if thinking else "</think>"))
    assert tok.encode_chat(ask, thinking=thinking) == _hf_ids(
        ds_dirs["deepseek_v31"], ask, add_generation_prompt=True, thinking=thinking
    )
    conversation = DS_CONVERSATIONS["two calls, consecutive results, answer"]
    calls = tok.apply_chat_template(conversation, thinking=thinking)
    assert (
        "<｜Assistant｜></think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>weather<｜tool▁sep｜>"
        '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>time<｜tool▁sep｜>' in calls
    )
    assert "<｜tool▁output▁begin｜>sunny, 21 C<｜tool▁output▁end｜>" in calls
