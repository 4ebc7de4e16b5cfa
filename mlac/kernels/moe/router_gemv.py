"""MoE router at decode: logits [T, E] float32 = x [T, D] @ gate [E, D].T, and optionally the routing,
in one launch.

    x       [T, D]  bf16/fp16/float32, rows contiguous; read directly and widened in registers
    gate    [E, D]  float32 (loader.ROUTER), contiguous
    logits  [T, E]  float32, float32 accumulation: F.linear(x.float(), gate) up to summation order

What it replaces, per MoE layer: `x.float()` (a cast launch), cuBLAS's float32 GEMV (two launches)
and `_route_kernel` (routing.py). An earlier fused kernel ran one program per token and re-read
the whole gate on one SM (48 us per layer at batch 1 on an H200). Here the programs split the
EXPERTS: program p computes BLOCK_E experts for all T rows, streaming its [BLOCK_E, D] slice of the
gate once (the whole gate is read once, spread over about one program per SM) and x's T rows (from
L2) in BLOCK_D steps, as a [BLOCK_T, BLOCK_E, BLOCK_D] broadcast product on CUDA cores.

Fused routing (`router_route_triton`, the kernel's ROUTE constexpr): each program stores its logits,
then takes a ticket from an arrival counter; the program that arrives last reads the [T, E] logits
back and routes the T tokens one after the other with routing.py's `_route_tile` (route_ref's rule,
the same code as `_route_kernel`), then puts the counter back to 0, so every launch and every
CUDA-graph replay starts from 0. The counter is this module's own (one int32 per device, made before
capture). `router_logits_triton` is the logits alone (ROUTE off), up to MAX_ROWS rows.

Which path a token count takes is one rule, `router_plan`: the fused launch for up to FUSED_MAX_ROWS
tokens, F.linear then `route` above (measured: see there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from mlac.kernels._triton import HAS_TRITON, pdl_launch, pdl_start, refuse_in_capture, tl, triton
from mlac.kernels._triton import use_triton as _use_triton
from mlac.kernels.fp8_quant import jit
from mlac.kernels.gemm.fp8_gemm import sm_count
from mlac.kernels.moe.routing import (
    RoutingSpec,
    _check_bias,
    _expert_tile,
    _route_launch_args,
    _route_tile,
    route,
)

MAX_ROWS = 16  # the largest T the logits kernel takes
FUSED_MAX_ROWS = 4  # the largest T the router runs as one fused launch (router_plan)
T_CLASSES = (1, 4, MAX_ROWS)  # BLOCK_T of a launch: the smallest class >= T (one compile each)
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

Plan = Literal["fused", "torch"]


def router_plan(t: int) -> Plan:
    """How the router runs for t tokens on the GPU: "fused" (logits and routing, one launch) for 1 to
    FUSED_MAX_ROWS tokens, else "torch" (F.linear, then `route`).

    The gate is E·D·4 bytes (V2-Lite 0.5 MB, V3 7.3 MB), read once by either path; the kernel's
    product runs on CUDA cores, cuBLAS's as a GEMM with the cast amortized over the rows. The fused
    routing runs the T tokens one after the other in one program (about 1 us each). Measured, 27
    calls in a CUDA graph, us per call: at 1 token the fused launch beat F.linear in the decode
    step (V2-Lite batch 1 on an H200: 367.6 against 355.0 tok/s FP8,
    benchmarks/results/kernels_mla_out_router_h200.txt); at 5 to 16 tokens the logits kernel lost to
    F.linear at every shape measured: V3's gate 62.5 against 23.3 us on an H200 (same record), and on
    an H100 V2-Lite's 19.2-19.4 against 11.8-12.2 us, V3's 62.6-63.3 against 21.8-24.9 us.
    """
    return "fused" if 1 <= t <= FUSED_MAX_ROWS else "torch"


def t_class(t: int) -> int:
    """The smallest of T_CLASSES that is >= t (1 <= t <= MAX_ROWS): the kernel's BLOCK_T."""
    return next(c for c in T_CLASSES if c >= t)


@dataclass(frozen=True)
class RouterConfig:
    """Tiles: BLOCK_E experts per program (>= 2), BLOCK_D columns per step; powers of two."""

    block_e: int
    block_d: int
    num_warps: int = 4


