"""The whole model on the Triton kernels (MLAC_FORCE_TRITON=1, CPU, TRITON_INTERPRET=1) against the
same artifact on the pure-torch references: logits of a prefill (MHA form), an extend after the
cached prefix (absorbed form) and a decode step, over two sequences of different lengths.

It lives in tests/kernels/ because it needs this folder's conftest: Triton's interpreter multiplies
the raw uint16 bits of bf16 `tl.dot` operands (triton-lang/triton#11584) and truncates float32 to
bf16; conftest.py patches both. Unpatched, every bf16 run (FP8 artifacts included) gives logits
near 1e11, from the first skinny GEMM on (layers.0.attn.wq: gemv.py; extend.py and
mla_decode.py meet it too; head_bmm.py, moe/grouped.py and moe/decode.py upcast under the
interpreter themselves).
An interpreter artefact: the GPU computes these dots right (GPU parity tests pass).

Bounds, relative L2 of a step's logits (measured worst, tiny presets, seed 0, in brackets):
- float32 [1e-6]: summation order only. In float32 the MoE GEMMs, head_bmm and the skinny GEMM
  take their references (they run bf16 / fp16 / FP8); norms, mla_prep, attention, routing and
  silu·mul run Triton.
- bf16 [1.3e-2]: every kernel, with bf16-rounded intermediates (the bf16 reference is itself 1e-2
  to 4e-2 from float32). Rounding noise can flip a near-tie in routing: tiny-v3's extend sends one
  token of layer 1 to expert 14 instead of 3 (same input: the same experts both ways), and that
  step's logits move 0.19. So: at most one rerouted token per MoE call, and the loose bound from
  the first rerouted step on.
- FP8 [0.42]: e4m3 activations turn rounding noise into whole e4m3 steps (tiny-v2 in float32: of
  6,144 silu·mul outputs of layer 0 one rounds to -56 instead of -52, w2's output moves 3e-4);
  each later quantization amplifies that and tokens reroute. The bound catches a broken kernel
  (random logits are ~1.4 away, the unpatched interpreter 1e10), not a rounding difference; the
  FP8 kernels are pinned one by one in test_fp8_gemm.py, test_moe_grouped.py, test_head_bmm.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

try:
    from tests.kernels import _util
except ImportError:  # tests/ is not a package: pytest put this folder on sys.path
    import _util

from mlac.runtime.engine.engine import Engine
from mlac.runtime.model import attention as attention_forms
from mlac.runtime.model import model as model_mod
from mlac.runtime.step import Step

pytestmark = pytest.mark.skipif(
    not _util.HAS_TRITON or _util.HAS_CUDA, reason="needs triton's CPU interpreter (no CUDA)"
)


@dataclass(frozen=True)
class Recipe:
    """How an artifact runs, which kernels it must reach, how close its Triton logits must stay."""

    dtype: torch.dtype  # compute dtype
    fp8: bool  # FP8 artifact (block-FP8 weights, e4m3 activations)
    bound: float  # a step's logits, while both runs have routed every token alike
    bound_rerouted: float  # a step's logits, once some token went to other experts
    max_rerouted: int  # tokens per MoE layer call that may go to other experts
    kernels: frozenset[str]  # Triton kernels the forward must launch (among others)


ATTENTION = frozenset(
    {"_rms_norm_kernel", "_mla_prep_kernel", "_extend_attention_kernel", "_mla_decode_split_kernel"}
)
RECIPES = {
    "fp32": Recipe(torch.float32, False, 1e-5, 1e-5, 0, ATTENTION | {"_router_kernel", "_silu_mul_kernel"}),
    "bf16": Recipe(
        torch.bfloat16,
        False,
        3e-2,
        0.4,
        1,
        ATTENTION | {"_skinny_kernel", "_head_bmm_kernel", "_moe_gemm_kernel"},
    ),
    "fp8": Recipe(
        torch.bfloat16, True, 0.6, 0.6, 1 << 30, ATTENTION | {"_fp8_gemm_kernel", "_act_quant_kernel"}
    ),
}
PREFILL, EXTEND = (6, 3), 2  # prompt tokens of the two sequences; tokens of the extend step


@pytest.fixture
def launched(monkeypatch) -> set[str]:
    """The names of the Triton kernels launched (under the interpreter) during the test."""
    from triton.runtime.interpreter import InterpretedFunction

    names: set[str] = set()
    run = InterpretedFunction.run

    def spy(self, *args, **kwargs):
        names.add(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", spy)
    return names


@pytest.fixture
def routes(monkeypatch) -> list[torch.Tensor]:
    """The experts of every MoE layer call, [T, top_k] sorted per token, in call order."""
    chosen: list[torch.Tensor] = []
    real = model_mod.gate_and_route

    def spy(*args, **kwargs):
        weights, ids = real(*args, **kwargs)
        chosen.append(ids.sort(dim=-1).values)
        return weights, ids

    monkeypatch.setattr(model_mod, "gate_and_route", spy)
    return chosen


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm())


def three_steps(engine: Engine, monkeypatch, routes: list) -> list[tuple[torch.Tensor, int]]:
    """(logits, MoE layer calls since the first step) after each of: the prefill (MHA form,
    every token's logits), the extend (absorbed form, every token's), one decode step."""
    g = torch.Generator().manual_seed(7)
    vocab = engine.config.vocab_size
    seqs = [torch.randint(3, vocab, (p + EXTEND + 1,), generator=g).tolist() for p in PREFILL]
    ctx = [p + EXTEND for p in PREFILL]
    tables: list[list[int]] = [[], []]
    for seq, table in zip(seqs, tables, strict=True):
        engine.pool.allocator.reserve(table, len(seq))
    steps = [
        (0, Step.of([s[:p] for s, p in zip(seqs, PREFILL, strict=True)], [0, 0], tables, every_token=True)),
        (
            1 << 30,
            Step.of([s[p:c] for s, p, c in zip(seqs, PREFILL, ctx, strict=True)], PREFILL, tables, True),
        ),
        (1 << 30, Step.of([[s[c]] for s, c in zip(seqs, ctx, strict=True)], ctx, tables)),
    ]
    start, out = len(routes), []
    try:
        for absorbed_max_q_len, step in steps:
            monkeypatch.setattr(attention_forms, "ABSORBED_MAX_Q_LEN", absorbed_max_q_len)
            out.append((engine.runner.run(step), len(routes) - start))
    finally:
        for table in tables:
            engine.pool.allocator.free(table)
    return out


def tokens_rerouted(ref: list[torch.Tensor], got: list[torch.Tensor]) -> list[int]:
    """For each MoE layer call, how many tokens the two runs sent to different experts."""
    return [int((r != g).any(dim=-1).sum()) for r, g in zip(ref, got, strict=True)]


SLOW = pytest.mark.slow  # ~10-15 s each under the interpreter


@pytest.mark.parametrize(
    "preset, recipe",
    [(p, "fp32") for p in ("tiny-v2-lite", "tiny-v2", "tiny-v3")]
    + [("tiny-v2-lite", "bf16"), ("tiny-v2-lite", "fp8")]
    + [pytest.param(p, r, marks=SLOW) for p in ("tiny-v2", "tiny-v3") for r in ("bf16", "fp8")],
)
def test_whole_model_triton_matches_reference(
    preset, recipe, artifact, monkeypatch, launched, routes, setting
):
    r = RECIPES[recipe]
    engine = Engine.from_artifact(artifact(preset, fp8=r.fp8), dtype=r.dtype)
    setting("MLAC_FORCE_TRITON", None)
    routes.clear()  # the engine's own start-up steps
    ref = three_steps(engine, monkeypatch, routes)
    assert not launched  # the reference run: no Triton
    n_ref = len(routes)
    setting("MLAC_FORCE_TRITON", "1")
    got = three_steps(engine, monkeypatch, routes)
    assert r.kernels <= launched, sorted(r.kernels - launched)
    rerouted = tokens_rerouted(routes[:n_ref], routes[n_ref:])
    errors = [rel_l2(g, w) for (g, _), (w, _) in zip(got, ref, strict=True)]
    assert max(rerouted) <= r.max_rerouted, rerouted  # a near-tie reroutes a token, a broken router many
    for (_, calls), err in zip(ref, errors, strict=True):
        bound = r.bound_rerouted if any(rerouted[:calls]) else r.bound
        assert err <= bound, (preset, recipe, errors, rerouted)
