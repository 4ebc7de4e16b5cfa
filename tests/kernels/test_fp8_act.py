"""Activations quantized by the kernel that makes them (`Fp8Act`) against act_quant + GEMM.

The quantizing RMSNorm and SiLU·mul write e4m3 + per-token per-128-channel scales in their own
launch, and the FP8 GEMMs (fp8_act_gemm, fused_moe's GEMM1) read them instead of quantizing their
input. Contract: bit for bit what the unfused path computes, act_quant of the plain kernel's
output, then the GEMM. Compared with torch.equal throughout, under TRITON_INTERPRET=1 on CPU.
"""

from __future__ import annotations

import pytest
import torch

try:
    from tests.kernels import _util
except ImportError:  # tests/ is not a package: pytest put this folder on sys.path
    import _util

_mods = _util.kernel_modules()  # before anything else imports triton
quant_mod, gemm_mod, moe_mod = _mods["fp8_quant"], _mods["fp8_gemm"], _mods["fused"]

from mlac.kernels import activation, norm_rope  # noqa: E402
from mlac.kernels.moe.routing import RoutingSpec, route_ref  # noqa: E402

DEV = "cuda" if _util.HAS_CUDA else "cpu"
needs_triton = pytest.mark.skipif(not _util.HAS_TRITON, reason="triton is not installed")


