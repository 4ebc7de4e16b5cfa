"""Speculative decoding with the MTP layer (engine/spec/decode.py) on CPU, float32, tiny-v3.

Random weights: the MTP layer's drafts are mostly rejected, yet greedy output must be
token-identical to plain decoding at every K, batch and prompt mix. An oracle draft (the plain
output itself) checks the accept path: every draft accepted, same output, fewer steps. Rejected
drafts leave no block allocated, and a preempted speculative sequence resumes exactly.
"""

from __future__ import annotations

import pytest
import torch

from mlac.core.errors import MlacError
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.engine.scheduler import Scheduler, SchedulerConfig
from mlac.runtime.worker.spec_exec import SpecExecutor

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def prompts(n: int, start: int = 7) -> list[list[int]]:
    """n token-id prompts of different lengths (2, 6, 10, ... tokens)."""
    return [list(range(start + i, start + i + 2 + 4 * i)) for i in range(n)]


def spec_engine(path, k: int, **kwargs) -> Engine:
    config = SchedulerConfig(speculative_num_steps=k, **kwargs.pop("sched", {}))
    kwargs.setdefault("dtype", torch.float32)
    kwargs.setdefault("verify", False)
    return Engine.from_artifact(path, scheduler=config, **kwargs)


def run(engine: Engine, ps: list[list[int]], params=GREEDY, check=True) -> tuple[list[list[int]], object]:
    """Generate through one scheduler, checking every KV block after every step; returns the
    outputs and the scheduler."""
    sched = engine.scheduler()
    seqs = [engine.new_sequence(p, params) for p in ps]
    for s in seqs:
        sched.add(s)
    while sched.has_unfinished:
        sched.step()
        if check:
            sched.check_blocks()
    assert engine.pool.allocator.num_free == engine.cache.num_blocks
    return [s.output_ids for s in seqs], sched


@pytest.fixture(scope="module")
def plain(artifact) -> Engine:
    return Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_is_token_identical_batch_1_and_mixed(plain, artifact, k):
    eng = spec_engine(artifact("tiny-v3"), k)
    for ps in (prompts(1), prompts(5)):
        want, _ = run(plain, ps)
        got, sched = run(eng, ps)
        assert got == want
        assert sched.spec.stats.verifies > 0 and sched.spec.stats.drafted > 0


def test_fp8_artifact_greedy_identical(artifact):
    path = artifact("tiny-v3", fp8=True)
    plain = Engine.from_artifact(path, dtype=torch.float32, verify=False)
    ps = prompts(3)
    assert run(spec_engine(path, 2), ps)[0] == run(plain, ps)[0]


def oracle(monkeypatch, outputs: dict[tuple[int, ...], list[int]], wrong: bool = False) -> None:
    """Drafts that are the plain greedy output itself (or never it, with `wrong`): every greedy
    draft, on the device (chain, keep) or the host (_pick), comes from SpecExecutor.pick."""
    prompts_of: dict[int, tuple[int, ...]] = {}  # seq_id -> prompt
    add = Scheduler.add

    def add_seen(self, seq):
        prompts_of[seq.seq_id] = tuple(seq.prompt_ids)
        return add(self, seq)

    def pick_oracle(self, logits, seq_ids, at):
        out = []
        for seq_id, i in zip(seq_ids, at, strict=True):
            prompt = prompts_of[seq_id]
            plain, i = outputs[prompt], i - len(prompt)
            right = plain[i] if i < len(plain) else 0
            out.append((right + 1) % logits.shape[-1] if wrong else right)
        return torch.tensor(out, dtype=torch.int64, device=logits.device)

    monkeypatch.setattr(Scheduler, "add", add_seen)
    monkeypatch.setattr(SpecExecutor, "pick", pick_oracle)


@pytest.mark.parametrize("k", [1, 3])
def test_oracle_drafts_are_all_accepted_and_output_unchanged(plain, artifact, monkeypatch, k):
    ps = prompts(4)
    want, base = run(plain, ps)
    oracle(monkeypatch, {tuple(p): w for p, w in zip(ps, want, strict=True)})
    eng = spec_engine(artifact("tiny-v3"), k)
    got, sched = run(eng, ps)
    st = sched.spec.stats
    assert got == want
    assert st.accepted == st.drafted > 0 and st.accept_length > 1.5


def test_wrong_drafts_are_all_rejected_and_output_unchanged(plain, artifact, monkeypatch):
    ps = prompts(3)
    want, _ = run(plain, ps)
    oracle(monkeypatch, {tuple(p): w for p, w in zip(ps, want, strict=True)}, wrong=True)
    got, sched = run(spec_engine(artifact("tiny-v3"), 3), ps)
    assert got == want and sched.spec.stats.accepted == 0 and sched.spec.stats.accept_length == 1.0


