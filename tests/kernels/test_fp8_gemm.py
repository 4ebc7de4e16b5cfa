"""Block-FP8 GEMM and activation quantization: Triton kernels against their pure-torch references.

Without CUDA the kernels run under TRITON_INTERPRET=1 on small shapes (set by _util before triton
is imported); tests marked gpu run real DeepSeek shapes and are skipped without CUDA.
"""

from __future__ import annotations

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

_mods = _util.kernel_modules()
quant_mod, gemm_mod = _mods["fp8_quant"], _mods["fp8_gemm"]


def _case(m: int, n: int, k: int, seed: int, dtype=torch.bfloat16, device=DEV):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * (1 + torch.rand(m, 1, generator=g) * 4)).to(dtype)
    w = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(gemm_mod.FP8)
    s = (torch.rand(-(-n // 128), -(-k // 128), generator=g) + 0.5) * 1e-2
    return x.to(device), w.to(device), s.to(device)


def _run(x, w, s, out_dtype=None, config=None):
    with _util.poisoned_empty():
        return gemm_mod.fp8_linear(x, w, s, out_dtype, use_triton=True, config=config)


@needs_triton
@pytest.mark.parametrize("m,k", [(1, 96), (3, 200), (17, 320), (130, 200), (5, 128)])
def test_act_quant_bit_exact(m, k):
    x, _, _ = _case(m, 8, k, seed=m * 1000 + k)
    x[0, :4] = torch.tensor([-0.0, 1e-6, -1e-6, 0.0])  # signed zeros after quantization
    with _util.poisoned_empty():
        q, s = quant_mod.act_quant(x)
    rq, rs = gemm_mod.quantize_act_ref(x)
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


def assert_m_major(q, s, x) -> None:
    """act_quant(x, m_major=True)'s layout: quantize_act_ref's bits in the first M rows, zero rows
    (q 0, scale 1) up to M rounded to 4, the scales M-major (strides (1, Mp))."""
    m, k = x.shape
    mp = -(-m // 4) * 4
    rq, rs = gemm_mod.quantize_act_ref(x.cpu())
    assert q.shape == (mp, k) and q.stride() == (k, 1) and s.shape == (mp, rs.shape[1])
    assert s.stride() == (1, mp), s.stride()
    assert torch.equal(q[:m].view(torch.uint8).cpu(), rq.view(torch.uint8))
    assert torch.equal(s[:m].cpu(), rs)
    assert not q[m:].view(torch.uint8).any() and bool((s[m:] == 1).all())


@needs_triton
@pytest.mark.parametrize("m,k", [(1, 96), (3, 200), (17, 320), (130, 512), (32, 256)])
def test_act_quant_m_major_layout(m, k):
    x, _, _ = _case(m, 8, k, seed=m * 1000 + k + 1)
    with _util.poisoned_empty():
        q, s = quant_mod.act_quant(x, m_major=True)
    assert_m_major(q, s, x)


@needs_triton
@pytest.mark.parametrize("m", [1, 3, 17, 130])
@pytest.mark.parametrize("n,k", [(96, 200), (200, 256), (320, 384)])
def test_fp8_linear_matches_reference(m, n, k):
    x, w, s = _case(m, n, k, seed=m * 7 + n * 13 + k)
    _util.assert_close(_run(x, w, s), gemm_mod.fp8_linear_ref(x, w, s))


@needs_triton
@pytest.mark.parametrize(
    "config",
    [
        dict(block_m=16, block_n=64, split_k=3, fuse_quant=True),  # ragged last split, quant in GEMM
        dict(block_m=16, block_n=64, split_k=2),
        dict(block_m=32, block_n=64, split_k=2, sub_k=2),  # 2 K blocks per step, odd count per split
        dict(block_m=32, block_n=256),  # per-column scales (the tile spans two 128-row blocks)
        dict(block_m=64, block_n=128, group_m=2, sub_k=2),
    ],
)
def test_fp8_gemm_configs(config):
    x, w, s = _case(20, 200, 520, seed=len(config))
    cfg = gemm_mod.GemmConfig(**config)
    ref = gemm_mod.fp8_linear_ref(x, w, s, torch.float32)
    # float32 out: summation order only, but for Hopper's FP8 wgmma (64-row tiles), which adds the
    # products of each K block at reduced precision before the float32 scale-and-add (DeepSeek-V3's
    # report: about 14 bits): 1.3e-4 measured on an H200
    wgmma = x.is_cuda and cfg.block_m >= 64 and torch.cuda.get_device_capability(x.device)[0] >= 9
    _util.assert_close(_run(x, w, s, torch.float32, cfg), ref, rtol=5e-4 if wgmma else None)


@needs_triton
def test_fp8_linear_leading_dims_and_float32_input():
    x, w, s = _case(6, 96, 200, seed=5, dtype=torch.float32)
    x = x.view(2, 3, 200)
    out = _run(x, w, s, torch.bfloat16)
    assert out.shape == (2, 3, 96)
    _util.assert_close(out, gemm_mod.fp8_linear_ref(x, w, s, torch.bfloat16))


def test_cpu_dispatch_runs_reference(monkeypatch, setting):
    setting("MLAC_FORCE_TRITON", None)

    def no_triton(*args, **kwargs):
        raise AssertionError("fp8_linear picked Triton for CPU tensors")

    monkeypatch.setattr(gemm_mod, "fp8_gemm", no_triton)
    x, w, s = _case(3, 96, 200, seed=3, device="cpu")
    assert torch.equal(gemm_mod.fp8_linear(x, w, s), gemm_mod.fp8_linear_ref(x, w, s))


def test_import_and_reference_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from mlac.kernels.gemm import fp8_gemm\n"
        "from mlac.kernels.moe import fused\n"
        "assert not fp8_gemm.HAS_TRITON\n"
        "x = torch.randn(2, 256)\n"
        "w = torch.randn(128, 256).to(torch.float8_e4m3fn)\n"
        "y = fp8_gemm.fp8_linear(x, w, torch.ones(1, 2))\n"
        "assert y.shape == (2, 128)\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=root)


# ---- GPU: real shapes -------------------------------------------------------------------------

GPU_SHAPES = [
    (2112, 7168),
    (24576, 1536),
    (32768, 512),
    (7168, 16384),
    (4096, 7168),
    (7168, 2048),
    (576, 200),
]


@pytest.mark.parametrize("m", [1, 64, 300, 4096])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
@pytest.mark.gpu
def test_gpu_fp8_linear_real_shapes(m, n, k):
    x, w, s = _case(m, n, k, seed=m + n + k)
    _util.assert_close(_run(x, w, s), _util.fp8_linear_ref64(x, w, s))


@pytest.mark.gpu
def test_gpu_split_k_deterministic():
    x, w, s = _case(16, 2112, 7168, seed=1)
    cfg = gemm_mod.GemmConfig(16, 64, split_k=8)
    outs = [_run(x, w, s, torch.float32, cfg) for _ in range(5)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    _util.assert_close(outs[0], _util.fp8_linear_ref64(x, w, s, torch.float32), rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k", [(1, 7168), (4096, 7168), (33, 1000)])
def test_gpu_act_quant_bit_exact(m, k):
    x, _, _ = _case(m, 8, k, seed=k)
    q, s = quant_mod.act_quant(x)
    for rq, rs in (gemm_mod.quantize_act_ref(x.cpu()), gemm_mod.quantize_act_ref(x)):  # CPU, CUDA
        assert torch.equal(s.cpu(), rs.cpu())
        assert torch.equal(q.view(torch.uint8).cpu(), rq.view(torch.uint8).cpu())
    assert_m_major(*quant_mod.act_quant(x, m_major=True), x)
