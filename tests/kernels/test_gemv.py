"""Skinny decode GEMM (kernels/gemm/gemv.py): the Triton kernel against its pure-torch reference, its
configs and where it applies (gemv_configs.py), and Linear's dispatch to it.

Without CUDA the kernel runs under TRITON_INTERPRET=1 on small shapes (set by _util and this
folder's conftest before triton is imported); tests marked gpu run V2-Lite's real shapes.
"""

from __future__ import annotations

import importlib

import pytest
import torch

try:
    from tests.kernels import _util
except ImportError:  # tests/ is not a package: pytest put this folder on sys.path
    import _util

from mlac.kernels.fp8_quant import Fp8Act
from mlac.kernels.gemm import gemv_configs as configs

needs_triton = pytest.mark.skipif(not _util.HAS_TRITON, reason="triton is not installed")
DEV = "cuda" if _util.HAS_CUDA else "cpu"


def _gemv_module():
    """mlac.kernels.gemm.gemv, interpreted when there is no CUDA (reloaded after _util's reloads)."""
    _util.kernel_modules()
    mod = importlib.import_module("mlac.kernels.gemm.gemv")
    if _util.HAS_TRITON and not _util.HAS_CUDA:
        mod = importlib.reload(mod)
    return mod


gemv = _gemv_module()
Cfg = configs.SkinnyConfig


def _x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * (1 + torch.rand(m, 1, generator=g) * 4)).to(dtype).to(DEV)


def _dense_w(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    return (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEV)


def _fp8_w(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    w, s = _util.random_fp8_weight(n, k)
    return w.to(DEV), s.to(DEV)


def _act(x: torch.Tensor, dtype: torch.dtype) -> Fp8Act:
    from mlac.kernels.gemm.fp8_gemm import quantize_act_ref

    q, s = quantize_act_ref(x.cpu())
    return Fp8Act(q.to(x.device), s.to(x.device), dtype)


def _run(x, w, s=None, cfg=None):
    with _util.poisoned_empty():  # an output element or partial left unwritten shows as NaN
        return gemv.skinny_linear(x, w, s, cfg)


DENSE_CONFIGS = [
    None,  # default_config
    Cfg(32, 128),  # CUDA cores
    Cfg(16, 64, split_k=3),  # ragged last split
    Cfg(32, 128, dot=True),  # tensor cores, M padded to 16
    Cfg(64, 64, split_k=2, dot=True),
]
FP8_CONFIGS = [
    None,
    Cfg(32, 128),
    Cfg(16, 128, split_k=2),
    Cfg(64, 128, dot=True),
    Cfg(128, 128, split_k=3, dot=True),
]


@needs_triton
@pytest.mark.parametrize("cfg", DENSE_CONFIGS)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(200, 256), (72, 320)])  # N off the block; K a multiple of 128 and not
def test_dense_matches_reference(cfg, m, n, k):
    x, w = _x(m, k, torch.float16, seed=m + n), _dense_w(n, k, torch.float16, seed=k)
    _util.assert_close(_run(x, w, cfg=cfg), gemv.skinny_linear_ref(x, w))


@needs_triton
def test_dense_bf16_and_leading_dims():
    x, w = _x(6, 320, torch.bfloat16, seed=1).view(2, 3, 320), _dense_w(96, 320, torch.bfloat16, seed=2)
    out = _run(x, w, cfg=Cfg(32, 128, split_k=2))
    assert out.shape == (2, 3, 96)
    _util.assert_close(out, gemv.skinny_linear_ref(x, w))


@needs_triton
@pytest.mark.parametrize("cfg", FP8_CONFIGS)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(200, 256), (96, 200)])
def test_fp8_act_matches_reference(cfg, m, n, k):
    """Fp8Act input with a float32 output: only the summation order differs from the reference."""
    w, s = _fp8_w(n, k, seed=m * 7 + n)
    x_act = _act(_x(m, k, torch.float32, seed=n + k), torch.float32)
    _util.assert_close(_run(x_act, w, s, cfg), gemv.skinny_linear_ref(x_act, w, s))


@needs_triton
@pytest.mark.parametrize("cfg", FP8_CONFIGS)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_fp8_float_input_quantized_in_kernel(cfg, m):
    """A float x is quantized inside the kernel with quantize_act_ref's arithmetic: float32 out at
    float32 tolerance (a different e4m3 rounding of any element would show far above it)."""
    w, s = _fp8_w(200, 200, seed=m)
    x = _x(m, 200, torch.float32, seed=m + 5)
    x[0, :4] = torch.tensor([-0.0, 1e-6, -1e-6, 0.0])
    _util.assert_close(_run(x, w, s, cfg), gemv.skinny_linear_ref(x, w, s))


