"""The decode path of fused MoE (decode_config.py, decode.py, decode_sum.py) against fused_moe_ref,
and its routing between the decode GEMVs and the grouped GEMMs.

Without CUDA the kernel runs under TRITON_INTERPRET=1 on small shapes (set by tests/kernels/_util
before triton is imported); tests marked gpu run V2-Lite's real shapes and skip without CUDA.
The shared experts inside the decode launches (shared.py): test_moe_shared.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels import _util

needs_triton = pytest.mark.skipif(not _util.HAS_TRITON, reason="triton is not installed")
DEV = "cuda" if _util.HAS_CUDA else "cpu"

# the kernels interpreted when there is no CUDA (reloaded if a module imported them compiled)
_mods = _util.kernel_modules()
gemm_mod, config_mod, grouped_mod, moe_mod = (
    _mods[m] for m in ("fp8_gemm", "decode_config", "grouped", "fused")
)

from mlac.kernels.moe.routing import RoutingSpec, route_ref  # noqa: E402


def make_experts(e: int, d: int, i: int, fp8: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    if fp8:
        torch.manual_seed(seed)
        w13, s13 = _util.random_fp8_weight(2 * i, d, (e,), scale=0.02 / d**0.5)
        w2, s2 = _util.random_fp8_weight(d, i, (e,), scale=0.02 / i**0.5)
        return w13.to(DEV), w2.to(DEV), s13.to(DEV), s2.to(DEV)
    w13 = (torch.randn(e, 2 * i, d, generator=g) / d**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, d, i, generator=g) / i**0.5).to(torch.bfloat16)
    return w13.to(DEV), w2.to(DEV), None, None


def make_routing(t: int, e: int, top_k: int, seed: int, n_invalid: int = 0):
    """Random top-k routing; `n_invalid` pairs point at another rank's experts (ids >= E or -1)."""
    g = torch.Generator().manual_seed(seed)
    weights, ids = route_ref(torch.randn(t, e, generator=g), RoutingSpec(e, top_k, "greedy", "softmax"))
    flat = ids.view(-1)
    bad = torch.randperm(flat.numel(), generator=g)[:n_invalid]
    flat[bad] = torch.where(torch.arange(bad.numel()) % 2 == 0, e + 5, -1)
    return weights.to(DEV), ids.to(DEV)


def make_x(t: int, d: int, seed: int) -> torch.Tensor:
    return torch.randn(t, d, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).to(DEV)


def _decode_config(pairs: int, e: int, fp8: bool) -> config_mod.MoeDecodeConfig | None:
    """The default where the decode kernel takes the shape by default (one token), else the tiles
    the kernel runs such a shape with when asked (tensor cores with several rows per expert, else
    GEMM2 per token with the top-k sum): the kernel stays correct past its default's reach."""
    default = config_mod.pick_moe_decode_config(pairs, e, fp8)
    if default is not None:
        return default
    if pairs > e:
        return config_mod.MoeDecodeConfig(64, 64, 128, 1, num_warps=4, num_stages=4, dot=True)
    return config_mod.MoeDecodeConfig(32, 16, 256, 1, num_warps=8, fuse_sum=True)


def run_moe(x, w13, w2, weights, ids, s13, s2, config=None, **kw):
    if config is None:
        config = _decode_config(ids.numel(), w13.shape[0], s13 is not None)
    with _util.poisoned_empty():
        return moe_mod.fused_moe(x, w13, w2, weights, ids, s13, s2, use_triton=True, config=config, **kw)


def no_grouped_path(monkeypatch):
    """The grouped GEMMs' first launch raises: a test that passes ran the decode kernel."""

    def no_align(*args, **kwargs):
        raise AssertionError("the grouped GEMM path ran")

    monkeypatch.setattr(grouped_mod, "moe_align", no_align)


CASES = [  # T, E, top_k, D, I, invalid pairs
    (1, 8, 2, 200, 96, 0),  # K tails (D, I not multiples of the K block)
    (1, 10, 6, 256, 200, 1),  # E not a power of two, a pair of another rank
    (2, 6, 3, 256, 128, 0),  # experts hit by both tokens
    (5, 10, 6, 200, 96, 3),  # 30 pairs over 10 experts: several rows per expert, chunked by rows
    (9, 40, 4, 128, 96, 2),  # 36 pairs (> SMALL_PAIRS) over 40 experts: GEMM2 per token, rows=1
    (9, 12, 4, 128, 96, 2),  # 36 pairs over 12 experts: GEMM2 per expert, rows=4
]