def test_preempted_speculative_sequences_resume_exactly(plain, artifact):
    ps, params = prompts(6), SamplingParams(max_tokens=24, ignore_eos=True)
    want, _ = run(plain, ps, params)
    for prefix_cache in (True, False):
        eng = spec_engine(artifact("tiny-v3"), 3, num_blocks=10, sched={"prefix_cache": prefix_cache})
        got, sched = run(eng, ps, params)
        assert got == want
        assert sched.num_preemptions > 0


def test_prefix_cache_hits_keep_output(plain, artifact):
    base = list(range(40, 80))
    ps = [base + [5], base + [6, 7]]
    want, _ = run(plain, ps)
    eng = spec_engine(artifact("tiny-v3"), 2)
    run(eng, [base + [9]])  # leaves base's full blocks in the prefix cache
    got, sched = run(eng, ps)
    assert got == want and sched.prefix_hit_tokens > 0


def test_stop_and_max_tokens_inside_accepted_drafts(plain, artifact, monkeypatch):
    ps = prompts(3)
    want, _ = run(plain, ps, SamplingParams(max_tokens=20, ignore_eos=True))
    oracle(monkeypatch, {tuple(p): w for p, w in zip(ps, want, strict=True)})
    eng = spec_engine(artifact("tiny-v3"), 3)
    got, _ = run(eng, ps, SamplingParams(max_tokens=5, ignore_eos=True))
    assert got == [w[:5] for w in want]
    stop = want[0][3]
    got, _ = run(eng, ps[:1], SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(stop,)))
    assert got[0] == want[0][: want[0].index(stop) + 1]


def test_logprobs_match_plain_decoding(plain, artifact):
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
    ps = prompts(2)
    a = plain.generate(ps, params)
    b = spec_engine(artifact("tiny-v3"), 2).generate(ps, params)
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        for u, v in zip(x.logprobs, y.logprobs, strict=True):
            assert u.token_id == v.token_id and abs(u.logprob - v.logprob) < 1e-4


def test_refused_without_mtp_layer(checkpoint, tmp_path):
    from mlac.compiler.pipeline import compile_checkpoint
    from mlac.core.artifact import CompileOptions

    compile_checkpoint(checkpoint("tiny-v3"), tmp_path / "a", CompileOptions(mtp=False))
    with pytest.raises(MlacError, match="the artifact has no MTP layer") as e:
        spec_engine(tmp_path / "a", 2)
    assert "\n" not in str(e.value)


