"""--attention-backend: the option through the options chain, the one-line refusals (flashinfer is
not installed here: that refusal runs for real), and the FlashInfer backend's plumbing on CPU.

On CPU FlashInfer's wrapper is replaced by a stand-in with its contract (`StandIn`: `plan` lays the
block tables out as FlashInfer's paged layout, `run` reads the pool through that layout,
kernels/attention/flashinfer_mla.paged_mla_ref), and mlac's mla_decode is made to raise: the eager
decode steps and the CUDA-graph path's padded steps (not captured on CPU: graphs.py) then run
through the backend alone, planned as on a GPU, and give the Triton path's greedy tokens, with
sequences that share cached prefix blocks. The kernel itself: test_attention_backend_gpu.py."""

from __future__ import annotations

import pytest
import torch

import mlac.runtime.model.attention as attention_forms
import mlac.runtime.worker.attention_backend as ab
import mlac.runtime.worker.backend_check as bc
from mlac.core.artifact import Manifest
from mlac.core.errors import MlacError
from mlac.kernels.attention.flashinfer_mla import page_layout, paged_mla_ref
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.options import EngineOptions
from mlac.runtime.serve.config import ServerConfig
from mlac.runtime.step import Step
from mlac.runtime.worker.graphs import DecodeGraphs
from mlac.runtime.worker.options import RuntimeOptions

# ---- the option ------------------------------------------------------------------------------------


def test_the_option_is_one_field_of_the_runtime_layer(tmp_path):
    assert RuntimeOptions().attention_backend == "triton"
    assert EngineOptions.of(attention_backend="flashinfer").runtime.attention_backend == "flashinfer"
    config = ServerConfig.of(artifact=tmp_path, attention_backend="flashinfer", dtype="float32")
    assert config.engine.runtime == RuntimeOptions(attention_backend="flashinfer", dtype="float32")
    with pytest.raises(MlacError, match="--attention-backend 'flash': one of triton, flashinfer"):
        RuntimeOptions(attention_backend="flash")


# ---- the refusals ------------------------------------------------------------------------------------


@pytest.mark.skipif(bc.flashinfer_installed(), reason="flashinfer is installed here")
def test_flashinfer_not_installed_is_one_line():
    with pytest.raises(MlacError) as e:
        bc.refuse_launch("flashinfer", "cuda", "bfloat16")
    assert str(e.value) == (
        "--attention-backend flashinfer: flashinfer is not installed (pip install flashinfer-python); "
        "or use triton"
    )
    assert bc.flashinfer_version() is None
    bc.refuse_launch("triton", "cpu", "float32")  # mlac's own kernels need nothing


def test_the_launch_is_refused_before_the_installation_is_asked(monkeypatch):
    monkeypatch.setattr(bc, "flashinfer_installed", lambda: pytest.fail("asked"))
    with pytest.raises(MlacError, match="needs a CUDA device, not cpu; use --attention-backend triton"):
        bc.refuse_launch("flashinfer", "cpu", "bfloat16")
    with pytest.raises(MlacError, match="take bfloat16 or float16, not --dtype float32"):
        bc.refuse_launch("flashinfer", "cuda:1", "float32")


@pytest.fixture
def installed(monkeypatch):
    """flashinfer "installed": the artifact's own reasons come next."""
    monkeypatch.setattr(bc, "flashinfer_installed", lambda: True)


def test_the_artifact_is_refused_by_its_own_reasons(artifact, installed):
    cuda = RuntimeOptions(device="cuda", attention_backend="flashinfer")
    manifest = Manifest.load(artifact("tiny-v2-lite"))  # kv_lora_rank 64, rope 16
    with pytest.raises(
        MlacError, match="built for kv_lora_rank 512 and qk_rope_head_dim 64; this model has 64 and 16"
    ):
        bc.check_backend(cuda, manifest)
    fp8 = manifest.model_copy(
        update={"options": manifest.options.model_copy(update={"kv_cache_dtype": "fp8_e4m3"})}
    )
    with pytest.raises(
        MlacError, match="the artifact's KV cache is fp8_e4m3, which FlashInfer's MLA path does not read"
    ):
        bc.check_backend(cuda, fp8)
    real = manifest.model_copy(
        update={"model": manifest.model.model_copy(update={"kv_lora_rank": 512, "qk_rope_head_dim": 64}),
                "plan": manifest.plan.model_copy(update={"dp_attention": True})}
    )  # fmt: skip
    with pytest.raises(MlacError, match="not with DP attention"):
        bc.check_backend(cuda, real)
    bc.check_backend(RuntimeOptions(device="cpu"), manifest)  # triton: nothing to refuse


def test_the_engine_refuses_before_it_loads_anything(artifact, monkeypatch):
    import mlac.runtime.engine.engine as engine_mod

    monkeypatch.setattr(
        engine_mod, "use_kernel_cache", lambda *a, **k: pytest.fail("reached the kernel cache")
    )
    monkeypatch.setattr(engine_mod, "make_runner", lambda *a, **k: pytest.fail("reached the load"))
    with pytest.raises(MlacError, match="^--attention-backend flashinfer: needs a CUDA device, not cpu"):
        Engine.from_artifact(artifact("tiny-v2-lite"), device="cpu", attention_backend="flashinfer")