@needs_triton
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("t,e,top_k,d,i,n_invalid", CASES)
def test_decode_matches_reference(t, e, top_k, d, i, n_invalid, fp8, monkeypatch):
    no_grouped_path(monkeypatch)
    w13, w2, s13, s2 = make_experts(e, d, i, fp8, seed=t * 31 + d)
    weights, ids = make_routing(t, e, top_k, seed=t + i, n_invalid=n_invalid)
    x = make_x(t, d, seed=t)
    ref = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2)
    _util.assert_close(run_moe(x, w13, w2, weights, ids, s13, s2), ref)


@needs_triton
@pytest.mark.parametrize(
    "rows,block_n,block_k,fuse_sum", [(1, 32, 128, False), (4, 64, 512, False), (2, 16, 256, True)]
)
def test_decode_configs(rows, block_n, block_k, fuse_sum, monkeypatch):
    """Other tiles: one row per pass (an expert's 5 rows take 5 passes), 4 rows, wider N blocks,
    K steps past K (512 > 256 and 160: masked 128-blocks); GEMM2 per token with the top-k sum
    where experts are shared by several tokens."""
    no_grouped_path(monkeypatch)
    t, e, top_k, d, i = 5, 3, 2, 256, 160
    w13, w2, s13, s2 = make_experts(e, d, i, True, seed=rows)
    weights, ids = make_routing(t, e, top_k, seed=rows + 1)
    x = make_x(t, d, seed=rows + 2)
    cfg = config_mod.MoeDecodeConfig(block_n, block_n, block_k, rows, num_warps=2, fuse_sum=fuse_sum)
    ref = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2)
    _util.assert_close(run_moe(x, w13, w2, weights, ids, s13, s2, cfg), ref)


@needs_triton
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize(
    "t,e,top_k,fuse_sum",
    [(2, 10, 3, True), (5, 10, 6, False), (20, 3, 2, False)],
    ids=["fused", "few", "chunked"],
)
def test_decode_tensor_cores(t, e, top_k, fuse_sum, fp8, monkeypatch):
    """The tensor-core form (dot: 16 rows a pass; 20 tokens over 3 experts take two passes)."""
    no_grouped_path(monkeypatch)
    d, i = 200, 160
    w13, w2, s13, s2 = make_experts(e, d, i, fp8, seed=t + e)
    weights, ids = make_routing(t, e, top_k, seed=t + 1, n_invalid=1)
    x = make_x(t, d, seed=t + 2)
    cfg = config_mod.MoeDecodeConfig(32, 16, 128, 1, num_warps=4, fuse_sum=fuse_sum, dot=True)
    ref = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2)
    _util.assert_close(run_moe(x, w13, w2, weights, ids, s13, s2, cfg), ref)
    if fp8 and fuse_sum:  # Fp8Act input
        x_act = gemm_mod.Fp8Act(*gemm_mod.quantize_act_ref(x), x.dtype)
        ref = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2, x_act=x_act)
        _util.assert_close(run_moe(x, w13, w2, weights, ids, s13, s2, cfg, x_act=x_act), ref)


@needs_triton
@pytest.mark.parametrize("t", [1, 5])
def test_decode_fp8_act_input(t, monkeypatch):
    """x already quantized by its producer (Fp8Act): GEMM1 reads q and scale, not x."""
    no_grouped_path(monkeypatch)
    e, top_k, d, i = 10, 4, 256, 200
    w13, w2, s13, s2 = make_experts(e, d, i, True, seed=t)
    weights, ids = make_routing(t, e, top_k, seed=t + 3)
    x = make_x(t, d, seed=t + 4)
    x_act = gemm_mod.Fp8Act(*gemm_mod.quantize_act_ref(x), x.dtype)
    ref = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2, x_act=x_act)
    out = run_moe(x, w13, w2, weights, ids, s13, s2, x_act=x_act)
    _util.assert_close(out, ref)
    # x itself is not read: a zeroed x gives the same bits
    assert torch.equal(out, run_moe(torch.zeros_like(x), w13, w2, weights, ids, s13, s2, x_act=x_act))


