"""MoE routing: router logits [T, E] -> (weights [T, top_k] float32, expert ids [T, top_k] int64).

`RoutingSpec` is one MoE layer's routing configuration, checked once when it is made; every
routing function here and in router_gemv.py takes it. `route_ref` is the rule in a dozen small
torch ops. One fused Triton kernel does the same: scores (softmax or sigmoid), the
`e_score_correction_bias` (noaux_tc), the group selection (keep the `topk_group` groups with the
largest max score, group_limited_greedy, or top-2 sum, noaux_tc), top-k by repeated argmax
(descending, the lowest index on ties: torch.topk's order), the weights gathered from the unbiased
scores, then the renormalization / routed_scaling_factor of route_ref.

Tile: one program per token; its E experts sit in a [G_PAD, S_PAD] tile, row g holding group g's
experts (E = n_group * group_size; one row of E when not grouping), padded to powers of two and
masked. `route` dispatches (Triton on CUDA, the reference on CPU) with route_ref's signature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from mlac.core.errors import MlacError
from mlac.kernels._triton import HAS_TRITON, pdl_launch, pdl_start, tl, triton
from mlac.kernels._triton import use_triton as _use_triton
from mlac.kernels.fp8_quant import interpreting, jit

if HAS_TRITON:
    from triton.language.extra import libdevice
else:  # the CPU runtime must not need triton
    libdevice = None

if TYPE_CHECKING:  # annotation only: kernels do not import the config at run time
    from mlac.core.config import ModelConfig

TopkMethod = Literal["greedy", "group_limited_greedy", "noaux_tc"]
Scoring = Literal["softmax", "sigmoid"]
METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORINGS = ("softmax", "sigmoid")
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class RoutingSpec:
    """The routing of one MoE layer: each token goes to `top_k` of `n_experts` experts.

    - greedy: top-k of the scores (n_group and topk_group are ignored).
    - group_limited_greedy: keep the `topk_group` groups with the largest max score, then top-k.
    - noaux_tc: choose with scores + bias (`e_score_correction_bias`), groups ranked by the sum of
      their top-2 biased scores; the weights come from the unbiased scores.
    norm_topk_prob renormalizes the chosen weights. routed_scaling_factor then multiplies them,
    except in the DeepSeek-V2 methods where it replaces the normalization (as V2's gate does).

    Made once per MoE layer (`from_config`); the constructor refuses a configuration the routing
    cannot run with a one-line MlacError. The noaux_tc bias is not a field: it is a tensor the
    layer owns (a buffer, replaced by `.to(device)` and by loading), so a reference kept here
    would go stale, and a tensor field would make the spec's equality and hash depend on tensor
    identity. The routing functions take it as their `bias` argument, [E] float.
    """

    n_experts: int  # E: the router's logits per token (all experts, on every rank)
    top_k: int
    method: TopkMethod
    scoring: Scoring
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem is not None:
            raise MlacError(f"routing: {problem}")

    def _problem(self) -> str | None:
        """What makes this configuration unroutable, or None."""
        e, k = self.n_experts, self.top_k
        if self.method not in METHODS:
            return f"unknown topk_method {self.method!r}: say greedy, group_limited_greedy or noaux_tc"
        if self.scoring not in SCORINGS:
            return f"unknown scoring_func {self.scoring!r}: say softmax or sigmoid"
        if not 1 <= k <= e:
            return f"top_k {k} for {e} experts: must be between 1 and {e}"
        if not (self.n_group >= 1 and self.topk_group >= 1):
            return f"n_group {self.n_group} and topk_group {self.topk_group} must be >= 1"
        if not self.grouped:
            return None
        if e % self.n_group:
            return f"{e} experts do not split into {self.n_group} groups"
        if self.topk_group > self.n_group:
            return f"topk_group {self.topk_group} of {self.n_group} groups"
        if k > self.topk_group * self.group_size:
            return f"top_k {k} > experts in {self.topk_group} groups of {self.group_size}"
        if self.method == "noaux_tc" and self.group_size < 2:
            return f"noaux_tc scores groups by their top 2 experts: groups of {self.group_size}"
        return None

    @classmethod
    def from_config(cls, config: ModelConfig) -> RoutingSpec:
        """The routing of `config`'s MoE layers (they all route alike)."""
        if config.n_routed_experts is None:
            raise MlacError("routing: the model has no routed experts (n_routed_experts is null)")
        return cls(
            n_experts=config.n_routed_experts,
            top_k=config.num_experts_per_tok,
            method=config.topk_method,
            scoring=config.scoring_func,
            n_group=config.n_group,
            topk_group=config.topk_group,
            norm_topk_prob=config.norm_topk_prob,
            routed_scaling_factor=config.routed_scaling_factor,
        )

    @property
    def grouped(self) -> bool:
        """Whether experts are chosen within the best groups (greedy, or one group, is not)."""
        return self.method != "greedy" and self.n_group > 1

    @property
    def groups(self) -> int:
        """Groups the selection sees: n_group when grouped, else 1."""
        return self.n_group if self.grouped else 1

    @property
    def group_size(self) -> int:
        """Experts per group (E when not grouped)."""
        return self.n_experts // self.groups

    @property
    def weight_rule(self) -> tuple[bool, float]:
        """(renormalize, then multiply by). noaux_tc renormalizes if asked, then scales; the V2
        methods renormalize (top_k > 1) instead of scaling."""
        if self.method == "noaux_tc":
            return self.norm_topk_prob, self.routed_scaling_factor
        if self.norm_topk_prob and self.top_k > 1:
            return True, 1.0
        return False, self.routed_scaling_factor


def route_ref(
    logits: torch.Tensor, spec: RoutingSpec, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (any float dtype, computed in float32) -> (weights [T, top_k] float32,
    expert ids [T, top_k] int64), `spec`'s rule; bias [E] (noaux_tc's correction) shifts the
    choice only. The pure-torch reference of `route_triton`."""
    logits = logits.to(torch.float32)
    t, e = logits.shape
    assert e == spec.n_experts, f"logits [T, {e}] for a routing of {spec.n_experts} experts"
    scores = logits.softmax(dim=-1) if spec.scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias.to(torch.float32)
    if spec.grouped:
        choice = _keep_best_groups(choice, spec)
    ids = choice.topk(spec.top_k, dim=-1).indices
    weights = scores.gather(1, ids)  # [T, top_k]
    renorm, scale = spec.weight_rule
    if renorm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def _keep_best_groups(choice: torch.Tensor, spec: RoutingSpec) -> torch.Tensor:
    """choice [T, E] with the experts outside the `topk_group` best groups set to -inf (noaux_tc,
    groups ranked by their top-2 sum) or 0.0 (group_limited_greedy, by their max)."""
    t, g = choice.shape[0], spec.n_group
    grouped = choice.view(t, g, spec.group_size)
    if spec.method == "noaux_tc":
        group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    else:
        group_score = grouped.amax(dim=-1)
    keep = group_score.topk(spec.topk_group, dim=-1).indices  # [T, topk_group]
    group_mask = torch.zeros_like(group_score).scatter_(1, keep, 1.0).bool()
    expert_mask = group_mask.unsqueeze(-1).expand(t, g, spec.group_size).reshape(t, spec.n_experts)
    fill = float("-inf") if spec.method == "noaux_tc" else 0.0
    return choice.masked_fill(~expert_mask, fill)


@jit
def _exp(x, EXACT: tl.constexpr):
    # EXACT: libdevice's expf, what torch's CUDA sigmoid / softmax call (tl.exp is ex2.approx,
    # a few ulp off: enough to reorder near-tied experts). The interpreter has no libdevice;
    # its tl.exp is numpy's, already accurate.
    if EXACT:
        return libdevice.exp(x)
    return tl.exp(x)


@jit
def _pick_max(values, avail, index, NO_INDEX: tl.constexpr):
    """Index of the largest available value; the lowest index on ties."""
    best = tl.max(tl.where(avail, values, float("-inf")), axis=None)
    return tl.min(tl.where(avail & (values == best), index, NO_INDEX), axis=None)


@jit
def _expert_tile(N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, G_PAD: tl.constexpr, S_PAD: tl.constexpr):
    """(ok [G, S], expert [G, S]: row g holds group g's experts, -1 in the padding)."""
    g = tl.arange(0, G_PAD)
    s = tl.arange(0, S_PAD)
    ok = (g[:, None] < N_GROUP) & (s[None, :] < GROUP_SIZE)  # [G, S]
    return ok, tl.where(ok, g[:, None] * GROUP_SIZE + s[None, :], -1)


@jit
def _route_tile(
    x,  # [G, S] float32 logits of token t, in the tile layout of _expert_tile
    ok,
    expert,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    t,
    scale,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    N_GROUP: tl.constexpr,  # groups of the tile: n_group when grouping, else 1
    G_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    SIGMOID: tl.constexpr,  # else softmax
    HAS_BIAS: tl.constexpr,
    GROUP_TOP2: tl.constexpr,  # group score: sum of its top-2 choice values (noaux_tc), else the max
    DROP_NEG_INF: tl.constexpr,  # experts of dropped groups choose as -inf (noaux_tc), else as 0.0
    RENORM: tl.constexpr,  # weights / (sum + 1e-20), before `scale`
    EXACT_EXP: tl.constexpr,
):
    """Route one token: store its top-k weights and ids at row t (route_ref's rule)."""
    g = tl.arange(0, G_PAD)
    s = tl.arange(0, S_PAD)
    if SIGMOID:
        scores = tl.math.div_rn(1.0, 1.0 + _exp(-x, EXACT_EXP))
    else:
        x = tl.where(ok, x, float("-inf"))
        p = _exp(x - tl.max(x, axis=None), EXACT_EXP)  # padding: exp(-inf) = 0
        scores = tl.math.div_rn(p, tl.sum(p, axis=None))
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + expert, mask=ok, other=0.0).to(tl.float32)

    if N_GROUP > 1:
        masked = tl.where(ok, choice, float("-inf"))
        group_score = tl.max(masked, axis=1)  # [G]; padding groups -inf
        if GROUP_TOP2:  # torch.topk(2).values.sum(): the max plus the max of the rest
            first = tl.min(tl.where(masked == group_score[:, None], s[None, :], S_PAD), axis=1)
            group_score += tl.max(tl.where(s[None, :] == first[:, None], float("-inf"), masked), axis=1)
        g_avail = g < N_GROUP
        for _ in tl.static_range(TOPK_GROUP):
            g_avail &= g != _pick_max(group_score, g_avail, g, G_PAD)
        kept = (g < N_GROUP) & ~g_avail  # [G]
        if DROP_NEG_INF:
            choice = tl.where(kept[:, None], choice, float("-inf"))
        else:
            choice = tl.where(kept[:, None], choice, 0.0)

    k = tl.arange(0, K_PAD)
    weights = tl.zeros([K_PAD], dtype=tl.float32)
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    avail = ok
    for j in tl.static_range(TOP_K):
        pick = _pick_max(choice, avail, expert, G_PAD * S_PAD)
        hit = expert == pick
        weights = tl.where(k == j, tl.sum(tl.where(hit, scores, 0.0), axis=None), weights)
        ids = tl.where(k == j, pick, ids)
        avail &= ~hit
    if RENORM:
        weights = tl.math.div_rn(weights, tl.sum(weights, axis=0) + 1e-20)
    weights = weights * scale
    out = t * TOP_K + k
    tl.store(weights_ptr + out, weights, mask=k < TOP_K)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=k < TOP_K)


@jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    stride_t,
    scale,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    N_GROUP: tl.constexpr,  # groups of the tile: n_group when grouping, else 1
    GROUP_SIZE: tl.constexpr,  # experts per group (E when not grouping)
    G_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    SIGMOID: tl.constexpr,  # else softmax
    HAS_BIAS: tl.constexpr,
    GROUP_TOP2: tl.constexpr,  # group score: sum of its top-2 choice values (noaux_tc), else the max
    DROP_NEG_INF: tl.constexpr,  # experts of dropped groups choose as -inf (noaux_tc), else as 0.0
    RENORM: tl.constexpr,  # weights / (sum + 1e-20), before `scale`
    EXACT_EXP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    ok, expert = _expert_tile(N_GROUP, GROUP_SIZE, G_PAD, S_PAD)
    x = tl.load(logits_ptr + t * stride_t + expert, mask=ok, other=0.0).to(tl.float32)
    _route_tile(
        x, ok, expert, bias_ptr, weights_ptr, ids_ptr, t, scale,
        TOP_K, K_PAD, N_GROUP, G_PAD, S_PAD, TOPK_GROUP, SIGMOID, HAS_BIAS, GROUP_TOP2, DROP_NEG_INF,
        RENORM, EXACT_EXP,
    )  # fmt: skip