def pick_config(e: int, d: int, block_t: int, sms: int) -> RouterConfig:
    """About one program per SM (BLOCK_E = E / SMs rounded up to a power of two, at least 2), and a
    [BLOCK_T, BLOCK_E, BLOCK_D] product of at most 4096 float32 (32 registers a thread at 4 warps):
    few D steps at one row (V2-Lite: one, V3: four), each a 16 KB slice of the gate, two in flight."""
    block_e = max(2, triton.next_power_of_2(triton.cdiv(e, sms)))
    block_d = max(64, min(4096 // (block_t * block_e), triton.next_power_of_2(d)))
    return RouterConfig(block_e, block_d)


# ---- reference ---------------------------------------------------------------------------------


def router_logits_ref(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [T, D] @ gate [E, D].T -> [T, E] float32: the path the kernel replaces."""
    return F.linear(x.float(), gate)


# ---- Triton ------------------------------------------------------------------------------------

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _arrival_counter(device: torch.device) -> torch.Tensor:
    """This module's zeroed int32 arrival counter on `device` (the fused kernel leaves it 0).

    NOTE: made on first use: run the step once eagerly before CUDA-graph capture (graphs.py does).
    Launches that share it run one after the other on one stream (one router per layer)."""
    counter = _COUNTERS.get(device)
    if counter is None:
        refuse_in_capture(device, "router_gemv's arrival counter")
        counter = _COUNTERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


@jit
def _chunk(x_rows, g_rows, d0, t_ok, e_ok, offs_d, D, EVEN_D: tl.constexpr):
    """(x [BT, BD] float32, gate [BE, BD]) at columns d0 + offs_d (zeros past T, E, D)."""
    if EVEN_D:
        x_ok = t_ok[:, None]
        g_ok = e_ok[:, None]
    else:
        d_ok = d0 + offs_d < D
        x_ok = t_ok[:, None] & d_ok[None, :]
        g_ok = e_ok[:, None] & d_ok[None, :]
    x = tl.load(x_rows + d0, mask=x_ok, other=0.0).to(tl.float32)
    return x, tl.load(g_rows + d0, mask=g_ok, other=0.0)


@jit
def _logits_block(
    x_ptr, gate_ptr, offs_t, offs_e, T, D, stride_xt,
    E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
):  # fmt: skip
    """[BLOCK_T, BLOCK_E] float32 logits of rows offs_t and experts offs_e (zeros past T, E)."""
    t_ok = offs_t < T
    e_ok = offs_e < E
    offs_d = tl.arange(0, BLOCK_D)
    x_rows = x_ptr + offs_t[:, None].to(tl.int64) * stride_xt + offs_d[None, :]  # [BT, BD]
    g_rows = gate_ptr + offs_e[:, None].to(tl.int64) * D + offs_d[None, :]  # [BE, BD]
    last = (tl.cdiv(D, BLOCK_D) - 1) * BLOCK_D
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    x, g = _chunk(x_rows, g_rows, 0, t_ok, e_ok, offs_d, D, EVEN_D)
    for d0 in range(0, D, BLOCK_D):
        # NOTE: the next chunk's loads are issued before this one's math (two chunks in flight);
        # the last step reloads its own chunk rather than read past D.
        x_next, g_next = _chunk(x_rows, g_rows, tl.minimum(d0 + BLOCK_D, last), t_ok, e_ok, offs_d, D, EVEN_D)
        acc += tl.sum(x[:, None, :] * g[None, :, :], axis=2)
        x, g = x_next, g_next
    return acc


@jit(dynamic=("T",))
def _router_kernel(
    x_ptr,  # [T, D] bf16/fp16/float32
    gate_ptr,  # [E, D] float32
    logits_ptr,  # [T, E] float32
    bias_ptr,  # [E] (HAS_BIAS)
    weights_ptr,  # [T, TOP_K] float32 (ROUTE)
    ids_ptr,  # [T, TOP_K] int64 (ROUTE)
    count_ptr,  # [1] int32 arrival counter, 0 between launches (ROUTE)
    T,
    D,
    stride_xt,
    scale,
    E: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    ROUTE: tl.constexpr,  # the last program to arrive routes the T tokens
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    N_GROUP: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    G_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP_TOP2: tl.constexpr,
    DROP_NEG_INF: tl.constexpr,
    RENORM: tl.constexpr,
    EXACT_EXP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    offs_t = tl.arange(0, BLOCK_T)
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    acc = _logits_block(
        x_ptr, gate_ptr, offs_t, offs_e, T, D, stride_xt, E, BLOCK_T, BLOCK_E, BLOCK_D, EVEN_D
    )
    out_ok = (offs_t < T)[:, None] & (offs_e < E)[None, :]
    tl.store(logits_ptr + offs_t[:, None] * E + offs_e[None, :], acc, mask=out_ok)
    if ROUTE:
        # fp8_gemm's split-K pattern: every thread's stores, then one release/acquire ticket; the
        # last program sees every program's logits (read past L1) and resets the counter.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(0) - 1:
            ok, expert = _expert_tile(N_GROUP, GROUP_SIZE, G_PAD, S_PAD)
            for t in range(T):
                row = tl.load(logits_ptr + t * E + expert, mask=ok, other=0.0, cache_modifier=".cg")
                _route_tile(
                    row, ok, expert, bias_ptr, weights_ptr, ids_ptr, t, scale,
                    TOP_K, K_PAD, N_GROUP, G_PAD, S_PAD, TOPK_GROUP, SIGMOID, HAS_BIAS, GROUP_TOP2,
                    DROP_NEG_INF, RENORM, EXACT_EXP,
                )  # fmt: skip
            tl.atomic_xchg(count_ptr, 0)


# ---- wrappers ----------------------------------------------------------------------------------


def _check(x: torch.Tensor, gate: torch.Tensor) -> None:
    t, d = x.shape
    assert 1 <= t <= MAX_ROWS, f"the router kernel takes 1..{MAX_ROWS} rows, got {t}"
    assert x.dtype in X_DTYPES and x.stride(-1) == 1, (
        f"x must be bf16/fp16/float32 rows: {x.dtype} {x.stride()}"
    )
    assert gate.dtype == torch.float32 and gate.is_contiguous(), (
        f"gate must be contiguous float32: {gate.dtype}"
    )
    assert gate.dim() == 2 and gate.shape[1] == d, f"x {tuple(x.shape)} vs gate {tuple(gate.shape)}"
    assert x.device == gate.device, (x.device, gate.device)


def _launch(x, gate, logits, route_args: tuple | None, config: RouterConfig | None):
    """One launch of _router_kernel; route_args: (weights, ids, bias, scale, constexprs) or None."""
    (t, d), e = x.shape, gate.shape[0]
    block_t = t_class(t)
    cfg = config or pick_config(e, d, block_t, sm_count(x.device))
    if route_args is None:  # the routing constexprs are unused: fixed, so they add no variant
        weights = ids = bias = logits
        scale, routing = 1.0, dict(TOP_K=1, K_PAD=1, N_GROUP=1, GROUP_SIZE=e, G_PAD=1, S_PAD=1, TOPK_GROUP=1)
        routing.update(SIGMOID=False, HAS_BIAS=False, GROUP_TOP2=False, DROP_NEG_INF=False, RENORM=False)
        routing.update(EXACT_EXP=False)
        counter = logits
    else:
        weights, ids, bias, scale, routing = route_args
        counter = _arrival_counter(x.device)
    _router_kernel[(triton.cdiv(e, cfg.block_e),)](
        x, gate, logits, bias, weights, ids, counter, t, d, x.stride(0), scale,
        E=e, BLOCK_T=block_t, BLOCK_E=cfg.block_e, BLOCK_D=cfg.block_d, EVEN_D=d % cfg.block_d == 0,
        ROUTE=route_args is not None, **routing, num_warps=cfg.num_warps, **pdl_launch(),
    )  # fmt: skip


def router_logits_triton(
    x: torch.Tensor, gate: torch.Tensor, config: RouterConfig | None = None
) -> torch.Tensor:
    """Triton: x [T, D] (1 <= T <= 16, rows contiguous) @ gate [E, D].T -> [T, E] float32, one
    launch; contract of `router_logits_ref` up to float32 summation order."""
    assert HAS_TRITON, "router_logits_triton needs triton"
    _check(x, gate)
    logits = torch.empty(x.shape[0], gate.shape[0], dtype=torch.float32, device=x.device)
    _launch(x, gate, logits, None, config)
    return logits


def router_route_triton(
    x: torch.Tensor,
    gate: torch.Tensor,
    spec: RoutingSpec,
    bias: torch.Tensor | None = None,
    config: RouterConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton, one launch: (weights [T, top_k] float32, ids [T, top_k] int64, logits [T, E] float32)
    = route(router_logits(x, gate), spec, bias), route_ref's contract. x and gate as
    router_logits_triton, E = spec.n_experts; bias [E] on x's device."""
    assert HAS_TRITON, "router_route_triton needs triton"
    _check(x, gate)
    (t, _), e = x.shape, gate.shape[0]
    assert e == spec.n_experts, f"gate [{e}, D] for a routing of {spec.n_experts} experts"
    _check_bias(bias, spec, x.device)
    scale, routing = _route_launch_args(spec, bias is not None)
    routing.pop("num_warps")  # the logits part picks the warps
    logits = torch.empty(t, e, dtype=torch.float32, device=x.device)
    weights = torch.empty(t, spec.top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, spec.top_k, dtype=torch.int64, device=x.device)
    route_args = (weights, ids, logits if bias is None else bias, scale, routing)
    _launch(x, gate, logits, route_args, config)
    return weights, ids, logits


def _plan_for(x: torch.Tensor, gate: torch.Tensor, use_triton: bool | None) -> Plan:
    """router_plan's choice where the kernel can run (Triton here, as `use_triton` or the device
    says; x of a kernel dtype; a contiguous float32 gate), else "torch"."""
    kernel_ok = x.dtype in X_DTYPES and gate.dtype == torch.float32 and gate.is_contiguous()
    return router_plan(x.shape[0]) if kernel_ok and _use_triton(x, use_triton) else "torch"


def gate_and_route(
    x: torch.Tensor,
    gate: torch.Tensor,
    spec: RoutingSpec,
    bias: torch.Tensor | None = None,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE router: x [T, D] -> (weights [T, top_k] float32, ids [T, top_k] int64), the contract
    of route(F.linear(x.float(), gate), spec, bias). On CUDA (or `use_triton`) `router_plan` picks
    one fused launch or F.linear then `route`; elsewhere the reference."""
    if _plan_for(x, gate, use_triton) == "fused":
        weights, ids, _ = router_route_triton(x if x.stride(-1) == 1 else x.contiguous(), gate, spec, bias)
        return weights, ids
    return route(router_logits_ref(x, gate), spec, bias, use_triton=use_triton)


__all__ = [
    "gate_and_route",
    "router_logits_ref",
    "router_logits_triton",
    "router_plan",
    "router_route_triton",
]
