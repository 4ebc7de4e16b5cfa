"""Overlap scheduling (overlap.py): the host work of decode step N after step N + 1 is launched.

CPU, float32, the tiny-v3 artifact, with `SchedulerConfig(overlap=True)` (CUDA turns it on by
default; on CPU there is nothing to overlap, but the logic is the same). Every run is compared with
the same requests run without overlap: tokens, logprobs, finish reasons and texts identical; every
KV block accounted for after each step; the steady state (a step launched before the one before it
is landed) is checked to have been reached, so the comparisons cover it.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from click.testing import CliRunner

from mlac.core.errors import MlacError
from mlac.runtime.engine import overlap as overlap_mod
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.engine.scheduler import SchedulerConfig
from mlac.runtime.engine.sequence import Sequence

PROMPT = "The morning train left the station"


@pytest.fixture(scope="module")
def engine(artifact) -> Engine:
    return Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False, num_blocks=160)


def prompts(n: int, start: int = 7) -> list[list[int]]:
    """n token-id prompts of different lengths (2, 5, 8, ... tokens)."""
    return [list(range(start + i, start + i + 2 + 3 * i)) for i in range(n)]


def run(engine: Engine, reqs, overlap: bool, arrive=None, abort=None, **config):
    """Run `reqs` [(prompt, SamplingParams)] through a fresh scheduler: request i is added before
    step `arrive[i]` (default 0), request j is aborted before step k for each (j, k) in `abort`.
    Checks the blocks after every step and that all are free at the end. Returns each request's
    (output ids, finish reason, text, logprobs)."""
    sched = engine.scheduler(SchedulerConfig(overlap=overlap, **config))
    assert (sched.overlap is not None) == overlap
    seqs = [engine.new_sequence(p, sp) for p, sp in reqs]
    arrive, abort = arrive or [0] * len(seqs), dict(abort or {})
    n = 0
    while n <= max(arrive) or sched.has_unfinished:
        for s, a in zip(seqs, arrive, strict=True):
            if a == n:
                sched.add(s)
        for j, k in abort.items():
            if k == n:
                sched.abort(seqs[j].seq_id)
        news = sched.step()
        assert len(news) == len(set(news))
        sched.check_blocks()
        n += 1
    sched.abort_all()
    counts = sched.check_blocks()
    assert counts["in_use"] == 0 and not sched.in_flight
    assert counts["free"] + counts["cached"] == sum(p.allocator.num_blocks for p in engine.runner.kv_pools)
    return [(s.output_ids, s.finish_reason, s.text(), s.logprobs) for s in seqs]


def both(engine: Engine, reqs, steady: list[bool], **kw):
    """Run with and without overlap; assert the same results and that overlap reached its steady state."""
    plain = run(engine, reqs, False, **kw)
    assert not steady
    over = run(engine, reqs, True, **kw)
    assert [o[:3] for o in over] == [p[:3] for p in plain]
    for o, p in zip(over, plain, strict=True):  # the batches differ (a finished row rides along):
        assert_close_logprobs(o[3], p[3])  # float32 rounding of other matmul shapes
    assert any(steady), "never launched a step before landing the one before it"
    return plain


def both_fed(engine: Engine, reqs, steady: list[bool], fed: list, **kw):
    """With and without overlap on a multi-rank engine (`fed`: what each fed step sent, spied): the
    same results; overlap reached its steady state through fed steps. Returns the results without
    overlap."""
    plain = run(engine, reqs, False, **kw)
    assert not steady and not fed
    over = run(engine, reqs, True, **kw)
    assert [o[:3] for o in over] == [p[:3] for p in plain]
    for o, p in zip(over, plain, strict=True):
        assert_close_logprobs(o[3], p[3])
    assert any(steady) and fed, "never launched a step before landing the one before it"
    return plain


def matches_one_rank(engine: Engine, one: Engine, reqs, steady: list[bool], fed: list) -> None:
    """A multi-rank engine with overlap gives the 1-rank engine's tokens and finish reasons for
    `reqs` (the fed ids reached every rank intact), through fed steps and a steady state."""
    want = run(one, reqs, False)
    got = run(engine, reqs, True)
    assert [g[:2] for g in got] == [w[:2] for w in want] and any(steady) and fed


def admissions_and_aborts(engine: Engine, both, steady: list[bool]) -> None:
    """Requests arriving mid-run (two sharing a prompt with the first: prefix hits) through `both`
    (reqs, **kw -> the results without overlap, having checked overlap's against them), then the
    same with two aborted mid-run under overlap: those stop early on the same tokens, the others are
    untouched, and the steady state is reached again (the multi-rank tests, DP attention or not)."""
    ps = prompts(6) + [prompts(1)[0]] * 2
    reqs = [(p, SamplingParams(max_tokens=6 + 5 * (i % 3), ignore_eos=True)) for i, p in enumerate(ps)]
    arrive = [0, 0, 2, 5, 5, 9, 12, 13]
    plain = both(reqs, arrive=arrive)
    steady.clear()
    aborted = run(engine, reqs, True, arrive=arrive, abort=[(1, 6), (4, 8)])
    for j, (ids, reason, _, _) in enumerate(aborted):
        if j in (1, 4):
            assert reason == "abort" and ids == plain[j][0][: len(ids)] and len(ids) < len(plain[j][0])
        else:
            assert (ids, reason) == plain[j][:2]
    assert any(steady)


def assert_close_logprobs(a, b) -> None:
    assert [(x.token_id, [t for t, _ in x.top]) for x in a] == [
        (x.token_id, [t for t, _ in x.top]) for x in b
    ]
    flat = lambda lps: [v for x in lps for v in (x.logprob, *(v for _, v in x.top))]  # noqa: E731
    assert flat(a) == pytest.approx(flat(b), abs=1e-4)


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_greedy_tokens_are_those_without_overlap(engine, steady, batch, prefix_cache):
    reqs = [(p, SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True)) for i, p in enumerate(prompts(batch))]
    out = both(engine, reqs, steady, prefix_cache=prefix_cache)
    assert [len(o[0]) for o in out] == [4 + 3 * i for i in range(batch)]


def test_staggered_arrivals_and_an_abort(engine, steady):
    ps = prompts(6) + [prompts(1)[0]] * 2  # the last two share a prompt with the first: prefix hits
    reqs = [(p, SamplingParams(max_tokens=6 + 5 * (i % 3), ignore_eos=True)) for i, p in enumerate(ps)]
    plain = run(engine, reqs, False, arrive=[0, 0, 2, 5, 5, 9, 12, 13])
    over = run(engine, reqs, True, arrive=[0, 0, 2, 5, 5, 9, 12, 13])
    assert [o[:3] for o in over] == [p[:3] for p in plain] and any(steady)
    steady.clear()
    aborted = run(engine, reqs, True, arrive=[0, 0, 2, 5, 5, 9, 12, 13], abort=[(1, 6), (4, 8)])
    for j, (ids, reason, _, _) in enumerate(aborted):
        if j in (1, 4):
            assert reason == "abort" and ids == plain[j][0][: len(ids)] and len(ids) < len(plain[j][0])
        else:
            assert (ids, reason) == plain[j][:2]


def test_stop_strings_eos_and_logprobs(engine, steady):
    full = engine.generate(PROMPT, max_tokens=24, ignore_eos=True)
    eos = full.token_ids[5]  # a token the greedy output produces: as a stop token and as eos
    reqs = [
        (PROMPT, SamplingParams(max_tokens=24, ignore_eos=True, stop=[full.text[8:11]])),
        (PROMPT, SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[eos])),
        (prompts(3)[2], SamplingParams(max_tokens=9, ignore_eos=True, logprobs=3)),
        (prompts(2)[1], SamplingParams(max_tokens=30)),  # eos of the model may end it
        (prompts(4)[3], SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0)),
    ]
    out = both(engine, reqs, steady)
    assert out[0][1] == "stop" and out[0][2] == full.text[: full.text.index(full.text[8:11])]
    assert out[1][1] == "stop" and out[1][0][-1] == eos
    assert len(out[2][3]) == 9 and all(len(lp.top) == 3 for lp in out[2][3])
    assert len(out[4][3]) == 12 and all(lp.top == () for lp in out[4][3])


def test_the_model_eos_ends_a_request(engine, steady, monkeypatch):
    """eos_token_ids holds a token the greedy output produces: the request ends there either way."""
    greedy = engine.generate(prompts(3)[1], max_tokens=16, ignore_eos=True).token_ids
    sched = engine.scheduler
    monkeypatch.setattr(engine, "scheduler", lambda config=None: _with_eos(sched(config), greedy[6]))
    reqs = [(p, SamplingParams(max_tokens=16)) for p in prompts(3)]
    out = both(engine, reqs, steady)
    assert out[1][1] == "stop" and out[1][0] == greedy[: greedy.index(greedy[6]) + 1]


def _with_eos(sched, token: int):
    sched.eos_ids = frozenset({token})
    return sched


def test_seeded_sampling_is_that_without_overlap(engine, steady):
    reqs = [
        (p, SamplingParams(max_tokens=10 + i, temperature=0.9, top_p=0.9, top_k=30, min_p=0.01 * (i % 2),
                           seed=100 + i, ignore_eos=True, logprobs=2 if i % 2 else None))
        for i, p in enumerate(prompts(5))
    ]  # fmt: skip
    reqs.append((prompts(6)[5], SamplingParams(max_tokens=12, ignore_eos=True)))  # greedy with them
    out = both(engine, reqs, steady, prefix_cache=False)
    assert len({tuple(o[0]) for o in out}) == len(out)


def test_preemption_under_a_small_pool_gives_the_same_tokens(artifact, monkeypatch, steady):
    small = Engine.from_artifact(
        artifact("tiny-v3"), dtype=torch.float32, verify=False, num_blocks=20, block_size=4
    )
    reqs = [
        (p, SamplingParams(max_tokens=10 + 2 * i, ignore_eos=True, temperature=0.0 if i % 3 else 0.9, seed=i))
        for i, p in enumerate(prompts(10))
    ]
    preempted = []
    scheduler = small.scheduler

    def spy(config=None):
        preempted.append(sched := scheduler(config))
        return sched

    monkeypatch.setattr(small, "scheduler", spy)
    plain = run(small, reqs, False, max_running_requests=10, chunked_prefill_size=16)
    over = run(small, reqs, True, max_running_requests=10, chunked_prefill_size=16)
    assert [o[:3] for o in over] == [p[:3] for p in plain] and any(steady)
    assert all(s.num_preemptions > 0 for s in preempted)


def test_off_by_default_on_cpu_and_under_speculation(engine, artifact):
    assert engine.scheduler(SchedulerConfig()).overlap is None  # CPU: nothing to overlap
    assert engine.scheduler(SchedulerConfig(overlap=True)).overlap is not None
    config = SchedulerConfig(speculative_num_steps=2, overlap=True)
    spec = Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False, scheduler=config)
    assert spec.scheduler().spec is not None and spec.scheduler().overlap is None
    assert overlap_mod.can_overlap(
        engine.runner
    )  # multi-rank: test_overlap_multirank.py, DP: test_overlap_dp.py

    class Plain:  # a runner that takes no ids from the device
        def run(self, step): ...

    assert not overlap_mod.can_overlap(Plain())
    with pytest.raises(MlacError, match="overlap=1: must be True, False or None"):
        SchedulerConfig(overlap=1)


def test_a_finished_request_left_in_flight_is_drained_by_abort_all(engine):
    """A request whose last token is still on the device at abort_all gets it (no token lost)."""
    sched = engine.scheduler(SchedulerConfig(overlap=True))
    seq = engine.new_sequence(prompts(1)[0], SamplingParams(max_tokens=5, ignore_eos=True))
    sched.add(seq)
    while not sched.in_flight:
        sched.step()
    have = len(seq.output_ids)
    news = sched.abort_all()
    assert news == [seq] and len(seq.output_ids) == have + 1 and seq.finish_reason == "abort"
    assert sched.check_blocks()["in_use"] == 0


def test_a_failed_landing_leaves_no_wrong_token_and_no_block(engine, monkeypatch, steady):
    """The host work of a step fails after the next step was launched: abort_all then aborts every
    request with the tokens it really had (the next step's rows, which assumed the lost tokens, are
    never landed) and frees every block."""
    reqs = [(p, SamplingParams(max_tokens=10, ignore_eos=True)) for p in prompts(3)]
    want = run(engine, reqs, False)
    sched = engine.scheduler(SchedulerConfig(overlap=True))
    seqs = [engine.new_sequence(p, sp) for p, sp in reqs]
    for s in seqs:
        sched.add(s)
    calls, append = [], Sequence.append_token

    def flaky(self, *args):
        calls.append(self)
        if len(calls) == 11:  # the second row of the third landing (3 came from the prefill)
            raise RuntimeError("detokenizer failed")
        return append(self, *args)

    monkeypatch.setattr(Sequence, "append_token", flaky)
    with pytest.raises(RuntimeError, match="detokenizer"):
        while sched.has_unfinished:
            sched.step()
    assert steady[-1] and not sched.in_flight
    assert set(sched.abort_all()) == set(seqs)
    for s, (ids, *_) in zip(seqs, want, strict=True):
        assert s.finish_reason == "abort" and s.output_ids == ids[: len(s.output_ids)]
    assert [len(s.output_ids) for s in seqs] == [4, 3, 3]
    assert sched.check_blocks()["in_use"] == 0


@pytest.mark.parametrize("command", ["serve", "generate", "bench"])
def test_the_flag_is_wired(command, monkeypatch):
    import mlac.cli as cli

    seen = {}

    class Stop(Exception):
        pass

    def fake(*args, **kwargs):  # Engine.from_artifact(path, options) or serve(config, ...)
        options = args[1] if len(args) > 1 else args[0].engine
        seen["overlap"] = options.scheduler.overlap
        raise Stop

    monkeypatch.setattr("mlac.runtime.engine.engine.Engine.from_artifact", fake)
    monkeypatch.setattr("mlac.runtime.serve.serve", fake)
    monkeypatch.setattr("mlac.runtime.serve.engine_process.EngineProcess.start", lambda: None)
    extra = (
        ["--prompt", "hi"] if command == "generate" else ["--no-engine-process"] if command == "serve" else []
    )
    for flag, want in (([], None), (["--disable-overlap-schedule"], False)):
        seen.clear()
        result = CliRunner().invoke(cli.main, [command, "nowhere", "--device", "cpu", *extra, *flag])
        assert isinstance(result.exception, Stop), result.output
        assert seen["overlap"] is want


@pytest.mark.gpu
def test_cuda_graphs_give_the_same_greedy_tokens_with_overlap(artifact, steady):
    """On by default on CUDA: greedy tokens identical to the serial scheduler's, through the CUDA
    graphs (the next step's ids taken on the device), at batch sizes 1, 3 and 17. Every request
    has the same max_tokens and no prefix cache, so both runs replay the same buckets step by step
    (other batch shapes pick other tiles: bf16 rounding could flip a greedy token)."""
    engine = Engine.from_artifact(artifact("tiny-v2-lite"), device="cuda", dtype=torch.bfloat16, verify=False,
                                  num_blocks=512, cuda_graph_max_bs=32)  # fmt: skip
    assert_graph_tokens_with_overlap(engine)
    assert any(steady)


def assert_graph_tokens_with_overlap(engine: Engine) -> None:
    """Greedy tokens with overlap equal the serial scheduler's through the CUDA graphs, batches 1,
    3 and 17 (same max_tokens, no prefix cache: both runs replay the same buckets step by step)."""
    assert engine.runner.graphs is not None and engine.scheduler().overlap is not None
    for batch in (1, 3, 17):
        reqs = [(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts(batch)]
        plain = run(engine, reqs, False, prefix_cache=False)
        over = run(engine, reqs, True, prefix_cache=False)
        assert [o[:2] for o in over] == [p[:2] for p in plain], f"batch {batch}"


def test_a_server_with_overlap_answers_as_the_engine_does(artifact, engine, steady):
    """The engine loop (serve/loop.py) over an overlapping scheduler: concurrent requests, one with
    a stop string, one streamed; their texts and token counts are the engine's without overlap."""
    import httpx

    from mlac.runtime.serve import ServerConfig, ServerThread

    ps = prompts(4)
    stop = engine.generate(ps[2], max_tokens=20, ignore_eos=True).text[6:9]
    bodies = [dict(prompt=p, max_tokens=8 + 3 * i, ignore_eos=True, temperature=0) for i, p in enumerate(ps)]
    bodies[2]["stop"] = [stop]
    want = [
        engine.generate(b["prompt"], max_tokens=b["max_tokens"], ignore_eos=True, stop=b.get("stop"))
        for b in bodies
    ]
    cfg = ServerConfig.of(artifact=artifact("tiny-v3"), dtype="float32", verify=False, served_model_name="tiny",
                       num_blocks=160, scheduler=SchedulerConfig(overlap=True), warmup=False)  # fmt: skip
    with ServerThread(cfg) as srv:

        def post(body: dict) -> dict:
            body = {"model": "tiny", **body}
            return httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()

        with ThreadPoolExecutor(len(bodies)) as pool:
            got = list(pool.map(post, bodies))
        with httpx.stream("POST", f"{srv.url}/v1/completions", json={"model": "tiny", "stream": True, **bodies[3]},
                          timeout=60) as r:  # fmt: skip
            lines = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    for g, w in zip(got, want, strict=True):
        assert g["choices"][0]["text"] == w.text and g["usage"]["completion_tokens"] == w.completion_tokens
        assert g["choices"][0]["finish_reason"] == w.finish_reason
    assert "".join(x["choices"][0]["text"] for x in lines if x["choices"]) == want[3].text
    assert any(steady)
