"""MLA decode prologue in one launch: rope on q, RMSNorm + rope on the latent, the paged-cache write.

What MLAttention.project / forward and PagedKVCache.write do in about 20 small kernels:

    q[..., nope:]  = rope(q[..., nope:])                         in place, q's dtype
    latent         = weight * (rms_normalize(kv[:, :C]) in kv's dtype)   (layers.RMSNorm)
    k              = rope(kv[:, C:])                                kv's dtype
    cache[slots[t]] = [latent ‖ k]        as is, or for an FP8 cache clamp(v / kv_scale, ±max) cast

Rope is rotate-half: out = x * cos + rotate_half(x) * sin, float32 math, one rounding to the
tensor's dtype (layers.apply_rope). RMSNorm normalizes in float32, rounds to kv's dtype, then
multiplies by the weight (in kv's dtype: one more rounding). A negative slot writes nothing (a
padded token of a CUDA-graph bucket). Nothing is synced to the host and nothing is allocated:
the launch is CUDA-graph safe. `mla_prep` dispatches: Triton on CUDA, the reference on CPU.
"""

from __future__ import annotations

import torch

from mlac.kernels._triton import pdl_launch, pdl_start, tl, triton
from mlac.kernels._triton import use_triton as _use_triton

CACHE_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def _rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., R], cos / sin [T, R] -> [T, ..., R] in x's dtype (float32 math)."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    xf = x.to(torch.float32)
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos.view(shape) + torch.cat([-x2, x1], dim=-1) * sin.view(shape)).to(x.dtype)