def test_seeded_sampling_is_reproducible(artifact):
    eng = spec_engine(artifact("tiny-v3"), 2)
    params = SamplingParams(max_tokens=8, temperature=0.8, top_k=20, seed=3, ignore_eos=True)
    a, sched = run(eng, prompts(2), params)
    b, _ = run(eng, prompts(2), params)
    assert a == b and all(len(x) == 8 for x in a) and sched.spec.stats.verifies > 0


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_draft_state_equals_a_fresh_mtp_pass_over_the_sequence(artifact, prefix_cache):
    """The MTP pool, built incrementally (prefill chunks, verifies with rejections, chains that
    write provisional entries), holds what one MTP pass over the whole sequence computes: the
    Draft after some steps equals that pass's output at the last position."""
    from mlac.runtime.kvcache.batch import ForwardBatch
    from mlac.runtime.kvcache.paged import PagedKVCache

    eng = spec_engine(artifact("tiny-v3"), 3, sched={"chunked_prefill_size": 8, "prefix_cache": prefix_cache})
    sched = eng.scheduler()
    seqs = [eng.new_sequence(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in prompts(4)]
    for s in seqs:
        sched.add(s)
    for _ in range(9):
        sched.step()
    model, checked = eng.runner.model, 0
    for s in seqs:
        draft = sched.spec.drafts.get(s.seq_id)
        if draft is None:
            continue
        n = s.num_tokens
        cache = PagedKVCache(model.config, 8, 16, torch.float32, extra_layers=1)
        batch = ForwardBatch.build([0], [n - 1], [list(range(8))], 16)
        h = model(torch.tensor(s.tokens(0, n - 1)), batch, cache)  # h_0 .. h_{n-2}
        g = model.draft(h, torch.tensor(s.tokens(1, n)), batch, cache)
        ex = eng.runner.spec_executor()
        stored = ex.store[s.seq_id]  # the Draft's g, on the device
        assert torch.allclose(stored, g[-1], atol=1e-4, rtol=1e-4)
        assert draft.token is None  # greedy: d_0 on the device too
        assert int(ex.tokens[s.seq_id]) == int(model.mtp[0].head(g[-1:]).argmax())
        checked += 1
    assert checked >= 3
    sched.abort_all()


def spy(fn, calls: list):
    def wrapped(step, *args, **kwargs):
        calls.append(step.num_seqs)
        return fn(step, *args, **kwargs)

    return wrapped


def test_verify_and_draft_steps_through_the_graph_buffers(plain, artifact):
    """Decode-shaped verify and draft steps run through DecodeGraphs (keeping hidden states) and
    DraftGraphs: on CPU nothing is captured and the same padded steps run eagerly, which checks the
    static inputs and the padding; the output stays the plain one."""
    from mlac.runtime.worker.graphs import DecodeGraphs
    from mlac.runtime.worker.spec_graphs import DraftGraphs

    ps = prompts(5)
    want, _ = run(plain, ps)
    eng = spec_engine(artifact("tiny-v3"), 3)
    r = eng.runner
    r.graphs = DecodeGraphs(r.model, r.cache, [1, 2, 4, 8, 16], eng.max_context, keep_hidden=True)
    r.draft_graphs = DraftGraphs(r.model, r.cache, [1, 2, 4, 8, 16], eng.max_context)
    verify, draft = [], []
    r.graphs.run = spy(r.graphs.run, verify)
    r.draft_graphs.run = spy(r.draft_graphs.run, draft)
    got, sched = run(eng, ps)
    assert got == want
    assert verify and max(verify) <= 16 and draft  # 5 sequences x 4 rows > 16 ran eagerly
    assert sched.spec.stats.verifies > 0


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_graphs_of_speculative_steps(artifact, fp8):
    """On a GPU: the captured verify (DecodeGraphs) and draft (DraftGraphs) steps give the tokens of
    the same padded steps run eagerly, and greedy speculative output matches plain decoding's
    first token (later ones may part at bf16 near-ties: other kernels, other batch shapes)."""
    path = artifact("tiny-v3", fp8=fp8)
    kw = dict(device="cuda", dtype=torch.bfloat16, verify=False, num_blocks=256, cuda_graph_max_bs=32)
    eng = spec_engine(path, 3, **kw)
    r = eng.runner
    assert r.graphs is not None and r.graphs.hidden is not None and r.draft_graphs is not None
    assert sorted(r.draft_graphs.graphs) == sorted(r.graphs.graphs)
    g = torch.Generator().manual_seed(3)
    for n in (1, 3, 8):
        ps = [torch.randint(3, 200, (4 + 3 * i,), generator=g).tolist() for i in range(n)]
        replayed, sched = run(eng, ps, check=False)
        assert sched.spec.stats.verifies > 0
        captured = r.graphs.graphs, r.draft_graphs.graphs
        r.graphs.graphs, r.draft_graphs.graphs = {}, {}  # the same padded steps, eagerly
        try:
            padded_eager, _ = run(eng, ps, check=False)
        finally:
            r.graphs.graphs, r.draft_graphs.graphs = captured
        assert replayed == padded_eager, f"batch {n}"
    plain = Engine.from_artifact(path, **kw)
    ps = [[5, 6, 7, 8, 9]]
    assert run(plain, ps)[0][0][0] == run(eng, ps)[0][0][0]


def test_mixed_requests_under_pressure(plain, artifact):
    """Greedy and sampled requests of mixed lengths, max_tokens and stop tokens, K = 2, a KV pool
    small enough to preempt, chunked prefill, the prefix cache on: every block is accounted for
    after every step, every greedy request gives its plain output, every sampled one its length."""
    import random

    rng = random.Random(0)
    base = list(range(300, 340))
    ps = [
        base[: rng.randrange(2, 40)] + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 9))]
        for _ in range(10)
    ]
    params = []
    for i in range(10):
        stop = (rng.randrange(3, 1000),) if i % 3 == 0 else ()
        kw = dict(max_tokens=rng.randrange(1, 20), ignore_eos=True, stop_token_ids=stop)
        params.append(SamplingParams(**kw) if i % 2 else SamplingParams(temperature=0.9, seed=i, **kw))
    want = [c.token_ids for c in plain.generate(ps, params)]
    eng = spec_engine(artifact("tiny-v3"), 2, num_blocks=12, sched={"chunked_prefill_size": 16})
    sched = eng.scheduler()
    seqs = [eng.new_sequence(p, sp) for p, sp in zip(ps, params, strict=True)]
    for s in seqs:
        sched.add(s)
    while sched.has_unfinished:
        sched.step()
        sched.check_blocks()
    for s, w, sp in zip(seqs, want, params, strict=True):
        if sp.greedy:
            assert s.output_ids == w
        assert s.finish_reason in ("stop", "length") and 1 <= len(s.output_ids) <= sp.max_tokens
    assert sched.num_preemptions > 0 and sched.spec.stats.verifies > 0
    assert eng.pool.allocator.num_free == eng.cache.num_blocks


