"""The server's streaming path without HTTP: the engine thread's hand-over of one step's deltas
(one call per event loop), Submission.batches (order, an engine error after the deltas before it),
the chunk template (byte-identical to json.dumps of the whole chunk), and the memo of token_text."""

from __future__ import annotations

import asyncio

import pytest

from mlac.runtime.engine.sampling import TokenLogprob
from mlac.runtime.engine.sequence import Delta
from mlac.runtime.serve.loop import EngineLoop
from mlac.runtime.serve.metrics import Metrics
from mlac.runtime.serve.outlet import Sink
from mlac.runtime.serve.protocol import ApiError
from mlac.runtime.serve.render import ChatRender, CompletionRender, event
from mlac.runtime.serve.submission import Submission


def delta(seq_id: int, text: str, finish: str | None = None, lps: list | None = None) -> Delta:
    return Delta(seq_id, text, [7], lps or [], finish, 3, 1)


class CountingLoop:
    """Stands for an asyncio loop: records call_soon_threadsafe calls and runs them at once."""

    def __init__(self):
        self.calls = 0

    def call_soon_threadsafe(self, fn, *args):
        self.calls += 1
        fn(*args)


def test_one_step_is_one_call_per_event_loop_in_order():
    engine_loop = EngineLoop(lambda: None, Metrics("tiny"), 16)
    a, b = CountingLoop(), CountingLoop()
    qa, qb = asyncio.Queue(), asyncio.Queue()
    sinks = [Sink(a, qa, 0), Sink(a, qa, 1), Sink(b, qb, 0)]
    items = [delta(0, "x"), delta(1, "y"), delta(2, "z"), delta(0, "w")]
    for sink, item in zip([*sinks, sinks[0]], items, strict=True):
        engine_loop._post(sink, item)
    engine_loop._send()
    assert (a.calls, b.calls) == (1, 1)
    got_a = [qa.get_nowait() for _ in range(qa.qsize())]
    assert got_a == [(0, items[0]), (1, items[1]), (0, items[3])]
    assert qb.get_nowait() == (0, items[2])
    engine_loop._send()  # nothing posted since: no call
    assert (a.calls, b.calls) == (1, 1)


class FakeEngineLoop:
    def __init__(self):
        self.sinks: list[Sink] = []
        self.cancelled: list[int] = []

    def submit(self, seqs, sinks):
        self.sinks = sinks

    def cancel(self, seq_id):
        self.cancelled.append(seq_id)


class FakeSeq:
    def __init__(self, seq_id):
        self.seq_id = seq_id


async def collect(sub: Submission) -> tuple[list, ApiError | None]:
    out = []
    try:
        async for batch in sub.batches():
            out.append(batch)
    except ApiError as e:
        return out, e
    return out, None


def test_batches_take_what_arrived_together_and_raise_after_it():
    async def run():
        loop = FakeEngineLoop()
        sub = Submission(loop, [FakeSeq(10), FakeSeq(11)])
        s0, s1 = loop.sinks
        d0, d1, d2 = delta(10, "a"), delta(11, "b"), delta(10, "c", "length")
        for sink, item in [(s0, d0), (s1, d1), (s0, d2)]:
            sink.queue.put_nowait((sink.index, item))
        first = await anext(sub.batches())
        assert first == [(0, d0), (1, d1), (0, d2)]
        s1.queue.put_nowait((1, RuntimeError("step failed")))
        rest, err = await collect(sub)
        assert rest == [] and err is not None and err.status == 500
        sub.cancel_unfinished()
        assert loop.cancelled == []  # both choices are done (one finished, one failed)

        sub = Submission(loop, [FakeSeq(12)])
        (s,) = loop.sinks
        d = delta(12, "x")
        s.queue.put_nowait((0, d))
        s.queue.put_nowait((0, RuntimeError("step failed")))
        got, err = await collect(sub)
        assert got == [[(0, d)]] and err.status == 500  # the delta first, then the error

    asyncio.run(run())


@pytest.mark.parametrize("include_usage", [False, True])
def test_chunk_template_is_byte_identical(include_usage):
    lps = [TokenLogprob(5, -0.25, ((5, -0.25), (6, float("-inf"))))]
    d = delta(0, 'é "quoted"\n', "stop", lps)
    usage = {"usage": None} if include_usage else {}

    r = CompletionRender(None, "m\u00fcdel", 2, logprobs=True)
    logprobs = {
        "tokens": [""],
        "token_logprobs": [-0.25],
        "top_logprobs": [{"": -9999.0}],
        "text_offset": [0],
    }
    choice = {"index": 1, "text": d.text, "logprobs": logprobs, "finish_reason": "stop"}
    want = {"id": r.id, "object": "text_completion", "created": r.created, "model": "m\u00fcdel",
            "choices": [choice], **usage}  # fmt: skip
    assert r.chunk_event(1, d, include_usage) == event(want)
    assert r.text[1] == d.text and r.finish[1] == "stop"

    c = ChatRender(None, "m", logprobs=False)
    choice = {"index": 0, "delta": {"content": d.text}, "logprobs": None, "finish_reason": "stop"}
    want = {"id": c.id, "object": "chat.completion.chunk", "created": c.created, "model": "m",
            "choices": [choice], **usage}  # fmt: skip
    assert c.chunk_event(0, d, include_usage) == event(want)
    assert c.chunk_event(0, delta(0, ""), include_usage) == event(
        {**want, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None}]}
    )


def test_token_text_is_remembered(artifact):
    from mlac.runtime.engine.tokenizer import Tokenizer

    tok = Tokenizer(artifact("tiny-v3") / "tokenizer")
    ids = range(min(tok.vocab_size, 300))
    want = [tok._tok.decode([i], skip_special_tokens=False) for i in ids]
    assert [tok.token_text(i) for i in ids] == want

    def refuse(*args, **kwargs):
        raise AssertionError("decoded again")

    tok._tok = type("NoDecode", (), {"decode": refuse})()
    assert [tok.token_text(i) for i in ids] == want  # every answer from the memo
