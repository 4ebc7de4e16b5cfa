"""The runtime model against transformers' DeepSeek V2/V3 (fp32), and cache-path consistency.

Parity: max |logits - ref| / max |ref| <= 1e-4 on 40-token prompts; greedy decoding of 32 tokens
through the paged cache (absorbed decode) equals transformers' generate(do_sample=False).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from _hf_convert import build_hf, convert, raw_config

from mlac.core.config import ModelConfig
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.kvcache.batch import ForwardBatch
from mlac.runtime.kvcache.blocks import BlockAllocator
from mlac.runtime.kvcache.paged import PagedKVCache

PRESETS = ["v2-lite", "v2", "v3", "v3-norope-scaling"]
TOL = 1e-4


@functools.cache
def pair(preset: str, block_size: int = 8) -> tuple[torch.nn.Module, Engine]:
    raw = raw_config(preset)
    hf = build_hf(raw, seed=PRESETS.index(preset))
    config = ModelConfig.from_hf(raw)
    engine = Engine.from_tensors(config, convert(hf, config), dtype=torch.float32, block_size=block_size)
    return hf, engine


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("preset", PRESETS)
def test_logits_match_transformers(preset):
    hf, engine = pair(preset)
    ids = prompt(40, seed=1)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = engine.score(ids)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert rel_err(got, ref) <= TOL


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_decode_matches_transformers_generate(preset):
    hf, engine = pair(preset)
    ids = prompt(36, seed=2)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32)[0, len(ids) :].tolist()
    out = engine.generate(ids, max_tokens=32, ignore_eos=True)
    assert len(set(ref)) > 4  # the reference is not degenerate
    assert out.token_ids == ref
    assert (out.finish_reason, out.prompt_tokens, out.completion_tokens) == ("length", 36, 32)


@pytest.mark.parametrize("preset", ["v2", "v3"])
def test_chunked_prefill_equals_one_prefill(preset):
    _, engine = pair(preset)
    ids = prompt(45, seed=3)
    whole = engine.score(ids)
    for chunk in (20, 8, 7):  # chunks aligned and unaligned with the 8-token blocks
        assert rel_err(engine.score(ids, chunk_size=chunk), whole) <= 1e-5


@pytest.mark.parametrize("preset", ["v2-lite", "v3"])
def test_batched_decode_equals_each_alone(preset):
    _, engine = pair(preset)
    prompts = [prompt(n, seed=10 + n) for n in (5, 17, 33, 9)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    together = engine.generate(prompts, params)
    alone = [engine.generate(p, params) for p in prompts]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert engine.pool.allocator.num_free == engine.cache.num_blocks  # every block given back


def test_decode_step_logits_equal_prefill_logits():
    """Absorbed decode over paged latents, B sequences of different lengths in one step, equals
    the MHA-form prefill logits at the same positions."""
    _, engine = pair("v3")
    model, cache = engine.runner.model, PagedKVCache(engine.config, 32, 4, torch.float32)
    seqs = [prompt(n, seed=n) for n in (3, 10, 21)]
    alloc = BlockAllocator(cache.num_blocks, cache.block_size)
    tables = [alloc.alloc(alloc.blocks_for(len(s))) for s in seqs]
    # prefill all but the last token of each sequence, several sequences in one extend batch
    batch = ForwardBatch.build([0] * 3, [len(s) - 1 for s in seqs], tables, 4)
    model(torch.tensor([t for s in seqs for t in s[:-1]]), batch, cache)
    step = ForwardBatch.build([len(s) - 1 for s in seqs], [1, 1, 1], tables, 4)
    assert step.is_decode
    decoded = model.logits(model(torch.tensor([s[-1] for s in seqs]), step, cache))
    for i, s in enumerate(seqs):
        assert rel_err(decoded[i], engine.score(s)[-1]) <= 1e-5


@pytest.mark.parametrize("preset", ["v2", "v3"])
def test_bf16_error_tracks_transformers_bf16(preset):
    """bf16 end to end: its error against fp32 is that of transformers run in bf16 (routing
    flips under bf16 dominate both), and the top-1 tokens mostly agree."""
    hf, engine32 = pair(preset)
    engine16 = Engine.from_tensors(engine32.config, convert(hf, engine32.config), dtype=torch.bfloat16)
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    ids = [prompt(40, seed=s) for s in (4, 5, 6)]
    ref = torch.cat([engine32.score(i) for i in ids])
    got = torch.cat([engine16.score(i) for i in ids])
    with torch.no_grad():
        hf_got = torch.cat([hf16(torch.tensor([i])).logits[0].float() for i in ids])
    assert got.dtype == torch.float32
    assert rel_l2(got, ref) <= 1.5 * rel_l2(hf_got, ref) + 0.01
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85


def rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).norm() / ref.norm()).item()