@needs_triton
@pytest.mark.parametrize("fuse_sum", [False, True], ids=["reduce", "fused-sum"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_decode_adds_shared_out_and_is_deterministic(fp8, fuse_sum, monkeypatch):
    no_grouped_path(monkeypatch)
    t, e, top_k, d, i = 2, 6, 3, 200, 96
    cfg = config_mod.MoeDecodeConfig(fuse_sum=fuse_sum)
    w13, w2, s13, s2 = make_experts(e, d, i, fp8, seed=5)
    weights, ids = make_routing(t, e, top_k, seed=6, n_invalid=1)
    x = make_x(t, d, seed=7)
    shared = make_x(t, d, seed=8)
    ref = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2, shared_out=shared)
    out = run_moe(x, w13, w2, weights, ids, s13, s2, cfg, shared_out=shared)
    _util.assert_close(out, ref)
    assert torch.equal(out, run_moe(x, w13, w2, weights, ids, s13, s2, cfg, shared_out=shared))


@needs_triton
def test_decode_no_local_expert_gives_shared_out(monkeypatch):
    no_grouped_path(monkeypatch)
    w13, w2, _, _ = make_experts(4, 96, 64, False, seed=1)
    x = make_x(3, 96, seed=1)
    shared = make_x(3, 96, seed=2)
    ids = torch.tensor([[4, 7], [-1, 9], [5, 4]], device=DEV)
    out = run_moe(x, w13, w2, torch.rand(3, 2, device=DEV), ids, None, None, shared_out=shared)
    assert torch.equal(out, shared)


def test_pick_decode_config_bounds():
    """One token's top-k only (measured: the grouped GEMMs win from 4 tokens on)."""
    assert config_mod.pick_moe_decode_config(6, 64, fp8=True).fuse_sum  # V2-Lite batch 1
    assert config_mod.pick_moe_decode_config(6, 64, fp8=False).dot
    assert config_mod.pick_moe_decode_config(8, 256, fp8=True) is not None  # V3 batch 1
    assert config_mod.pick_moe_decode_config(12, 64, fp8=False) is None  # batch 2
    assert config_mod.pick_moe_decode_config(192, 64, fp8=False) is None  # batch 32
    assert config_mod.pick_moe_decode_config(300, 256, fp8=True) is None  # too many pairs
    assert config_mod.pick_moe_decode_config(64 * 6, 64, fp8=True) is None  # prefill-like rows per expert
    assert config_mod.pick_moe_decode_config(40, 8, fp8=True) is None


@needs_triton
def test_a_grouped_config_runs_the_grouped_gemms_at_a_decode_shape(monkeypatch):
    """A decode shape given a grouped config (grouped.pick_moe_config) runs the grouped GEMMs."""

    def no_decode(*args, **kwargs):
        raise AssertionError("the decode kernel ran")

    monkeypatch.setattr(moe_mod, "moe_decode_gate_up", no_decode)
    w13, w2, _, _ = make_experts(8, 96, 64, False, seed=3)
    weights, ids = make_routing(1, 8, 2, seed=4)
    x = make_x(1, 96, seed=5)
    grouped = grouped_mod.pick_moe_config(ids.numel(), 8, False)
    _util.assert_close(
        run_moe(x, w13, w2, weights, ids, None, None, grouped),
        moe_mod.fused_moe_ref(x, w13, w2, weights, ids),
    )


# ---- GPU: V2-Lite's real shapes -------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 32])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_decode_v2_lite(fp8, t, monkeypatch):
    """E=64, top-6, D=2048, I=1408: the decode kernel against the reference (exact expert products)
    and against the grouped GEMMs; the same bits on a second run."""
    monkeypatch.setattr(moe_mod, "fp8_linear_ref", _util.fp8_linear_ref64)
    e, top_k, d, i = 64, 6, 2048, 1408
    w13, w2, s13, s2 = make_experts(e, d, i, fp8, seed=t)
    weights, ids = make_routing(t, e, top_k, seed=t + 1, n_invalid=t // 4)
    x = make_x(t, d, seed=t)
    # from 4 tokens on the grouped GEMMs win and the server gives them these shapes; the decode
    # kernels must still be right there (a MoeDecodeConfig asks for them)
    cfg = config_mod.pick_moe_decode_config(ids.numel(), e, fp8)
    assert (cfg is not None) == (t == 1)
    cfg = cfg or config_mod.MoeDecodeConfig(fuse_sum=fp8, dot=not fp8)
    ref = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2)
    out = run_moe(x, w13, w2, weights, ids, s13, s2, cfg)
    _util.assert_close(out, ref)
    grouped = run_moe(x, w13, w2, weights, ids, s13, s2, grouped_mod.pick_moe_config(ids.numel(), e, fp8))
    _util.assert_close(out, grouped)
    assert torch.equal(out, run_moe(x, w13, w2, weights, ids, s13, s2, cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("fuse_sum", [False, True], ids=["reduce", "fused-sum"])
def test_gpu_decode_fp8_act_v2_lite(fuse_sum, monkeypatch):
    """V2-Lite FP8 at batch 4 with the activation quantized by its producer, both GEMM2 forms."""
    monkeypatch.setattr(moe_mod, "fp8_act_linear_ref", _fp8_act_linear_ref64)
    monkeypatch.setattr(moe_mod, "fp8_linear_ref", _util.fp8_linear_ref64)
    e, top_k, d, i, t = 64, 6, 2048, 1408, 4
    w13, w2, s13, s2 = make_experts(e, d, i, True, seed=9)
    weights, ids = make_routing(t, e, top_k, seed=10)
    x = make_x(t, d, seed=11)
    x_act = gemm_mod.Fp8Act(*gemm_mod.quantize_act_ref(x), x.dtype)
    cfg = config_mod.MoeDecodeConfig(32, 16, 256, 1, num_warps=8, fuse_sum=fuse_sum)
    ref = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2, x_act=x_act)
    _util.assert_close(run_moe(x, w13, w2, weights, ids, s13, s2, cfg, x_act=x_act), ref)


def _fp8_act_linear_ref64(x_act, w, w_scale, out_dtype=None):
    """fp8_act_linear_ref with the product in float64 (exact expert products on the GPU)."""
    from mlac.core.fp8 import BLOCK, expand_block_scale

    k = x_act.q.shape[-1]
    x_deq = x_act.q.double() * x_act.scale.double().repeat_interleave(BLOCK, dim=-1)[:, :k]
    w_deq = w.double() * expand_block_scale(w_scale.double(), *w.shape)
    return (x_deq @ w_deq.t()).to(out_dtype or x_act.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 32])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_decode_in_cuda_graph(fp8, t):
    """Captured in a CUDA graph (no host sync), replayed on new routings and inputs copied into the
    captured buffers: the eager call's bits."""
    e, top_k, d, i = 64, 6, 2048, 1408
    w13, w2, s13, s2 = make_experts(e, d, i, fp8, seed=t)
    weights, ids = make_routing(t, e, top_k, seed=t + 1)
    x = make_x(t, d, seed=t + 2)

    def call():
        return moe_mod.fused_moe(x, w13, w2, weights, ids, s13, s2)

    call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for seed in (3, 4):
        new_weights, new_ids = make_routing(t, e, top_k, seed=seed + 100 * t)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        x.copy_(make_x(t, d, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, call())


def test_config_override_replaces_the_picked_tiles(setting):
    """MLAC_MOE_DECODE_CONFIG (JSON per weight kind) replaces the tiles of that kind only; anything
    else (not JSON, an unknown kind or field) is a one-line MlacError naming the variable."""
    from mlac.core.errors import MlacError

    setting(
        "MLAC_MOE_DECODE_CONFIG", '{"fp8": {"block_n1": 64, "block_n2": 16, "dot": true, "fuse_sum": true}}'
    )
    picked = config_mod.pick_moe_decode_config(6, 64, fp8=True)
    assert picked == config_mod.MoeDecodeConfig(64, 16, dot=True, fuse_sum=True)
    assert config_mod.pick_moe_decode_config(6, 64, fp8=False) == config_mod.MoeDecodeConfig(
        64, 32, 128, 1, 4, 3, dot=True
    )
    assert config_mod.config_override(None) == {} and config_mod.config_override("") == {}
    for bad in ('{"fp8": {"block_q": 1}}', "fp8:64", '{"fp16": {}}', "[1]"):
        with pytest.raises(MlacError, match="MLAC_MOE_DECODE_CONFIG") as err:
            config_mod.config_override(bad)
        assert "\n" not in str(err.value)
