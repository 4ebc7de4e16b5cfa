"""The Triton kernel variants a model step of t tokens compiles, and the token counts that meet them all.

mlac promises no JIT compile after start-up: the warm-up (Engine.warmup, which `mlac prepare` runs to
fill the kernel cache) must run a step of every variant that serving can pick. Triton compiles one
variant per set of constexprs and per class of each integer argument not marked `dynamic`
(fp8_gemm.int_class). Several wrappers pick constexprs from the step's token count t, not only from
the weights' shapes:

- MoE (fused.moe_variants): the tile config from the rows per expert, and with FP8 the K split
  of each GEMM (`split_k_for`, from the tile count, so from t: V3 on 132 SMs splits GEMM1 in 2 at 2
  tokens only, narrower experts or fewer SMs split 2-8 ways over wider ranges), the top-k reduce's
  BLOCK_T, the one-token decode GEMVs;
- dense FP8 GEMM (fp8_gemm.gemm_variant, per weight shape): BLOCK_M = next power of two of M up to
  64 (decode tiles), then two prefill configs; and M itself (not `dynamic`): "1", "16", "any" (a
  warm-up of multiples of 16 above 256 tokens left every eager step of 300 tokens, say, to compile);
  where the model routes FP8 linears to cuBLAS (`StepShapes.fp8_cublas`), the products that
  fp8_cublas.cublas_takes compile no GEMM and quantize a plain input with act_quant's m_major
  layout (M's class; its padded rows and scale stride are `dynamic`);
- skinny GEMM (gemv.py, gemv_configs.py; bf16 weights at <= 16 rows): its config and BLOCK_M per row count;
- router (router_gemv.py): the fused launch's BLOCK_T, where router_plan takes it (<= 4 rows);
- act_quant (FP8 activations quantized apart): M's class.

Other kernels take t as a grid size or a `dynamic` argument only, or pick their variant from the
batch's shape rather than its size (attention form, split-KV decode): the warm-up's batches meet
those (Engine.warmup). Prefill steps of t tokens run every kernel here with M = t, so a warm-up of
one-sequence prefills of `warmup_token_counts(...)` meets every variant that a step of 1..max_tokens
tokens picks.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlac.kernels.gemm import gemv_configs
from mlac.kernels.gemm.fp8_cublas import cublas_takes
from mlac.kernels.gemm.fp8_gemm import gemm_variant, int_class, next_power_of_2
from mlac.kernels.moe import router_gemv
from mlac.kernels.moe.fused import moe_variants


@dataclass(frozen=True)
class MoeShape:
    """One rank's routed experts, as every MoE layer of a model has them."""

    num_experts: int  # local experts: w13 [num_experts, 2 * intermediate, hidden]
    top_k: int
    hidden: int
    intermediate: int  # per expert, local
    fp8: bool


@dataclass(frozen=True)
class StepShapes:
    """What, besides its token count, picks a step's kernel variants: the GPU's SM count and the
    weight shapes (this rank's) of the layers a step runs with M = t rows."""

    sms: int
    fp8_linears: tuple[tuple[int, int], ...] = ()  # (N, K) of each FP8 weight [N, K]
    dense_linears: tuple[tuple[int, int], ...] = ()  # (N, K) of each bf16/fp16 weight
    moe: MoeShape | None = None
    fp8_cublas: bool = False  # the FP8 linears run through cuBLAS where cublas_takes (Linear.cublas)


def step_variants(t: int, shapes: StepShapes) -> list[tuple]:
    """The kernel variants a step of t >= 1 tokens picks: one tuple per kernel (its name first)."""
    out: list[tuple] = []
    for n, k in shapes.fp8_linears:
        if shapes.fp8_cublas and cublas_takes(t, n, k):  # cuBLAS compiles nothing; a plain x is quantized
            out.append(("act_quant_m_major", k, int_class(t)))
        else:
            out.append(("fp8_gemm", n, k, *gemm_variant(t, n, k, shapes.sms)))
    if shapes.fp8_linears or (shapes.moe is not None and shapes.moe.fp8):  # where x is not an Fp8Act
        out.append(("act_quant", int_class(t)))
    if t <= gemv_configs.MAX_ROWS:
        out += [("skinny", n, k, *_skinny(t, n, k, shapes.sms)) for n, k in shapes.dense_linears]
    moe = shapes.moe
    if moe is not None:
        out += moe_variants(t, moe.top_k, moe.num_experts, moe.hidden, moe.intermediate, moe.fp8, shapes.sms)
        if router_gemv.router_plan(t) == "fused":
            out.append(("router", router_gemv.t_class(t)))
    return out


def _skinny(m: int, n: int, k: int, sms: int) -> tuple:
    """The skinny GEMM's (config, BLOCK_M) for a bf16 weight [n, k] at m <= 16 rows; None where
    cuBLAS runs instead (gemv_configs.skinny_applies: TUNED says None)."""
    key = ("bf16", n, k, gemv_configs.m_class(m))
    if key in gemv_configs.TUNED and gemv_configs.TUNED[key] is None:
        return (None,)
    cfg = gemv_configs.TUNED.get(key) or gemv_configs.default_config("bf16", n, k, m, sms)
    return cfg, gemv_configs.MAX_ROWS if cfg.dot else next_power_of_2(m)


def warmup_token_counts(shapes: StepShapes, max_tokens: int) -> list[int]:
    """Token counts (ascending) whose steps together meet every kernel variant that steps of 1 to
    `max_tokens` tokens pick: t is listed when its step picks a variant no smaller t picks. One pass
    over t, no tensors (it runs at start-up: about 50 ms for V3 at 8,192 tokens on a slow CPU)."""
    met: set[tuple] = set()
    counts, before = [], None
    for t in range(1, max_tokens + 1):
        variants = step_variants(t, shapes)
        if variants == before:  # most steps pick what the one before picked (cheaper than hashing)
            continue
        before = variants
        new = [v for v in variants if v not in met]
        if new:
            met.update(new)
            counts.append(t)
    return counts
