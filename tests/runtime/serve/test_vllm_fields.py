"""The request fields vLLM users send, through the server with the official openai client:
penalties, logit_bias and min_tokens (the same tokens as the engine's, which test_penalties.py
checks against a reference), echo (with logprobs, with max_tokens 0, streamed), prompt_logprobs,
guided_choice / guided_regex / guided_grammar / structured_outputs, and a 400 naming each field
given out of its range."""

from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest
import torch

from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.sampling import SamplingParams
from mlac.runtime.serve import ServerConfig, ServerThread

KEY, MODEL = "sk-test", "tiny"
PROMPT = "The morning train left the station"
MSGS = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def art(artifact) -> Path:
    return artifact("tiny-v3")


@pytest.fixture(scope="module")
def ref(art) -> Engine:
    return Engine.from_artifact(art, dtype=torch.float32, verify=False)


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
