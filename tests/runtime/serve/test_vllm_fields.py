"""The request fields vLLM users send, through the server with the official openai client:
penalties, logit_bias and min_tokens (the same tokens as the engine's, which test_penalties.py
checks against a reference), echo (with logprobs, with max_tokens 0, streamed), prompt_logprobs,
guided_choice / guided_regex / guided_grammar / structured_outputs, continue_final_message and
echo on chat, add_special_tokens, truncate_prompt_tokens, documents, a 400 naming each field given
out of its range, and a 400 naming each vLLM field mlac does not implement unless it is neutral."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from mlac.core.artifact import TOKENIZER_DIR
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.engine.tokenizer import Tokenizer
from mlac.runtime.serve import ServerConfig, ServerThread
from mlac.runtime.serve.app import _encode_chat
from mlac.runtime.serve.protocol import ChatBody, chat_messages, parse_body

KEY, MODEL = "sk-test", "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The morning train left the station"
MSGS = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server(art):
    cfg = ServerConfig.of(artifact=art, api_key=KEY, dtype="float32", verify=False, served_model_name=MODEL)
    with ServerThread(cfg) as srv:
        yield srv


@pytest.fixture(scope="module")
def c(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


# ---- penalties, logit_bias, min_tokens ---------------------------------------------------------


def test_penalties_and_bias_give_the_engines_tokens(c, ref):
    bias = {"17": 10}
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logit_bias=bias,
                             frequency_penalty=2.0, presence_penalty=0.5,
                             extra_body={"repetition_penalty": 1.3})  # fmt: skip
    want = ref.generate(PROMPT, SamplingParams(max_tokens=10, logit_bias={17: 10.0}, frequency_penalty=2.0,
                                               presence_penalty=0.5, repetition_penalty=1.3))  # fmt: skip
    assert r.choices[0].text == want.text
    only_bias = c.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logit_bias=bias
    )
    assert only_bias.choices[0].text != r.choices[0].text  # the penalties changed the answer
    chat = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, temperature=0,
                                     logit_bias={"17": 100})  # fmt: skip
    assert chat.choices[0].message.content == ref.tokenizer.decode([17] * 6)


def test_min_tokens_holds_eos_back(c, ref):
    eos = str(ref.config.eos_token_ids[0])
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logit_bias={eos: 100},
                             extra_body={"min_tokens": 4})  # fmt: skip
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (5, "stop")  # 4, then eos


# ---- echo and prompt logprobs ------------------------------------------------------------------


def test_echo_puts_the_prompt_first(c):
    plain = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    echoed = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    streamed = c.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, stream=True
    )
    assert "".join(x.choices[0].text for x in streamed if x.choices) == echoed.choices[0].text
    ids = [0, 17, 18, 19]
    r = c.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, echo=True)
    assert r.choices[0].text.startswith("<｜begin▁of▁sentence｜>")  # token ids: decoded as they are


def test_echo_with_logprobs_scores_the_prompt(c, ref):
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2)
    lp, ids = r.choices[0].logprobs, ref.encode_prompt(PROMPT)
    n = len(ids)
    assert len(lp.tokens) == n + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = torch.log_softmax(ref.score(ids), dim=-1)
    for i in range(1, n):
        assert lp.token_logprobs[i] == pytest.approx(want[i - 1, ids[i]].item(), abs=1e-4)
        assert len(lp.top_logprobs[i]) <= 2
    assert lp.text_offset == sorted(lp.text_offset)


def test_echo_with_max_tokens_0_is_the_prompt_alone(c, ref):
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    ch = r.choices[0]
    assert ch.text == PROMPT and ch.finish_reason == "length"
    assert len(ch.logprobs.tokens) == len(ref.encode_prompt(PROMPT))  # lm-eval's loglikelihood request
    assert r.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_prompt_logprobs_in_vllms_shape(c, ref):
    ids = ref.encode_prompt(PROMPT)
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 2})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for i, entry in enumerate(got[1:], start=1):
        own = entry[str(ids[i])]
        assert set(own) == {"logprob", "rank", "decoded_token"} and own["rank"] >= 1
        assert 2 <= len(entry) <= 3  # the token itself, and the 2 most likely
    streamed = list(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stream=True,
                                         extra_body={"prompt_logprobs": 2}))  # fmt: skip
    firsts = [x.choices[0].model_extra.get("prompt_logprobs") for x in streamed if x.choices]
    assert firsts[0] == got and all(f is None for f in firsts[1:])
    chat = c.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 3
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 0})  # fmt: skip
    assert e.value.body["param"] == "prompt_logprobs"


# ---- guided decoding ---------------------------------------------------------------------------


def test_guided_choice_regex_grammar(c):
    choices = ["yes", "no", "maybe later"]
    for seed in range(3):
        r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=1.0, seed=seed,
                                 extra_body={"guided_choice": choices})  # fmt: skip
        assert r.choices[0].text in choices and r.choices[0].finish_reason == "stop"
    r = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=30, temperature=1.0, seed=1,
                                  extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})  # fmt: skip
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.choices[0].message.content)
    grammar = 'start: "(" NUMBER ")"\nNUMBER: /[1-9][0-9]?/\n'
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=2,
                             extra_body={"guided_grammar": grammar})  # fmt: skip
    assert re.fullmatch(r"\([1-9][0-9]?\)", r.choices[0].text)
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=1.0, seed=3,
                             extra_body={"structured_outputs": {"json": {"type": "object", "properties":
                                         {"ok": {"type": "boolean"}}, "required": ["ok"],
                                         "additionalProperties": False}}})  # fmt: skip
    assert isinstance(json.loads(r.choices[0].text)["ok"], bool)
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0,
                             extra_body={"structured_outputs": {"choice": ["a1", "b2"]}})  # fmt: skip
    assert r.choices[0].text in ("a1", "b2")


@pytest.mark.parametrize(
    "extra, param",
    [({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice"),
     ({"guided_regex": "a+", "guided_json": {"type": "object"}}, "guided_regex"),
     ({"guided_regex": "a+("}, "guided_regex"),
     ({"guided_grammar": "start: nothing_defined"}, "guided_grammar"),
     ({"guided_choice": []}, "guided_choice"),
     ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs")],
)  # fmt: skip
def test_guided_fields_that_cannot_be_are_400_naming_them(c, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body=extra)
    assert e.value.body["param"].split(".")[0] == param


# ---- ranges ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0), ("repetition_penalty", -1),
     ("logit_bias", {"5": 101}), ("logit_bias", {"x": 1}), ("logit_bias", {"99999999": 1}),
     ("min_tokens", -1), ("min_tokens", 9), ("prompt_logprobs", 21), ("prompt_logprobs", -1)],
)  # fmt: skip
def test_out_of_range_values_are_400_naming_the_field(c, field, value):
    for call in (
        lambda: c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={field: value}),
        lambda: c.chat.completions.create(
            model=MODEL, messages=MSGS, max_tokens=8, extra_body={field: value}
        ),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"].split(".")[0] == field, e.value.body
        assert e.value.body["type"] == "invalid_request_error"


# ---- continue_final_message and echo on chat ---------------------------------------------------

PREFIX = "The morning train left"
OPEN = [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": PREFIX}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


def _tokenize(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/tokenize", json={"model": MODEL, **body}, headers=AUTH)


def _open_prompt(ref) -> list[int]:
    """OPEN rendered without a generation prompt and cut right after PREFIX (no end of turn)."""
    whole = ref.tokenizer.apply_chat_template(OPEN, add_generation_prompt=False)
    cut = whole[: whole.rindex(PREFIX) + len(PREFIX)]
    assert cut != whole and whole.startswith(cut)  # the template's end of turn is dropped
    return ref.tokenizer.encode(cut, add_bos=False)


def test_continue_final_message_leaves_the_final_message_open(server, c, ref):
    want = _open_prompt(ref)
    for body in (CONTINUE, {"continue_final_message": True}):  # add_generation_prompt left out: false
        r = _tokenize(server, messages=OPEN, **body)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == want
    assert _tokenize(server, messages=OPEN, add_generation_prompt=False).json()["tokens"] != want
    r = c.chat.completions.create(
        model=MODEL, messages=OPEN, max_tokens=6, temperature=0, extra_body=CONTINUE
    )
    assert r.usage.prompt_tokens == len(want)
    assert r.choices[0].message.content == ref.generate(want, SamplingParams(max_tokens=6)).text
    closed = c.chat.completions.create(model=MODEL, messages=OPEN, max_tokens=6, temperature=0)
    assert closed.usage.prompt_tokens != len(want)


def test_continue_final_message_with_a_generation_prompt_is_400(server, c):
    both = {"continue_final_message": True, "add_generation_prompt": True}
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=OPEN, max_tokens=2, extra_body=both)
    assert e.value.body["param"] == "continue_final_message"
    r = _tokenize(server, messages=OPEN, **both)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    blank = [OPEN[0], {"role": "assistant", "content": "  "}]  # nothing to continue
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=blank, max_tokens=2, extra_body=CONTINUE)
    assert e.value.body["param"] == "continue_final_message"


def test_chat_echo_puts_the_final_assistant_content_first(c):
    plain = c.chat.completions.create(model=MODEL, messages=OPEN, max_tokens=5, temperature=0, n=2,
                                      extra_body=CONTINUE)  # fmt: skip
    echoed = c.chat.completions.create(model=MODEL, messages=OPEN, max_tokens=5, temperature=0, n=2,
                                       extra_body={**CONTINUE, "echo": True})  # fmt: skip
    assert [ch.message.content for ch in echoed.choices] == [
        PREFIX + ch.message.content for ch in plain.choices
    ]
    assert echoed.usage == plain.usage
    user_last = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, temperature=0,
                                          extra_body={"echo": True})  # fmt: skip
    alone = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, temperature=0)
    assert user_last.choices[0].message.content == alone.choices[0].message.content  # a user's: no echo


def test_chat_echo_streamed_opens_with_the_echo(c):
    whole = c.chat.completions.create(model=MODEL, messages=OPEN, max_tokens=5, temperature=0, n=2,
                                      extra_body={**CONTINUE, "echo": True})  # fmt: skip
    stream = c.chat.completions.create(model=MODEL, messages=OPEN, max_tokens=5, temperature=0, n=2,
                                       stream=True, extra_body={**CONTINUE, "echo": True})  # fmt: skip
    deltas: dict[int, list[str]] = {0: [], 1: []}
    for chunk in stream:
        for ch in chunk.choices:
            if ch.delta.content:
                deltas[ch.index].append(ch.delta.content)
    for i, ch in enumerate(whole.choices):
        assert deltas[i][0] == PREFIX  # the first content delta is the echo alone
        assert "".join(deltas[i]) == ch.message.content


# ---- add_special_tokens, truncate_prompt_tokens, documents -------------------------------------


def test_add_special_tokens(c, ref):
    ids = ref.encode_prompt(PROMPT)
    assert ids[0] == ref.tokenizer.bos_token_id
    bare = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                extra_body={"add_special_tokens": False})  # fmt: skip
    assert bare.usage.prompt_tokens == len(ids) - 1
    assert bare.choices[0].text == ref.generate(ids[1:], SamplingParams(max_tokens=4)).text
    chat = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1)
    bos = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1,
                                    extra_body={"add_special_tokens": True})  # fmt: skip
    assert bos.usage.prompt_tokens == chat.usage.prompt_tokens + 1  # a second bos, as asked


def test_truncate_prompt_tokens_keeps_the_last_tokens(c, ref):
    ids = ref.encode_prompt(PROMPT)
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                             extra_body={"truncate_prompt_tokens": 3})  # fmt: skip
    assert r.usage.prompt_tokens == 3
    tail = ref.generate(ids[-3:], SamplingParams(max_tokens=4)).text
    assert r.choices[0].text == ref.tokenizer.decode(ids[-3:], skip_special_tokens=False) + tail
    whole = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                 extra_body={"truncate_prompt_tokens": -1})  # fmt: skip
    assert whole.usage.prompt_tokens == len(ids)  # the context holds it all
    chat = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1,
                                     extra_body={"truncate_prompt_tokens": 2})  # fmt: skip
    assert chat.usage.prompt_tokens == 2
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"truncate_prompt_tokens": 0}
        )
    assert e.value.body["param"] == "truncate_prompt_tokens"


def test_documents_reach_the_template(art, tmp_path):
    (tmp_path / "t.jinja").write_text(
        "{% for d in documents %}[{{ d.title }}]{% endfor %}{{ messages[0].content }}"
    )
    tok = Tokenizer(art / TOKENIZER_DIR)
    tok.use_chat_template(tmp_path / "t.jinja")
    body = parse_body(
        ChatBody, {"model": MODEL, "messages": MSGS, "documents": [{"title": "A", "text": "a"}]}
    )
    ids = _encode_chat(SimpleNamespace(tokenizer=tok), chat_messages(body), body)
    assert tok.decode(ids) == "[A]" + MSGS[0]["content"]


# ---- fields mlac does not implement ------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, neutral",
    [("include_stop_str_in_output", True, False), ("skip_special_tokens", False, True),
     ("include_reasoning", False, True), ("allowed_token_ids", [5, 6], None), ("bad_words", ["train"], []),
     ("logprob_token_ids", [5], None), ("logits_processors", ["m.P"], []), ("truncation_side", "right", "left"),
     ("thinking_token_budget", 8, -1), ("repetition_detection", {"max_pattern_size": 4}, None),
     ("watermarking", True, False), ("early_stopping", True, False), ("prompt_embeds", "AAAA", None),
     ("chat_template", "{{ 'x' }}", None), ("priority", 1, 0), ("cache_salt", "s", None),
     ("kv_transfer_params", {"do_remote_prefill": True}, None), ("ec_transfer_params", {"x": 1}, None),
     ("vllm_xargs", {"k": 1}, {}), ("structural_tag", "{}", None), ("reasoning_effort", "low", None),
     ("return_tokens_as_token_ids", True, False), ("return_token_ids", True, False),
     ("return_prompt_text", True, False)],
)  # fmt: skip
def test_unimplemented_vllm_fields_are_400_unless_neutral(c, field, value, neutral):
    for call in (
        lambda extra: c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body=extra),
        lambda extra: c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1, extra_body=extra),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            call({field: value})
        assert e.value.body["param"] == field and field in e.value.body["message"]
        assert call({field: neutral}).usage.completion_tokens == 1


def test_continuous_usage_stats_is_400(c):
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1, stream=True,
                                  stream_options={"include_usage": True, "continuous_usage_stats": True})  # fmt: skip
    assert e.value.body["param"] == "stream_options.continuous_usage_stats"
