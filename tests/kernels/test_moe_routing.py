"""MoE routing: the Triton kernel (mlac.kernels.moe.routing) against its route_ref.

Without CUDA the kernel runs under TRITON_INTERPRET=1 (set by _util before triton is imported)
on small token counts; tests marked gpu run the V2-Lite and V3 shapes and are skipped without CUDA.
Logits are random, so exact ties between experts (or groups) have probability ~0 and the expert
ids must match route_ref's exactly, in order.

Weight tolerance: 1e-6 relative, elementwise (8 float32 ulps; epsilon is 1.2e-7). The kernel
computes the same float32 formulas as route_ref; what differs is the summation order of the
softmax denominator and of the top-k sum, and exp itself (numpy's in the interpreter, libdevice
on the GPU, against torch's): a few roundings of 2^-24 each.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

from mlac.core.config import ModelConfig
from mlac.core.errors import MlacError

try:
    from tests.kernels import _util
except ImportError:  # tests/ is not a package: pytest put this folder on sys.path
    import _util

needs_triton = pytest.mark.skipif(not _util.HAS_TRITON, reason="triton is not installed")
DEV = "cuda" if _util.HAS_CUDA else "cpu"
RTOL = 1e-6

_util.kernel_modules()  # fp8_quant (moe_routing's @jit) interpreted without CUDA
routing = importlib.import_module("mlac.kernels.moe.routing")
if _util.HAS_TRITON and not _util.HAS_CUDA and type(routing._route_kernel).__name__ != "InterpretedFunction":
    routing = importlib.reload(routing)  # imported earlier in compiled mode: interpret it


def _inputs(t: int, e: int, with_bias: bool, seed: int, device=DEV):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g) * 2
    bias = torch.randn(e, generator=g) * 0.5 if with_bias else None
    return logits.to(device), None if bias is None else bias.to(device)


def _check(logits, bias, top_k, method, scoring, n_group=1, topk_group=1, norm=False, scale=1.0):
    spec = routing.RoutingSpec(logits.shape[1], top_k, method, scoring, n_group, topk_group, norm, scale)
    with _util.poisoned_empty():
        weights, ids = routing.route(logits, spec, bias, use_triton=True)
    ref_weights, ref_ids = routing.route_ref(logits, spec, bias)
    assert ids.dtype == ref_ids.dtype and torch.equal(ids, ref_ids), (ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=RTOL, atol=0)


CASES = [  # T, E, top_k, method, scoring, n_group, topk_group, norm_topk_prob, scale, bias
    (1, 6, 1, "greedy", "softmax", 1, 1, False, 1.0, False),
    (3, 6, 2, "greedy", "softmax", 1, 1, True, 1.0, False),
    (17, 64, 6, "greedy", "softmax", 1, 1, False, 1.0, False),  # V2-Lite
    (17, 64, 6, "greedy", "softmax", 1, 1, True, 16.0, False),  # norm replaces the scale
    (3, 40, 1, "greedy", "softmax", 1, 1, True, 2.0, False),  # top_k 1: no norm, scaled
    (17, 40, 3, "greedy", "sigmoid", 1, 1, False, 2.5, True),
    (3, 72, 8, "greedy", "softmax", 8, 3, False, 1.0, False),  # groups ignored by greedy
    (17, 40, 4, "group_limited_greedy", "softmax", 5, 2, False, 16.0, False),
    (33, 72, 6, "group_limited_greedy", "softmax", 8, 3, False, 16.0, False),  # V2's rule, E=160
    (3, 72, 6, "group_limited_greedy", "softmax", 8, 3, True, 16.0, False),
    (17, 6, 2, "group_limited_greedy", "sigmoid", 3, 2, False, 1.0, True),
    (1, 6, 2, "noaux_tc", "sigmoid", 3, 1, True, 2.5, True),
    (17, 40, 5, "noaux_tc", "sigmoid", 5, 2, True, 2.5, True),
    (33, 72, 8, "noaux_tc", "sigmoid", 8, 4, True, 2.5, True),
    (17, 72, 7, "noaux_tc", "sigmoid", 8, 4, False, 2.5, True),
    (3, 40, 3, "noaux_tc", "softmax", 4, 2, True, 1.0, False),
    (3, 64, 8, "noaux_tc", "sigmoid", 1, 1, True, 2.5, True),  # ungrouped
    (33, 256, 8, "noaux_tc", "sigmoid", 8, 4, True, 2.5, True),  # V3
    (3, 256, 8, "noaux_tc", "sigmoid", 8, 4, False, 1.0, False),
    (3, 256, 6, "group_limited_greedy", "softmax", 8, 3, True, 1.0, False),
]


@needs_triton
@pytest.mark.parametrize("t,e,top_k,method,scoring,n_group,topk_group,norm,scale,bias", CASES)
def test_route_matches_reference(t, e, top_k, method, scoring, n_group, topk_group, norm, scale, bias):
    logits, b = _inputs(t, e, bias, seed=t * 1000 + e + top_k)
    _check(logits, b, top_k, method, scoring, n_group, topk_group, norm, scale)


@needs_triton
def test_route_strided_and_half_logits():
    """Rows of a wider buffer (row stride != E), and bf16 logits (route_ref upcasts them)."""
    wide, bias = _inputs(17, 100, True, seed=5)
    _check(wide[:, :72], bias[:72], 8, "noaux_tc", "sigmoid", 8, 4, True, 2.5)
    logits, _ = _inputs(3, 64, False, seed=6)
    _check(logits.to(torch.bfloat16), None, 6, "greedy", "softmax")


@needs_triton
def test_group_limited_greedy_drops_groups_to_zero():
    """route_ref's group_limited_greedy fills dropped experts with 0.0, not -inf: with a negative
    bias the one dropped expert (groups of 1) outranks both kept ones and is picked first."""
    logits, _ = _inputs(5, 3, False, seed=2)
    bias = torch.full((3,), -2.0, device=DEV)
    _check(logits, bias, 2, "group_limited_greedy", "sigmoid", 3, 2)


@needs_triton
def test_route_no_tokens():
    spec = routing.RoutingSpec(64, 6, "greedy", "softmax")
    weights, ids = routing.route(torch.empty(0, 64, device=DEV), spec, use_triton=True)
    assert weights.shape == ids.shape == (0, 6) and ids.dtype == torch.int64


@pytest.mark.parametrize(
    "e,top_k,method,n_group,topk_group,message",
    [
        (40, 2, "noaux_tc", 3, 1, "do not split"),
        (40, 2, "noaux_tc", 4, 5, "topk_group"),
        (40, 8, "noaux_tc", 8, 1, "top_k 8 >"),
        (8, 2, "noaux_tc", 8, 4, "top 2"),
        (8, 9, "greedy", 1, 1, "top_k 9 for 8"),
    ],
)
def test_route_rejects_bad_arguments(e, top_k, method, n_group, topk_group, message):
    """Checked once, where the spec is made, for every path (Triton and the reference)."""
    with pytest.raises(MlacError, match=f"^routing: .*{message}"):
        routing.RoutingSpec(e, top_k, method, "sigmoid", n_group, topk_group)


@pytest.mark.parametrize(
    "method,scoring,message",
    [("top_k", "softmax", "unknown topk_method 'top_k'"), ("greedy", "tanh", "unknown scoring_func 'tanh'")],
)
def test_spec_refuses_unknown_names(method, scoring, message):
    with pytest.raises(MlacError, match=f"^routing: {message}"):
        routing.RoutingSpec(64, 6, method, scoring)


def test_spec_from_config_and_its_weight_rule():
    """A checkpoint's routing fields land in the spec as they are; the weight rule is route_ref's."""

    def spec(name):
        raw = json.loads((Path(__file__).resolve().parent.parent / "configs" / f"{name}.json").read_text())
        return routing.RoutingSpec.from_config(ModelConfig.from_hf(raw))

    v3 = spec("DeepSeek-V3")
    assert v3 == routing.RoutingSpec(256, 8, "noaux_tc", "sigmoid", 8, 4, True, 2.5)
    assert (v3.groups, v3.group_size, v3.weight_rule) == (8, 32, (True, 2.5))
    v2 = spec("DeepSeek-V2")
    assert v2.method == "group_limited_greedy" and (v2.groups, v2.topk_group) == (8, 3)
    assert v2.weight_rule == (False, 16.0)  # V2: the factor, no renormalization
    greedy = routing.RoutingSpec(72, 8, "greedy", "softmax", 8, 3, True, 16.0)  # groups ignored
    assert (greedy.grouped, greedy.group_size, greedy.weight_rule) == (False, 72, (True, 1.0))


def test_cpu_dispatch_runs_reference(monkeypatch, setting):
    setting("MLAC_FORCE_TRITON", None)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def no_triton(*args, **kwargs):
        raise AssertionError("route picked Triton for CPU tensors")

    monkeypatch.setattr(routing, "route_triton", no_triton)
    logits, bias = _inputs(5, 64, True, seed=1, device="cpu")
    args = (logits, routing.RoutingSpec(64, 6, "noaux_tc", "sigmoid", 8, 4, True, 2.5), bias)
    for out, ref in zip(routing.route(*args), routing.route_ref(*args), strict=True):
        assert torch.equal(out, ref)


# ---- GPU: real shapes -------------------------------------------------------------------------

GPU_CASES = [  # name, E, top_k, method, scoring, n_group, topk_group, norm, scale, bias, T
    *[("v2lite", 64, 6, "greedy", "softmax", 1, 1, False, 1.0, False, t) for t in (1, 2048)],
    *[("v3", 256, 8, "noaux_tc", "sigmoid", 8, 4, True, 2.5, True, t) for t in (64, 256, 4096)],
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name,e,top_k,method,scoring,n_group,topk_group,norm,scale,bias,t",
    GPU_CASES,
    ids=[f"{c[0]}-T{c[-1]}" for c in GPU_CASES],
)
def test_gpu_route_real_shapes(name, e, top_k, method, scoring, n_group, topk_group, norm, scale, bias, t):
    logits, b = _inputs(t, e, bias, seed=t)
    _check(logits, b, top_k, method, scoring, n_group, topk_group, norm, scale)
