"""Speculative decoding on a multi-rank artifact (CPU, gloo): rank 0 broadcasts every op of the
draft and verify steps (spec_exec.py) and the other ranks mirror it; greedy output equals plain
decoding of the same tp-2 artifact."""

from __future__ import annotations

import pytest
import torch

from mlac.compiler.pipeline import compile_checkpoint
from mlac.core.artifact import CompileOptions
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.engine.scheduler import SchedulerConfig

PROMPTS = [list(range(30, 41)), list(range(100, 103)), list(range(200, 222))]


@pytest.mark.parametrize("ep", [1, 2])
def test_tp2_speculative_greedy_equals_plain(checkpoint, tmp_path, ep):
    path = tmp_path / "tp2"
    compile_checkpoint(checkpoint("tiny-v3"), path, CompileOptions(tp=2, ep=ep, accuracy_check=False))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with Engine.from_artifact(path, dtype=torch.float32, num_blocks=32) as plain:
        want = [c.token_ids for c in plain.generate(PROMPTS, params)]
    config = SchedulerConfig(speculative_num_steps=3)
    with Engine.from_artifact(path, dtype=torch.float32, num_blocks=32, scheduler=config) as spec:
        sched = spec.scheduler()
        seqs = [spec.new_sequence(p, params) for p in PROMPTS]
        for s in seqs:
            sched.add(s)
        while sched.has_unfinished:
            sched.step()
        got = [s.output_ids for s in seqs]
        sampled = spec.generate(
            PROMPTS, SamplingParams(max_tokens=6, temperature=1.0, seed=1, ignore_eos=True)
        )
    assert got == want
    assert sched.spec.stats.verifies > 0
    assert all(len(c.token_ids) == 6 for c in sampled)


def test_rank_0_failing_in_a_draft_step_stops_the_others(checkpoint, tmp_path, monkeypatch):
    import time

    from mlac.core.errors import MlacError

    path = tmp_path / "tp2"
    compile_checkpoint(checkpoint("tiny-v3"), path, CompileOptions(tp=2, accuracy_check=False))
    config = SchedulerConfig(speculative_num_steps=2)
    with Engine.from_artifact(path, dtype=torch.float32, num_blocks=32, scheduler=config) as spec:
        rank1 = spec.runner.group.procs[1]

        def broken(*args):
            raise RuntimeError("rank 0 broke")

        monkeypatch.setattr(spec.runner.local.model, "draft", broken)
        t = time.monotonic()
        with pytest.raises(MlacError, match="RuntimeError: rank 0 broke"):
            spec.generate(PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True))
        assert time.monotonic() - t < 10 and not rank1.is_alive()