# ---- the backend's plumbing on CPU -----------------------------------------------------------------


class StandIn:
    """PagedMLA's contract on CPU (kernels/attention/flashinfer_mla.py): `plan` keeps FlashInfer's
    layout of the rows, `run` computes what FlashInfer's kernel computes through it. Records each
    plan's (tables, lengths)."""

    made: list[StandIn] = []

    def __init__(self, workspace, heads, kv_lora, rope, page, scale, dtype, rows=None, indices=None):
        self.scale, self.rows, self.indices, self.plans = scale, rows, indices, []
        StandIn.made.append(self)

    def plan(self, tables: torch.Tensor, seq_lens) -> None:
        self.layout = page_layout(tables, seq_lens)
        self.plans.append((tables.tolist(), list(seq_lens)))

    def run(self, q_lat, q_rope, pool) -> torch.Tensor:
        return paged_mla_ref(q_lat, q_rope, pool, *self.layout, self.scale)


def use_standin(monkeypatch) -> type[StandIn]:
    """FlashInfer's wrapper replaced by StandIn from now on; mla_decode raises (the backend alone
    runs decode attention)."""
    StandIn.made = []
    monkeypatch.setattr(ab, "PagedMLA", StandIn)
    monkeypatch.setattr(ab, "jit_modules", set)

    def no_triton(*args, **kwargs):
        raise AssertionError("mla_decode ran under the flashinfer backend")

    monkeypatch.setattr(attention_forms, "mla_decode", no_triton)
    return StandIn


def cpu_engine(artifact) -> Engine:
    return Engine.from_artifact(artifact("tiny-v2-lite"), device="cpu", dtype=torch.float32, verify=False,
                                num_blocks=64, max_running_requests=8)  # fmt: skip


def use_flashinfer(engine: Engine, graphs: bool) -> ab.FlashInferAttention:
    """The engine's runner switched to the FlashInfer backend (with DecodeGraphs over it: `graphs`;
    on CPU their padded steps run uncaptured)."""
    runner = engine.runner
    backend = ab.FlashInferAttention(runner.model, runner.cache)
    runner.attention = backend
    if graphs:
        runner.graphs = DecodeGraphs(
            runner.model, runner.cache, [1, 2, 4, 8], engine.max_context, attention=backend
        )
    return backend


PREFIX = [5 + (7 * i) % 200 for i in range(40)]  # two full blocks of 16, and a part
PROMPTS = [PREFIX + [11, 12], PREFIX + [13], [21, 22, 23]]


def greedy(engine: Engine) -> list[list[int]]:
    return [c.token_ids for c in engine.generate(PROMPTS, max_tokens=6, temperature=0.0, ignore_eos=True)]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_flashinfer_backend_gives_the_triton_tokens_over_shared_prefix_blocks(artifact, monkeypatch, graphs):
    """Same greedy tokens as mla_decode. The prefix cache shares blocks between sequences: each row's
    page list is its block table, so the sharers' rows simply name the same blocks."""
    want = greedy(cpu_engine(artifact))
    made = use_standin(monkeypatch).made
    engine = cpu_engine(artifact)
    backend = use_flashinfer(engine, graphs)
    assert greedy(engine) == want
    if graphs:  # the eager wrapper, and one per bucket, planned for every replay
        assert [s.rows for s in made] == [None, 1, 2, 4, 8]
        assert all(s.indices is made[1].indices for s in made[1:])  # one page-id buffer for the buckets
        assert made[1].indices.numel() == 8 * engine.runner.graphs.inputs.max_blocks
        assert sum(len(s.plans) for s in made[1:]) > 0
    else:
        assert len(backend.eager_mla.plans) > 1  # the load's one-row plan, then the decode steps
    plans = [p for s in made for p in s.plans]
    shared = [t for t, lens in plans if len(t) >= 2 and t[0][:2] == t[1][:2] and min(lens[:2]) > 32]
    assert shared, "no step had two rows over the same cached prefix blocks"


def test_a_flattened_extend_plans_one_row_per_token(artifact, monkeypatch):
    """A short extend through the graphs: token j of a sequence with c cached tokens is a row of
    c + j + 1 tokens over that sequence's blocks; the padding rows one token of the scratch block."""
    engine = cpu_engine(artifact)
    runner = engine.runner
    table = [0, 1, 2]
    runner.run(Step.of([list(range(3, 35))], [0], [table]))  # 32 tokens cached in blocks 0 and 1
    step = Step.of([[40, 41, 42], [43, 44]], [32, 0], [table, [3]])  # 5 rows: the bucket of 8
    graphs = DecodeGraphs(runner.model, runner.cache, [1, 2, 4, 8], engine.max_context)
    want = graphs.run(step).clone()
    made = use_standin(monkeypatch).made
    backend = ab.FlashInferAttention(runner.model, runner.cache)
    graphs = DecodeGraphs(runner.model, runner.cache, [1, 2, 4, 8], engine.max_context, attention=backend)
    got = graphs.run(step)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    scratch = runner.cache.scratch_block
    rows = [table] * 3 + [[3, 0, 0]] * 2 + [[scratch, 0, 0]] * 3
    assert made[4].plans == [(rows, [33, 34, 35, 1, 2, 1, 1, 1])]  # planned after the fill, before the step