def _check_bias(bias: torch.Tensor | None, spec: RoutingSpec, device: torch.device) -> None:
    """The Triton routing's bias checks: [E] float, contiguous, on the logits' device."""
    if bias is None:
        return
    e = spec.n_experts
    assert tuple(bias.shape) == (e,) and bias.is_contiguous(), f"bias must be [{e}], got {tuple(bias.shape)}"
    assert bias.device == device and bias.is_floating_point(), (bias.device, bias.dtype)


def _route_launch_args(spec: RoutingSpec, has_bias: bool) -> tuple[float, dict]:
    """(the weights' final scale, the routing constexprs and num_warps) of both kernels."""
    renorm, scale = spec.weight_rule
    g_pad, s_pad = triton.next_power_of_2(spec.groups), triton.next_power_of_2(spec.group_size)
    return float(scale), dict(
        TOP_K=spec.top_k,
        K_PAD=triton.next_power_of_2(spec.top_k),
        N_GROUP=spec.groups,
        GROUP_SIZE=spec.group_size,
        G_PAD=g_pad,
        S_PAD=s_pad,
        TOPK_GROUP=spec.topk_group if spec.grouped else 1,
        SIGMOID=spec.scoring == "sigmoid",
        HAS_BIAS=has_bias,
        GROUP_TOP2=spec.method == "noaux_tc",
        DROP_NEG_INF=spec.method == "noaux_tc",
        RENORM=renorm,
        EXACT_EXP=not interpreting(),
        num_warps=1 if g_pad * s_pad <= 512 else 4,  # one warp: the argmax reductions stay in-warp
    )


