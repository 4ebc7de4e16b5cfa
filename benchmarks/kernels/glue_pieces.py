"""The glue of a decode step, piece by piece, as mlac runs it and as the pure-torch reference that
torch.compile gets (inductor_glue.py times both). Not a benchmark itself.

Each `Case` holds one piece at one model shape and token count: fresh inputs, mlac's call (the
Triton kernel through its wrapper, or the plain eager ops where the model has no kernel), the
reference over the same inputs, the outputs compared (FP8 dequantized), and the bytes the piece
must read and write (the bandwidth floor). What the decode step runs, per layer unless said:

    rms_norm_add        attn_norm / ffn_norm of a bf16 model: norm_rope.rms_norm(x, w, eps, residual)
    rms_norm_add_quant  ffn_norm of an FP8 MoE layer: rms_norm_quant(..., keep_y=True) (x for the router)
    q_norm_quant        q_lora models, FP8: rms_norm_quant over the strided qkv[:, :q_lora], no residual
    rope_cos_sin        once per step: RotaryEmbedding.cos_sin, plain eager ops (no kernel)
    mla_prep            rope of q_pe and k_pe, kv_norm, the paged-cache write: one Triton launch
    act_quant           an FP8 GEMM's input quantized apart, per token per 128 channels (wo's input
                        [T, H*v] when the MLA output is not fused)
    silu_mul            a bf16 MLP's activation; I = the shared experts' width (n_shared x moe_inter)
    silu_mul_quant      the same for an FP8 w2: e4m3 + scales in the launch
    greedy              once per step: logits.argmax (sampling.sample with every row greedy)
    sample              once per step: temperature, top-k, top-p, softmax and the draw, every row sampling
    embed               once per step: VocabParallelEmbedding at one rank, plain eager ops (masks, lookup)
    logits_float        once per step: the head's bf16 logits cast to float32 and copied into the
                        graphs' logits buffer (worker/graphs.py), one copy_ that casts
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mlac.core.config import ModelConfig
from mlac.core.fp8 import BLOCK
from mlac.kernels.activation import silu_mul, silu_mul_quant, silu_mul_quant_ref, silu_mul_ref
from mlac.kernels.attention.mla_prep import mla_prep
from mlac.kernels.fp8_quant import HAS_TRITON, act_quant, use_triton
from mlac.kernels.gemm.fp8_gemm import quantize_act_ref
from mlac.kernels.norm_rope import rms_norm, rms_norm_quant, rms_norm_quant_ref, rms_norm_ref
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.engine.sampling import apply_top_k, apply_top_p, sample
from mlac.runtime.model.layers import RotaryEmbedding, Weights, apply_rope
from mlac.runtime.model.model import LATENT_NORM_EPS
from mlac.runtime.model.parallel import SINGLE, VocabParallelEmbedding
from mlac.synth.presets import PRESETS

CACHE_BLOCKS, BLOCK_SIZE = 2048, 16  # a 32,768-slot latent pool: a copy of it would show in the time
MAX_POSITION = 8192
# Tolerances, relative to the largest |value| of an output. bf16: a few units in the last place (the
# normalization's rsqrt, exp and the order of a sum may round the other way). FP8: one e4m3 step at
# the top of a group is 32/448 = 0.071 of its amax, plus a bf16 ulp of the value it was rounded from.
BF16_TOL, FP8_TOL, FP32_TOL = 0.02, 0.1, 1e-4


@dataclass
class Case:
    """One piece at one shape. `inputs()` makes fresh inputs (pieces that write in place get clones);
    `mlac(*inputs)` and `ref(*inputs)` run the piece; `outputs(inputs, result)` gives the float32
    tensors compared (or int ids when `ids`); `before(inputs)`, if any, runs before each timed call of
    either (the sampler's fresh noise). `tol`: the largest error allowed, relative to the largest
    |value| of each output (ids: the fraction of rows that may differ). `checks()`: more checks,
    recorded as they are; `eager`: calls timed eagerly, as they run outside any graph."""

    shape: str
    what: str
    inputs: Callable[[], tuple]
    mlac: Callable[..., Any]
    ref: Callable[..., Any]
    outputs: Callable[[tuple, Any], list[torch.Tensor]]
    nbytes: int
    tol: float
    ids: bool = False
    before: Callable[[tuple], None] | None = None
    checks: Callable[[], dict] | None = None
    eager: dict[str, Callable[[], Any]] | None = None


def forced(dev: torch.device) -> bool | None:
    """The wrappers' `use_triton`: by device on CUDA (as the model runs them); on CPU the Triton kernels
    under the interpreter when TRITON_INTERPRET=1 (so the smoke test checks the kernels), else None
    (the wrappers' CPU dispatch: their references)."""
    if dev.type == "cpu" and HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return None


def triton_version() -> str | None:
    if not HAS_TRITON:
        return None
    import triton  # noqa: PLC0415

    return triton.__version__


def model_configs(smoke: bool) -> dict[str, ModelConfig]:
    """V2-Lite (the preset: DeepSeek's config) and V3's attention, norm, MLP and vocabulary shapes;
    with `smoke`, the tiny presets of both."""
    if smoke:
        return {k: ModelConfig.from_hf(dict(PRESETS[f"tiny-{k}"])) for k in ("v2-lite", "v3")}
    v3 = {
        **PRESETS["v2-lite"], "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": 7168, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_shared_experts": 1,
        "n_routed_experts": 256, "num_experts_per_tok": 8, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "n_group": 8, "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 3, "num_hidden_layers": 61, "vocab_size": 129280,
        "rope_scaling": {**PRESETS["v2-lite"]["rope_scaling"], "mscale": 1.0, "mscale_all_dim": 1.0},
    }  # fmt: skip
    return {"v2-lite": ModelConfig.from_hf(dict(PRESETS["v2-lite"])), "v3": ModelConfig.from_hf(v3)}


def _act(*shape: int, dev: torch.device) -> torch.Tensor:
    return torch.randn(*shape, device=dev).to(torch.bfloat16)


def _norm_weight(d: int, dev: torch.device) -> torch.Tensor:
    return (1 + 0.1 * torch.randn(d, device=dev)).to(torch.bfloat16)


def dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 [M, K] and its per-128-channel scales [M, ceil(K/128)] -> float32 [M, K]."""
    return q.float() * scale.repeat_interleave(BLOCK, dim=-1)[:, : q.shape[1]]


# ---- norms ------------------------------------------------------------------------------------


def rms_norm_add(cfg: ModelConfig, t: int, dev: torch.device) -> Case:
    d, eps = cfg.hidden_size, cfg.rms_norm_eps
    x, res, w = _act(t, d, dev=dev), _act(t, d, dev=dev), _norm_weight(d, dev)

    def ref(x, r, w):  # [T, D] x2 -> (y, x + residual) [T, D] bf16
        return rms_norm_ref(x, w, eps, r)

    return Case(
        f"[{t}, {d}] bf16 + residual", "norm_rope.rms_norm (Triton, one launch)", lambda: (x, res, w),
        lambda x, r, w: rms_norm(x, w, eps, r, use_triton=forced(dev)), ref,
        lambda _, out: [o.float() for o in out], nbytes=4 * t * d * 2 + d * 2, tol=BF16_TOL,
    )  # fmt: skip


def rms_norm_add_quant(cfg: ModelConfig, t: int, dev: torch.device) -> Case:
    d, eps = cfg.hidden_size, cfg.rms_norm_eps
    x, res, w = _act(t, d, dev=dev), _act(t, d, dev=dev), _norm_weight(d, dev)

    def mlac(x, r, w):
        act, new_res = rms_norm_quant(x, w, eps, r, keep_y=True, use_triton=forced(dev))
        return act.q, act.scale, act.x, new_res

    def ref(x, r, w):  # -> e4m3 [T, D], scales [T, D/128], y and x + residual [T, D] bf16
        act, new_res = rms_norm_quant_ref(x, w, eps, r)
        return act.q, act.scale, act.x, new_res

    return Case(
        f"[{t}, {d}] bf16 + residual -> e4m3 + y", "norm_rope.rms_norm_quant keep_y (Triton, one launch)",
        lambda: (x, res, w), mlac, ref,
        lambda _, o: [dequant(o[0], o[1]), o[2].float(), o[3].float()],
        nbytes=4 * t * d * 2 + t * d + t * (d // BLOCK) * 4 + d * 2, tol=FP8_TOL,
    )  # fmt: skip


def q_norm_quant(cfg: ModelConfig, t: int, dev: torch.device) -> Case | None:
    if cfg.q_lora_rank is None:
        return None  # V2-Lite: a plain q projection, no q_norm
    ql = cfg.q_lora_rank
    qkv = _act(t, ql + cfg.kv_latent_dim, dev=dev)  # w_qkv_a's output: q_a ‖ latent ‖ k_rope
    w = _norm_weight(ql, dev)

    def mlac(qkv, w):
        act, _ = rms_norm_quant(qkv[:, :ql], w, LATENT_NORM_EPS, use_triton=forced(dev))
        return act.q, act.scale

    def ref(qkv, w):  # [T, q_lora] (rows strided) -> e4m3 [T, q_lora], scales [T, q_lora/128]
        act, _ = rms_norm_quant_ref(qkv[:, :ql], w, LATENT_NORM_EPS)
        return act.q, act.scale

    return Case(
        f"[{t}, {ql}] of [{t}, {qkv.shape[1]}] -> e4m3", "norm_rope.rms_norm_quant (Triton, one launch)",
        lambda: (qkv, w), mlac, ref, lambda _, o: [dequant(*o)],
        nbytes=t * ql * 3 + t * (ql // BLOCK) * 4 + ql * 2, tol=FP8_TOL,
    )  # fmt: skip


# ---- rope -------------------------------------------------------------------------------------


def rope_cos_sin(cfg: ModelConfig, t: int, dev: torch.device) -> Case:
    rope = RotaryEmbedding(cfg, device=dev)
    positions = torch.randint(0, MAX_POSITION, (t,), device=dev)

    def ref(p):  # positions [T] int64 -> cos, sin [T, R] float32
        return rope.cos_sin(p)

    r = cfg.qk_rope_head_dim
    return Case(
        f"[{t}] -> 2 x [{t}, {r}] fp32", "RotaryEmbedding.cos_sin (eager torch ops)", lambda: (positions,),
        rope.cos_sin, ref, lambda _, out: list(out), nbytes=t * 8 + r * 2 + 2 * t * r * 4, tol=FP32_TOL,
    )  # fmt: skip


def mla_prep_graph(q, kv, cos, sin, norm_weight, eps, cache, slots):
    """mla_prep_ref in a form torch.compile takes whole (fullgraph): every slot written.
    NOTE: slots must all be >= 0. mla_prep skips a negative slot (a padded row of a CUDA-graph
    bucket); the boolean mask that does so here has a data-dependent shape, which fullgraph refuses,
    so an adopted form would send padded rows to a scratch slot instead."""
    r = cos.shape[1]
    c = kv.shape[1] - r
    q[..., -r:] = apply_rope(q[..., -r:], cos, sin)  # [T, H, R], in place
    xf = kv[:, :c].float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(kv.dtype)
    entry = torch.cat([norm_weight * normed, apply_rope(kv[:, c:], cos, sin)], dim=-1)  # [T, C + R]
    cache.view(-1, c + r).index_copy_(0, slots, entry)


def mla_prep_case(cfg: ModelConfig, t: int, dev: torch.device) -> Case:
    h, c, r = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    qd = cfg.qk_nope_head_dim + r
    ql = cfg.q_lora_rank or 0
    q = _act(t, h * qd, dev=dev).view(t, h, qd)  # wq / wq_b's output [T, H, nope + R]
    qkv = _act(t, ql + c + r, dev=dev)
    kv = qkv[:, ql:]  # [T, C + R]: strided under q-LoRA (a slice of w_qkv_a's output)
    cos, sin = RotaryEmbedding(cfg, device=dev).cos_sin(torch.randint(0, MAX_POSITION, (t,), device=dev))
    w = _norm_weight(c, dev)
    cache = torch.zeros(CACHE_BLOCKS, BLOCK_SIZE, c + r, dtype=torch.bfloat16, device=dev)
    slots = torch.randperm(CACHE_BLOCKS * BLOCK_SIZE, device=dev)[:t]

    def mlac(q, kv, cos, sin, w, cache, slots):
        mla_prep(q, kv, cos, sin, w, LATENT_NORM_EPS, cache, slots, use_triton=forced(dev))

    def ref(q, kv, cos, sin, w, cache, slots):
        mla_prep_graph(q, kv, cos, sin, w, LATENT_NORM_EPS, cache, slots)

    return Case(
        f"q [{t}, {h}, {qd}], kv [{t}, {c + r}] -> bf16 cache", "attention.mla_prep (Triton, one launch)",
        lambda: (q.clone(), kv, cos, sin, w, cache.clone(), slots), mlac, ref,
        lambda a, _: [a[0].float(), a[5].view(-1, c + r)[a[6]].float()],
        nbytes=2 * t * h * r * 2 + 2 * t * (c + r) * 2 + 2 * t * r * 4 + t * 8 + c * 2, tol=BF16_TOL,
    )  # fmt: skip


# ---- FP8 activations, SiLU ------------------------------------------------------------------------


def act_quant_case(cfg: ModelConfig, t: int, dev: torch.device) -> Case:
    k = cfg.num_attention_heads * cfg.v_head_dim
    x = _act(t, k, dev=dev)

    def mlac(x):  # fp8_gemm's dispatch: the Triton pass on CUDA
        return act_quant(x) if use_triton(x, forced(dev)) else quantize_act_ref(x)

    return Case(
        f"[{t}, {k}] bf16 -> e4m3", "fp8_quant.act_quant (Triton, one launch)", lambda: (x,), mlac,
        quantize_act_ref, lambda _, o: [dequant(*o)], nbytes=t * k * 3 + t * (k // BLOCK) * 4, tol=FP8_TOL,
    )  # fmt: skip


def _shared_width(cfg: ModelConfig) -> int:
    return max(cfg.n_shared_experts, 1) * cfg.moe_intermediate_size


def silu_mul_case(cfg: ModelConfig, t: int, dev: torch.device) -> Case:
    i = _shared_width(cfg)
    x = _act(t, 2 * i, dev=dev)  # w13's output: gate ‖ up
    return Case(
        f"[{t}, {2 * i}] -> [{t}, {i}] bf16", "activation.silu_mul (Triton, one launch)", lambda: (x,),
        lambda x: silu_mul(x, use_triton=forced(dev)), silu_mul_ref, lambda _, o: [o.float()],
        nbytes=t * 3 * i * 2, tol=BF16_TOL,
    )  # fmt: skip


def silu_mul_quant_case(cfg: ModelConfig, t: int, dev: torch.device) -> Case:
    i = _shared_width(cfg)
    x = _act(t, 2 * i, dev=dev)

    def mlac(x):
        act = silu_mul_quant(x, use_triton=forced(dev))
        return act.q, act.scale

    def ref(x):  # [T, 2I] -> e4m3 [T, I], scales [T, I/128]
        act = silu_mul_quant_ref(x)
        return act.q, act.scale

    return Case(
        f"[{t}, {2 * i}] -> [{t}, {i}] e4m3", "activation.silu_mul_quant (Triton, one launch)", lambda: (x,),
        mlac, ref, lambda _, o: [dequant(*o)], nbytes=t * 5 * i + t * (i // BLOCK) * 4, tol=FP8_TOL,
    )  # fmt: skip


# ---- sampling ---------------------------------------------------------------------------------


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float32 -> ids [B]: sampling.sample when every row is greedy."""
    return logits.argmax(dim=-1)


def sample_device(logits, temperature, top_k, top_p, noise):
    """sampling.sample's device work for a batch whose rows all sample, in one batch: temperature,
    top-k, top-p, softmax, then the draw as torch.multinomial draws one sample (argmax of probs over
    Exp(1) noise [B, V], here handed in; sample draws row by row from each row's generator)."""
    x = logits / temperature[:, None]  # [B, V] float32
    x = apply_top_p(apply_top_k(x, top_k), top_p)
    return (x.softmax(dim=-1) / noise).argmax(dim=-1)  # [B] int64


def _logits(t: int, v: int, dev: torch.device) -> torch.Tensor:
    return 4 * torch.randn(t, v, device=dev)  # [B, V] float32, as the graphs' logits buffer


def greedy_case(cfg: ModelConfig, t: int, dev: torch.device) -> Case:
    v = cfg.vocab_size
    logits = _logits(t, v, dev)
    return Case(
        f"[{t}, {v}] fp32 -> ids", "logits.argmax (eager, one launch)", lambda: (logits,), greedy_argmax,
        greedy_argmax, lambda _, o: [o], nbytes=t * v * 4 + t * 8, tol=0.0, ids=True,
    )  # fmt: skip


def sample_case(cfg: ModelConfig, t: int, dev: torch.device) -> Case:
    v = cfg.vocab_size
    logits = _logits(t, v, dev)
    rows = [(0.6 + 0.4 * (i % 3) / 2, (0, 50, 20)[i % 3], (1.0, 0.9, 0.95)[i % 3]) for i in range(t)]
    temperature = torch.tensor([r[0] for r in rows], device=dev)
    top_k = torch.tensor([r[1] for r in rows], device=dev)
    top_p = torch.tensor([r[2] for r in rows], device=dev)
    noise = torch.empty(t, v, device=dev).exponential_()
    params = [SamplingParams(temperature=a, top_k=k, top_p=p) for a, k, p in rows]

    def checks() -> dict:
        """Whether the batched draw gives sampling.sample's seeded draws (torch.multinomial row by row):
        the same generator's noise, the same ids."""
        gens = [torch.Generator(device=dev).manual_seed(i) for i in range(t)]
        ids = sample(logits, params, gens)
        gens = [torch.Generator(device=dev).manual_seed(i) for i in range(t)]
        rows_noise = torch.stack([torch.empty(v, device=dev).exponential_(generator=g) for g in gens])
        same = (sample_device(logits, temperature, top_k, top_p, rows_noise) == ids).float().mean().item()
        return {"draws_equal_sampler": same}

    return Case(
        f"[{t}, {v}] fp32 -> ids", "sampling.sample's ops (eager torch: two sorts, softmax, cumsum, scatter)",
        lambda: (logits, temperature, top_k, top_p, noise.clone()), sample_device, sample_device,
        lambda _, o: [o], nbytes=3 * t * v * 4 + t * 8, tol=0.01, ids=True,
        before=lambda a: a[4].exponential_(), checks=checks,
        eager={"sampler": lambda: sample(logits, params, [None] * t)},  # as the engine calls it
    )  # fmt: skip


# ---- the step's ends -----------------------------------------------------------------------------


def embed_case(cfg: ModelConfig, t: int, dev: torch.device) -> Case:
    v, d = cfg.vocab_size, cfg.hidden_size
    table = (0.02 * torch.randn(v, d, device=dev)).to(torch.bfloat16)  # [V, D]
    embed = VocabParallelEmbedding(Weights({"embed": table}), "embed", v, SINGLE)
    ids = torch.randint(0, v, (t,), device=dev)

    def ref(ids):  # [T] int64 -> [T, D] bf16
        return embed(ids)

    return Case(
        f"[{t}] ids of [{v}, {d}] -> [{t}, {d}] bf16", "VocabParallelEmbedding (eager torch ops)", lambda: (ids,),
        embed, ref, lambda _, o: [o.float()], nbytes=t * 8 + 2 * t * d * 2, tol=0.0,
    )  # fmt: skip


def logits_float(cfg: ModelConfig, t: int, dev: torch.device) -> Case:
    v = cfg.vocab_size
    head_out = (4 * torch.randn(t, v, device=dev)).to(torch.bfloat16)  # the head's F.linear output
    buffer = torch.empty(t, v, device=dev)  # the graphs' float32 logits [B, V]

    def step(h, buf):  # worker/graphs.py: self.model.logits_into(hidden, self.logits[:bs])
        buf.copy_(h)

    return Case(
        f"[{t}, {v}] bf16 -> fp32 buffer", "DeepseekModel.logits_into: copy_ casting (one launch)",
        lambda: (head_out, buffer.clone()), step, step, lambda a, _: [a[1]], nbytes=t * v * 6, tol=0.0,
    )  # fmt: skip


PIECES: dict[str, Callable[[ModelConfig, int, torch.device], Case | None]] = {
    "rms_norm_add": rms_norm_add,
    "rms_norm_add_quant": rms_norm_add_quant,
    "q_norm_quant": q_norm_quant,
    "rope_cos_sin": rope_cos_sin,
    "mla_prep": mla_prep_case,
    "act_quant": act_quant_case,
    "silu_mul": silu_mul_case,
    "silu_mul_quant": silu_mul_quant_case,
    "greedy": greedy_case,
    "sample": sample_case,
    "embed": embed_case,
    "logits_float": logits_float,
}


def build(piece: str, cfg: ModelConfig, t: int, dev: torch.device) -> Case | None:
    """The Case of `piece` at cfg's shapes and t tokens, from seeded random inputs (None: the model
    does not run that piece)."""
    torch.manual_seed(0)
    return PIECES[piece](cfg, t, dev)


def max_error(case: Case, got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Over the outputs: the largest |got - want| relative to the largest |want| of that output, or
    for ids the fraction of entries that differ."""
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        if case.ids:
            worst = max(worst, (g != w).float().mean().item())
            continue
        diff = (g.float() - w.float()).abs().max().item()
        worst = max(worst, diff / max(w.float().abs().max().item(), 1e-30))
    return worst
