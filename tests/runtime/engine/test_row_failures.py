"""One request never fails the others (sequence.py, sampling.sample_apart, overlap.py): a row whose
sampling, grammar mask, grammar matcher or detokenizer raises fails its own sequence (finish_reason
"error", `error` says why) while the other rows of the same step get exactly the tokens they get
alone; every KV block comes back. And parameters at the edge of the accepted range (temperature
1e-300 and 5e-324, top_k 10**20) sample without failing anything.

CPU, float32, the tiny-v3 artifact; the failures are injected by monkeypatching one row's work.
"""

from __future__ import annotations

import pytest
import torch
from _cli import invoke

from mlac.core.errors import MlacError
from mlac.runtime.engine import constrain, sampling
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.overlap import Overlap
from mlac.runtime.engine.params import GrammarSpec, InvalidGrammar, SamplingParams
from mlac.runtime.engine.scheduler import SchedulerConfig
from mlac.runtime.engine.sequence import Sequence

POISON_SEED = 666  # the poisoned request's seed: how the patched sampler knows its row
BOOM = "poisoned row"


@pytest.fixture(scope="module")
def engine(artifact) -> Engine:
    return Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False, num_blocks=160)


INNOCENTS = [
    ([5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True)),  # greedy
    ([9, 10], SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=3)),  # seeded draws
    (
        [11, 12, 13, 14],
        SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, top_k=20, seed=4, logprobs=2),
    ),
]
POISON = ([20, 21], SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=POISON_SEED))


def run(engine: Engine, reqs, overlap: bool = False) -> tuple[list[Sequence], int]:
    """Every request of `reqs` [(prompt, params)] added before the first step, steps until all end,
    blocks checked after each step and all free at the end. Returns the sequences and the steps."""
    sched = engine.scheduler(SchedulerConfig(overlap=overlap))
    seqs = [engine.new_sequence(p, sp) for p, sp in reqs]
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_unfinished:
        sched.step()
        sched.check_blocks()
        steps += 1
    sched.abort_all()
    assert sched.check_blocks()["in_use"] == 0
    return seqs, steps


def outputs(seqs: list[Sequence]) -> list[tuple]:
    """Each sequence's tokens, finish reason, text and logprob values (rounded: a row's logits may
    differ in the last bits with the batch around it)."""
    return [(s.output_ids, s.finish_reason, s.text(), [round(lp.logprob, 4) for lp in s.logprobs])
            for s in seqs]  # fmt: skip


@pytest.fixture(scope="module")
def alone(engine) -> list[tuple]:
    """What each innocent request gets without the poison next to it."""
    return [outputs(run(engine, [req])[0])[0] for req in INNOCENTS]


def poison_sampling(monkeypatch, after: int = 2) -> list[int]:
    """sampling.sample raises whenever the poisoned row is among its rows, from its `after`-th
    call with that row on (so that the poison has been sampled with the others before). Returns
    the number of rows of each call that raised."""
    raised: list[int] = []
    calls = [0]
    sample = sampling.sample_deferred  # what sample and sample_apart (deferred or not) run

    def patched(logits, params, generators):
        if any(p.seed == POISON_SEED for p in params):
            calls[0] += 1
            if calls[0] > after:
                raised.append(len(params))
                raise RuntimeError(BOOM)
        return sample(logits, params, generators)

    monkeypatch.setattr(sampling, "sample_deferred", patched)
    return raised


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_row_whose_sampling_raises_fails_alone(engine, alone, monkeypatch, overlap):
    raised = poison_sampling(monkeypatch)
    land, landed = Overlap.land, []

    def spy(sched, flight):
        landed.append(dict(flight.errors))
        return land(sched, flight)

    monkeypatch.setattr(Overlap, "land", staticmethod(spy))
    seqs, _ = run(engine, [*INNOCENTS, POISON], overlap)
    *innocents, poison = seqs
    assert max(raised) == len(seqs)  # it raised in a step of every row: the step went on without it
    if overlap:  # the failed draw was that of a flight (launched ahead), landed as a failure
        assert {3} in [set(e) for e in landed]
    assert outputs(innocents) == alone  # seeded draws included: the failed attempt is not counted
    assert poison.finish_reason == "error" and poison.error == f"RuntimeError: {BOOM}"
    assert len(poison.output_ids) == 2  # the tokens it had before its row failed


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_row_that_is_no_distribution_fails_alone(engine, alone, monkeypatch, overlap):
    """NaN probabilities in one row (here: its min-p filter made to return NaN): the plain path finds
    it when the batch's draw is checked, overlap when the flight lands (nothing waits for the device
    at the draw); the row fails with one line, the others get their tokens as alone."""
    min_p = sampling.apply_min_p

    def nan_row(x, p):
        out = min_p(x, p)
        out[p == 0.5] = float("nan")
        return out

    monkeypatch.setattr(sampling, "apply_min_p", nan_row)
    poison = ([20, 21], SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, min_p=0.5, seed=7))
    seqs, _ = run(engine, [*INNOCENTS, poison], overlap)
    *innocents, bad = seqs
    assert outputs(innocents) == alone
    assert bad.finish_reason == "error" and bad.output_ids == []
    assert bad.error.endswith(sampling.NOT_A_DISTRIBUTION) and bad.error.startswith("ValueError: ")


def test_a_row_whose_detokenizer_raises_fails_alone(engine, alone, monkeypatch):
    seqs = [engine.new_sequence(p, sp) for p, sp in [*INNOCENTS, POISON]]
    detok = seqs[-1].detok

    def add(token: int) -> str:
        raise UnicodeError(BOOM)

    monkeypatch.setattr(detok, "add", add)
    sched = engine.scheduler()
    for s in seqs:
        sched.add(s)
    while sched.has_unfinished:
        sched.step()
    assert outputs(seqs[:-1]) == alone
    assert seqs[-1].finish_reason == "error" and seqs[-1].error == f"UnicodeError: {BOOM}"
    assert sched.check_blocks()["in_use"] == 0


