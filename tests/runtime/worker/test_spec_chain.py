"""A greedy speculative step as one ChainGraphs replay (spec_chain.py), on CPU, float32, tiny-v3.

On CPU nothing is captured: the runner gets the graphs' buffers and every "replay" runs the same
padded body eagerly, which checks the j-major static inputs, the in-graph acceptance, the refresh
of every row and the state rows that carry each sequence's (g, d_0) from step to step. The
per-replay path (DecodeGraphs + DraftGraphs, no ChainGraphs made) is the reference.
"""

from __future__ import annotations

import pytest
import torch
from test_spec_decode import oracle, prompts, run, spec_engine

import mlac.runtime.engine.spec.decode as spec_decode
import mlac.runtime.worker.spec_exec as spec_exec
from mlac.core.errors import MlacError
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.engine.spec.decode import SpecDecoder
from mlac.runtime.worker.graphs import DecodeGraphs
from mlac.runtime.worker.spec_chain import ChainGraphs, ChainInputs, accepted, chain_batches
from mlac.runtime.worker.spec_graphs import DraftGraphs

BUCKETS = [1, 2, 4, 8, 16]


@pytest.fixture(scope="module")
def plain(artifact) -> Engine:
    return Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False)


def graph_engine(artifact, k: int, chain: bool = True, **kwargs) -> Engine:
    """A speculative engine whose runner has the decode and draft graphs' buffers (nothing captured);
    without `chain` its executor keeps the per-replay path."""
    eng = spec_engine(artifact("tiny-v3"), k, **kwargs)
    r = eng.runner
    r.graphs = DecodeGraphs(r.model, r.cache, BUCKETS, eng.max_context, keep_hidden=True)
    r.draft_graphs = DraftGraphs(r.model, r.cache, BUCKETS, eng.max_context)
    if not chain:
        r.spec_executor()._make_chain = lambda k: None
    return eng


def counting(monkeypatch, cls, name: str, calls: list) -> None:
    fn = getattr(cls, name)

    def wrapped(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)

    monkeypatch.setattr(cls, name, wrapped)


def test_accepted_counts_leading_matches():
    drafts = torch.tensor([[5, 5, 1, 9], [6, 6, 6, 9], [7, 0, 7, 9]])  # [K = 3, B = 4]
    top = torch.tensor([[5, 4, 1, 9], [6, 6, 2, 9], [7, 7, 7, 9], [8, 8, 8, 8]])  # [K + 1, B]
    assert accepted(drafts, top).tolist() == [3, 0, 1, 3]


def test_chain_inputs_rows_are_j_major_with_padding(artifact):
    eng = spec_engine(artifact("tiny-v3"), 2)
    cache = eng.runner.cache
    size, scratch = cache.block_size, cache.scratch_block
    inputs = ChainInputs(4, 3, cache, torch.device("cpu"))
    inputs.fill([1, 2, 3], [40, 41, 42], [[9, 9, 9], [9, 9, 9], [9, 9, 9]], 4)  # a wider step first
    inputs.fill([11, 12], [size - 1, 3], [[4, 7], [2]], 4)  # sequence 0 crosses into its 2nd block
    last, ctx, (every, b0, b1) = chain_batches(inputs, 4, 2, size)
    assert last.tolist() == [11, 12, 0, 0] and ctx.tolist() == [size - 1, 3, 0, 0]
    # row j * 4 + i: sequence i at position ctx_i + j (padding rows: position j of the scratch block)
    assert every.positions.tolist() == [size - 1, 3, 0, 0, size, 4, 1, 1, size + 1, 5, 2, 2]
    want_slots = [4 * size + size - 1, 2 * size + 3, scratch * size, scratch * size]
    want_slots += [7 * size, 2 * size + 4, scratch * size + 1, scratch * size + 1]
    want_slots += [7 * size + 1, 2 * size + 5, scratch * size + 2, scratch * size + 2]
    assert every.slots.tolist() == want_slots
    assert every.seq_lens.tolist() == [p + 1 for p in every.positions.tolist()]
    assert every.block_tables[5, :2].tolist() == [2, 0] and every.block_tables[8, :2].tolist() == [4, 7]
    assert every.block_tables[2, :1].tolist() == [scratch] and every.block_tables.shape == (12, 3)
    assert b1.positions.tolist() == every.positions[4:8].tolist() and b0.num_seqs == 4
    with pytest.raises(MlacError, match="longer than the graphs'"):
        inputs.fill([1], [0], [[1, 2, 3, 4]], 1)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_chain_graphs_drafts_outputs_and_state_equal_the_per_replay_path(plain, artifact, monkeypatch, k):
    """Same drafts verified, same output (the plain one), same MTP state after the run, and every
    greedy decode-only step one ChainGraphs replay."""

    def drafted(chain: bool):
        eng = graph_engine(artifact, k, chain)
        seen, runs = [], []
        verify = SpecDecoder._verify

        def spied(self, sched, seq, logits, top, drafts, probs):
            seen.append((seq.num_tokens, list(drafts)))
            return verify(self, sched, seq, logits, top, drafts, probs)

        with monkeypatch.context() as m:
            m.setattr(SpecDecoder, "_verify", spied)
            counting(m, ChainGraphs, "run", runs)
            sched = eng.scheduler()
            seqs = [eng.new_sequence(p, SamplingParams(max_tokens=16, ignore_eos=True)) for p in prompts(3)]
            for s in seqs:
                sched.add(s)
            for _ in range(6):
                sched.step()
            ex = eng.runner.spec_executor()
            ex.evacuate()
            state = {s.seq_id: (ex.store[s.seq_id].clone(), int(ex.tokens[s.seq_id])) for s in seqs}
            while sched.has_unfinished:
                sched.step()
        return [s.output_ids for s in seqs], seen, state, len(runs)

    want, _ = run(plain, prompts(3), SamplingParams(max_tokens=16, ignore_eos=True))
    out, seen, state, runs = drafted(True)
    ref_out, ref_seen, ref_state, ref_runs = drafted(False)
    assert out == ref_out == want
    assert seen == ref_seen and sum(len(d) for _, d in seen) > 20
    assert runs > 3 and ref_runs == 0
    for i, (g, t) in ref_state.items():
        assert torch.allclose(state[i][0], g, atol=1e-4, rtol=1e-4) and state[i][1] == t


