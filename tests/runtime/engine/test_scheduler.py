"""Continuous batching (scheduler.py) through the Engine, and the KV cache dtypes (kvcache/paged.py).

CPU, float32, the tiny-v3 artifact. Outputs are compared token by token: a request's greedy
output must not depend on what else runs with it, on chunking, or on being preempted.
"""

from __future__ import annotations

import pytest
import torch
from _hf_convert import raw_config

from mlac.core.config import ModelConfig
from mlac.core.errors import MlacError
from mlac.kernels.attention.mla_decode import mla_decode_ref
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.engine.scheduler import SchedulerConfig
from mlac.runtime.kvcache.paged import PagedKVCache

PROMPT = "The morning train left the station"


@pytest.fixture(scope="module")
def engine(artifact) -> Engine:
    return Engine.from_artifact(artifact("tiny-v3"), dtype=torch.float32, verify=False)


def prompts(n: int, start: int = 7) -> list[list[int]]:
    """n token-id prompts of different lengths (2, 5, 8, ... tokens)."""
    return [list(range(start + i, start + i + 2 + 3 * i)) for i in range(n)]


def record_steps(monkeypatch, engine: Engine) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Record (q_lens, ctx_lens) of every step the engine's runner runs."""
    steps = []
    run = engine.runner.run

    def spy(step):
        steps.append((step.q_lens, step.ctx_lens))
        return run(step)

    monkeypatch.setattr(engine.runner, "run", spy)
    return steps


def all_free(engine: Engine) -> bool:
    return engine.pool.allocator.num_free == engine.cache.num_blocks


def test_batch_of_16_gives_each_request_its_output_alone(engine):
    ps, params = prompts(16), [SamplingParams(max_tokens=3 + i % 5, ignore_eos=True) for i in range(16)]
    together = engine.generate(ps, params)
    alone = [engine.generate(p, sp) for p, sp in zip(ps, params, strict=True)]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert [c.completion_tokens for c in together] == [3 + i % 5 for i in range(16)]
    assert all_free(engine)


def test_chunked_prefill_spans_steps_mixed_with_decodes(engine, monkeypatch):
    short, long_a, long_b = [5, 6, 7, 8], list(range(20, 60)), list(range(100, 130))
    params = [
        SamplingParams(max_tokens=12, ignore_eos=True),
        SamplingParams(max_tokens=3, ignore_eos=True),
        SamplingParams(max_tokens=3, ignore_eos=True),
    ]
    alone = [engine.generate(p, sp).token_ids for p, sp in zip([short, long_a, long_b], params, strict=True)]
    steps = record_steps(monkeypatch, engine)
    sched = engine.scheduler(
        SchedulerConfig(max_running_requests=2, chunked_prefill_size=8, prefix_cache=False)
    )
    seqs = [engine.new_sequence(p, sp) for p, sp in zip([short, long_a, long_b], params, strict=True)]
    for s in seqs:
        sched.add(s)
    while sched.has_unfinished:
        sched.step()
    assert [s.output_ids for s in seqs] == alone
    for q_lens, _ in steps:
        assert len(q_lens) <= 2  # max_running_requests
        assert sum(q for q in q_lens if q > 1) <= 8  # chunked_prefill_size
    assert any(1 in q and max(q) > 1 for q, _ in steps)  # a prefill chunk mixed with a decode
    long_chunks = [q for q, ctx in steps if len(q) == 2 and q[1] > 1]
    assert len(long_chunks) >= 40 // 8  # the 40-token prompt spans several steps
    assert all_free(engine)