def test_a_grammar_in_error_fails_its_row_alone(engine, alone):
    """A matcher that llguidance put in error (here: fed a token its grammar forbids, as only a
    bug could) raises GrammarFailed at the step's masks: its row fails with llguidance's first line,
    the rows without a grammar are sampled as alone."""
    constrained = ([30, 31], SamplingParams(max_tokens=8, grammar=GrammarSpec("json_object", "")))
    seqs = [engine.new_sequence(p, sp) for p, sp in [*INNOCENTS, constrained]]
    seqs[-1].matcher._m.consume_token(engine.tokenizer.encode("x", add_bos=False)[0])  # not '{'
    sched = engine.scheduler()
    for s in seqs:
        sched.add(s)
    while sched.has_unfinished:
        sched.step()
    assert outputs(seqs[:-1]) == alone
    assert seqs[-1].finish_reason == "error" and seqs[-1].output_ids == []
    assert seqs[-1].error.startswith("GrammarFailed: the grammar failed: ") and "\n" not in seqs[-1].error
    assert sched.check_blocks()["in_use"] == 0


def test_a_grammar_that_matches_nothing_is_refused_when_compiled(engine):
    """A schema that compiles but allows no first token ({"$ref": "#"}) is an InvalidGrammar (a 400
    naming response_format), not a completion that stops at once with no text."""
    with pytest.raises(InvalidGrammar, match=r"response_format: .* matches no output \(NoExtensionBias\)"):
        engine.new_sequence([5, 6], SamplingParams(grammar=GrammarSpec("json_schema", '{"$ref": "#"}')))
    ok = engine.new_sequence([5, 6], SamplingParams(grammar=GrammarSpec("json_schema", '{"type": "object"}')))
    assert isinstance(ok.matcher, constrain.Matcher)


def test_generate_raises_for_a_failed_prompt_after_the_others_ran(engine, monkeypatch):
    poison_sampling(monkeypatch, after=0)
    with pytest.raises(MlacError, match=f"prompt 1: the request failed in the engine: RuntimeError: {BOOM}"):
        engine.generate([[5, 6, 7], [20, 21]], [INNOCENTS[0][1], POISON[1]])
    with pytest.raises(MlacError, match=f"^the request failed in the engine: RuntimeError: {BOOM}$"):
        list(engine.stream([20, 21], POISON[1]))


# ---- parameters at the edge of the accepted range ---------------------------------------------------

EDGES = [dict(temperature=1e-300), dict(temperature=5e-324), dict(top_k=10**20, temperature=1.0, seed=1)]


@pytest.mark.parametrize("edge", EDGES, ids=["temperature=1e-300", "temperature=5e-324", "top_k=10**20"])
def test_edge_parameters_sample_in_a_batch_without_failing_it(engine, edge):
    """Next to a plain greedy request, in one batch: both finish with max_tokens; a tiny temperature
    is greedy (the same tokens as temperature 0)."""
    greedy = SamplingParams(max_tokens=5, ignore_eos=True)
    edgy = SamplingParams(max_tokens=5, ignore_eos=True, **edge)
    a, b = engine.generate([[5, 6, 7], [5, 6, 7]], [greedy, edgy])
    assert a.finish_reason == b.finish_reason == "length" and len(b.token_ids) == 5
    if "temperature" in edge and edge["temperature"] < 1e-5:
        assert b.token_ids == a.token_ids


@pytest.mark.parametrize("flags", [["--temperature", "1e-300"], ["--temperature", "5e-324"],
                                   ["--temperature", "1", "--top-k", str(10**20)]],
                         ids=["temperature=1e-300", "temperature=5e-324", "top_k=10**20"])  # fmt: skip
def test_mlac_generate_takes_edge_parameters(artifact, flags):
    r = invoke("generate", artifact("tiny-v3"), "--prompt", "hi", "--max-tokens", "3", "--dtype", "float32",
               "--no-verify", *flags)  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output and "3 completion tokens, finish: length" in r.output


def test_a_speculative_row_whose_acceptance_raises_fails_alone(artifact, monkeypatch):
    """With MTP speculation, sampled rows are accepted on the host (rejection sampling): the
    poisoned row's acceptance raises, the innocents' drafts are verified as alone."""
    from mlac.runtime.engine.spec import decode

    config = SchedulerConfig(speculative_num_steps=2)
    eng = Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False, scheduler=config)
    alone = [outputs(run_spec(eng, [req]))[0] for req in INNOCENTS]
    accept = decode.accept_sampled

    def poisoned(p, q, drafts, generator):
        if generator is not None and generator.initial_seed() == POISON_SEED:
            raise RuntimeError(BOOM)
        return accept(p, q, drafts, generator)

    monkeypatch.setattr(decode, "accept_sampled", poisoned)
    *innocents, poison = run_spec(eng, [*INNOCENTS, POISON])
    assert outputs(innocents) == alone
    assert poison.finish_reason == "error" and poison.error == f"RuntimeError: {BOOM}"


def run_spec(engine: Engine, reqs) -> list[Sequence]:
    """`reqs` through the engine's own (speculative) scheduler; every block free at the end."""
    sched = engine.scheduler()
    seqs = [engine.new_sequence(p, sp) for p, sp in reqs]
    for s in seqs:
        sched.add(s)
    while sched.has_unfinished:
        sched.step()
        sched.check_blocks()
    assert sched.check_blocks()["in_use"] == 0
    return seqs