def randn(*shape, seed: int, scale: float = 1.0, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (e4m3 compared as bytes; NaN never equals, so unwritten values fail)."""
    if a.dtype == torch.float8_e4m3fn:
        return (
            a.shape == b.shape
            and b.dtype == a.dtype
            and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        )
    return torch.equal(a, b)


def assert_same_act(act, q: torch.Tensor, s: torch.Tensor) -> None:
    assert bits_equal(act.q, q), "e4m3 values differ from act_quant's"
    assert bits_equal(act.scale, s), "scales differ from act_quant's"


@needs_triton
@pytest.mark.parametrize("rows,d", [(1, 128), (3, 200), (9, 512), (2, 64)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quant_is_act_quant_of_rms_norm(rows, d, with_residual):
    x = randn(rows, d, seed=d, scale=3.0)
    r = randn(rows, d, seed=d + 1) if with_residual else None
    w = randn(d, seed=7, scale=0.2) + 1
    with _util.poisoned_empty():
        out = norm_rope.rms_norm(x, w, 1e-6, residual=r, use_triton=True)
        y, r_ref = out if with_residual else (out, None)
        act, r_new = norm_rope.rms_norm_quant(x, w, 1e-6, residual=r, keep_y=True, use_triton=True)
        q, s = quant_mod.act_quant(y)
    assert_same_act(act, q, s)
    assert bits_equal(act.x, y) and act.dtype == x.dtype
    if with_residual:
        assert bits_equal(r_new, r_ref)


@needs_triton
def test_rms_norm_quant_strided_rows():
    """q_norm reads the first q_lora columns of the fused q_a ‖ kv_a output."""
    wide = randn(5, 256 + 96, seed=3, scale=2.0)
    x, w = wide[:, :256], randn(256, seed=4) + 1
    with _util.poisoned_empty():
        act, _ = norm_rope.rms_norm_quant(x, w, 1e-6, use_triton=True)
        q, s = quant_mod.act_quant(norm_rope.rms_norm(x, w, 1e-6, use_triton=True))
    assert_same_act(act, q, s)
    assert act.x is None


@needs_triton
@pytest.mark.parametrize("t,i", [(1, 128), (3, 100), (5, 1408), (2, 2100)])
def test_silu_mul_quant_is_act_quant_of_silu_mul(t, i):
    x = randn(t, 2 * i, seed=t + i, scale=3.0)
    with _util.poisoned_empty():
        act = activation.silu_mul_quant(x, use_triton=True)
        q, s = quant_mod.act_quant(activation.silu_mul(x, use_triton=True))
    assert_same_act(act, q, s)
    assert act.dtype == x.dtype and act.x is None


def test_quant_refs_are_quantize_act_ref_of_the_plain_refs():
    x = randn(4, 2 * 300, seed=5, scale=3.0).cpu()
    act = activation.silu_mul_quant(x)  # CPU: the reference
    q, s = gemm_mod.quantize_act_ref(activation.silu_mul_ref(x))
    assert_same_act(act, q, s)


@needs_triton
@pytest.mark.parametrize("m,n,k", [(1, 96, 200), (3, 256, 384), (17, 200, 256), (70, 128, 128)])
def test_fp8_linear_on_fp8_act_equals_fp8_linear(m, n, k):
    x = randn(m, k, seed=m + n + k, scale=2.0)
    w, s = _util.random_fp8_weight(n, k, device=DEV)
    with _util.poisoned_empty():
        plain = gemm_mod.fp8_linear(x, w, s, use_triton=True)
        act = quant_mod.Fp8Act(*quant_mod.act_quant(x), x.dtype)
        fused = gemm_mod.fp8_linear(act, w, s, use_triton=True)
    assert fused.dtype == x.dtype and bits_equal(fused, plain)


@needs_triton
def test_fp8_act_gemm_split_k_config():
    x = randn(16, 520, seed=11, scale=2.0)
    w, s = _util.random_fp8_weight(200, 520, device=DEV)
    cfg = gemm_mod.GemmConfig(16, 64, split_k=3)
    with _util.poisoned_empty():
        plain = gemm_mod.fp8_gemm(x, w, s, torch.float32, cfg)
        fused = gemm_mod.fp8_act_gemm(quant_mod.Fp8Act(*quant_mod.act_quant(x), x.dtype), w, s, None, cfg)
    assert fused.dtype == x.dtype
    assert bits_equal(fused, plain.to(x.dtype))


def test_fp8_linear_on_fp8_act_cpu_reference():
    x = randn(5, 300, seed=12, scale=2.0).cpu()
    w, s = _util.random_fp8_weight(64, 300)
    act = quant_mod.Fp8Act(*gemm_mod.quantize_act_ref(x), x.dtype)
    assert bits_equal(gemm_mod.fp8_linear(act, w, s), gemm_mod.fp8_linear_ref(x, w, s))


def test_fp8_act_gemm_rejects_a_float_activation():
    w, s = _util.random_fp8_weight(64, 128)
    bad = quant_mod.Fp8Act(torch.zeros(2, 128), torch.ones(2, 1), torch.bfloat16)
    if not _util.HAS_TRITON:
        pytest.skip("triton is not installed")
    with pytest.raises(AssertionError):
        gemm_mod.fp8_act_gemm(bad, w, s)


def _moe_case(t: int, d: int, i: int, e: int, top_k: int, seed: int):
    x = randn(t, d, seed=seed, scale=2.0)
    w13, s13 = _util.random_fp8_weight(2 * i, d, lead=(e,), device=DEV, scale=0.02 / d**0.5)
    w2, s2 = _util.random_fp8_weight(d, i, lead=(e,), device=DEV, scale=0.02 / i**0.5)
    g = torch.Generator().manual_seed(seed)
    weights, ids = route_ref(torch.randn(t, e, generator=g), RoutingSpec(e, top_k, "greedy", "softmax"))
    return x, w13, w2, s13, s2, weights.to(DEV), ids.to(DEV)


@needs_triton
@pytest.mark.parametrize("t", [1, 5])
def test_fused_moe_on_fp8_act_equals_fused_moe(t):
    x, w13, w2, s13, s2, weights, ids = _moe_case(t, 256, 256, 4, 2, seed=t)
    shared = randn(t, 256, seed=99)
    act = quant_mod.Fp8Act(*quant_mod.act_quant(x), x.dtype, x)
    with _util.poisoned_empty():
        plain = moe_mod.fused_moe(x, w13, w2, weights, ids, s13, s2, use_triton=True, shared_out=shared)
        fused = moe_mod.fused_moe(
            x, w13, w2, weights, ids, s13, s2, use_triton=True, shared_out=shared, x_act=act
        )
    assert bits_equal(fused, plain)


def test_fused_moe_reference_on_fp8_act():
    x, w13, w2, s13, s2, weights, ids = (a.cpu() for a in _moe_case(6, 256, 128, 4, 2, seed=3))
    act = quant_mod.Fp8Act(*gemm_mod.quantize_act_ref(x), x.dtype)
    plain = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2)
    assert bits_equal(moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2, x_act=act), plain)


def test_fused_moe_reference_reads_the_fp8_act():
    """x_act is what GEMM1 reads (not decoration): a different quantization changes the output."""
    x, w13, w2, s13, s2, weights, ids = (a.cpu() for a in _moe_case(3, 256, 128, 4, 2, seed=4))
    q, s = gemm_mod.quantize_act_ref(x)
    act = quant_mod.Fp8Act(q, s * 2, x.dtype)
    plain = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2)
    assert not torch.equal(moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2, x_act=act), plain)
