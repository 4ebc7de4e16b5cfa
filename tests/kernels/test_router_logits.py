"""The MoE router in one launch (mlac/kernels/moe/router_gemv.py) against F.linear(x.float(), gate) and route_ref.

Without CUDA the kernel runs under TRITON_INTERPRET=1 on small shapes (set by tests/kernels/_util
before triton is imported); tests marked gpu run the V2-Lite and V3 shapes (and a CUDA-graph replay)
and skip without CUDA.

Logits tolerance: elementwise |out - exact| <= 4e-6 * (|x| @ |gate|.T), "exact" the float64
product of the same (bf16-exact) operands. The kernel and F.linear both accumulate in float32
and differ only in summation order (the kernel: a tree over each BLOCK_D chunk, the chunks in
order); a sum of D products in float32 errs by at most about log2(D)·2^-24 of the sum of
|products| on random data, here under 1e-6. A bf16 rounding of any operand or partial sum
(2^-9 = 2e-3) or a missing chunk fails it by orders of magnitude.
Routing: the ids must equal route_ref's on the reference logits exactly (inputs are checked to
have no near-ties). The fused weights are compared with route_ref on the kernel's own logits,
within 1e-6 relative (tests/kernels/test_moe_routing.py's bound: the routing's own float32
formulas). Against the weights routed from F.linear's logits they may differ more, through the
logits: a logit error of at most dz moves a softmax or sigmoid weight by at most 2·dz relative, and
the renormalization at most doubles that, hence 1e-6 + 4·dz with dz the logits' bound above.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from _paths import REPO

from tests.kernels import _util

needs_triton = pytest.mark.skipif(not _util.HAS_TRITON, reason="triton is not installed")
DEV = "cuda" if _util.HAS_CUDA else "cpu"
LOGIT_TOL = 4e-6
WEIGHT_RTOL = 1e-6


def _modules():
    """(moe_routing, router_gemv), their kernels interpreted when there is no CUDA (reloaded in
    order if a module imported them compiled: router_gemv calls moe_routing's @jit helpers)."""
    _util.kernel_modules()
    routing = importlib.import_module("mlac.kernels.moe.routing")
    router = importlib.import_module("mlac.kernels.moe.router_gemv")
    if _util.HAS_TRITON and not _util.HAS_CUDA:
        if type(routing._route_kernel).__name__ != "InterpretedFunction":
            routing = importlib.reload(routing)
        if type(router._router_kernel).__name__ != "InterpretedFunction" or router.route is not routing.route:
            router = importlib.reload(router)
    return routing, router


routing, rg = _modules()
SMALL = rg.RouterConfig(block_e=4, block_d=64)  # 4 programs for 16 experts, ragged against D=200


def _case(t: int, e: int, d: int, seed: int, dtype=torch.bfloat16, device=DEV):
    """x [T, D] in dtype (rows of varied scale), gate [E, D] float32 like a trained router's."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g) * (1 + 3 * torch.rand(t, 1, generator=g))
    gate = torch.randn(e, d, generator=g) / d**0.5
    return x.to(dtype).to(device), gate.to(device)


def _assert_logits(out: torch.Tensor, x: torch.Tensor, gate: torch.Tensor) -> None:
    assert out.dtype == torch.float32 and out.shape == (x.shape[0], gate.shape[0])
    assert torch.isfinite(out).all(), "an element was not written (poisoned NaN)"
    exact = x.double() @ gate.double().t()
    bound = LOGIT_TOL * (x.double().abs() @ gate.double().abs().t())
    err = (out.double() - exact).abs()
    assert (err <= bound).all(), f"max error / bound {(err / bound).max().item():.2f}"
    ref = F.linear(x.float(), gate)  # the path it replaces, within the same bound
    assert ((out.double() - ref.double()).abs() <= 2 * bound).all()


def _route_case(t: int, e: int, method: str, seed: int):
    """(x, gate, routing spec, bias or None) of one routing method (V2-Lite, V2, V3 rules)."""
    x, gate = _case(t, e, 200, seed)
    kw = dict(top_k=4, method=method, scoring="softmax")
    if method == "group_limited_greedy":
        kw.update(n_group=4, topk_group=2, routed_scaling_factor=16.0)
    bias = None
    if method == "noaux_tc":
        bias = torch.randn(e, generator=torch.Generator().manual_seed(seed + 1)) * 0.1
        kw.update(scoring="sigmoid", n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
        bias = bias.to(DEV)
    return x, gate, routing.RoutingSpec(e, **kw), bias


def _assert_no_near_ties(logits: torch.Tensor) -> None:
    """The test's premise: no two logits of a token within 1e-4 (then float32 summation order
    cannot reorder experts)."""
    s = logits.sort(dim=-1).values
    assert (s[:, 1:] - s[:, :-1]).min() > 1e-4, "near-tied logits: pick another seed"


def _logit_bound(x: torch.Tensor, gate: torch.Tensor) -> float:
    """dz: the largest error _assert_logits allows on these inputs."""
    return LOGIT_TOL * (x.double().abs() @ gate.double().abs().t()).max().item()


def _assert_routing(weights, ids, ref_weights, ref_ids, rtol: float = WEIGHT_RTOL):
    assert torch.equal(ids.cpu(), ref_ids.cpu()), (ids, ref_ids)
    weights, ref_weights = weights.cpu(), ref_weights.cpu()
    ok = (weights - ref_weights).abs() <= rtol * ref_weights.abs() + 1e-30
    assert ok.all(), (weights, ref_weights)


# ---- the plan -----------------------------------------------------------------------------------


def test_plan_by_rows():
    """One fused launch for 1-4 tokens, F.linear then route otherwise (the logits kernel lost to
    F.linear at 5-16 rows: router_plan)."""
    assert [rg.router_plan(t) for t in (0, 1, 4, 5, 16, 17)] == [
        "torch",
        "fused",
        "fused",
        "torch",
        "torch",
        "torch",
    ]
    assert [rg.t_class(t) for t in (1, 2, 4, 5, 16)] == [1, 4, 4, 16, 16]


def test_configs_cover_the_experts_with_about_one_program_per_sm():
    v2_lite, v3 = rg.pick_config(64, 2048, 1, 132), rg.pick_config(256, 7168, 16, 132)
    assert (v2_lite.block_e, v3.block_e) == (2, 2)
    assert v2_lite.block_d == 2048 and v3.block_d == 128  # the 3-D product stays <= 4096 floats
    assert rg.pick_config(256, 7168, 1, 132).block_d == 2048


# ---- CPU: the reference ---------------------------------------------------------------------------


def test_cpu_runs_the_reference(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the Triton router ran on CPU without being asked")

    monkeypatch.setattr(rg, "router_route_triton", boom)
    monkeypatch.setattr(rg, "router_logits_triton", boom)
    x, gate, spec, bias = _route_case(3, 16, "greedy", seed=1)
    weights, ids = rg.gate_and_route(x.cpu(), gate.cpu(), spec, bias)
    ref_w, ref_ids = routing.route_ref(F.linear(x.cpu().float(), gate.cpu()), spec, bias)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w)


# ---- the kernel -----------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("t", [1, 2, 4, 5, 16])
@pytest.mark.parametrize("d", [200, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_logits_match_linear(t, d, dtype):
    x, gate = _case(t, 16, d, seed=t * 10 + d, dtype=dtype)
    with _util.poisoned_empty():
        out = rg.router_logits_triton(x, gate, SMALL)
    _assert_logits(out, x, gate)


@needs_triton
@pytest.mark.parametrize("e", [6, 64])
def test_logits_default_config_and_ragged_experts(e):
    x, gate = _case(3, e, 136, seed=e)
    with _util.poisoned_empty():
        out = rg.router_logits_triton(x, gate)  # E=6: the last program's experts are masked
    _assert_logits(out, x, gate)


@needs_triton
def test_logits_read_strided_rows():
    x, gate = _case(4, 16, 320, seed=7)
    view, gate = x[:, :256], gate[:, :256].contiguous()  # x: rows of a wider tensor, stride 320
    _assert_logits(rg.router_logits_triton(view, gate, SMALL), view, gate)


@needs_triton
@pytest.mark.parametrize("t", [1, 3, 4, 16])
@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy", "noaux_tc"])
def test_fused_routing_matches_route_ref(t, method):
    x, gate, spec, bias = _route_case(t, 16, method, seed=t + len(method))
    ref_logits = F.linear(x.float(), gate)
    _assert_no_near_ties(ref_logits)
    _, ref_ids = routing.route_ref(ref_logits, spec, bias)
    with _util.poisoned_empty():
        weights, ids, logits = rg.router_route_triton(x, gate, spec, bias, config=SMALL)
    _assert_logits(logits, x, gate)
    own_w, _ = routing.route_ref(logits, spec, bias)  # the routing of the kernel's own logits
    _assert_routing(weights, ids, own_w, ref_ids)
    assert rg._arrival_counter(x.device).item() == 0  # back to 0 for the next launch


@needs_triton
def test_fused_routing_repeats_exactly():
    """Launch after launch (as graph replays do) the counter starts at 0 and the results are the
    same bits: the last program always routes, in token order."""
    x, gate, spec, bias = _route_case(4, 16, "noaux_tc", seed=3)
    first = rg.router_route_triton(x, gate, spec, bias, config=SMALL)
    for _ in range(2):
        again = rg.router_route_triton(x, gate, spec, bias, config=SMALL)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
        assert rg._arrival_counter(x.device).item() == 0


@needs_triton
@pytest.mark.parametrize("t", [2, 9])
def test_gate_and_route_matches_the_torch_path(t, monkeypatch):
    """Both plans (fused at 2 tokens, F.linear then the routing kernel at 9) give
    route(F.linear(x.float(), gate)): the same experts, weights within 1e-6."""
    launched = []
    real = rg.router_route_triton
    monkeypatch.setattr(rg, "router_route_triton", lambda *a, **k: launched.append(1) or real(*a, **k))
    x, gate, spec, bias = _route_case(t, 16, "group_limited_greedy", seed=40 + t)
    ref_logits = F.linear(x.float(), gate)
    _assert_no_near_ties(ref_logits)
    ref_w, ref_ids = routing.route_ref(ref_logits, spec, bias)
    weights, ids = rg.gate_and_route(x, gate, spec, bias, use_triton=True)
    _assert_routing(weights, ids, ref_w, ref_ids, rtol=WEIGHT_RTOL + 4 * _logit_bound(x, gate))
    assert launched == ([1] if rg.router_plan(t) == "fused" else [])


# ---- GPU: real shapes, CUDA graphs ----------------------------------------------------------------


V2_LITE = routing.RoutingSpec(64, top_k=6, method="greedy", scoring="softmax")
V3 = routing.RoutingSpec(
    256, top_k=8, method="noaux_tc", scoring="sigmoid", n_group=8, topk_group=4, norm_topk_prob=True,
    routed_scaling_factor=2.5,
)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 3, 4, 16])
@pytest.mark.parametrize("d,spec", [(2048, V2_LITE), (7168, V3)], ids=["v2_lite", "v3"])
def test_gpu_real_shapes(t, d, spec):
    e = spec.n_experts
    x, gate = _case(t, e, d, seed=t + e)
    bias = torch.randn(e, device="cuda") * 0.1 if spec.method == "noaux_tc" else None
    _assert_logits(rg.router_logits_triton(x, gate), x, gate)
    weights, ids, logits = rg.router_route_triton(x, gate, spec, bias)
    _assert_logits(logits, x, gate)
    ref_w, ref_ids = routing.route_ref(logits, spec, bias)  # the routing of the kernel's own logits
    _assert_routing(weights, ids, ref_w, ref_ids)


@pytest.mark.gpu
def test_gpu_graph_replay_keeps_the_counter_at_zero():
    x, gate = _case(2, 64, 2048, seed=5)
    eager = rg.router_route_triton(x, gate, V2_LITE)  # compiles, makes the counter
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = rg.router_route_triton(x, gate, V2_LITE)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(eager, captured, strict=True))
        assert rg._arrival_counter(x.device).item() == 0


# ---- the sm90 compile (runs on CPU; nothing is launched) ------------------------------------------

COMPILE_SM90 = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mlac.kernels.moe.routing import RoutingSpec, _route_launch_args
from mlac.kernels.moe.router_gemv import _router_kernel, pick_config

sig = {"x_ptr": "*bf16", "gate_ptr": "*fp32", "logits_ptr": "*fp32", "bias_ptr": "*fp32",
       "weights_ptr": "*fp32", "ids_ptr": "*i64", "count_ptr": "*i32", "T": "i32", "D": "i32",
       "stride_xt": "i32", "scale": "fp32"}
e, d = 256, 7168
v3 = RoutingSpec(e, top_k=8, method="noaux_tc", scoring="sigmoid", n_group=8, topk_group=4, norm_topk_prob=True,
                 routed_scaling_factor=2.5)
out = {}
for block_t, route in ((1, True), (16, False)):
    _, consts = _route_launch_args(v3, has_bias=True)
    consts.pop("num_warps")
    cfg = pick_config(e, d, block_t, 132)
    consts.update(E=e, BLOCK_T=block_t, BLOCK_E=cfg.block_e, BLOCK_D=cfg.block_d, EVEN_D=d % cfg.block_d == 0,
                  ROUTE=route, PDL=True, EXACT_EXP=True)
    src = ASTSource(_router_kernel, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.num_warps, "launch_pdl": True})
    ptx = k.asm["ptx"]
    out[str(route)] = {"wait": "griddepcontrol.wait" in ptx, "atomic": "atom." in ptx, "local": ".local" in ptx}
print(json.dumps(out))
"""


