"""Engine.warmup: the step shapes a server meets, run once before it reports ready (Triton JIT)."""

from __future__ import annotations

import torch

from mlac.kernels.moe.grouped import pick_moe_config
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.scheduler import SchedulerConfig
from mlac.runtime.model import model as model_module

PROMPT = [5, 9, 2, 7, 11, 3, 8]


def test_warmup_is_a_no_op_on_cpu(artifact):
    engine = Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, num_blocks=64)
    assert engine.warmup() == []


def test_forced_warmup_runs_every_shape_and_leaves_no_trace(artifact):
    path = artifact("tiny-v3")
    limits = SchedulerConfig(max_running_requests=8, chunked_prefill_size=120)
    engine = Engine.from_artifact(path, dtype=torch.float32, num_blocks=256, scheduler=limits)
    variants = [(1, n) for n in (1, 2, 3, 5, 9, 97)]  # step_variants.warmup_token_counts (4 SMs on CPU)
    assert engine.warmup(force=True) == [(1, 4), (3, 4), (8, 4), (16, 4), *variants, (1, 100), (1, 120)]
    assert engine.pool.allocator.num_free == engine.cache.num_blocks
    fresh = Engine.from_artifact(path, dtype=torch.float32, num_blocks=256)
    want = fresh.generate(PROMPT, max_tokens=8, ignore_eos=True).token_ids
    assert engine.generate(PROMPT, max_tokens=8, ignore_eos=True).token_ids == want


def test_warmup_skips_what_the_cache_cannot_hold(artifact):
    # 10 blocks of 16 tokens: 16 sequences of 6 tokens need 16 blocks, a 100-token prompt 7
    engine = Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, num_blocks=10)
    ran = engine.warmup(force=True)
    assert (16, 4) not in ran and (64, 4) not in ran and (1, 100) in ran and (1, 4) in ran
    assert engine.pool.allocator.num_free == engine.cache.num_blocks


def test_server_load_warms_up_unless_told_not_to(artifact, monkeypatch):
    from mlac.runtime.serve import ServerConfig, load_engine

    calls = []
    monkeypatch.setattr(Engine, "warmup", lambda self, force=False: calls.append(self) or [(1, 4)])
    for warmup in (True, False):
        engine = load_engine(ServerConfig.of(artifact=artifact("tiny-v3"), num_blocks=32, warmup=warmup))
        engine.close()
    assert len(calls) == 1


def test_warmup_meets_every_moe_tile_config(artifact, monkeypatch):
    # A cached burst ran steps of 257-1,365 tokens whose MoE tiles the warm-up (and so
    # `mlac prepare`) never compiled; tiny-v2-lite: 8 experts, top-2, so 385-511 tokens at chunk 512
    limits = SchedulerConfig(max_running_requests=8, chunked_prefill_size=512)
    engine = Engine.from_artifact(artifact("tiny-v2-lite"), dtype=torch.float32, scheduler=limits)
    met = set()

    def spy(x, w13, w2, weights, ids, *args, **kwargs):
        met.add(pick_moe_config(ids.numel(), w13.shape[0], False))
        return fused_moe(x, w13, w2, weights, ids, *args, **kwargs)

    fused_moe = model_module.fused_moe
    monkeypatch.setattr(model_module, "fused_moe", spy)
    engine.warmup(force=True)
    experts, top_k = engine.config.n_routed_experts, engine.config.num_experts_per_tok
    assert met == {pick_moe_config(t * top_k, experts, False) for t in range(1, 513)}
