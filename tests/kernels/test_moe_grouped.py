"""Fused MoE's grouped path: moe_align (align.py) and the grouped expert GEMMs (grouped.py), run
through fused_moe (fused.py) against fused_moe_ref.

Without CUDA the kernels run under TRITON_INTERPRET=1 on small shapes (set by _util before triton
is imported); tests marked gpu run V2-Lite and V3 TP-8 shapes and are skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

try:
    from tests.kernels import _util
except ImportError:  # tests/ is not a package: pytest put this folder on sys.path
    import _util

needs_triton = pytest.mark.skipif(not _util.HAS_TRITON, reason="triton is not installed")
DEV = "cuda" if _util.HAS_CUDA else "cpu"

_mods = _util.kernel_modules()
gemm_mod, align_mod, grouped_mod, moe_mod = (_mods[m] for m in ("fp8_gemm", "align", "grouped", "fused"))

from mlac.kernels.moe.routing import RoutingSpec, route_ref  # noqa: E402


def _experts(e: int, d: int, i: int, fp8: bool, seed: int, device=DEV):
    g = torch.Generator(device=device).manual_seed(seed)
    kw = dict(generator=g, device=device)
    if fp8:
        w13 = (torch.randn(e, 2 * i, d, **kw) * 64).clamp(-448, 448).to(gemm_mod.FP8)
        w2 = (torch.randn(e, d, i, **kw) * 64).clamp(-448, 448).to(gemm_mod.FP8)
        s13 = (torch.rand(e, -(-2 * i // 128), -(-d // 128), **kw) + 0.5) * (0.02 / d**0.5)
        s2 = (torch.rand(e, -(-d // 128), -(-i // 128), **kw) + 0.5) * (0.02 / i**0.5)
        return w13, w2, s13, s2
    w13 = (torch.randn(e, 2 * i, d, **kw) / d**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, d, i, **kw) / i**0.5).to(torch.bfloat16)
    return w13, w2, None, None


def _routing(t: int, e: int, top_k: int, seed: int, n_invalid: int = 0, device=DEV):
    """Random top-k routing; `n_invalid` pairs point at experts of another rank (ids >= E or -1)."""
    g = torch.Generator().manual_seed(seed)
    weights, ids = route_ref(torch.randn(t, e, generator=g), RoutingSpec(e, top_k, "greedy", "softmax"))
    flat = ids.view(-1)
    bad = torch.randperm(flat.numel(), generator=g)[:n_invalid]
    flat[bad] = torch.where(torch.arange(bad.numel()) % 2 == 0, e + 5, -1)
    return weights.to(device), ids.to(device)


def _run(x, w13, w2, weights, ids, s13, s2, config=None):
    with _util.poisoned_empty():
        return moe_mod.fused_moe(x, w13, w2, weights, ids, s13, s2, use_triton=True, config=config)


@needs_triton
@pytest.mark.parametrize(
    "t,e,top_k,block_m", [(1, 8, 2, 16), (17, 6, 3, 16), (130, 8, 2, 32), (40, 64, 6, 16)]
)
def test_moe_align(t, e, top_k, block_m):
    _, ids = _routing(t, e, top_k, seed=t + e, n_invalid=min(3, t * top_k - 1))
    with _util.poisoned_empty():
        sorted_pairs, block_expert, num_padded = align_mod.moe_align(ids, e, block_m)
    p = ids.numel()
    sorted_pairs, block_expert, total = sorted_pairs.cpu(), block_expert.cpu(), int(num_padded.item())
    flat = ids.view(-1).cpu()
    valid = (flat >= 0) & (flat < e)
    assert total % block_m == 0 and total <= sorted_pairs.numel()
    assert (sorted_pairs[total:] == p).all()
    real = sorted_pairs[:total][sorted_pairs[:total] < p].long()
    assert sorted(real.tolist()) == torch.nonzero(valid).view(-1).tolist()  # every valid pair once
    n_blocks = total // block_m
    assert (block_expert[n_blocks:] == -1).all()
    experts = block_expert[:n_blocks].repeat_interleave(block_m)
    assert (experts[:total][sorted_pairs[:total] < p] == flat[real]).all()  # pair sits with its expert
    counts = torch.bincount(flat[valid], minlength=e)
    assert total == int(((counts + block_m - 1) // block_m * block_m).sum())


CPU_CASES = [  # T, E, top_k, D, I, invalid pairs, FP8 weights
    (1, 8, 2, 96, 64, 0, False),
    (1, 8, 2, 96, 64, 0, True),
    (3, 8, 2, 200, 96, 1, False),
    (3, 8, 2, 200, 96, 1, True),
    (17, 6, 3, 200, 96, 4, False),
    (17, 6, 3, 320, 200, 4, True),
    (130, 8, 2, 96, 64, 9, False),
    (130, 8, 2, 96, 64, 9, True),
]


@needs_triton
@pytest.mark.parametrize("t,e,top_k,d,i,n_invalid,fp8", CPU_CASES)
def test_fused_moe_matches_reference(t, e, top_k, d, i, n_invalid, fp8):
    w13, w2, s13, s2 = _experts(e, d, i, fp8, seed=t * 31 + d)
    weights, ids = _routing(t, e, top_k, seed=t + i, n_invalid=n_invalid)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16).to(DEV)
    ref = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2)
    _util.assert_close(_run(x, w13, w2, weights, ids, s13, s2), ref)


@needs_triton
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_fused_moe_prefill_config(fp8):
    """The larger-tile configuration (block_m 64, 8 warps) on a small problem."""
    t, e, top_k, d, i = 40, 2, 2, 256, 128
    w13, w2, s13, s2 = _experts(e, d, i, fp8, seed=7)
    weights, ids = _routing(t, e, top_k, seed=8, n_invalid=2)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).to(DEV)
    cfg = grouped_mod.MoeConfig(64, 128, 128, 128 if fp8 else 64, num_warps=8, num_stages=3)
    ref = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2)
    _util.assert_close(_run(x, w13, w2, weights, ids, s13, s2, cfg), ref)


@needs_triton
def test_fused_moe_no_local_expert_gives_zeros():
    w13, w2, _, _ = _experts(4, 96, 64, False, seed=1)
    x = torch.randn(3, 96).to(torch.bfloat16).to(DEV)
    ids = torch.tensor([[4, 7], [-1, 9], [5, 4]], device=DEV)
    weights = torch.rand(3, 2, device=DEV)
    out = _run(x, w13, w2, weights, ids, None, None)
    assert torch.equal(out, torch.zeros_like(out))


@needs_triton
@pytest.mark.parametrize("t,n_invalid", [(1, 0), (17, 4)])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_fused_moe_adds_shared_out(t, n_invalid, fp8):
    """routed + shared_out with one rounding: the reference's float32 sum, rounded once."""
    e, top_k, d, i = 6, 3, 200, 96
    w13, w2, s13, s2 = _experts(e, d, i, fp8, seed=t + 11)
    weights, ids = _routing(t, e, top_k, seed=t + 12, n_invalid=n_invalid)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16).to(DEV)
    shared = torch.randn(t, d, generator=torch.Generator().manual_seed(t + 1)).to(torch.bfloat16).to(DEV)
    ref = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2, shared_out=shared)
    with _util.poisoned_empty():
        out = moe_mod.fused_moe(x, w13, w2, weights, ids, s13, s2, use_triton=True, shared_out=shared)
    _util.assert_close(out, ref)
    plain = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2)
    assert _util.rel_err(ref, plain) > 0.1  # shared_out really is in the sum


