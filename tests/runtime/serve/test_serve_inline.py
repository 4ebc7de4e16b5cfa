"""A request's fixed cost to its first token (benchmarks/e2e/ttft_overhead.py): a small request is
tokenized and built on the event loop (no worker-thread hand-offs), a large text or a grammar in
a worker thread; a completion's prompt keeps its type (token ids are tried first)."""

from __future__ import annotations

import threading

import httpx
import pytest

from mlac.runtime.serve import ServerConfig, ServerThread, app
from mlac.runtime.serve.protocol import ApiError, CompletionBody, parse_body

MODEL = "tiny"


def test_small_requests_are_built_on_the_event_loop_large_text_and_grammars_in_a_worker(art, monkeypatch):
    built: list[threading.Thread] = []
    real = app.new_sequences

    def spy(*args, **kwargs):
        built.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(app, "new_sequences", spy)
    config = ServerConfig.of(artifact=art, dtype="float32", verify=False, served_model_name=MODEL)
    bodies = [
        {"prompt": list(range(5, 2000))},  # 2,000 token ids: nothing to tokenize
        {"prompt": "hello there"},
        {"prompt": "a " * (app.INLINE_TEXT_CHARS // 2 + 1)},  # more text than INLINE_TEXT_CHARS
        {"prompt": "hi", "response_format": {"type": "json_object"}},  # a grammar to compile
    ]
    with ServerThread(config) as srv:
        loop_thread = srv._thread  # uvicorn's event loop runs on it
        for body in bodies:
            body = {"model": MODEL, "max_tokens": 1, **body}
            httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
        chat = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(f"{srv.url}/v1/chat/completions", json=chat, timeout=120).status_code == 200
    assert [t is loop_thread for t in built] == [True, True, False, False, True]


@pytest.mark.parametrize(
    "prompt",
    [[5, 6, 7], ["1", "2"], "12", [[1, 2], [3]], ["a", "b"], []],
)
def test_completion_prompts_keep_their_type(prompt):
    body = parse_body(CompletionBody, {"model": MODEL, "prompt": prompt})
    assert body.prompt == prompt
    assert [type(p) for p in body.prompt] == [type(p) for p in prompt]


@pytest.mark.parametrize("prompt", [[5.0, 6], [True, 5], ["a", 1], 5, [[1], 2]])
def test_prompts_of_no_listed_type_are_400s(prompt):
    with pytest.raises(ApiError, match="prompt") as e:
        parse_body(CompletionBody, {"model": MODEL, "prompt": prompt})
    assert e.value.status == 400
