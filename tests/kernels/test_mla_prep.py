"""mla_prep (q rope in place, latent RMSNorm + k rope, paged-cache write): Triton against the reference.

q and kv are strided views of one wider projection output, as in the model. The cache starts
poisoned (NaN): rows that are not written must keep their exact bits, written rows must be finite.

Tolerances: the kernel and the reference compute the same float32 formulas; the sum of squares
(summation order) and rsqrt may differ in the last bits, which can move a value across one
rounding boundary of the stored dtype. float32: 1e-5 relative; bf16: one bf16 step (2^-7
relative); FP8: one e4m3 step (2^-3 relative, or the subnormal spacing 2^-9 times the scale).
"""

from __future__ import annotations

import pytest
import torch

from mlac.kernels.attention import mla_prep as prep

BF16, F32, E4M3 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
BLOCK_SIZE = 4


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def make_inputs(t, h, nope, c, r, dtype, cache_dtype, device, seed=0):
    """q [T, H, nope + R] and kv [T, C + R] as views of one projection [T, H*(nope+R) + C + R + 8]."""
    width = h * (nope + r) + c + r + 8
    proj = randn(t, width, seed=seed, scale=2.0).to(dtype).to(device)
    q = proj[:, : h * (nope + r)].view(t, h, nope + r)
    kv = proj[:, h * (nope + r) : h * (nope + r) + c + r]
    f = randn(t, r // 2, seed=seed + 1, scale=3.0)
    cos, sin = torch.cat([f.cos(), f.cos()], -1).to(device), torch.cat([f.sin(), f.sin()], -1).to(device)
    weight = (1 + randn(c, seed=seed + 2, scale=0.3)).to(dtype).to(device)
    num_blocks = (2 * t + 1) // BLOCK_SIZE + 2
    cache = torch.full((num_blocks, BLOCK_SIZE, c + r), float("nan"), device=device).to(cache_dtype)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=torch.Generator().manual_seed(seed))[:t]
    scale = torch.tensor([0.05], device=device) if cache_dtype == E4M3 else None
    return proj, q, kv, cos, sin, weight, cache, slots.to(device), scale


def close(out, ref):
    """out and ref: tensors of one dtype (the cache's, or q's)."""
    assert torch.isfinite(out.float()).all(), "non-finite value: a row or element was not written"
    if out.dtype == F32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    elif out.dtype == BF16:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-5)
    else:  # e4m3 values, compared in stored units: one step is 2^-3 relative, 2^-9 absolute
        o, rf = out.float(), ref.float()
        assert ((o - rf).abs() <= rf.abs() / 8 + 2**-9).all()
        same = (out.view(torch.uint8) == ref.view(torch.uint8)).float().mean().item()
        assert same > 0.97, f"only {same:.3f} of the fp8 values are bit-identical"


def check_cache(cache, ref_cache, slots):
    """Written rows close to the reference's; every other row still holds the poison, bit for bit."""
    flat, ref_flat = cache.view(-1, cache.shape[-1]), ref_cache.view(-1, cache.shape[-1])
    close(flat[slots], ref_flat[slots])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[untouched].view(torch.uint8), ref_flat[untouched].view(torch.uint8))
    assert flat[untouched].float().isnan().all()


def run_both(t, h, nope, c, r, dtype, cache_dtype, device, seed=0):
    args = make_inputs(t, h, nope, c, r, dtype, cache_dtype, device, seed)
    proj, q, kv, cos, sin, weight, cache, slots, scale = args
    ref = [a.cpu().clone() if isinstance(a, torch.Tensor) else a for a in args]
    ref_proj, ref_cache = ref[0], ref[6]
    ref_q = ref_proj[:, : h * (nope + r)].view(t, h, nope + r)
    ref_kv = ref_proj[:, h * (nope + r) : h * (nope + r) + c + r]
    prep.mla_prep(q, kv, cos, sin, weight, 1e-6, cache, slots, scale, use_triton=True)
    prep.mla_prep_ref(ref_q, ref_kv, ref[3], ref[4], ref[5], 1e-6, ref_cache, ref[7], ref[8])
    return proj.cpu(), ref_proj, cache.cpu(), ref_cache, slots.cpu()


@pytest.mark.parametrize("t", [1, 3, 17])
@pytest.mark.parametrize("h", [1, 4])
@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [(BF16, BF16), (BF16, E4M3), (F32, F32), (F32, E4M3)],
    ids=["bf16", "bf16-fp8", "f32", "f32-fp8"],
)
def test_mla_prep_matches_reference(triton_device, t, h, dtype, cache_dtype):
    nope, c, r = 8, 32, 16
    proj, ref_proj, cache, ref_cache, slots = run_both(
        t, h, nope, c, r, dtype, cache_dtype, triton_device, t * h
    )
    q_end = h * (nope + r)
    q, ref_q = proj[:, :q_end].view(t, h, -1), ref_proj[:, :q_end].view(t, h, -1)
    assert torch.equal(q[..., :nope], ref_q[..., :nope])  # nope dims untouched
    close(q[..., nope:], ref_q[..., nope:])
    assert torch.equal(proj[:, q_end:], ref_proj[:, q_end:])  # kv and the rest of the projection untouched
    check_cache(cache, ref_cache, slots)