@needs_triton
def test_fused_moe_shared_out_without_local_experts():
    """No pair on this rank: the result is shared_out itself."""
    w13, w2, _, _ = _experts(4, 96, 64, False, seed=1)
    x = torch.randn(3, 96).to(torch.bfloat16).to(DEV)
    shared = torch.randn(3, 96).to(torch.bfloat16).to(DEV)
    ids = torch.tensor([[4, 7], [-1, 9], [5, 4]], device=DEV)
    out = moe_mod.fused_moe(x, w13, w2, torch.rand(3, 2, device=DEV), ids, use_triton=True, shared_out=shared)
    assert torch.equal(out, shared)


@needs_triton
@pytest.mark.parametrize("split_k", [2, 3])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_fused_moe_split_k(split_k, fp8):
    """Both grouped GEMMs split over K (3 K blocks in GEMM1, 2 in GEMM2: a ragged or empty last
    split), reduced by the last CTA of each tile: the result of the unsplit kernel up to float32
    summation order, and the tile counters are left zeroed."""
    t, e, top_k, d, i = 3, 8, 2, 384, 256
    w13, w2, s13, s2 = _experts(e, d, i, fp8, seed=split_k)
    weights, ids = _routing(t, e, top_k, seed=split_k + 1, n_invalid=1)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(DEV)
    cfg = grouped_mod.MoeConfig(16, 128 if fp8 else 64, 128, 128, split_k=split_k)
    ref = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2)
    out = _run(x, w13, w2, weights, ids, s13, s2, cfg)
    _util.assert_close(out, ref)
    unsplit = _run(x, w13, w2, weights, ids, s13, s2, cfg.__class__(16, cfg.block_n1, 128, 128))
    _util.assert_close(out, unsplit)
    assert not gemm_mod.split_k_locks(x.device, 1).any()


