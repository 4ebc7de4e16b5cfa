"""RMSNorm (+ residual, + FP8 quantization) and rotate-half rope: Triton against the references.

Tolerances: float32 1e-5 relative (rsqrt may differ by an ulp or two), bf16 outputs 1e-2 (one
rounding; compared elementwise at bf16 resolution), FP8 outputs: scales to 1e-5 relative, values
within one e4m3 step of the reference (the float32 input to the rounding may differ in its last
bits, which can move a value across a rounding boundary) and at least 99% bit-identical.
"""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

from mlac.kernels.gemm.fp8_gemm import quantize_act_ref
from mlac.kernels.norm_rope import (
    rms_norm,
    rms_norm_quant,
    rms_norm_quant_ref,
    rms_norm_ref,
)

# Buffers the wrappers allocate themselves (outputs, split-KV partials) start as NaN.
pytestmark = pytest.mark.usefixtures("poison_empty")


def randn(*shape, dtype=torch.float32, device="cpu", seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def close(out, ref, dtype):
    if dtype == torch.float32:
        assert rel_err(out, ref) < 1e-5
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows,d", [(1, 16), (7, 33), (33, 512), (5, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(triton_device, rows, d, dtype):
    x = randn(rows, d, dtype=dtype, device=triton_device, seed=rows + d, scale=3.0)
    w = randn(d, dtype=dtype, device=triton_device, seed=1)
    y = rms_norm(x, w, 1e-6, use_triton=True)
    close(y, rms_norm_ref(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_residual(triton_device, dtype):
    x = randn(7, 130, dtype=dtype, device=triton_device, seed=2)
    r = randn(7, 130, dtype=dtype, device=triton_device, seed=3)
    x0, r0 = x.clone(), r.clone()
    w = randn(130, dtype=dtype, device=triton_device, seed=4)
    y, r_new = rms_norm(x, w, 1e-6, residual=r, use_triton=True)
    y_ref, r_ref = rms_norm_ref(x, w, 1e-6, residual=r)
    close(y, y_ref, dtype)
    assert torch.equal(r_new, r_ref)  # one rounding of an exact float32 sum: bit-identical
    assert torch.equal(x, x0) and torch.equal(r, r0)


def test_rms_norm_strided_rows(triton_device):
    # kv_norm applies to the first 512 of the 576 kv_a dims: a view with a row stride of 576.
    kv = randn(9, 48, device=triton_device, seed=5)
    x = kv[:, :32]
    w = randn(32, device=triton_device, seed=6)
    close(rms_norm(x, w, 1e-6, use_triton=True), rms_norm_ref(x, w, 1e-6), torch.float32)


def check_fp8(q, s, q_ref, s_ref):
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=0)
    deq = q.float() * s.repeat_interleave(128, -1)[:, : q.shape[1]]
    deq_ref = q_ref.float() * s_ref.repeat_interleave(128, -1)[:, : q.shape[1]]
    step = deq_ref.abs() / 8 + s_ref.repeat_interleave(128, -1)[:, : q.shape[1]] * 2**-9  # one e4m3 step
    assert ((deq - deq_ref).abs() <= step * 1.01).all()
    same = (q.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean().item()
    assert same > 0.99, f"only {same:.4f} of the fp8 values are bit-identical"


@pytest.mark.parametrize("rows,d", [(1, 128), (7, 200), (33, 384), (3, 64)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quant(triton_device, rows, d, with_residual):
    dtype = torch.bfloat16
    x = randn(rows, d, dtype=dtype, device=triton_device, seed=d, scale=2.0)
    r = randn(rows, d, dtype=dtype, device=triton_device, seed=d + 1) if with_residual else None
    w = randn(d, dtype=dtype, device=triton_device, seed=7)
    act, r_new = rms_norm_quant(x, w, 1e-6, residual=r, use_triton=True)
    ref, r_ref = rms_norm_quant_ref(x, w, 1e-6, residual=r)
    q, s = act.q, act.scale
    assert q.dtype == torch.float8_e4m3fn and q.shape == (rows, d) and s.shape == (rows, -(-d // 128))
    assert act.dtype == dtype and act.x is None  # keep_y=False: no bf16 output
    check_fp8(q.cpu(), s.cpu(), ref.q.cpu(), ref.scale.cpu())
    if with_residual:
        assert torch.equal(r_new, r_ref)


def test_rms_norm_quant_ref_is_quantize_act_ref():
    """The quantizing norm quantizes the output of rms_norm, rounded to x's dtype (what an FP8
    GEMM quantized when it read that output), not the float32 value before the rounding."""
    x = randn(4, 256, seed=8, dtype=torch.bfloat16, scale=3.0)
    w = randn(256, seed=9, dtype=torch.bfloat16)
    act, _ = rms_norm_quant_ref(x, w, 1e-6)
    q2, s2 = quantize_act_ref(rms_norm_ref(x, w, 1e-6))
    assert torch.equal(act.q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(act.scale, s2)
    assert torch.equal(act.x, rms_norm_ref(x, w, 1e-6))


def test_dispatch_cpu_uses_reference():
    x = randn(3, 64)
    w = randn(64, seed=1)
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
