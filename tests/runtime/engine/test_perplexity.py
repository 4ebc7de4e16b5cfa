"""`mlac eval` on CPU: perplexity against transformers on the same checkpoint, the windows, the CLI
record, and bad input as one-line errors.

The reference follows Hugging Face's perplexity guide on its own: transformers' DeepseekV3ForCausalLM
(float32, over the synthetic FP8 checkpoint dequantized by test_parity's independent helper) computes
each window's loss from labels masked with -100, independently of mlac's windowing and log_softmax.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner
from test_hf_parity import dequantized_copy

from mlac.cli import main
from mlac.core.artifact import artifact_identity
from mlac.core.errors import MlacError
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.perplexity import perplexity, windows

PRESET = "tiny-v3"
REL_BOUND = 1e-4
TEXT = (
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\n"
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "    def norm(self):\n        return (self.x ** 2 + self.y ** 2) ** 0.5\n"
)


@pytest.fixture(scope="module")
def engine(artifact):
    return Engine.from_artifact(artifact(PRESET), dtype=torch.float32)


@pytest.fixture(scope="module")
def hf_model(checkpoint, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = checkpoint(PRESET)
    assert "quantization_config" in json.loads((path / "config.json").read_text())  # FP8, as V3 ships
    path = dequantized_copy(path, tmp_path_factory.mktemp("hf") / PRESET)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_perplexity(model, ids: list[int], max_length: int, stride: int) -> tuple[float, int]:
    """(perplexity, tokens scored), the loop of Hugging Face's perplexity guide."""
    enc = torch.tensor([ids])
    seq_len, nll_sum, n_tokens, prev_end = enc.size(1), 0.0, 0, 0
    for begin in range(0, seq_len, stride):
        end = min(begin + max_length, seq_len)
        input_ids = enc[:, begin:end]
        target = input_ids.clone()
        target[:, : -(end - prev_end)] = -100
        n_valid = int((target[:, 1:] != -100).sum())  # the model shifts labels left by one
        if n_valid:
            nll_sum += float(model(input_ids, labels=target).loss) * n_valid
            n_tokens += n_valid
        prev_end = end
        if end == seq_len:
            break
    return math.exp(nll_sum / n_tokens), n_tokens


@pytest.mark.parametrize(("context_len", "stride"), [(32, None), (32, 12), (200, None)])
def test_perplexity_matches_transformers(engine, hf_model, context_len, stride):
    ids = engine.tokenizer.encode(TEXT)
    assert len(ids) > 64  # several windows of 32
    got = perplexity(engine, ids, context_len, stride)
    want, n_tokens = hf_perplexity(hf_model, ids, context_len, stride or context_len)
    assert got.tokens == n_tokens
    assert got.perplexity == pytest.approx(want, rel=REL_BOUND)
    assert got.perplexity == pytest.approx(math.exp(got.nll / got.tokens))


@pytest.mark.parametrize(
    ("n", "context_len", "stride"), [(100, 32, 32), (100, 32, 7), (33, 32, 32), (5, 8, 3)]
)
def test_windows_score_each_token_at_most_once_within_context(n, context_len, stride):
    plan = windows(n, context_len, stride)
    scored = [t for w in plan for t in range(w.first, w.end)]
    assert all(w.begin < w.first < w.end <= w.begin + context_len for w in plan)
    if stride < context_len:
        assert scored == list(range(1, n))  # overlapping windows: every token after the first, once
    else:  # non-overlapping: each window's first token is context only (a 1-token last window: none)
        assert scored == [t for t in range(1, n) if t % context_len]


def test_progress_counts_every_scored_token(engine):
    ids = engine.tokenizer.encode(TEXT)
    steps: list[int] = []
    result = perplexity(engine, ids, 16, 10, progress=steps.append)
    assert len(steps) == result.windows and sum(steps) == result.tokens == len(ids) - 1


@pytest.mark.parametrize(
    ("ids", "context_len", "stride", "message"),
    [([5], 8, None, "at least 2"), ([5, 6, 7], 1, None, "--context-len 1"), ([5, 6, 7], 8, 9, "--stride 9"),
     ([5, 6, 7], 8, 0, "--stride 0")],
)  # fmt: skip
def test_bad_api_input_raises(engine, ids, context_len, stride, message):
    with pytest.raises(MlacError, match=message):
        perplexity(engine, ids, context_len, stride)


def run_eval(*args: str):
    return CliRunner().invoke(main, ["eval", *args, "--device", "cpu", "--dtype", "float32", "--no-verify"])


def test_cli_writes_the_record(artifact, engine, tmp_path):
    text, out = tmp_path / "held_out.py", tmp_path / "ppl.json"
    text.write_text(TEXT)
    result = run_eval(str(artifact(PRESET)), "--text", str(text), "--context-len", "24", "--stride", "16",
                      "--json", str(out))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "perplexity" in result.output and "scoring" in result.output  # the summary and the bar
    record = json.loads(out.read_text())
    want = perplexity(engine, engine.tokenizer.encode(TEXT), 24, 16)
    assert record["artifact_identity"] == artifact_identity(artifact(PRESET))
    assert (record["device"], record["dtype"], record["context_len"], record["stride"]) == (
        "cpu",
        "float32",
        24,
        16,
    )
    assert (record["tokens"], record["windows"]) == (want.tokens, want.windows)
    assert record["perplexity"] == pytest.approx(want.perplexity, rel=1e-6)
    assert record["bytes"] == len(TEXT.encode())
    assert record["bits_per_byte"] == pytest.approx(record["nll"] / math.log(2) / record["bytes"])


def test_cli_max_tokens_caps_the_tokens(artifact, tmp_path):
    text, out = tmp_path / "t.txt", tmp_path / "ppl.json"
    text.write_text(TEXT)
    result = run_eval(str(artifact(PRESET)), "--text", str(text), "--max-tokens", "20", "--json", str(out))
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert record["tokens"] == 19 and record["windows"] == 1 and record["bytes"] < len(TEXT.encode())


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        (None, [], "no such file"),
        (b"", [], "empty"),
        (b"\xff\xfe abc", [], "not UTF-8"),
        (TEXT.encode(), ["--max-tokens", "1"], "at least 2"),
        (TEXT.encode(), ["--context-len", "1"], "--context-len 1"),
        (TEXT.encode(), ["--context-len", "8", "--stride", "9"], "--stride 9"),
        (TEXT.encode(), ["--max-model-len", "8", "--context-len", "16"], "exceeds the engine's context"),
    ],
)
def test_bad_input_is_a_one_line_error(artifact, tmp_path, content, args, message):
    text = tmp_path / "t.txt"
    if content is not None:
        text.write_bytes(content)
    result = run_eval(str(artifact(PRESET)), "--text", str(text), *args)
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