@needs_triton
def test_fused_moe_split_k_auto_at_decode():
    """split_k=0 (the FP8 decode default): split_k_for splits the GEMM whose grid is too small."""
    cfg = grouped_mod.pick_moe_config(1, 64, fp8=True)
    assert cfg.split_k == 0
    sms = gemm_mod.sm_count(torch.device(DEV))
    assert grouped_mod._split_for(cfg, 1, 1024, torch.device(DEV)) == gemm_mod.split_k_for(1, 1024, sms) > 1
    t, e, top_k, d, i = 1, 4, 1, 1024, 128
    w13, w2, s13, s2 = _experts(e, d, i, True, seed=3)
    weights, ids = _routing(t, e, top_k, seed=4)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).to(DEV)
    ref = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2)
    _util.assert_close(_run(x, w13, w2, weights, ids, s13, s2, cfg), ref)


def test_cpu_dispatch_runs_reference(monkeypatch, setting):
    setting("MLAC_FORCE_TRITON", None)

    def no_triton(*args, **kwargs):
        raise AssertionError("fused_moe picked Triton for CPU tensors")

    monkeypatch.setattr(moe_mod, "fused_moe_triton", no_triton)
    w13, w2, _, _ = _experts(4, 96, 64, False, seed=2, device="cpu")
    weights, ids = _routing(3, 4, 2, seed=3, device="cpu")
    x = torch.randn(3, 96).to(torch.bfloat16)
    out = moe_mod.fused_moe(x, w13, w2, weights, ids)
    assert torch.equal(out, moe_mod.fused_moe_ref(x, w13, w2, weights, ids))
    shared = torch.randn(3, 96).to(torch.bfloat16)
    out = moe_mod.fused_moe(x, w13, w2, weights, ids, shared_out=shared)
    assert torch.equal(out, moe_mod.fused_moe_ref(x, w13, w2, weights, ids, shared_out=shared))


# ---- GPU: real shapes -------------------------------------------------------------------------

GPU_CASES = [  # name, E, top_k, D, I, fp8
    ("v2lite-bf16", 64, 6, 2048, 1408, False),
    ("v2lite-fp8", 64, 6, 2048, 1408, True),  # decode: split-K (split_k_for) on both GEMMs
    ("v3-tp8-fp8", 256, 8, 7168, 256, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64, 300, 2048])
@pytest.mark.parametrize("name,e,top_k,d,i,fp8", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_fused_moe_real_shapes(name, e, top_k, d, i, fp8, t, monkeypatch):
    monkeypatch.setattr(moe_mod, "fp8_linear_ref", _util.fp8_linear_ref64)  # exact expert products
    w13, w2, s13, s2 = _experts(e, d, i, fp8, seed=t)
    weights, ids = _routing(t, e, top_k, seed=t + 1, n_invalid=t // 10)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16).to(DEV)
    ref = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2)
    out = _run(x, w13, w2, weights, ids, s13, s2)
    _util.assert_close(out, ref)
    assert torch.equal(out, _run(x, w13, w2, weights, ids, s13, s2))  # no race between runs
