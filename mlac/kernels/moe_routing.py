"""MoE routing: router logits [T, E] -> (weights [T, top_k] float32, expert ids [T, top_k] int64).

One fused Triton kernel does what `moe.route_ref` does in a dozen small torch ops: scores
(softmax or sigmoid), the `e_score_correction_bias` (noaux_tc), the group selection (keep the
`topk_group` groups with the largest max score, group_limited_greedy, or top-2 sum, noaux_tc),
top-k by repeated argmax (descending, the lowest index on ties: torch.topk's order), the weights
gathered from the unbiased scores, then the renormalization / routed_scaling_factor of route_ref.

Tile: one program per token; its E experts sit in a [G_PAD, S_PAD] tile, row g holding group g's
experts (E = n_group * group_size; one row of E when not grouping), padded to powers of two and
masked. `route` dispatches (Triton on CUDA, the reference on CPU) with route_ref's signature.
"""

from __future__ import annotations

from typing import Literal

import torch

from mlac.kernels._triton import HAS_TRITON, pdl_launch, pdl_start, tl, triton
from mlac.kernels._triton import use_triton as _use_triton
from mlac.kernels.fp8_quant import interpreting, jit
from mlac.kernels.moe import TopkMethod, route_ref

if HAS_TRITON:
    from triton.language.extra import libdevice
else:  # the CPU runtime must not need triton
    libdevice = None

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def _weight_rule(
    method: TopkMethod, top_k: int, norm_topk_prob: bool, routed_scaling_factor: float
) -> tuple[bool, float]:
    """(renormalize, then multiply by): route_ref's rule. noaux_tc renormalizes if asked, then
    scales; the V2 methods renormalize (top_k > 1) instead of scaling."""
    if method == "noaux_tc":
        return norm_topk_prob, routed_scaling_factor
    if norm_topk_prob and top_k > 1:
        return True, 1.0
    return False, routed_scaling_factor


def _check_route_args(e: int, top_k, method, scoring, n_group, topk_group, bias, device) -> None:
    """The Triton routing's argument checks."""
    assert method in ("greedy", "group_limited_greedy", "noaux_tc"), f"unknown topk_method {method!r}"
    assert scoring in ("softmax", "sigmoid"), f"unknown scoring_func {scoring!r}"
    assert 1 <= top_k <= e, f"top_k {top_k} for {e} experts"
    if method != "greedy" and n_group > 1:
        assert e % n_group == 0, f"{e} experts do not split into {n_group} groups"
        assert 1 <= topk_group <= n_group, f"topk_group {topk_group} of {n_group} groups"
        assert top_k <= topk_group * (e // n_group), f"top_k {top_k} > experts in {topk_group} groups"
        assert method != "noaux_tc" or e // n_group >= 2, "noaux_tc scores groups by their top 2"
    if bias is not None:
        assert tuple(bias.shape) == (e,) and bias.is_contiguous(), (
            f"bias must be [{e}], got {tuple(bias.shape)}"
        )
        assert bias.device == device and bias.is_floating_point(), (bias.device, bias.dtype)


def _route_launch_args(
    e: int, top_k, method, scoring, n_group, topk_group, norm_topk_prob, routed_scaling_factor, bias
) -> tuple[float, dict]:
    """(the weights' final scale, the routing constexprs and num_warps) of both kernels."""
    grouped = method != "greedy" and n_group > 1
    groups, group_size = (n_group, e // n_group) if grouped else (1, e)
    renorm, scale = _weight_rule(method, top_k, norm_topk_prob, routed_scaling_factor)
    g_pad, s_pad = triton.next_power_of_2(groups), triton.next_power_of_2(group_size)
    return float(scale), dict(
        TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k),
        N_GROUP=groups,
        GROUP_SIZE=group_size,
        G_PAD=g_pad,
        S_PAD=s_pad,
        TOPK_GROUP=topk_group if grouped else 1,
        SIGMOID=scoring == "sigmoid",
        HAS_BIAS=bias is not None,
        GROUP_TOP2=method == "noaux_tc",
        DROP_NEG_INF=method == "noaux_tc",
        RENORM=renorm,
        EXACT_EXP=not interpreting(),
        num_warps=1 if g_pad * s_pad <= 512 else 4,  # one warp: the argmax reductions stay in-warp
    )


def route_triton(
    logits: torch.Tensor,
    top_k: int,
    method: TopkMethod,
    scoring: Literal["softmax", "sigmoid"],
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton routing; contract as `route_ref`. logits [T, E] float32/bf16/fp16 with contiguous
    rows; bias [E] on the same device. Grouping needs E % n_group == 0 and top_k experts within
    the kept groups (top_k <= topk_group * E / n_group)."""
    assert HAS_TRITON, "route_triton needs triton"
    assert logits.dim() == 2 and logits.stride(-1) == 1, (
        f"logits must be [T, E] with contiguous rows, got {tuple(logits.shape)} strides {logits.stride()}"
    )
    assert logits.dtype in LOGIT_DTYPES, f"logits must be float32/bf16/fp16, got {logits.dtype}"
    t, e = logits.shape
    _check_route_args(e, top_k, method, scoring, n_group, topk_group, bias, logits.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    args = (e, top_k, method, scoring, n_group, topk_group, norm_topk_prob, routed_scaling_factor, bias)
    scale, constexprs = _route_launch_args(*args)
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
    top_k: int,
    method: TopkMethod,
    scoring: Literal["softmax", "sigmoid"],
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
    bias: torch.Tensor | None = None,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatching entry point (Triton on CUDA, reference on CPU); contract as `route_ref`.

    Logits of another dtype (float64, say) run the reference on any device. `use_triton` forces
    the choice."""
    args = (logits, top_k, method, scoring, n_group, topk_group, norm_topk_prob, routed_scaling_factor, bias)
    if use_triton and logits.dtype not in LOGIT_DTYPES:
        raise ValueError(f"no Triton routing for {logits.dtype} logits")
    if logits.dtype in LOGIT_DTYPES and _use_triton(logits, use_triton):
        return route_triton(*args)
    return route_ref(*args)


__all__ = ["route", "route_ref", "route_triton"]