def test_a_grammar_request_is_not_speculated_and_keeps_its_mask(plain, artifact):
    """A request with a grammar gets no drafts (they would need its mask) and samples under its
    grammar; the unconstrained requests of the same batch still speculate. Same outputs as plain."""
    import json

    from mlac.runtime.engine.params import GrammarSpec

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}  # fmt: skip
    constrained = SamplingParams(max_tokens=40, grammar=GrammarSpec("json_schema", json.dumps(schema)))
    eng = spec_engine(artifact("tiny-v3"), 2)

    def outputs(engine: Engine) -> tuple[list[list[int]], object]:
        sched = engine.scheduler()
        seqs = [engine.new_sequence(p, constrained if i == 0 else GREEDY) for i, p in enumerate(prompts(3))]
        for s in seqs:
            sched.add(s)
        while sched.has_unfinished:
            sched.step()
        return [s.output_ids for s in seqs], sched

    want, _ = outputs(plain)
    got, sched = outputs(eng)
    assert got == want
    text = eng.tokenizer.decode(got[0])
    assert set(json.loads(text)) == {"n"}
    assert sched.spec.stats.drafted > 0  # the other two speculated


def test_a_greedy_speculative_step_syncs_once(plain, artifact, monkeypatch):
    """A decode-only greedy step (every sequence drafting K = 3) runs K - 1 chained draft steps,
    the verify and the refresh's draft step with ONE device-to-host transfer (the drafts and the
    target's argmax together), not K + 1; the output stays the plain one."""
    import mlac.runtime.engine.spec.decode as spec_decode
    import mlac.runtime.worker.spec_exec as spec_exec

    ps, params = prompts(3), SamplingParams(max_tokens=24, ignore_eos=True)
    want, _ = run(plain, ps, params)
    eng = spec_engine(artifact("tiny-v3"), 3)
    sched = eng.scheduler()
    seqs = [eng.new_sequence(p, params) for p in ps]
    for s in seqs:
        sched.add(s)
    while not all(s.decoding for s in seqs):
        sched.step()
    counts = {"sync": 0, "draft": 0, "target": 0, "sample": 0}

    def counted(name, fn):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    to_host = counted("sync", spec_exec.to_host)
    for module in (spec_exec, spec_decode):
        monkeypatch.setattr(module, "to_host", to_host)
    monkeypatch.setattr(spec_decode, "sample_one", counted("sample", spec_decode.sample_one))
    ex = eng.runner.spec_executor()
    monkeypatch.setattr(ex, "_draft", counted("draft", ex._draft))
    monkeypatch.setattr(ex, "_target", counted("target", ex._target))
    for _ in range(3):
        before = dict(counts)
        verifies = sched.spec.stats.verifies
        sched.step()
        assert sched.spec.stats.verifies - verifies == 3  # each of the 3 sequences verified drafts
        step = {k: counts[k] - before[k] for k in counts}
        assert step == {"sync": 1, "draft": 3, "target": 1, "sample": 0}
    while sched.has_unfinished:
        sched.step()
    assert [s.output_ids for s in seqs] == want


@pytest.mark.parametrize("graphs", [False, True])
def test_device_chain_drafts_equal_the_host_chain(artifact, monkeypatch, graphs):
    """The greedy chain on the device (token ids written from the previous draft's argmax, through
    the graphs' static inputs with `graphs`) drafts exactly what the host-side chain drafts."""
    from mlac.runtime.engine.spec.decode import SpecDecoder
    from mlac.runtime.worker.graphs import DecodeGraphs
    from mlac.runtime.worker.spec_graphs import DraftGraphs

    def drafted(fast: bool) -> tuple[list, list]:
        eng = spec_engine(artifact("tiny-v3"), 3)
        if graphs:
            r = eng.runner
            r.graphs = DecodeGraphs(r.model, r.cache, [1, 2, 4, 8, 16], eng.max_context, keep_hidden=True)
            r.draft_graphs = DraftGraphs(r.model, r.cache, [1, 2, 4, 8, 16], eng.max_context)
        seen = []
        verify = SpecDecoder._verify

        def spied(self, sched, seq, logits, top, drafts, probs):
            seen.append((seq.num_tokens, list(drafts)))
            return verify(self, sched, seq, logits, top, drafts, probs)

        with monkeypatch.context() as m:
            m.setattr(SpecDecoder, "_verify", spied)
            if not fast:
                m.setattr(SpecDecoder, "_fast", lambda self, plan: False)
            out, _ = run(eng, prompts(3), SamplingParams(max_tokens=16, ignore_eos=True))
        return out, seen

    host, device = drafted(False), drafted(True)
    assert device == host and sum(len(d) for _, d in device[1]) > 20