@needs_triton
def test_compiles_for_sm90_with_the_pdl_wait_and_no_local_memory(tmp_path):
    """The V3 variants (fused at one row, logits at 16) compile for an H100/H200 on any machine:
    the PDL wait is there, the fused one takes its ticket with an atomic, neither uses local memory
    (ptxas -v, run by hand on 2026-11-23: 56-159 registers, no spills, for V2-Lite and V3)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-c", COMPILE_SM90], env=env, capture_output=True, text=True)
    if out.returncode != 0 and "ptxas" in out.stderr:
        pytest.skip("no ptxas for sm90 here")
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {
        "True": {"wait": True, "atomic": True, "local": False},
        "False": {"wait": True, "atomic": False, "local": False},
    }


# ---- the wiring: MoE.partial through the kernel ---------------------------------------------------


@needs_triton
@pytest.mark.parametrize("preset", ["v2-lite", "v2", "v3"])
@pytest.mark.parametrize("t,plan", [(1, "fused"), (3, "fused"), (7, "torch")])
def test_moe_layer_through_the_kernel_equals_the_torch_path(preset, t, plan, monkeypatch):
    """A tiny preset's MoE layer (float32, CPU): MoE.partial with the router on the Triton path
    (interpreted; `router_plan`'s choice) against the same layer on the reference path. The experts and their weights
    come from the same logits up to summation order: 1e-5 relative (the weights' 4·dz, dz ~ 1e-6
    at these sizes, through a float32 expert sum)."""
    from _hf_convert import build_hf, convert, raw_config

    from mlac.core.config import ModelConfig
    from mlac.runtime.model import model as model_mod
    from mlac.runtime.model.layers import Weights

    raw = raw_config(preset)
    config = ModelConfig.from_hf(raw)
    model = model_mod.DeepseekModel(config, Weights(convert(build_hf(raw, seed=0), config), source="tensors"))
    moe = next(layer.ffn for layer in model.layers if isinstance(layer.ffn, model_mod.MoE))
    x = torch.randn(t, config.hidden_size, generator=torch.Generator().manual_seed(t)) * 2
    with torch.no_grad():
        ref = moe.partial(x)
        ran = []
        real = {name: getattr(rg, name) for name in ("router_route_triton", "router_logits_triton")}
        for name, fn in real.items():
            monkeypatch.setattr(
                rg, name, lambda *a, _fn=fn, _name=name, **k: ran.append(_name) or _fn(*a, **k)
            )
        monkeypatch.setattr(
            model_mod, "gate_and_route", lambda *a, **k: rg.gate_and_route(*a, **k, use_triton=True)
        )
        out = moe.partial(x)
    assert ref.abs().max() > 0
    assert ran == (
        ["router_route_triton"] if plan == "fused" else []
    )  # "torch": F.linear, the routing kernel
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-5