def route_triton(
    logits: torch.Tensor, spec: RoutingSpec, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton routing; contract as `route_ref`. logits [T, E] float32/bf16/fp16 with contiguous
    rows (E = spec.n_experts); bias [E] on the same device."""
    assert HAS_TRITON, "route_triton needs triton"
    assert logits.dim() == 2 and logits.stride(-1) == 1, (
        f"logits must be [T, E] with contiguous rows, got {tuple(logits.shape)} strides {logits.stride()}"
    )
    assert logits.dtype in LOGIT_DTYPES, f"logits must be float32/bf16/fp16, got {logits.dtype}"
    t, e = logits.shape
    assert e == spec.n_experts, f"logits [T, {e}] for a routing of {spec.n_experts} experts"
    _check_bias(bias, spec, logits.device)
    weights = torch.empty(t, spec.top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, spec.top_k, dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    scale, constexprs = _route_launch_args(spec, bias is not None)
    _route_kernel[(t,)](
        logits,
        logits if bias is None else bias,  # unused without bias
        weights,
        ids,
        logits.stride(0),
        scale,
        **constexprs,
        **pdl_launch(),
    )
    return weights, ids


def route(
    logits: torch.Tensor,
    spec: RoutingSpec,
    bias: torch.Tensor | None = None,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatching entry point (Triton on CUDA, reference on CPU); contract as `route_ref`.

    Logits of another dtype (float64, say) run the reference on any device. `use_triton` forces
    the choice."""
    if use_triton and logits.dtype not in LOGIT_DTYPES:
        raise ValueError(f"no Triton routing for {logits.dtype} logits")
    if logits.dtype in LOGIT_DTYPES and _use_triton(logits, use_triton):
        return route_triton(logits, spec, bias)
    return route_ref(logits, spec, bias)


__all__ = ["RoutingSpec", "route", "route_ref", "route_triton"]