def test_a_chain_step_is_one_replay_and_one_sync(plain, artifact, monkeypatch):
    ps, params = prompts(3), SamplingParams(max_tokens=24, ignore_eos=True)
    want, _ = run(plain, ps, params)
    eng = graph_engine(artifact, 3)
    sched = eng.scheduler()
    seqs = [eng.new_sequence(p, params) for p in ps]
    for s in seqs:
        sched.add(s)
    while not all(s.decoding for s in seqs):
        sched.step()
    calls: list[str] = []
    to_host = spec_exec.to_host

    def synced(x):
        calls.append("sync")
        return to_host(x)

    for module in (spec_exec, spec_decode):
        monkeypatch.setattr(module, "to_host", synced)
    counting(monkeypatch, ChainGraphs, "_step", calls)
    counting(monkeypatch, ChainGraphs, "load", calls)
    ex = eng.runner.spec_executor()
    for name in ("_target", "_draft"):
        counting(monkeypatch, ex, name, calls)
    for step in range(3):
        calls.clear()
        sched.step()
        # the first chain step loads the state rows (from the prefill's refresh); then they stay
        assert calls == (["load"] if step == 0 else []) + ["_step", "sync"]
    while sched.has_unfinished:
        sched.step()
    assert [s.output_ids for s in seqs] == want


