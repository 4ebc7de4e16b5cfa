"""Block-FP8 linear through cuBLAS (kernels/gemm/fp8_cublas.py): the rule of which products take it,
the availability check, the operand layouts, and the results against `fp8_linear_ref`.

On CPU, torch._scaled_mm is replaced by `emulated_scaled_mm`: the layouts cuBLASLt's 1x128 / 128x128
block scaling takes (anything else is refused), the product in float32 as the reference computes
it. On a GPU (tests marked gpu) the real cuBLAS runs at V2-Lite's and V3's shapes, eagerly and
under CUDA-graph capture, against the float64 reference, within the bf16 tolerance of the Triton
GEMM's tests (_util.RTOL: 1e-2 relative Frobenius).
"""

from __future__ import annotations

import pytest
import torch

try:
    from tests.kernels import _util
except ImportError:  # tests/ is not a package: pytest put this folder on sys.path
    import _util

from mlac.core.fp8 import BLOCK, FP8, dequantize_blocks
from mlac.kernels import fp8_quant
from mlac.kernels.fp8_quant import Fp8Act
from mlac.kernels.gemm import fp8_cublas
from mlac.kernels.gemm.fp8_cublas import cublas_fp8_linear, cublas_takes, cublas_unavailable
from mlac.kernels.gemm.fp8_gemm import fp8_act_linear_ref, fp8_linear_ref, quantize_act_ref

DEV = "cuda" if _util.HAS_CUDA else "cpu"