def test_requests_join_and_leave_the_running_batch(engine, monkeypatch):
    steps = record_steps(monkeypatch, engine)
    sched = engine.scheduler()
    a = engine.new_sequence([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    b = engine.new_sequence([8, 9], SamplingParams(max_tokens=2, ignore_eos=True))
    sched.add(a)
    sched.step()
    sched.step()
    sched.add(b)  # joins a running batch
    while sched.has_unfinished:
        sched.step()
    sizes = [len(q) for q, _ in steps]
    assert sizes[:2] == [1, 1] and 2 in sizes and sizes[-1] == 1  # b joined, then left before a
    assert a.output_ids == engine.generate([5, 6, 7], max_tokens=6, ignore_eos=True).token_ids


def test_preemption_recomputes_and_changes_no_output(artifact, engine):
    ps = prompts(10)
    params = [
        SamplingParams(max_tokens=10 + 2 * i, ignore_eos=True, temperature=0.0 if i % 3 else 0.9, seed=i)
        for i in range(10)
    ]
    alone = [engine.generate(p, sp).token_ids for p, sp in zip(ps, params, strict=True)]
    small = Engine.from_artifact(
        artifact("tiny-v3"), dtype=torch.float32, verify=False, num_blocks=20, block_size=4
    )
    sched = small.scheduler(SchedulerConfig(max_running_requests=10, chunked_prefill_size=16))
    seqs = [small.new_sequence(p, sp) for p, sp in zip(ps, params, strict=True)]
    for s in seqs:
        sched.add(s)
    while sched.has_unfinished:
        sched.step()
        held = [b for s in seqs for b in s.block_table]  # finished and preempted sequences hold none
        assert len(set(held)) == len(held)  # no block in two tables
        assert small.pool.allocator.num_free == small.cache.num_blocks - len(held)
    assert sched.num_preemptions > 0 and any(s.num_preemptions for s in seqs)
    assert [s.output_ids for s in seqs] == alone  # greedy and seeded alike
    assert [s.finish_reason for s in seqs] == ["length"] * 10
    assert all_free(small)


def test_abort_frees_blocks_at_the_next_step(engine):
    sched = engine.scheduler()
    a = engine.new_sequence(list(range(5, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
    b = engine.new_sequence([5, 6], SamplingParams(max_tokens=4, ignore_eos=True))
    sched.add(a)
    sched.add(b)
    sched.step()
    held = engine.cache.num_blocks - engine.pool.allocator.num_free
    assert held >= 4
    sched.abort(a.seq_id)
    assert engine.cache.num_blocks - engine.pool.allocator.num_free == held  # not before the step
    news = sched.step()
    assert a in news and a.finish_reason == "abort" and a.block_table == []
    assert engine.cache.num_blocks - engine.pool.allocator.num_free == 1  # b's block only
    while sched.has_unfinished:
        sched.step()
    assert b.finish_reason == "length" and all_free(engine)


def test_stream_deltas_add_up_to_the_completion(engine):
    full = engine.generate(PROMPT, max_tokens=24, ignore_eos=True)
    stop = full.text[8:11]
    want = engine.generate(PROMPT, max_tokens=24, ignore_eos=True, stop=[stop])
    deltas = list(engine.stream(PROMPT, max_tokens=24, ignore_eos=True, stop=[stop]))
    assert "".join(d.text for d in deltas) == want.text
    assert [t for d in deltas for t in d.token_ids] == want.token_ids
    assert [d.finish_reason for d in deltas][-1] == "stop" and all(
        d.finish_reason is None for d in deltas[:-1]
    )
    assert deltas[-1].completion_tokens == want.completion_tokens and len(deltas) > 2
    assert all_free(engine)


def test_closing_a_stream_early_frees_its_blocks(engine):
    it = engine.stream(PROMPT, max_tokens=200, ignore_eos=True)
    next(it)
    assert not all_free(engine)
    it.close()
    assert all_free(engine)


def test_validation_happens_before_the_first_delta(engine):
    with pytest.raises(MlacError, match="empty prompt"):
        engine.stream([], max_tokens=4)
    with pytest.raises(ValueError, match="min_p"):
        engine.generate([PROMPT, PROMPT], min_p=2.0)
    with pytest.raises(MlacError, match="not both"):
        engine.generate(PROMPT, SamplingParams(), max_tokens=3)
    assert all_free(engine)


def test_logprobs_are_the_model_distribution(engine):
    ids = engine.tokenizer.encode(PROMPT)
    out = engine.generate(ids, max_tokens=5, ignore_eos=True, logprobs=3)
    assert len(out.logprobs) == len(out.token_ids) == 5
    teacher = torch.log_softmax(engine.score(ids + out.token_ids[:-1]), dim=-1)[len(ids) - 1 :]  # [5, V]
    for pos, (lp, tok) in enumerate(zip(out.logprobs, out.token_ids, strict=True)):
        assert lp.token_id == tok and len(lp.top) == 3
        assert lp.top[0][0] == tok  # greedy: the chosen token is the most likely
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert lp.logprob == pytest.approx(teacher[pos, tok].item(), abs=1e-4)
    assert engine.generate(ids, max_tokens=2).logprobs is None


# ---- KV cache dtypes -------------------------------------------------------------------------------

CONFIG = ModelConfig.from_hf(raw_config("v3"))


@pytest.mark.parametrize(
    "kv_dtype, torch_dtype, rel",
    [("fp8_e4m3", torch.float8_e4m3fn, 2**-4), ("fp8_e5m2", torch.float8_e5m2, 2**-3)],
)
def test_fp8_cache_quantizes_on_write_and_dequantizes_on_read(kv_dtype, torch_dtype, rel):
    c = PagedKVCache(CONFIG, num_blocks=4, block_size=4, dtype=torch.float32, kv_dtype=kv_dtype)
    assert c.layers[0].dtype == torch_dtype and c.storage_dtype == torch_dtype
    x = torch.randn(3, CONFIG.kv_latent_dim, generator=torch.Generator().manual_seed(0)) * 3
    slots = torch.tensor([13, 2, 7])
    c.write(1, slots, x)
    got = c.read(1, slots)
    assert got.dtype == torch.float32
    assert ((got - x).abs() <= rel * x.abs() + 2**-9).all()  # round to nearest: half a step, plus subnormals
    assert torch.equal(c.layers[1][3, 1].float(), got[0])  # slot 13 = block 3, offset 1
    c.write(0, torch.tensor([0]), torch.full((1, CONFIG.kv_latent_dim), 1e6))
    assert c.read(0, torch.tensor([0])).max() == torch.finfo(torch_dtype).max  # clamped, not NaN
    scale = c.kv_scale(1)
    assert scale.dtype == torch.float32 and scale.numel() == 1  # mla_decode's kv_scale contract


def test_cache_sizes_follow_the_kv_dtype():
    bf16 = PagedKVCache.bytes_per_block(CONFIG, 16, torch.bfloat16)
    assert PagedKVCache.bytes_per_block(CONFIG, 16, torch.bfloat16, "fp8_e4m3") * 2 == bf16
    assert PagedKVCache.bytes_per_block(CONFIG, 16, torch.float32, "bf16") == 2 * bf16  # = compute dtype
    assert PagedKVCache.from_budget(CONFIG, 10 * bf16, 16, kv_dtype="fp8_e5m2").num_blocks == 19  # + scratch
    assert PagedKVCache(CONFIG, 2, 4, torch.float32).kv_scale(0) is None
    with pytest.raises(MlacError, match="unknown KV cache dtype"):
        PagedKVCache(CONFIG, 2, 4, kv_dtype="int4")


def test_fp8_cache_matches_the_decode_kernel_contract():
    """The paged FP8 pool and its scale go to mla_decode as they are; same as attending over read()."""
    c = PagedKVCache(CONFIG, num_blocks=6, block_size=4, dtype=torch.float32, kv_dtype="fp8_e4m3")
    c.scales[0].fill_(0.5)  # a non-unit static scale
    g = torch.Generator().manual_seed(1)
    table, n = [4, 1, 3], 10
    slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(n)])
    c.write(0, slots, torch.randn(n, CONFIG.kv_latent_dim, generator=g))
    h, lora = 2, CONFIG.kv_lora_rank
    q = torch.randn(1, h, CONFIG.kv_latent_dim, generator=g)
    o, _ = mla_decode_ref(
        q[..., :lora],
        q[..., lora:],
        c.layers[0],
        torch.tensor([table], dtype=torch.int32),
        torch.tensor([n], dtype=torch.int32),
        0.1,
        kv_scale=c.kv_scale(0),
    )
    kv = c.read(0, slots)  # [n, C + R]
    want = torch.softmax(torch.einsum("hd,sd->hs", q[0], kv) * 0.1, dim=-1) @ kv[:, :lora]
    torch.testing.assert_close(o[0], want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def fp8_kv_artifact(tmp_path_factory, checkpoint):
    from mlac.compiler.pipeline import compile_checkpoint
    from mlac.core.artifact import CompileOptions

    out = tmp_path_factory.mktemp("artifact") / "tiny-v3-kv-fp8"
    compile_checkpoint(
        checkpoint("tiny-v3"), out, CompileOptions(kv_cache_dtype="fp8_e4m3", accuracy_check=False)
    )
    return out


def test_artifact_kv_cache_dtype_reaches_the_engine(fp8_kv_artifact, engine):
    fp8 = Engine.from_artifact(fp8_kv_artifact, dtype=torch.float32, verify=False, kv_cache_bytes=1 << 20)
    assert fp8.cache.kv_dtype == "fp8_e4m3" and fp8.cache.layers[0].dtype == torch.float8_e4m3fn
    per_block = PagedKVCache.bytes_per_block(fp8.config, 16, torch.float32, "fp8_e4m3")
    assert fp8.cache.num_blocks == (1 << 20) // per_block - 1  # from the budget, less the scratch block
    ids = engine.tokenizer.encode(PROMPT + " at dawn, and the")
    want, got = engine.score(ids), fp8.score(ids)
    assert ((got - want).norm() / want.norm()).item() < 0.2  # random tiny weights amplify FP8 noise
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.7
    out = fp8.generate([ids, ids[:5]], SamplingParams(max_tokens=6, ignore_eos=True))  # prefill + decode
    assert [c.completion_tokens for c in out] == [6, 6]
    assert out[0].token_ids[0] == want[-1].argmax().item()
    assert fp8.pool.allocator.num_free == fp8.cache.num_blocks
