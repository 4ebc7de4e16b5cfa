"""Tokenizer wrapper: bos handling, decode, sandboxed chat templates, incremental detokenization."""

from __future__ import annotations

import json

import pytest
from _hf_convert import make_tokenizer

from mlac.core.errors import MlacError
from mlac.runtime.engine.tokenizer import Tokenizer

TEXTS = ["hello world", "the lazy dog, héllo wörld", "日本語 and emoji 🙂🙃 mixed", "  spaces\n\nnewlines\t"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer(make_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def synth_tok(tmp_path_factory) -> Tokenizer:
    """The synthetic checkpoints' tokenizer (its post-processor adds bos by itself)."""
    from mlac.synth.tokenizer import write_tokenizer

    out = tmp_path_factory.mktemp("synth-tok")
    write_tokenizer(out, vocab_size=2048, model_max_length=4096)
    return Tokenizer(out)


@pytest.mark.parametrize("which", ["tok", "synth_tok"])
def test_encode_prepends_bos_exactly_once(which, request):
    t = request.getfixturevalue(which)
    ids = t.encode("hello world")
    assert ids[0] == t.bos_token_id and ids.count(t.bos_token_id) == 1
    assert t.encode("hello world", add_bos=False) == ids[1:]
    assert t.decode(ids) == "hello world"  # special tokens skipped
    assert t.decode(ids, skip_special_tokens=False).endswith("hello world")


def test_special_tokens_from_config(tok):
    assert (tok.bos_token, tok.eos_token) == ("<bos>", "<eos>")  # a string and a {"content": ...} entry
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)


def test_chat_template(tok, synth_tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tok.apply_chat_template(msgs) == "<bos><user>hi<assistant>hello<assistant>"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "<bos><user>hi<assistant>hello"
    ids = synth_tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == synth_tok.bos_token_id and ids.count(ids[0]) == 1


def test_chat_template_runs_sandboxed(tmp_path):
    from jinja2.exceptions import SecurityError, TemplateError

    root = make_tokenizer(tmp_path)
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    for template, err in [("{{ ''.__class__.__mro__[1].__subclasses__() }}", SecurityError),
                          ("{{ raise_exception('no system role') }}", TemplateError)]:  # fmt: skip
        cfg["chat_template"] = template
        (root / "tokenizer_config.json").write_text(json.dumps(cfg))
        with pytest.raises(err):
            Tokenizer(root).apply_chat_template([])
    del cfg["chat_template"]
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(MlacError, match="no chat_template"):
        Tokenizer(root).apply_chat_template([])


@pytest.mark.parametrize("which", ["tok", "synth_tok"])
def test_incremental_text_equals_full_decode(which, request):
    t = request.getfixturevalue(which)
    for text in TEXTS:
        ids = t.encode(text)
        cut = next(i for i in range(3, len(ids)) if "\ufffd" not in t.decode(ids[:i]))  # a clean split
        prompt, completion = ids[:cut], ids[cut:]
        d = t.detokenizer(prompt)
        pieces = [d.add(i) for i in completion]
        assert "".join(pieces) == d.text == t.decode(completion)
        assert not any("\ufffd" in p for p in pieces)  # partial characters are held back


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(MlacError, match="tokenizer.json not found"):
        Tokenizer(tmp_path)