@pytest.mark.parametrize("k", [1, 3])
def test_oracle_drafts_are_all_accepted_in_the_graph(plain, artifact, monkeypatch, k):
    """Drafts that are the plain output (the executor's pick on the host, the graph's pick on the
    device): every one accepted by the in-graph count, whose row then feeds the next step."""
    prompt = prompts(1)[0]
    want, _ = run(plain, [prompt] * 3, SamplingParams(max_tokens=20, ignore_eos=True))
    outputs = {tuple(prompt): want[0]}
    oracle(monkeypatch, outputs)
    table = torch.tensor([0] * len(prompt) + want[0] + [0] * 8)  # token index -> plain token

    def pick_oracle(self, g, at):
        return table[at.clamp(max=len(table) - 1)]

    monkeypatch.setattr(ChainGraphs, "pick", pick_oracle)
    eng = graph_engine(artifact, k)
    sched = eng.scheduler()
    seqs = [eng.new_sequence(prompt, SamplingParams(max_tokens=20, ignore_eos=True)) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    for _ in range(3):
        sched.step()
    ex = eng.runner.spec_executor()
    assert ex.resident  # the states live in the graph's rows: row a of the refresh, a = k
    ex.evacuate()
    for s in seqs:  # each equals one MTP pass over the sequence, at its last position
        assert torch.allclose(ex.store[s.seq_id], fresh_g(eng.runner.model, s), atol=1e-4, rtol=1e-4)
    while sched.has_unfinished:
        sched.step()
    st = sched.spec.stats
    assert [s.output_ids for s in seqs] == want
    assert st.accepted == st.drafted > 0 and st.accept_length > 1.5


def fresh_g(model, seq) -> torch.Tensor:
    """[D]: the MTP layer's output at position n - 2 of one pass over the sequence's n tokens."""
    from mlac.runtime.kvcache.batch import ForwardBatch
    from mlac.runtime.kvcache.paged import PagedKVCache

    n = seq.num_tokens
    cache = PagedKVCache(model.config, 8, 16, torch.float32, extra_layers=1)
    batch = ForwardBatch.build([0], [n - 1], [list(range(8))], 16)
    h = model(torch.tensor(seq.tokens(0, n - 1)), batch, cache)  # h_0 .. h_{n-2}
    return model.draft(h, torch.tensor(seq.tokens(1, n)), batch, cache)[-1]


def test_composition_changes_preemption_and_mixed_requests(plain, artifact):
    """Sequences joining, finishing and being preempted move states in and out of the graph's rows;
    sampled requests take the host path in the same batches: greedy outputs stay the plain ones."""
    import random

    rng = random.Random(1)
    ps = [[rng.randrange(3, 1000) for _ in range(rng.randrange(2, 30))] for _ in range(8)]
    params = [
        SamplingParams(max_tokens=rng.randrange(4, 24), ignore_eos=True)
        if i % 3
        else SamplingParams(max_tokens=10, temperature=0.9, seed=i, ignore_eos=True)
        for i in range(8)
    ]
    want = [c.token_ids for c in plain.generate(ps, params)]
    eng = graph_engine(artifact, 3, num_blocks=14, sched={"chunked_prefill_size": 16})
    sched = eng.scheduler()
    seqs = [eng.new_sequence(p, sp) for p, sp in zip(ps, params, strict=True)]
    for s in seqs[:5]:
        sched.add(s)
    steps = 0
    while sched.has_unfinished:
        sched.step()
        sched.check_blocks()
        steps += 1
        if steps == 4:
            for s in seqs[5:]:
                sched.add(s)
    for s, w, sp in zip(seqs, want, params, strict=True):
        assert s.output_ids == w if sp.greedy else len(s.output_ids) == sp.max_tokens
    assert sched.spec.stats.verifies > 0
    assert eng.pool.allocator.num_free == eng.cache.num_blocks


def test_logprobs_requests_take_the_per_replay_path(plain, artifact, monkeypatch):
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
    ps = prompts(2)
    runs: list[str] = []
    counting(monkeypatch, ChainGraphs, "run", runs)
    a = plain.generate(ps, params)
    b = graph_engine(artifact, 2).generate(ps, params)
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        for u, v in zip(x.logprobs, y.logprobs, strict=True):
            assert u.token_id == v.token_id and abs(u.logprob - v.logprob) < 1e-4
    assert not runs


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_captured_chain_equals_its_eager_body(artifact, monkeypatch, fp8):
    """On a GPU: the scheduler's start captures the chain of every bucket whose K + 1 rows per
    sequence fit the largest decode bucket; its replays give the tokens of the same padded body run
    eagerly, and each greedy decode-only step is one replay."""
    kw = dict(device="cuda", dtype=torch.bfloat16, verify=False, num_blocks=256, cuda_graph_max_bs=32)
    eng = spec_engine(artifact("tiny-v3", fp8=fp8), 3, **kw)
    eng.scheduler()  # its SpecDecoder prepares the chain
    chain = eng.runner.spec_executor().chains[3]
    assert sorted(chain.graphs) == [1, 2, 4, 8]  # 4 rows per sequence, up to the decode bucket 32
    runs: list[str] = []
    counting(monkeypatch, ChainGraphs, "run", runs)
    g = torch.Generator().manual_seed(5)
    for n in (1, 3, 8):
        ps = [torch.randint(3, 200, (4 + 3 * i,), generator=g).tolist() for i in range(n)]
        runs.clear()
        replayed, _ = run(eng, ps, SamplingParams(max_tokens=16, ignore_eos=True), check=False)
        assert runs, f"batch {n}: no chain replay"
        captured, chain.graphs = chain.graphs, {}  # the same padded body, eagerly
        try:
            padded_eager, _ = run(eng, ps, SamplingParams(max_tokens=16, ignore_eos=True), check=False)
        finally:
            chain.graphs = captured
        assert replayed == padded_eager, f"batch {n}"


def test_release_graphs_drops_the_chains_and_their_states(artifact):
    eng = graph_engine(artifact, 2)
    sched = eng.scheduler()  # prepares the chain
    ex = eng.runner.spec_executor()
    assert set(ex.chains) == {2}
    for p in prompts(2):
        sched.add(eng.new_sequence(p, SamplingParams(max_tokens=12, ignore_eos=True)))
    for _ in range(4):
        sched.step()
    assert ex.resident and ex.resident_in is ex.chains[2]
    sched.abort_all()
    ex.release_graphs()
    assert ex.chains == {} and ex.resident == () and ex.resident_in is None
