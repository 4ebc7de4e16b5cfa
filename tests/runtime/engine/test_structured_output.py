"""Structured output (constrain.py): grammar-constrained sampling on the tiny model (random weights),
through the engine and through the server with the official `openai` client.

Random weights must still give valid JSON when constrained: every completion here is parsed and
checked against its schema (by `conforms`, a hand check of SCHEMA: jsonschema is not installed).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from _paths import REPO

from mlac.runtime.engine.constrain import Grammars, mask_logits, token_bitmask, unpack_bits
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.params import GrammarSpec, InvalidGrammar, SamplingParams
from mlac.runtime.engine.scheduler import SchedulerConfig
from mlac.runtime.serve import ServerConfig, ServerThread

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "tier": {"enum": ["gold", "silver", "bronze"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "age", "member", "tier", "tags"],
    "additionalProperties": False,
}
SPEC = GrammarSpec("json_schema", json.dumps(SCHEMA))
MAX_TOKENS = 200  # > the longest document SCHEMA allows, in byte tokens (escaped characters included)
KEY, MODEL = "sk-test", "tiny"


def conforms(doc: object) -> bool:
    """`doc` is valid under SCHEMA."""
    if not isinstance(doc, dict) or set(doc) != set(SCHEMA["required"]):
        return False
    name, age, member, tier, tags = (doc[k] for k in ("name", "age", "member", "tier", "tags"))
    return (
        isinstance(name, str)
        and len(name) <= 8
        and type(age) is int
        and 0 <= age <= 120
        and type(member) is bool
        and tier in ("gold", "silver", "bronze")
        and isinstance(tags, list)
        and len(tags) <= 2
        and all(isinstance(t, str) and len(t) <= 4 for t in tags)
    )


def test_conforms_rejects_what_the_schema_rejects():
    good = {"name": "Ada", "age": 36, "member": True, "tier": "gold", "tags": ["x"]}
    assert conforms(good)
    for bad in ({**good, "age": 121}, {**good, "name": "x" * 9}, {**good, "tier": "iron"},
                {**good, "member": 1}, {**good, "tags": ["a", "b", "c"]}, {**good, "extra": 1}):  # fmt: skip
        assert not conforms(bad)


@pytest.fixture(scope="module")
def art(artifact):
    return artifact("tiny-v3")


@pytest.fixture(scope="module")
def engine(art) -> Engine:
    return Engine.from_artifact(art, dtype=torch.float32, verify=False)


def prompts(engine: Engine, n: int) -> list[list[int]]:
    texts = ["Hello", "The weather report", "Questions and answers", "She opened the notebook"]
    return [engine.tokenizer.encode(f"{texts[i % 4]} {i}:") for i in range(n)]


# ---- the mask -----------------------------------------------------------------------------------


def test_unpack_bits_maps_bit_k_of_word_w_to_token_32w_plus_k():
    bits = torch.tensor([[1 - 2**31, 1 << 3], [0, -1]], dtype=torch.int32)  # [2, 2]: 64 tokens
    allowed = unpack_bits(bits, 40)
    assert allowed.shape == (2, 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 31, 35]
    assert allowed[1].nonzero().flatten().tolist() == list(range(32, 40))


def test_the_mask_allows_exactly_the_grammar_tokens(engine):
    tok = engine.tokenizer
    m = engine.grammars.matcher(GrammarSpec("lark", 'start: "yes" | "no"'))
    allowed = unpack_bits(token_bitmask([m]), engine.config.vocab_size)[0]
    texts = {tok.decode([t]) for t in allowed.nonzero().flatten().tolist()}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    assert "yes" in texts or "y" in texts


def test_eos_is_allowed_once_the_grammar_accepts(engine):
    m = engine.grammars.matcher(GrammarSpec("lark", 'start: "a"+'))
    vocab, eos = engine.config.vocab_size, engine.config.eos_token_ids
    assert not any(unpack_bits(token_bitmask([m]), vocab)[0, list(eos)])
    m.advance(engine.tokenizer.encode("a", add_bos=False)[0])
    assert m.accepting and not m.done
    assert all(unpack_bits(token_bitmask([m]), vocab)[0, list(eos)])


def test_logit_columns_past_the_tokenizer_are_never_allowed(engine):
    tok = engine.tokenizer
    grammars = Grammars(tok, tok.vocab_size + 70, engine.config.eos_token_ids)  # an embedding padded past it
    m = grammars.matcher(GrammarSpec("json_object", ""))
    bits = token_bitmask([m])
    assert bits.shape == (1, (tok.vocab_size + 70 + 31) // 32)
    allowed = unpack_bits(bits, tok.vocab_size + 70)[0]
    assert allowed[: tok.vocab_size].any() and not allowed[tok.vocab_size :].any()


def test_rows_without_grammar_are_not_touched(engine):
    logits = torch.randn(3, engine.config.vocab_size)
    assert mask_logits(logits, [None, None, None]) is logits  # no copy, no mask work
    m = engine.grammars.matcher(SPEC)
    out = mask_logits(logits, [None, m, None])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert out[1].isinf().sum() > 0 and logits[1].isfinite().all()  # the input is not changed
    assert out[1].argmax().item() in engine.tokenizer.encode("{", add_bos=False)  # a JSON object opens


def test_bad_schemas_and_grammars_name_response_format(engine):
    bad = [
        GrammarSpec("json_schema", "{not json"),
        GrammarSpec("json_schema", "[1, 2]"),
        GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "nope"}}})),
        GrammarSpec("lark", "start: undefined_rule"),
    ]
    for spec in bad:
        with pytest.raises(InvalidGrammar, match="response_format") as e:
            engine.new_sequence("Hi", SamplingParams(grammar=spec))
        assert e.value.param == "response_format"
    with pytest.raises(InvalidGrammar):
        GrammarSpec("xml", "<a/>")
    with pytest.raises(InvalidGrammar, match="response_format") as e:
        engine.new_sequence("Hi", SamplingParams(grammar=GrammarSpec("regex", "a+(")))
    with pytest.raises(ValueError, match="grammar"):
        SamplingParams(grammar='{"type": "object"}')


# ---- the engine ---------------------------------------------------------------------------------


def test_greedy_and_sampled_outputs_match_the_schema(engine):
    ps = prompts(engine, 12)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0 if i < 2 else 1.0, seed=i, grammar=SPEC)
              for i in range(12)]  # fmt: skip
    outs = engine.generate(ps, params)
    for o in outs:
        assert o.finish_reason == "stop" and conforms(json.loads(o.text)), o.text
    assert len({o.text for o in outs[2:]}) > 5  # sampling still samples
    again = engine.generate(ps[5], params[5])  # seeded: the same JSON again
    assert again.text == outs[5].text


def test_json_object_and_lark(engine):
    for i in range(3):
        o = engine.generate(prompts(engine, 3)[i], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=i,
                            grammar=GrammarSpec("json_object", "")))  # fmt: skip
        assert o.finish_reason == "length" or isinstance(json.loads(o.text), dict), o.text
    lark = GrammarSpec("lark", 'start: "The answer is " ("yes" | "no") "."')
    outs = engine.generate(
        prompts(engine, 4), SamplingParams(max_tokens=30, temperature=1.0, seed=3, grammar=lark)
    )
    assert {o.text for o in outs} <= {"The answer is yes.", "The answer is no."}
    assert all(o.finish_reason == "stop" for o in outs)


def test_grammar_completes_even_with_ignore_eos(engine):
    lark = GrammarSpec("lark", 'start: "ok"')
    o = engine.generate("Hi", SamplingParams(max_tokens=20, ignore_eos=True, grammar=lark))
    assert (o.text, o.finish_reason) == ("ok", "stop") and o.completion_tokens < 20


def test_mixed_batch_leaves_unconstrained_rows_unchanged(engine):
    ps = prompts(engine, 8)
    free = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0 if i % 2 else 0.9, seed=i)
            for i in range(8)]  # fmt: skip
    alone = [engine.generate(p, sp).token_ids for p, sp in zip(ps, free, strict=True)]
    mixed = [sp if i % 2 else SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, grammar=SPEC)
             for i, sp in enumerate(free)]  # fmt: skip
    outs = engine.generate(ps, mixed)
    for i, o in enumerate(outs):
        if i % 2:
            assert o.token_ids == alone[i]
        else:
            assert conforms(json.loads(o.text)), o.text


def test_preemption_keeps_the_matcher_right(art, engine):
    ps = prompts(engine, 6)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, grammar=SPEC) for i in range(6)]
    alone = [engine.generate(p, sp).text for p, sp in zip(ps, params, strict=True)]
    small = Engine.from_artifact(art, dtype=torch.float32, verify=False, num_blocks=40, block_size=4)
    sched = small.scheduler(SchedulerConfig(max_running_requests=6, chunked_prefill_size=16))
    seqs = [small.new_sequence(p, sp) for p, sp in zip(ps, params, strict=True)]
    for s in seqs:
        sched.add(s)
    while sched.has_unfinished:
        sched.step()
    assert sched.num_preemptions > 0
    assert [s.text() for s in seqs] == alone
    assert all(conforms(json.loads(t)) for t in alone)


# ---- the server, with the official openai client ------------------------------------------------


@pytest.fixture(scope="module")
def server(art):
    cfg = ServerConfig.of(artifact=art, api_key=KEY, dtype="float32", verify=False, served_model_name=MODEL)
    with ServerThread(cfg) as srv:
        yield srv


def test_50_sampled_json_schema_completions_validate(server):
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    docs = []
    for i in range(5):
        r = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Describe person number {i} as JSON."}],
            response_format=fmt,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=100 * i,
            n=10,
        )
        for ch in r.choices:
            assert ch.finish_reason == "stop", ch.message.content
            docs.append(json.loads(ch.message.content))
    assert len(docs) == 50 and all(conforms(d) for d in docs)
    assert len({json.dumps(d) for d in docs}) > 25  # 50 samples, not one answer repeated


def test_json_object_guided_json_streaming_and_errors(server):
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "JSON please"}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, response_format={"type": "json_object"},
                                  max_tokens=MAX_TOKENS, temperature=0)  # fmt: skip
    ch = r.choices[0]
    assert ch.finish_reason == "length" or isinstance(json.loads(ch.message.content), dict)
    r = c.completions.create(model=MODEL, prompt="Hello", max_tokens=MAX_TOKENS, temperature=0.7, seed=1,
                             extra_body={"guided_json": SCHEMA})  # fmt: skip
    assert conforms(json.loads(r.choices[0].text))
    chunks = c.completions.create(model=MODEL, prompt="Hello", max_tokens=MAX_TOKENS, temperature=0.7, seed=1,
                                  stream=True, extra_body={"guided_json": json.dumps(SCHEMA)})  # fmt: skip
    assert "".join(x.choices[0].text for x in chunks if x.choices) == r.choices[0].text
    r = c.chat.completions.create(model=MODEL, messages=msgs, response_format={"type": "text"}, max_tokens=3)
    assert r.choices[0].finish_reason in ("length", "stop")

    bad = [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
            "response_format",
        ),
        ({"type": "json_schema"}, "response_format"),
        ({"type": "xml"}, "response_format.type"),
    ]
    for fmt, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=msgs, response_format=fmt, max_tokens=8)
        assert e.value.body["param"] == param
    r = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "prompt": "x", "guided_regex": "a+("})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"  # does not compile


# ---- the GPU benchmark's script, run small on CPU so that it is known to run --------------------


def test_constrained_overhead_benchmark_runs(art, tmp_path, monkeypatch):
    import importlib.util
    import sys

    path = REPO / "benchmarks" / "e2e" / "constrained_overhead.py"
    spec = importlib.util.spec_from_file_location("constrained_overhead", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "overhead.json"
    argv = [str(path), str(art), "--out", str(out), "--batches", "1,4", "--steps", "4", "--warmup", "1",
            "--device", "cpu", "--dtype", "float32"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    rec = json.loads(out.read_text())
    for b in ("1", "4"):
        r = rec["results"][b]
        assert r["free"]["step_ms_median"] > 0 and r["constrained"]["mask_ms_median"] > 0
        assert r["constrained"]["bitmask_cpu_ms_median"] <= r["constrained"]["mask_ms_median"]