def mla_prep_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cache: torch.Tensor,
    slots: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Pure-torch `mla_prep`: same contract (q's rope dims rotated in place, cache rows written)."""
    r = cos.shape[1]
    c = kv.shape[1] - r
    q[..., -r:] = _rope_ref(q[..., -r:], cos, sin)
    xf = kv[:, :c].to(torch.float32)
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(kv.dtype)
    entry = torch.cat([norm_weight * normed, _rope_ref(kv[:, c:], cos, sin)], dim=-1)  # [T, C + R]
    if cache.dtype in CACHE_FP8:
        m = torch.finfo(cache.dtype).max
        entry = (entry.float() / kv_scale).clamp(-m, m).to(cache.dtype).view(torch.uint8)
    keep = slots >= 0
    dst = cache.view(-1, c + r)
    dst = dst.view(torch.uint8) if cache.dtype in CACHE_FP8 else dst  # no FP8 index_copy_ on CPU
    dst.index_copy_(0, slots[keep], entry.to(dst.dtype)[keep])


# --------------------------------------------------------------------------------------------
# Triton
# --------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _rope_halves(x1, x2, c1, c2, s1, s2):
        """Rotate-half rope of the two halves (float32): (x1 c1 - x2 s1, x2 c2 + x1 s2)."""
        return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2

    @triton.jit
    def _mla_prep_kernel(
        q, kv, cos, sin, weight, cache, slots, kv_scale,
        stride_qt, stride_qh, stride_kvt, stride_ct, stride_st, stride_cache,
        H, eps,
        NOPE: tl.constexpr, C: tl.constexpr, HALF: tl.constexpr,
        BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
        FP8_CACHE: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """One program per token: its cache entry, then its q heads in tiles of BLOCK_H."""
        pdl_start(PDL)
        t = tl.program_id(0).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_HALF)
        mask_d = offs_d < HALF
        c1 = tl.load(cos + t * stride_ct + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        c2 = tl.load(cos + t * stride_ct + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        s1 = tl.load(sin + t * stride_st + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        s2 = tl.load(sin + t * stride_st + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)

        # latent = weight * round(rms_normalize(kv[:C])), k = rope(kv[C:]), both rounded to kv's dtype
        dtype = kv.dtype.element_ty
        row = kv + t * stride_kvt
        offs_c = tl.arange(0, BLOCK_C)
        mask_c = offs_c < C
        x = tl.load(row + offs_c, mask=mask_c, other=0.0).to(tl.float32)  # [BLOCK_C], 0 past C
        normed = (x * tl.math.rsqrt(tl.sum(x * x, 0) / C + eps)).to(dtype).to(tl.float32)
        w = tl.load(weight + offs_c, mask=mask_c, other=0.0).to(tl.float32)
        latent = (normed * w).to(dtype).to(tl.float32)
        k1 = tl.load(row + C + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        k2 = tl.load(row + C + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        k1, k2 = _rope_halves(k1, k2, c1, c2, s1, s2)
        k1, k2 = k1.to(dtype).to(tl.float32), k2.to(dtype).to(tl.float32)

        slot = tl.load(slots + t).to(tl.int64)
        if slot >= 0:
            if FP8_CACHE:  # PagedKVCache.write: clamp(v / scale, ±max) in float32, then cast
                scale = tl.load(kv_scale)
                latent = tl.clamp(tl.math.div_rn(latent, scale), -FP8_MAX, FP8_MAX)
                k1 = tl.clamp(tl.math.div_rn(k1, scale), -FP8_MAX, FP8_MAX)
                k2 = tl.clamp(tl.math.div_rn(k2, scale), -FP8_MAX, FP8_MAX)
            dst = cache + slot * stride_cache
            out_ty = cache.dtype.element_ty
            tl.store(dst + offs_c, latent.to(out_ty), mask=mask_c)
            tl.store(dst + C + offs_d, k1.to(out_ty), mask=mask_d)
            tl.store(dst + C + HALF + offs_d, k2.to(out_ty), mask=mask_d)

        # q's rope dims, in place: each element is read before it is written, by this program
        mask_rope = mask_d[None, :]
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mask = (offs_h < H)[:, None] & mask_rope
            ptrs = q + t * stride_qt + offs_h[:, None] * stride_qh + NOPE + offs_d[None, :]  # [BH, HALF]
            x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
            o1, o2 = _rope_halves(x1, x2, c1[None, :], c2[None, :], s1[None, :], s2[None, :])
            tl.store(ptrs, o1.to(q.dtype.element_ty), mask=mask)
            tl.store(ptrs + HALF, o2.to(q.dtype.element_ty), mask=mask)


def _check_args(q, kv, cos, sin, norm_weight, cache, slots, kv_scale) -> tuple[int, int]:
    """Shapes, strides and dtypes of `mla_prep`; returns (C, R)."""
    t, _, qd = q.shape
    r = cos.shape[1]
    c = kv.shape[1] - r
    assert r % 2 == 0 and qd >= r and c > 0, f"q {tuple(q.shape)}, kv {tuple(kv.shape)}, rope {r}"
    assert kv.shape[0] == t and cos.shape == sin.shape == (t, r), (q.shape, kv.shape, cos.shape, sin.shape)
    assert q.stride(-1) == kv.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1, "last dims contiguous"
    assert cos.dtype == sin.dtype == torch.float32, (cos.dtype, sin.dtype)
    assert norm_weight.shape == (c,) and norm_weight.is_contiguous(), (tuple(norm_weight.shape), c)
    assert norm_weight.dtype == kv.dtype, f"norm weight {norm_weight.dtype} vs kv {kv.dtype}"
    assert cache.dim() == 3 and cache.shape[2] == c + r and cache.is_contiguous(), tuple(cache.shape)
    assert slots.shape == (t,) and not slots.is_floating_point() and slots.is_contiguous(), slots.shape
    if cache.dtype in CACHE_FP8:
        assert kv_scale is not None and kv_scale.numel() == 1 and kv_scale.dtype == torch.float32
    else:
        assert cache.dtype == kv.dtype, f"a {cache.dtype} cache for {kv.dtype} latents"
    for other in (kv, cos, sin, norm_weight, cache, slots):
        assert other.device == q.device, (other.device, q.device)
    return c, r


def mla_prep_triton(
    q: torch.Tensor,
    kv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cache: torch.Tensor,
    slots: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Triton `mla_prep` (one launch, one program per token); contract as `mla_prep`."""
    c, r = _check_args(q, kv, cos, sin, norm_weight, cache, slots, kv_scale)
    t, h, qd = q.shape
    if t == 0:
        return
    fp8 = cache.dtype in CACHE_FP8
    half = r // 2
    _mla_prep_kernel[(t,)](
        q, kv, cos, sin, norm_weight, cache, slots, kv_scale if fp8 else cos,
        q.stride(0), q.stride(1), kv.stride(0), cos.stride(0), sin.stride(0), cache.stride(1),
        h, eps,
        NOPE=qd - r, C=c, HALF=half,
        BLOCK_C=triton.next_power_of_2(c), BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_H=min(triton.next_power_of_2(h), 16),
        FP8_CACHE=fp8, FP8_MAX=torch.finfo(cache.dtype).max if fp8 else 0.0,
        num_warps=4, **pdl_launch(),
    )  # fmt: skip


def mla_prep(
    q: torch.Tensor,
    kv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cache: torch.Tensor,
    slots: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    use_triton: bool | None = None,
) -> None:
    """Rope q in place and write [RMSNorm(latent) ‖ rope(k)] into the paged cache, for T tokens.

    q [T, H, nope + R] (q's dtype; a strided view, last dim contiguous): its last R dims rotated
    in place. kv [T, C + R] (a strided view, last dim contiguous): latent kv[:, :C], key kv[:, C:].
    cos / sin [T, R] float32; norm_weight [C] in kv's dtype; eps the RMSNorm epsilon.
    cache [num_blocks, block_size, C + R] contiguous, kv's dtype or float8_e4m3fn / float8_e5m2
    (then kv_scale [1] float32 divides, as PagedKVCache.write); slots [T] int64 flat token slots
    (block * block_size + offset), a negative slot writes nothing. Returns None.
    """
    if _use_triton(q, use_triton):
        mla_prep_triton(q, kv, cos, sin, norm_weight, eps, cache, slots, kv_scale)
    else:
        _check_args(q, kv, cos, sin, norm_weight, cache, slots, kv_scale)
        mla_prep_ref(q, kv, cos, sin, norm_weight, eps, cache, slots, kv_scale)


__all__ = ["mla_prep", "mla_prep_ref", "mla_prep_triton"]
