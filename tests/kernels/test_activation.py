"""silu_mul: the Triton kernel against the eager expression F.silu(gate) * up.

Tolerances: the kernel rounds where eager torch rounds (silu to x's dtype, then the product), so
results are bit-identical except where exp differs by an ulp (numpy's or libdevice's against
torch's vectorized one) and the float32 silu lands on the other side of a rounding boundary:
float32 within 1e-6 relative; bf16 / fp16 within one step of the dtype, and at least 99% of
the values bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from mlac.kernels import activation

# Buffers the wrappers allocate themselves start as NaN.
pytestmark = pytest.mark.usefixtures("poison_empty")


def randn(*shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 3).to(dtype).to(device)


def check(y, ref):
    assert y.shape == ref.shape and y.dtype == ref.dtype and y.is_contiguous()
    assert torch.isfinite(y).all(), "non-finite output: an element was not written"
    if y.dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-7)
        return
    step = 2**-7 if y.dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(y.float(), ref.float(), rtol=step, atol=1e-5)
    same = (y == ref).float().mean().item()
    assert same > 0.99, f"only {same:.4f} of the values are bit-identical"


@pytest.mark.parametrize("t,i", [(1, 16), (3, 100), (17, 1408), (5, 2100)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_silu_mul_matches_eager(triton_device, t, i, dtype):
    x = randn(t, 2 * i, dtype=dtype, device=triton_device, seed=t + i)
    y = activation.silu_mul(x, use_triton=True)
    check(y.cpu(), activation.silu_mul_ref(x.cpu()))


def test_silu_mul_strided_rows(triton_device):
    """The [gate ‖ up] columns of a wider GEMM output (row stride 2I + 24)."""
    wide = randn(7, 2 * 40 + 24, dtype=torch.bfloat16, device=triton_device, seed=3)
    x = wide[:, 8 : 8 + 80]
    check(activation.silu_mul(x, use_triton=True).cpu(), activation.silu_mul_ref(x.cpu()))


def test_silu_mul_rejects_bad_input():
    with pytest.raises(AssertionError, match=r"\[T, 2I\]"):
        activation.silu_mul_triton(torch.zeros(3, 5))
    with pytest.raises(AssertionError, match="contiguous last dim"):
        activation.silu_mul_triton(torch.zeros(6, 4).t())


def test_cpu_dispatch_runs_reference(monkeypatch, setting):
    setting("MLAC_FORCE_TRITON", None)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def no_triton(*args, **kwargs):
        raise AssertionError("silu_mul picked Triton for CPU tensors")

    monkeypatch.setattr(activation, "silu_mul_triton", no_triton)
    x = randn(4, 64, dtype=torch.bfloat16, device="cpu")
    assert torch.equal(activation.silu_mul(x), activation.silu_mul_ref(x))
