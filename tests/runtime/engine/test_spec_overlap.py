"""Overlap scheduling of greedy speculative steps (engine/spec/overlap.py) on CPU, float32, tiny-v3.

The runner has the graphs' buffers (nothing captured: every replay runs its body eagerly), so the
chain steps are ChainGraphs steps, and step N + 1 takes its last tokens and cached lengths from
step N's `nxt` rows, not from the host. Greedy output must equal plain decoding's, token for token,
with every KV block accounted for after every step, through finishes at different steps, a stop
token that ends a sequence while its next step is in flight, an admission and an abort.
"""

from __future__ import annotations

import pytest
import torch
from test_spec_chain import graph_engine
from test_spec_decode import oracle, prompts, run

from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.worker.spec_chain import ChainGraphs
from mlac.runtime.worker.spec_exec import SpecExecutor


@pytest.fixture(scope="module")
def plain(artifact) -> Engine:
    return Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False)


def params(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def follows(monkeypatch) -> list[bool]:
    """Each SpecExecutor.launch that returned a launch: whether it followed the last one (first=None)."""
    seen: list[bool] = []
    launch = SpecExecutor.launch

    def spied(self, seq_ids, k, tables, first):
        out = launch(self, seq_ids, k, tables, first)
        if out is not None:
            seen.append(first is None)
        return out

    monkeypatch.setattr(SpecExecutor, "launch", spied)
    return seen


def generate(eng: Engine, ps: list[list[int]], ps_params: list[SamplingParams], events=None) -> tuple:
    """(outputs of `ps`, the scheduler): one scheduler, blocks checked after every step; events[i](sched, seqs)
    runs before step i (it may add sequences to `seqs`)."""
    sched = eng.scheduler()
    seqs = [eng.new_sequence(p, q) for p, q in zip(ps, ps_params, strict=True)]
    for s in seqs:
        sched.add(s)
    i = 0
    while sched.has_unfinished:
        if events and i in events:
            events[i](sched, seqs)
        sched.step()
        sched.check_blocks()
        i += 1
    assert not sched.in_flight
    assert eng.pool.allocator.num_free == eng.cache.num_blocks
    return [s.output_ids for s in seqs], sched


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_tokens_equal_plain_with_finishes_at_different_steps(plain, artifact, monkeypatch, batch):
    ps = prompts(batch)
    ps_params = [params(12 + 5 * i) for i in range(batch)]  # each finishes at its own step
    want = [run(plain, [p], q)[0][0] for p, q in zip(ps, ps_params, strict=True)]
    seen = follows(monkeypatch)
    got, _ = generate(graph_engine(artifact, 3, sched={"overlap": True}), ps, ps_params)
    assert got == want
    assert sum(seen) >= 3 and not all(seen)  # steady steps, and fresh launches after changes
    seen.clear()
    assert generate(graph_engine(artifact, 3), ps, ps_params)[0] == want and not seen  # off: none


@pytest.mark.parametrize("k", [1, 3])
def test_all_accepted_drafts_with_worst_case_blocks(plain, artifact, monkeypatch, k):
    """Oracle drafts (the plain output): K + 1 tokens a step, the most the reserved blocks cover."""
    prompt = prompts(1)[0]
    want, _ = run(plain, [prompt], params(40))
    oracle(monkeypatch, {tuple(prompt): want[0]})
    table = torch.tensor([0] * len(prompt) + want[0] + [0] * 16)  # token index -> plain token
    monkeypatch.setattr(ChainGraphs, "pick", lambda self, g, at: table[at.clamp(max=len(table) - 1)])
    seen = follows(monkeypatch)
    eng = graph_engine(artifact, k, sched={"overlap": True})
    got, sched = generate(eng, [prompt] * 3, [params(40)] * 3)
    st = sched.spec.stats
    assert got == want * 3 and sum(seen) >= 3 and st.accepted == st.drafted > 0


def test_a_stop_token_in_flight_admission_and_abort(plain, artifact, monkeypatch):
    ps = prompts(4)
    base = [run(plain, [p], params(30))[0][0] for p in ps]
    stop = base[0][9]  # sequence 0 stops there, while its next step is in flight
    want0 = base[0][: base[0].index(stop) + 1]
    late = prompts(1, start=40)[0]
    want_late = run(plain, [late], params(14))[0][0]
    seen = follows(monkeypatch)
    eng = graph_engine(artifact, 3, sched={"overlap": True})
    aborted = {}

    def admit(sched, seqs):
        seqs.append(eng.new_sequence(late, params(14)))
        sched.add(seqs[-1])

    def abort(sched, seqs):
        aborted["seq"] = seqs[3]
        aborted["len"] = len(seqs[3].output_ids)
        sched.abort(seqs[3].seq_id)

    ps_params = [params(30, stop_token_ids=[stop]), params(30), params(30), params(30)]
    got, _ = generate(eng, ps, ps_params, {6: admit, 11: abort})
    assert got[0] == want0 and aborted["seq"].finish_reason == "abort"
    assert got[1:3] == base[1:3] and got[4] == want_late
    assert got[3] == base[3][: len(got[3])] and len(got[3]) >= aborted["len"]
    assert sum(seen) >= 3


@pytest.mark.gpu
def test_captured_overlap_equals_the_synchronous_steps(artifact, monkeypatch):
    """On a GPU (captured chains, pinned copies behind events): the same tokens with and without
    overlap, at batch 1, 3 and 8 with different max_tokens, and steady steps among them."""
    from test_spec_decode import spec_engine

    kw = dict(device="cuda", dtype=torch.bfloat16, verify=False, num_blocks=256, cuda_graph_max_bs=32)
    g = torch.Generator().manual_seed(7)
    for n in (1, 3, 8):
        ps = [torch.randint(3, 200, (4 + 3 * i,), generator=g).tolist() for i in range(n)]
        ps_params = [params(14 + 6 * i) for i in range(n)]
        seen = follows(monkeypatch)
        on, _ = generate(spec_engine(artifact("tiny-v3"), 3, sched={"overlap": True}, **kw), ps, ps_params)
        off, _ = generate(spec_engine(artifact("tiny-v3"), 3, sched={"overlap": False}, **kw), ps, ps_params)
        assert on == off and sum(seen) >= 2, f"batch {n}"
        monkeypatch.undo()