def emulated_scaled_mm(
    a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False
):
    """torch._scaled_mm with DeepSeek's block scaling as cuBLASLt takes it, computed on the CPU as
    fp8_act_linear_ref computes: a [M, K] e4m3 row-major with scale_a [M, K/128] M-major, M a
    multiple of 4; b [K, N] column-major with scale_b [K/128, ceil(N/128)] K-major, K/128 a
    multiple of 4 (each scale tensor's leading dimension 16-byte aligned)."""
    (m, k), (kb_, n) = a.shape, b.shape
    assert kb_ == k and a.dtype == b.dtype == FP8 and bias is None and scale_result is None
    assert not use_fast_accum and out_dtype == torch.bfloat16
    assert a.stride() == (k, 1) and b.stride() == (1, k), "a row-major, b column-major"
    assert k % 16 == 0 and n % 16 == 0, "torch: dimensions multiples of 16"
    kb, nb = -(-k // BLOCK), -(-n // BLOCK)
    assert scale_a.dtype == scale_b.dtype == torch.float32
    assert scale_a.shape == (m, kb) and scale_a.stride() == (1, m), f"scale_a M-major: {scale_a.stride()}"
    assert scale_b.shape == (kb, nb) and scale_b.stride() == (1, kb), f"scale_b K-major: {scale_b.stride()}"
    assert m % 4 == 0 and kb % 4 == 0, "cuBLASLt: 16-byte aligned scale leading dimensions"
    x_deq = a.to(torch.float32) * scale_a.repeat_interleave(BLOCK, dim=-1)[:, :k]
    return (x_deq @ dequantize_blocks(b.t(), scale_b.t()).t()).to(out_dtype)


@pytest.fixture
def small_weights(monkeypatch) -> None:
    """The tests' tiny weights take the cuBLAS route as a large model's do (fp8_cublas.CUBLAS_MIN_WEIGHT
    off): the rows and the layouts decide, as for V3's linears."""
    monkeypatch.setattr(fp8_cublas, "CUBLAS_MIN_WEIGHT", 0)


@pytest.fixture
def routed(small_weights, monkeypatch) -> list[tuple[int, bool]]:
    """(rows, reads an Fp8Act) of every call of the model's cuBLAS route (layers.cublas_fp8_linear:
    eager calls, and captures), small weights taking it as a large model's do."""
    import mlac.runtime.model.layers as layers

    calls: list[tuple[int, bool]] = []
    real = layers.cublas_fp8_linear

    def spy(x, w, scale):
        a = x.q if isinstance(x, Fp8Act) else x
        calls.append((a.numel() // a.shape[-1], isinstance(x, Fp8Act)))
        return real(x, w, scale)

    monkeypatch.setattr(layers, "cublas_fp8_linear", spy)
    return calls


@pytest.fixture
def emulated(monkeypatch) -> list[tuple[int, int, int]]:
    """torch._scaled_mm emulated (on CPU tensors: the CPU has none); the list of (M, N, K) of
    every call."""
    calls: list[tuple[int, int, int]] = []

    def scaled_mm(a, b, *args, **kwargs):
        calls.append((a.shape[0], b.shape[1], a.shape[1]))
        return emulated_scaled_mm(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    return calls


def spread_case(m: int, n: int, k: int, seed: int, device=DEV):
    """x [m, k] bf16 whose 128-channel groups and rows differ in magnitude by powers of two, an e4m3
    weight [n, k] whose 128x128 blocks do too: a scale read from the wrong block shows."""
    g = torch.Generator().manual_seed(seed)
    kb, nb = -(-k // BLOCK), -(-n // BLOCK)
    group = 2.0 ** torch.randint(-3, 4, (m, kb), generator=g).float()
    x = torch.randn(m, k, generator=g) * group.repeat_interleave(BLOCK, dim=1)[:, :k]
    w = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(FP8)
    s = 2.0 ** torch.randint(-10, -4, (nb, kb), generator=g).float() * (torch.rand(nb, kb, generator=g) + 0.5)
    return x.to(torch.bfloat16).to(device), w.to(device), s.to(device)


# ---- the rule and the availability ---------------------------------------------------------------

# (M, N, K, cuBLAS takes it): the measured rules (rows, the weight's size), V2-Lite's and V3's shapes (TP 1) at 32, 64, 65, 256 rows
RULE_CASES = [
    (31, 3072, 2048, False),  # below 32 rows
    (32, 3072, 2048, False),  # V2-Lite q_proj: N >= K, but 6.3M weights (end to end: slower)
    (256, 2048, 2048, False),  # V2-Lite o_proj: 4.2M weights, at any rows
    (32, 21888, 2048, True),  # V2-Lite dense w13: 44.8M weights, N >= K
    (32, 24576, 1536, True),  # V3 q_b
    (32, 2112, 7168, False),  # V3 qkv_a: N < K, the decode tiles split K
    (64, 7168, 16384, False),  # V3 o_proj, up to the decode tiles' 64 rows
    (65, 7168, 16384, True),
    (256, 2112, 7168, True),  # V3 qkv_a: partial last 128-block of N
    (256, 7168, 18432, True),
    (256, 2048, 10944, False),  # V2-Lite dense w2: K not a multiple of 128
    (256, 2048, 2816, False),  # V2-Lite shared w2: K/128 = 22, not a multiple of 4
    (256, 2048, 2304, False),  # V3 dense w2 at TP 8: K/128 = 18
    (256, 520, 512, False),  # N not a multiple of 16
]


@pytest.mark.parametrize("m, n, k, takes", RULE_CASES)
def test_which_products_cublas_takes(m, n, k, takes):
    assert cublas_takes(m, n, k) is takes


def test_availability_is_decided_from_versions_and_the_gpu(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert cublas_unavailable("cuda") is None
    assert "cpu" in cublas_unavailable("cpu")
    assert "bf16" in cublas_unavailable("cuda", torch.float16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert "sm100" in cublas_unavailable("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch, "__version__", "2.10.1+cu128")
    assert "torch 2.10" in cublas_unavailable("cuda")
    monkeypatch.setattr(torch, "__version__", "2.12.0a0+git1234")
    assert cublas_unavailable("cuda") is None
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert "CUDA 12.8" in cublas_unavailable("cuda")
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU build of torch
    assert "CUDA None" in cublas_unavailable("cuda")


# ---- layouts and results on the CPU ---------------------------------------------------------------


@pytest.mark.parametrize("m", [32, 33, 257])
def test_m_major_operands_relay_an_fp8act(m):
    x, _, _ = spread_case(m, 16, 512, seed=m, device="cpu")
    q, s = quantize_act_ref(x)
    qp, sp = fp8_cublas.m_major_operands(q, s)
    mp = -(-m // 4) * 4
    assert qp.shape == (mp, 512) and sp.shape == (mp, 4) and sp.stride() == (1, mp)
    assert torch.equal(qp[:m].view(torch.uint8), q.view(torch.uint8)) and torch.equal(sp[:m], s)
    assert not qp[m:].view(torch.uint8).any() and bool((sp[m:] == 1).all())
    assert (qp.data_ptr() == q.data_ptr()) == (mp == m)  # q is copied only to pad its rows


SHAPES = [(272, 512), (128, 1024), (512, 512)]  # a partial last N block; N < K; N == K


@pytest.mark.parametrize("m", [32, 33, 64, 257])
@pytest.mark.parametrize("n, k", SHAPES)
def test_cublas_route_matches_the_reference_on_cpu(emulated, m, n, k):
    x, w, s = spread_case(m, n, k, seed=m + n, device="cpu")
    ref = fp8_linear_ref(x, w, s, torch.bfloat16)
    _util.assert_close(cublas_fp8_linear(x, w, s), ref)
    act = Fp8Act(*quantize_act_ref(x), torch.bfloat16)
    _util.assert_close(cublas_fp8_linear(act, w, s), fp8_act_linear_ref(act, w, s))
    mp = -(-m // 4) * 4
    assert emulated == [(mp, n, k)] * 2


def test_cublas_route_takes_leading_dims_and_strided_rows(emulated):
    x, w, s = spread_case(64, 272, 512, seed=9, device="cpu")
    x3 = x.view(4, 16, 512)
    y = cublas_fp8_linear(x3, w, s)
    assert y.shape == (4, 16, 272)
    _util.assert_close(y, fp8_linear_ref(x3, w, s, torch.bfloat16))
    wide = torch.zeros(64, 640, dtype=torch.bfloat16)
    wide[:, 64:576] = x
    strided = wide[:, 64:576]  # rows 640 apart
    _util.assert_close(cublas_fp8_linear(strided, w, s), fp8_linear_ref(x, w, s, torch.bfloat16))


@pytest.mark.skipif(not _util.HAS_TRITON, reason="triton is not installed")
def test_cublas_route_quantizes_with_act_quant_m_major(emulated, monkeypatch):
    """With Triton (the interpreter on CPU), a plain x is quantized by act_quant's m_major launch."""
    seen = []
    real = fp8_quant.act_quant

    def spy(x, m_major=False):
        seen.append(m_major)
        return real(x, m_major)

    monkeypatch.setattr(fp8_cublas, "act_quant", spy)
    x, w, s = spread_case(45, 128, 512, seed=4, device="cpu")
    with _util.poisoned_empty():
        y = cublas_fp8_linear(x, w, s, use_triton=True)
    assert seen == [True] and emulated == [(48, 128, 512)]
    _util.assert_close(y, fp8_linear_ref(x, w, s, torch.bfloat16))


def test_the_emulation_refuses_what_cublas_refuses():
    """The CPU tests above can fail: the emulated cuBLAS takes only the block-scaled layouts."""
    x, w, s = spread_case(32, 256, 512, seed=1, device="cpu")
    q, xs = quantize_act_ref(x)
    with pytest.raises(AssertionError, match="M-major"):
        emulated_scaled_mm(q, w.t(), xs, s.t(), out_dtype=torch.bfloat16)  # token-major scales
    qp, sp = fp8_cublas.m_major_operands(q, xs)
    with pytest.raises(AssertionError, match="K-major"):
        emulated_scaled_mm(qp, w.t(), sp, s.t().contiguous(), out_dtype=torch.bfloat16)  # N-major
    y = emulated_scaled_mm(qp, w.t(), sp, s.t(), out_dtype=torch.bfloat16)
    assert torch.equal(y, fp8_linear_ref(x, w, s, torch.bfloat16))


# ---- GPU: cuBLAS at real shapes --------------------------------------------------------------------

# (N, K) of the FP8 linears cuBLAS takes, TP 1: V2-Lite q_proj, kv_a, o_proj, dense and shared w13;
# V3 qkv_a, q_b, o_proj, dense w13, dense w2, shared w13, shared w2
GPU_SHAPES = [
    (3072, 2048),
    (576, 2048),
    (2048, 2048),
    (21888, 2048),
    (2816, 2048),
    (2112, 7168),
    (24576, 1536),
    (7168, 16384),
    (36864, 7168),
    (7168, 18432),
    (4096, 7168),
    (7168, 2048),
]


@pytest.mark.gpu
def test_gpu_cublas_block_scaling_is_available_here():
    """The GPU tests run on sm90 with torch >= 2.11 built with CUDA >= 12.9: the route is on."""
    assert cublas_unavailable("cuda") is None


@pytest.mark.gpu
@pytest.mark.parametrize("m", [32, 64, 256, 257])
@pytest.mark.parametrize("n, k", GPU_SHAPES)
def test_gpu_cublas_matches_the_reference(m, n, k):
    x, w, s = spread_case(m, n, k, seed=m + n + k)
    ref = _util.fp8_linear_ref64(x, w, s)
    _util.assert_close(cublas_fp8_linear(x, w, s), ref)  # act_quant (m_major), then cuBLAS
    act = Fp8Act(*fp8_quant.act_quant(x), x.dtype)  # a producer's Fp8Act: token-major scales
    _util.assert_close(cublas_fp8_linear(act, w, s), ref)


@pytest.mark.gpu
def test_gpu_cublas_takes_leading_dims_and_strided_rows():
    n, k = 2112, 7168
    x, w, s = spread_case(258, n, k, seed=3)
    ref = _util.fp8_linear_ref64(x, w, s)
    _util.assert_close(cublas_fp8_linear(x.view(2, 129, k), w, s), ref.view(2, 129, n))
    wide = torch.zeros(258, k + 256, dtype=torch.bfloat16, device="cuda")
    wide[:, 128 : 128 + k] = x
    _util.assert_close(cublas_fp8_linear(wide[:, 128 : 128 + k], w, s), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [64, 257])
def test_gpu_cublas_under_cuda_graph_capture(m):
    """Captured once (after an eager call, as the decode graphs are), replayed on new inputs: the
    bits of the eager call on the same inputs, a plain x and an Fp8Act (257 rows: padded)."""
    n, k = 3072, 2048
    x, w, s = spread_case(m, n, k, seed=m)
    act = Fp8Act(*fp8_quant.act_quant(x), x.dtype)
    eager = [cublas_fp8_linear(x, w, s), cublas_fp8_linear(act, w, s)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [cublas_fp8_linear(x, w, s), cublas_fp8_linear(act, w, s)]
    x2, _, _ = spread_case(m, n, k, seed=m + 1)
    act2 = fp8_quant.act_quant(x2)
    for src, dst in ((x2, x), (act2[0].view(torch.uint8), act.q.view(torch.uint8)), (act2[1], act.scale)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    ref2 = [cublas_fp8_linear(x2, w, s), cublas_fp8_linear(Fp8Act(*act2, x.dtype), w, s)]
    assert all(torch.equal(o, r) for o, r in zip(outs, ref2, strict=True))
    _util.assert_close(outs[0], _util.fp8_linear_ref64(x2, w, s))
    assert not any(torch.equal(o, e) for o, e in zip(outs, eager, strict=True))  # the new inputs were read
