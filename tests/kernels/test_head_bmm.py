"""Batched-over-heads matmul of absorbed MLA (w_kc, w_vc): Triton kernel against its reference.

Without CUDA the kernel runs under TRITON_INTERPRET=1 on small shapes (set by _util before triton
is imported); tests marked gpu run real DeepSeek shapes and are skipped without CUDA.
Tolerances: _util.RTOL by output dtype (bf16 1e-2 relative Frobenius: the kernel and the
reference differ only in float32 summation order, then both round to bf16).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

try:
    from tests.kernels import _util
except ImportError:  # tests/ is not a package: pytest put this folder on sys.path
    import _util

needs_triton = pytest.mark.skipif(not _util.HAS_TRITON, reason="triton is not installed")
DEV = "cuda" if _util.HAS_CUDA else "cpu"


def _head_bmm_module():
    """mlac.kernels.attention.head_bmm, interpreted when there is no CUDA (after _util's reloads)."""
    _util.kernel_modules()
    mod = importlib.import_module("mlac.kernels.attention.head_bmm")
    if (
        _util.HAS_TRITON
        and not _util.HAS_CUDA
        and type(mod._head_bmm_kernel).__name__ != "InterpretedFunction"
    ):
        mod = importlib.reload(sys.modules["mlac.kernels.attention.head_bmm"])
    return mod


hb = _head_bmm_module()
SMALL = hb.HeadBmmConfig(16, 32, 64, num_warps=4, num_stages=1)  # ragged against K=200, N=96


def _case(b: int, h: int, k: int, n: int, seed: int, pad: int = 0, dtype=torch.bfloat16, device=DEV):
    """x [B, H, K] (a view of a [B, H, K + pad] tensor, like q_nope in q), w [H, K, N] in dtype."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, k + pad, generator=g) * (1 + 4 * torch.rand(b, h, 1, generator=g))
    w = torch.randn(h, k, n, generator=g) / k**0.5
    return q.to(dtype).to(device)[..., :k], w.to(dtype).to(device)


def _run(x, w, s=None, quant_act=False, config=None):
    with _util.poisoned_empty():
        out = hb.head_bmm(x, w, s, quant_act=quant_act, use_triton=True, config=config)
    assert out.is_contiguous() and out.shape == (x.shape[0], x.shape[1], w.shape[2])
    return out


@needs_triton
@pytest.mark.parametrize("b", [1, 3, 17])
@pytest.mark.parametrize("h", [1, 3])
@pytest.mark.parametrize("k,n", [(200, 96), (64, 160)])
def test_bf16_matches_reference(b, h, k, n):
    x, w = _case(b, h, k, n, seed=b * 100 + h * 10 + k + n, pad=64)
    assert x.stride(1) == k + 64  # a slice of a wider tensor, like q_nope
    _util.assert_close(_run(x, w, config=SMALL), hb.head_bmm_ref(x, w))


@needs_triton
@pytest.mark.parametrize("b", [1, 3, 17])
@pytest.mark.parametrize("h", [1, 3])
@pytest.mark.parametrize("k,n", [(200, 96), (136, 160)])
def test_fp8_w8a16_matches_reference(b, h, k, n):
    x, w = _case(b, h, k, n, seed=b * 100 + h * 10 + k + n + 1, pad=64)
    q, s = hb.quantize_head_weight(w)
    _util.assert_close(_run(x, q, s, config=SMALL), hb.head_bmm_ref(x, q, s))


@needs_triton
@pytest.mark.parametrize("b,h", [(1, 3), (17, 1)])
def test_fp8_w8a8_matches_reference(b, h):
    x, w = _case(b, h, 200, 96, seed=b + h, pad=64)
    q, s = hb.quantize_head_weight(w)
    cfg = hb.HeadBmmConfig(16, 32, 128, num_stages=1)
    _util.assert_close(_run(x, q, s, True, cfg), hb.head_bmm_ref(x, q, s, quant_act=True))


@needs_triton
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize(
    "config",
    [
        hb.CONFIGS["decode"],
        hb.HeadBmmConfig(32, 256, 32),  # a tile spans two 128-column scale blocks; 4 K steps per block
        hb.HeadBmmConfig(16, 16, 128),
        hb.HeadBmmConfig(64, 128, 64),
    ],
)
def test_configs(config, fp8):
    x, w = _case(20, 1, 200, 300, seed=config.block_n + fp8)
    s = None
    if fp8:
        w, s = hb.quantize_head_weight(w)
    _util.assert_close(_run(x, w, s, config=config), hb.head_bmm_ref(x, w, s))


@needs_triton
def test_strided_views_and_fp16():
    """x as a head-major buffer seen batch-major ([H, B, K] transposed), fp16 (tighter tolerance)."""
    x, w = _case(5, 3, 96, 48, seed=7, dtype=torch.float16)
    x = x.transpose(0, 1).contiguous().transpose(0, 1)  # strides (K, B*K, 1)
    w = w.transpose(0, 1).contiguous().transpose(0, 1)  # [H, K, N] with strides (N, H*N, 1)
    _util.assert_close(_run(x, w, config=SMALL), hb.head_bmm_ref(x, w))
    q, s = hb.quantize_head_weight(w)
    _util.assert_close(_run(x, q, s, config=SMALL), hb.head_bmm_ref(x, q, s))


def test_cpu_dispatch_runs_reference(monkeypatch, setting):
    setting("MLAC_FORCE_TRITON", None)

    def no_triton(*args, **kwargs):
        raise AssertionError("head_bmm picked Triton for CPU tensors")

    monkeypatch.setattr(hb, "head_bmm_triton", no_triton)
    x, w = _case(3, 2, 128, 64, seed=3, device="cpu")
    q, s = hb.quantize_head_weight(w)
    assert torch.equal(hb.head_bmm(x, w), hb.head_bmm_ref(x, w))
    assert torch.equal(hb.head_bmm(x, q, s), hb.head_bmm_ref(x, q, s))


def test_import_and_reference_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from mlac.kernels.attention import head_bmm as hb\n"
        "assert not hb.HAS_TRITON\n"
        "q, s = hb.quantize_head_weight(torch.randn(2, 128, 64))\n"
        "assert hb.head_bmm(torch.randn(3, 2, 128).bfloat16(), q, s).shape == (3, 2, 64)\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=root)


@needs_triton
def test_wrapper_rejects_bad_arguments():
    x, w = _case(2, 2, 128, 64, seed=4)
    q, s = hb.quantize_head_weight(w)
    bad = [
        (dict(x=x, w=w[:1]), "must be \\[H=2"),
        (dict(x=x, w=w.float()), "unscaled w must have x's dtype"),
        (dict(x=x.transpose(1, 2).contiguous().transpose(1, 2), w=w), "last dim must be contiguous"),
        (dict(x=x, w=q, w_scale=s[:, :, :0]), "w_scale"),
        (dict(x=x, w=w, quant_act=True), "needs an FP8 weight"),
        (dict(x=x, w=q, w_scale=s, config=hb.HeadBmmConfig(16, 64, 256)), "block_k dividing 128"),
        (dict(x=x, w=q, w_scale=s, quant_act=True, config=SMALL), "W8A8 needs block_k == 128"),
    ]
    for kwargs, msg in bad:
        with pytest.raises(AssertionError, match=msg):
            hb.head_bmm_triton(**kwargs)


def test_quantize_head_weight_blocks_per_head():
    w = torch.randn(3, 200, 300)
    w[1] *= 1000  # a loud head must not change the others' scales
    q, s = hb.quantize_head_weight(w.to(torch.bfloat16))
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and s.shape == (3, 2, 3)
    for h in range(3):
        deq = q[h].float() * s[h].repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
        assert _util.rel_err(deq, w[h]) < 0.036  # e4m3 rounding: at most 2^-4 relative (see below)
    assert s[1].min() > 100 * s[0].max()


# ---- what FP8 costs ----------------------------------------------------------------------------
# e4m3 keeps 3 mantissa bits: within a binade the spacing is 2^-3 of its bottom, so rounding moves
# a normal value by at most 2^-4 relative, and the RMS relative error of one element is at most
# 2^-4/sqrt(3) = 0.036 (uniform rounding error, value at the bottom of its binade); values spread
# over a binade average to about 0.026. The block scale amax/448 puts Gaussian weights (amax ~ 4.5 sigma
# over 16384 values) at sigma ~ 100 in e4m3 units, far from the subnormals (< 2^-6), so the
# weights' rel_l2 is ~0.02-0.03 and so is that of a product with independent activations.
# W8A8 adds the activations' own e4m3 error (the same size): about sqrt(2) times as much.
# bf16 output rounding alone (8 significant bits, the same argument) is ~2^-8/sqrt(3) * 0.72 = 1.6e-3.
# Measured here (CPU, seeded): w_kc bf16 1.7e-3, W8A16 2.6e-2, W8A8 3.7e-2; w_vc the same.
FP8_W_BOUND = 0.036
FP8_WA_BOUND = 0.036 * 2**0.5


@needs_triton
@pytest.mark.parametrize("which,k,n", [("w_kc", 128, 512), ("w_vc", 512, 128)])
def test_fp8_accuracy_cost(which, k, n, record_property):
    b, h = 4, 2
    x, w = _case(b, h, k, n, seed=k)
    exact = torch.einsum("bhk,hkn->bhn", x.double(), w.double())  # the bf16 weights' exact product
    q, s = hb.quantize_head_weight(w)
    cfg = hb.HeadBmmConfig(16, 128, 128, num_stages=1)
    errs = {
        "bf16": _util.rel_err(_run(x, w, config=cfg), exact),
        "w8a16": _util.rel_err(_run(x, q, s, config=cfg), exact),
        "w8a8": _util.rel_err(_run(x, q, s, True, cfg), exact),
    }
    for key, err in errs.items():
        record_property(f"{which}_{key}_rel_err", err)
    print(f"{which} rel_l2 vs exact bf16-weight product: {errs}")
    assert errs["bf16"] < 3e-3
    assert 0.01 < errs["w8a16"] < FP8_W_BOUND
    assert errs["w8a16"] < errs["w8a8"] < FP8_WA_BOUND


# ---- GPU: real shapes --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 16, 64, 300, 4096])
@pytest.mark.parametrize("h", [16, 128])
@pytest.mark.parametrize("which,k,n,pad", [("w_kc", 128, 512, 64), ("w_vc", 512, 128, 0)])
@pytest.mark.parametrize("fmt", ["bf16", "w8a16", "w8a8"])
def test_gpu_real_shapes(b, h, which, k, n, pad, fmt):
    x, w = _case(b, h, k, n, seed=b + h + k, pad=pad)
    s = None
    if fmt != "bf16":
        w, s = hb.quantize_head_weight(w)
    quant_act = fmt == "w8a8"
    _util.assert_close(_run(x, w, s, quant_act), hb.head_bmm_ref(x, w, s, quant_act=quant_act))