@needs_triton
def test_fp8_bf16_input_and_matches_fp8_linear():
    from mlac.kernels.gemm.fp8_gemm import fp8_linear_ref

    w, s = _fp8_w(160, 384, seed=3)
    x = _x(5, 384, torch.bfloat16, seed=4)
    out = _run(x, w, s, Cfg(32, 128, split_k=2))
    assert out.dtype == torch.bfloat16
    _util.assert_close(out, fp8_linear_ref(x, w, s, torch.bfloat16))


@needs_triton
def test_split_k_counters_stay_zero_between_launches():
    x, w = _x(4, 512, torch.float16, seed=9), _dense_w(48, 512, torch.float16, seed=9)
    cfg = Cfg(16, 64, split_k=4)
    first, second = _run(x, w, cfg=cfg), _run(x, w, cfg=cfg)
    assert torch.equal(first, second)  # a counter left non-zero would skip or repeat the reduction


def test_configs_cover_the_kernel_constraints():
    """default_config gives block_k 128 and block_n | 128 for FP8, and a split that leaves every
    split at least one K step, for V2-Lite and V3 shapes at every M."""
    for n, k in [(576, 2048), (3072, 2048), (21888, 2048), (2048, 10944), (24576, 1536), (7168, 16384)]:
        for m in range(1, configs.MAX_ROWS + 1):
            for kind in ("bf16", "fp8"):
                cfg = configs.default_config(kind, n, k, m, sms=132)
                assert cfg.dot == (m > 4)
                assert -(-k // cfg.block_k) >= cfg.split_k >= 1
                if kind == "fp8":
                    assert cfg.block_k == 128 and 128 % cfg.block_n == 0, cfg
    assert configs.default_config("bf16", 576, 2048, 1, sms=132).split_k > 1  # N alone gives few programs
    assert configs.default_config("bf16", 21888, 2048, 1, sms=132).split_k == 1
    assert [configs.m_class(m) for m in (1, 2, 4, 5, 16)] == [1, 4, 4, 16, 16]


def _tuned_fp8(monkeypatch, n: int, k: int, m: int) -> None:
    """An FP8 shape the skinny GEMM takes: FP8 goes to it only where TUNED holds a config."""
    monkeypatch.setitem(configs.TUNED, ("fp8", n, k, m), configs.default_config("fp8", n, k, m, 4))


def test_skinny_applies(monkeypatch):
    _tuned_fp8(monkeypatch, 96, 256, 16)
    w, s = _fp8_w(96, 256, seed=0)
    wd = _dense_w(96, 256, torch.bfloat16, seed=0)
    x16, x17 = _x(16, 256, torch.bfloat16, seed=0), _x(17, 256, torch.bfloat16, seed=0)
    assert configs.skinny_applies(x16, wd, None) and not configs.skinny_applies(x17, wd, None)
    assert configs.skinny_applies(x16.view(2, 8, 256), wd, None)
    assert configs.skinny_applies(x16, w, s) and configs.skinny_applies(_act(x16, torch.bfloat16), w, s)
    assert not configs.skinny_applies(_act(x17, torch.bfloat16), w, s)
    monkeypatch.setattr(configs, "TUNED", {})  # an FP8 shape TUNED does not hold: fp8_gemm
    assert not configs.skinny_applies(x16, w, s) and not configs.skinny_applies(
        _act(x16, torch.bfloat16), w, s
    )
    assert not configs.skinny_applies(x16.float(), wd, None)  # dense needs x in W's dtype
    assert not configs.skinny_applies(_act(x16, torch.bfloat16), wd, None)


def test_skinny_declines_shapes_measured_slower():
    """bf16: TUNED None (cuBLAS measured faster on the H200) sends a shape back to cuBLAS; a
    measured win, and an unmeasured shape, take the skinny GEMM. FP8: only a shape with a config
    in TUNED takes it (none today)."""
    slower = torch.zeros(3072, 2048, dtype=torch.bfloat16)  # V2-Lite q_proj: cuBLAS won at M = 1
    faster = torch.zeros(576, 2048, dtype=torch.bfloat16)  # V2-Lite kv_a: skinny won
    x = torch.zeros(1, 2048, dtype=torch.bfloat16)
    assert configs.TUNED[("bf16", 3072, 2048, 1)] is None and not configs.skinny_applies(x, slower, None)
    assert configs.TUNED[("bf16", 576, 2048, 1)] is not None and configs.skinny_applies(x, faster, None)
    assert ("bf16", 640, 2048, 1) not in configs.TUNED
    assert configs.skinny_applies(x, torch.zeros(640, 2048, dtype=torch.bfloat16), None)
    w8, s8 = _fp8_w(640, 2048, seed=0)  # FP8: not unless TUNED holds a config for the shape
    assert ("fp8", 640, 2048, 1) not in configs.TUNED and not configs.skinny_applies(x, w8, s8)
    assert configs.TUNED[("fp8", 576, 2048, 1)] is None
    assert not configs.skinny_applies(x, *_fp8_w(576, 2048, seed=0))


# ---- Linear's dispatch -------------------------------------------------------------------------


def _linear(fp8: bool):
    from mlac.runtime.model.layers import Linear, Weights

    if fp8:
        w, s = _fp8_w(96, 256, seed=1)
        return Linear(Weights({"w": w, "w.scale": s}), "w")
    return Linear(Weights({"w": _dense_w(96, 256, torch.bfloat16, seed=1)}), "w")


@pytest.fixture
def spy(monkeypatch):
    """Calls of layers.skinny_linear (which then runs the interpreted kernel); the other paths are
    replaced by the references so that only the choice is tested."""
    from mlac.kernels.gemm.fp8_gemm import fp8_linear_ref
    from mlac.runtime.model import layers

    calls = []

    def skinny(x, w, scale=None):
        calls.append(tuple((x.q if isinstance(x, Fp8Act) else x).shape))
        return gemv.skinny_linear(x, w, scale)

    monkeypatch.setattr(layers, "skinny_linear", skinny)
    monkeypatch.setattr(layers, "fp8_linear", lambda x, w, s, out_dtype: fp8_linear_ref(x, w, s, out_dtype))
    return calls


@needs_triton
@pytest.mark.parametrize("fp8", [False, True])
def test_linear_picks_skinny_up_to_16_rows(spy, monkeypatch, fp8, setting):
    setting("MLAC_FORCE_TRITON", "1")  # the Triton path on CPU tensors (interpreter)
    _tuned_fp8(monkeypatch, 96, 256, 16)
    lin = _linear(fp8)
    x16 = _x(16, 256, torch.bfloat16, seed=2).view(2, 8, 256)
    y = lin(x16)
    assert spy == [(2, 8, 256)] and y.shape == (2, 8, 96)
    _util.assert_close(y, gemv.skinny_linear_ref(x16, lin.weight, lin.scale))
    x17 = _x(17, 256, torch.bfloat16, seed=3)
    assert lin(x17).shape == (17, 96) and len(spy) == 1
    if fp8:
        lin(_act(x16.view(16, 256), torch.bfloat16))
        assert spy[-1] == (16, 256)


@pytest.mark.parametrize("fp8", [False, True])
def test_linear_keeps_reference_on_cpu_and_where_declined(spy, monkeypatch, fp8, setting):
    """CPU tensors take F.linear / the FP8 reference; on the device, a shape the table declines
    (bf16: TUNED None; FP8: no config) keeps cuBLAS / fp8_gemm."""
    setting("MLAC_FORCE_TRITON", None)
    lin, x = _linear(fp8), _x(1, 256, torch.bfloat16, seed=4).cpu()
    if DEV == "cpu":
        lin(x)
        assert spy == []  # CPU tensors: F.linear / the FP8 reference
    monkeypatch.setitem(configs.TUNED, ("bf16", 96, 256, 1), None)
    lin.to(DEV)(x.to(DEV))
    assert spy == []


# ---- GPU: V2-Lite's real shapes ------------------------------------------------------------------

V2_LITE_SHAPES = [
    (3072, 2048),
    (576, 2048),
    (2048, 2048),
    (2816, 2048),
    (2048, 1408),
    (21888, 2048),
    (2048, 10944),
]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("n,k", V2_LITE_SHAPES)
def test_gpu_real_shapes(m, n, k):
    x = _x(m, k, torch.bfloat16, seed=m + n + k)
    w = _dense_w(n, k, torch.bfloat16, seed=n)
    _util.assert_close(_run(x, w), gemv.skinny_linear_ref(x, w))
    w8, s = _fp8_w(n, k, seed=n + k)
    _util.assert_close(_run(x, w8, s), _util.fp8_linear_ref64(x, w8, s))
    x_act = _act(x, torch.bfloat16)
    _util.assert_close(_run(x_act, w8, s), _util.fp8_linear_ref64(x, w8, s))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_cuda_graph_replays_match_eager(fp8):
    """Captured with split-K (counters allocated by the eager warm-up), replayed twice: the same
    bits as the eager call each time (the counters are left zeroed by every launch)."""
    n, k, cfg = 576, 2048, Cfg(32, 128, split_k=4)
    x = _x(1, k, torch.bfloat16, seed=1)
    w, s = _fp8_w(n, k, seed=1) if fp8 else (_dense_w(n, k, torch.bfloat16, seed=1), None)
    eager = gemv.skinny_linear(x, w, s, cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv.skinny_linear(x, w, s, cfg)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, eager)