@pytest.mark.parametrize("cache_dtype", [BF16, E4M3], ids=["bf16", "fp8"])
def test_mla_prep_odd_sizes(triton_device, cache_dtype):
    """C + R not a power of two (C = 40, R = 12), no nope dims, three heads (a partial head tile)."""
    t, h, nope, c, r = 5, 3, 0, 40, 12
    proj, ref_proj, cache, ref_cache, slots = run_both(t, h, nope, c, r, BF16, cache_dtype, triton_device, 9)
    close(proj[:, : h * r], ref_proj[:, : h * r])
    assert torch.equal(proj[:, h * r :], ref_proj[:, h * r :])
    check_cache(cache, ref_cache, slots)


def test_mla_prep_fp8_clamps_to_finite_max(triton_device):
    """Values beyond the e4m3 range times the scale saturate at ±448 (a bare cast would give NaN)."""
    proj, q, kv, cos, sin, weight, cache, slots, _ = make_inputs(3, 1, 0, 32, 16, BF16, E4M3, triton_device)
    tiny = torch.tensor([1e-4], device=triton_device)
    prep.mla_prep(q, kv, cos, sin, weight, 1e-6, cache, slots, tiny, use_triton=True)
    written = cache.view(-1, 48)[slots].float()
    assert torch.isfinite(written).all() and written.abs().max().item() == 448.0


def test_mla_prep_negative_slot_writes_nothing(triton_device):
    proj, q, kv, cos, sin, weight, cache, slots, _ = make_inputs(3, 2, 8, 32, 16, BF16, BF16, triton_device)
    slots[1] = -1
    prep.mla_prep(q, kv, cos, sin, weight, 1e-6, cache, slots, use_triton=True)
    flat = cache.view(-1, 48).cpu()
    assert torch.isfinite(flat[slots[[0, 2]].cpu()]).all()
    assert int(torch.isfinite(flat).all(-1).sum()) == 2


def test_mla_prep_rejects_bad_arguments():
    proj, q, kv, cos, sin, weight, cache, slots, _ = make_inputs(3, 2, 8, 32, 16, BF16, E4M3, "cpu")
    with pytest.raises(AssertionError):  # an FP8 cache needs its scale
        prep.mla_prep(q, kv, cos, sin, weight, 1e-6, cache, slots)
    with pytest.raises(AssertionError, match="norm weight"):
        prep.mla_prep(q, kv, cos, sin, weight.float(), 1e-6, cache, slots, torch.ones(1))


def test_cpu_dispatch_runs_reference(monkeypatch, setting):
    setting("MLAC_FORCE_TRITON", None)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def no_triton(*args, **kwargs):
        raise AssertionError("mla_prep picked Triton for CPU tensors")

    monkeypatch.setattr(prep, "mla_prep_triton", no_triton)
    a = make_inputs(5, 2, 8, 32, 16, BF16, BF16, "cpu", seed=3)
    b = [x.clone() if isinstance(x, torch.Tensor) else x for x in a]
    b_q = b[0][:, : 2 * 24].view(5, 2, 24)
    b_kv = b[0][:, 48:96]
    prep.mla_prep(a[1], a[2], a[3], a[4], a[5], 1e-6, a[6], a[7])
    prep.mla_prep_ref(b_q, b_kv, b[3], b[4], b[5], 1e-6, b[6], b[7])
    assert torch.equal(a[0], b[0])
    assert torch.equal(a[6].view(torch.uint8), b[6].view(torch.uint8))


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_reference_is_what_the_model_does(kv_dtype):
    """mla_prep_ref == MLAttention.project's rope / kv_norm / cat, then PagedKVCache.write: bit for bit."""
    from types import SimpleNamespace

    from mlac.runtime.kvcache.paged import PagedKVCache
    from mlac.runtime.model.layers import RMSNorm, Weights, apply_rope

    t, h, nope, c, r = 6, 2, 8, 32, 16
    cache_dtype = E4M3 if kv_dtype == "fp8_e4m3" else BF16
    proj, q, kv, cos, sin, weight, _, slots, _ = make_inputs(t, h, nope, c, r, BF16, cache_dtype, "cpu", 4)
    config = SimpleNamespace(kv_latent_dim=c + r, num_hidden_layers=1)
    model_cache = PagedKVCache(config, num_blocks=5, block_size=BLOCK_SIZE, kv_dtype=kv_dtype, kv_scale=0.05)
    ref_cache = model_cache.layers[0].clone()
    q_rope = apply_rope(q[..., nope:], cos, sin)
    norm = RMSNorm(Weights({"w": weight}), "w", 1e-6)
    model_cache.write(0, slots, torch.cat([norm(kv[:, :c]), apply_rope(kv[:, c:], cos, sin)], -1))
    prep.mla_prep_ref(q, kv, cos, sin, weight, 1e-6, ref_cache, slots, model_cache.kv_scale(0))
    assert torch.equal(q[..., nope:], q_rope)
    assert torch.equal(ref_cache.view(torch.uint8), model_cache.layers[0].view(torch.uint8))
