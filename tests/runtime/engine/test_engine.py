"""Engine end to end on a compiled synthetic artifact (mlac synth -> mlac compile -> Engine)."""

from __future__ import annotations

import pytest
import torch

import mlac
from mlac.core.errors import MlacError
from mlac.runtime.engine.engine import Completion, Engine
from mlac.runtime.engine.params import SamplingParams

PROMPT = "The morning train left the station"


@pytest.fixture(scope="module")
def engine(artifact) -> Engine:
    return Engine.from_artifact(artifact("tiny-v3"))  # bf16, verified, default cache


def with_config(engine: Engine, **update) -> Engine:
    """The same model and cache under a changed ModelConfig (eos, context length)."""
    return Engine(engine.config.model_copy(update=update), engine.runner, engine.tokenizer)


def test_public_exports():
    assert mlac.Engine is Engine


def test_text_prompt_is_encoded_with_bos(engine):
    out = engine.generate(PROMPT, max_tokens=5)
    ids = engine.tokenizer.encode(PROMPT)
    assert ids[0] == engine.tokenizer.bos_token_id and ids.count(ids[0]) == 1
    assert isinstance(out, Completion) and out.prompt_tokens == len(ids)
    assert out.completion_tokens == len(out.token_ids) <= 5
    assert engine.pool.allocator.num_free == engine.cache.num_blocks


def test_greedy_is_deterministic_and_text_is_the_decoded_tokens(engine):
    a = engine.generate(PROMPT, max_tokens=12, ignore_eos=True)
    b = engine.generate(PROMPT, max_tokens=12, ignore_eos=True)
    assert a == b and a.finish_reason == "length" and a.completion_tokens == 12
    assert a.text == engine.tokenizer.decode(a.token_ids)


def test_same_seed_same_sample_other_seed_other_sample(engine):
    def run(seed):
        return engine.generate(PROMPT, max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True).token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)
    top1 = engine.generate(PROMPT, max_tokens=8, temperature=1.0, top_k=1, seed=3, ignore_eos=True)
    assert top1.token_ids == engine.generate(PROMPT, max_tokens=8, ignore_eos=True).token_ids


def test_stop_string_cuts_the_text(engine):
    full = engine.generate(PROMPT, max_tokens=24, ignore_eos=True)
    assert len(full.text) > 10
    stop = full.text[6:9]
    out = engine.generate(PROMPT, max_tokens=24, ignore_eos=True, stop=["@@never@@", stop])
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.find(stop)]
    assert out.token_ids == full.token_ids[: out.completion_tokens]
    assert out.completion_tokens < full.completion_tokens


def test_stop_token_ids_and_eos(engine):
    ids = engine.generate(PROMPT, max_tokens=10, ignore_eos=True).token_ids
    k = ids.index(ids[3])  # first occurrence
    out = engine.generate(PROMPT, max_tokens=10, ignore_eos=True, stop_token_ids=[ids[3]])
    assert (out.finish_reason, out.token_ids) == ("stop", ids[: k + 1])
    assert out.text == engine.tokenizer.decode(ids[:k])  # the stop token is not in the text
    eos_engine = with_config(engine, eos_token_ids=(ids[3],))
    assert eos_engine.generate(PROMPT, max_tokens=10).token_ids == ids[: k + 1]
    assert eos_engine.generate(PROMPT, max_tokens=10, ignore_eos=True).token_ids == ids


def test_context_length_limits(engine):
    ids = engine.tokenizer.encode(PROMPT)
    short = with_config(engine, max_position_embeddings=len(ids) + 3)
    out = short.generate(ids, max_tokens=10, ignore_eos=True)
    assert (out.finish_reason, out.completion_tokens) == ("length", 3)
    with pytest.raises(MlacError, match="exceeds max_position_embeddings"):
        with_config(engine, max_position_embeddings=len(ids) - 1).generate(ids)


def test_cache_limits(artifact):
    small = Engine.from_artifact(artifact("tiny-v3"), verify=False, num_blocks=2, block_size=16)
    assert small.max_context == 32
    with pytest.raises(MlacError, match="exceeds the KV cache"):
        small.score(list(range(5, 45)))
    both = small.generate([[5] * 20, [6] * 20], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [c.completion_tokens for c in both] == [4, 4]  # one at a time: the second waits for blocks
    assert small.pool.allocator.num_free == 2
    out = small.generate([5] * 30, max_tokens=8, ignore_eos=True)
    assert (out.finish_reason, out.completion_tokens) == ("length", 2)


def test_score(engine):
    ids = engine.tokenizer.encode(PROMPT)
    logits = engine.score(torch.tensor(ids))
    assert logits.shape == (len(ids), engine.config.vocab_size) and logits.dtype == torch.float32
    first = engine.generate(ids, max_tokens=1).token_ids[0]
    assert first == logits[-1].argmax().item()
    with pytest.raises(MlacError, match="empty prompt"):
        engine.score([])
    with pytest.raises(MlacError, match="out of range"):
        engine.score([0, engine.config.vocab_size])


def test_batch_of_prompts_with_their_own_params(engine):
    prompts = [PROMPT, "What is two plus three?", [0, 5, 6, 7]]
    params = [SamplingParams(max_tokens=6, ignore_eos=True), SamplingParams(max_tokens=3, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0.8, seed=4, ignore_eos=True)]  # fmt: skip
    together = engine.generate(prompts, params)
    alone = [engine.generate(p, sp) for p, sp in zip(prompts, params, strict=True)]
    assert [c.completion_tokens for c in together] == [6, 3, 5]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]


def test_chat_prompt(engine):
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert ids[0] == engine.tokenizer.bos_token_id and ids.count(ids[0]) == 1
    assert engine.generate(ids, max_tokens=4).prompt_tokens == len(ids)


def test_invalid_sampling_parameters_are_refused(engine):
    with pytest.raises(MlacError, match="top_p"):
        engine.generate(PROMPT, top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(PROMPT, temperature=-1)


def test_find_stop_sees_strings_straddling_tokens():
    from mlac.runtime.engine.sequence import find_stop

    assert find_stop("abc##de", 2, ["##"]) is None  # "##" ended before the new "de"
    assert find_stop("abc##", 1, ["##"]) == 3  # completed by the last character
    assert find_stop("xx END", 3, ["END", "x E"]) == 1  # the earliest of several
