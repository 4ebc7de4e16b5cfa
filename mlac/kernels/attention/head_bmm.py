"""Batched-over-heads matmul of MLA's absorbed decode: out[b, h, :] = x[b, h, :] @ w[h].

    x      [B, H, K]  bf16/fp16; a strided view is fine (q_nope out of q) if the last dim is contiguous
    w      [H, K, N]  x's dtype, or e4m3 with
    w_scale [H, ceil(K/128), ceil(N/128)] float32 block scales (multiply to dequantize)
    out    [B, H, N]  x's dtype, contiguous

The two uses, per layer (einsum subscripts of mlac.runtime.model.model.MLAAttention.decode):

    q_lat = head_bmm(q_nope, w_kc)    "bhd,hdc->bhc"   w_kc [H, nope=128, kv_lora=512]
    out   = head_bmm(o_lat, w_vc)     "bhc,hcv->bhv"   w_vc [H, kv_lora=512, v=128]

One Triton kernel serves three weight/activation formats with the same tiling, so that they can be
measured against each other (benchmarks/kernels/head_bmm.py):

- bf16: w in x's dtype, float32 accumulation.
- W8A16 (`w_scale` given): e4m3 weight tiles widened to x's dtype in registers (exact: every e4m3
  value is a bf16/fp16 value), multiplied with the unquantized activations, and each 128-wide K
  block's partial product scaled by its weight block scale in float32. This equals x @ dequant(w)
  up to float32 summation order; the only error FP8 adds is the weight's own quantization.
- W8A8 (`w_scale` and `quant_act=True`): activations also quantized in the kernel, per (token,
  head) per 128 channels exactly like `fp8_gemm.quantize_act_ref`, and an e4m3 x e4m3 dot.
  Adds the activations' quantization error to the weights'.

W8A16 is the FP8 form `head_bmm` runs unless W8A8 is asked for: half the FP8 error (measured on
Gaussian weights: rel_l2 2.6e-2 against 3.7e-2; bf16 output rounding alone is 1.7e-3).
For an FP8 source checkpoint (V3, R1) kv_b's 128x128 blocks map one to one onto these per-head
blocks (each head's nope rows and v rows are one block row each), so FP8 w_kc / w_vc can carry the
source's bits and scales unchanged: no error beyond the checkpoint's own.

Two fusions around the v-absorb (`head_bmm(o_lat, w_vc)`) remove a launch each from the decode:

- x may be mla_decode's unmerged split-KV partials (`SplitKV`, from `mla_decode(merge=False)`):
  the x tile is then merged while it is loaded, by the merge kernel's own Triton helpers
  (split_kv.merge_weights / merge_splits) and rounded to o_lat's dtype as its store does, so the
  result is bit for bit that of the merge kernel followed by head_bmm (same config).
- `quant_out=True` (the FP8 o_proj reads the output): with N % 128 == 0 each program owns whole
  128-wide groups of one head, which are exactly the quantization groups of o_proj's input
  [B, H*N], so the epilogue writes `Fp8Act` (e4m3 [B, H*N] and scales [B, H*N/128]) with the bits
  of `quantize_act_ref` of the output rounded to x's dtype.

Grid: (N tiles, B tiles, H); the N tiles of one (B tile, head) are adjacent, so they share the x
rows in L2. Decode (B <= 64) uses 16-row tiles; CONFIGS holds the defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mlac.core.fp8 import BLOCK, FP8, FP8_MAX, dequantize_blocks, quantize_blocks
from mlac.kernels._triton import HAS_TRITON, pdl_launch, pdl_start, tl, triton
from mlac.kernels._triton import use_triton as _use_triton
from mlac.kernels.attention.split_kv import SplitKV, merge_ref
from mlac.kernels.fp8_quant import Fp8Act, cast_out, interpreting, quant_groups, round_e4m3
from mlac.kernels.gemm.fp8_gemm import quantize_act_ref

if HAS_TRITON:
    from mlac.kernels.attention.split_kv import merge_splits, merge_weights, used_splits


@dataclass(frozen=True)
class HeadBmmConfig:
    """Tile shape and launch options. With FP8 weights block_k divides 128 and block_n divides
    128 or is a multiple of it (a tile never straddles a scale block along K); W8A8 needs
    block_k == 128 (one activation scale per tile row and K step)."""

    block_m: int
    block_n: int
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    # x as split partials: splits whose [block_m, block_k] float32 tiles are loaded at once (the
    # merge's latency against registers; large tiles at large B, where there are few splits: 2)
    merge_chunk: int = 8


CONFIGS = {
    "decode": HeadBmmConfig(16, 64, 128, num_warps=4, num_stages=3),  # B <= 64: stream the weights
    # B <= 64, a program per (head, 128 outputs): merges split-KV partials once per head, and owns
    # the 128-channel quantization groups of quant_out
    "decode_heads": HeadBmmConfig(16, 128, 128, num_warps=4, num_stages=3),
    # B > 64: tensor-core bound
    "large": HeadBmmConfig(128, 128, 64, num_warps=8, num_stages=3, merge_chunk=2),
    # W8A8 (block_k 128): 128x128x64 x3 stages asked 262656 B of shared memory on an H200 (limit 232448)
    "large_w8a8": HeadBmmConfig(64, 128, 128, num_warps=4, num_stages=2, merge_chunk=2),
}
DECODE_MAX_B = 64


def pick_config(b: int, quant_act: bool = False, whole_heads: bool = False) -> HeadBmmConfig:
    """The default tiles for batch size b; `whole_heads`: 128-wide N tiles (a merging x load, or
    quant_out)."""
    if b <= DECODE_MAX_B:
        return CONFIGS["decode_heads" if whole_heads else "decode"]
    return CONFIGS["large_w8a8"] if quant_act else CONFIGS["large"]


# ---- reference ---------------------------------------------------------------------------------


def head_bmm_ref(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None = None, *, quant_act: bool = False
) -> torch.Tensor:
    """x [B, H, K] @ w [H, K, N] per head -> [B, H, N] in x's dtype, float32 math.

    With `w_scale` the e4m3 weight is dequantized by its 128x128 block scales; `quant_act` also
    quantizes x per (token, head) per 128 channels (W8A8), as the kernel does.
    """
    b, h, k = x.shape
    assert w.shape[:2] == (h, k), f"x {tuple(x.shape)} vs w {tuple(w.shape)}"
    wf = w.to(torch.float32) if w_scale is None else dequantize_blocks(w, w_scale)  # [H, K, N]
    xf = x.to(torch.float32)
    if quant_act:
        assert w_scale is not None, "W8A8 needs an FP8 weight"
        xq, xs = quantize_act_ref(x.reshape(b * h, k))
        xf = (xq.to(torch.float32) * xs.repeat_interleave(BLOCK, dim=-1)[:, :k]).view(b, h, k)
    return torch.einsum("bhk,hkn->bhn", xf, wf).to(x.dtype)


def quantize_head_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [H, K, N] float -> (e4m3 [H, K, N], float32 scales [H, ceil(K/128), ceil(N/128)]).

    Each head's [K, N] matrix is quantized on its own with `mlac.core.fp8.quantize_blocks`, the
    compiler's 128x128 block quantizer (scale = amax(block) / 448), so no block spans two heads.
    """
    assert w.dim() == 3 and w.is_floating_point(), f"w must be [H, K, N] float: {w.dtype} {tuple(w.shape)}"
    pairs = [quantize_blocks(w_h.cpu()) for w_h in w]
    q = torch.stack([p[0] for p in pairs]).to(w.device)
    s = torch.stack([p[1] for p in pairs]).to(w.device)
    return q, s


# ---- Triton ------------------------------------------------------------------------------------

if HAS_TRITON:
    # B varies per decode step, and the scale strides are 1 or 4 for these shapes: one compile.
    # A merging load: num_splits is fixed per CUDA graph but differs between graphs, and so do the
    # lse strides (multiples of it): one compile for all of them.
    @triton.jit(do_not_specialize=["B", "stride_sh", "stride_sk", "num_splits", "stride_lb", "stride_lh"])
    def _head_bmm_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        o_ptr,
        lse_ptr,
        seq_lens_ptr,
        os_ptr,
        B,
        N,
        K,
        stride_xb,
        stride_xh,
        stride_xs,
        stride_wh,
        stride_wk,
        stride_sh,
        stride_sk,
        stride_ob,
        stride_oh,
        stride_lb,
        stride_lh,
        stride_osb,
        num_splits,
        W_FP8: tl.constexpr,  # w e4m3 with block scales s [H, ceil(K/128), ceil(N/128)]
        QUANT_A: tl.constexpr,  # W8A8: quantize x per row per 128 channels (BLOCK_K == 128)
        MERGE: tl.constexpr,  # x: split partials [B, H, S, K] float32, lse [B, H, S] (SplitKV)
        MIN_SPLIT: tl.constexpr,  # MERGE: SplitKV.min_split
        MERGE_CHUNK: tl.constexpr,  # MERGE: splits whose [BM, BK] tiles are loaded at once
        QUANT_OUT: tl.constexpr,  # o e4m3 [B, H*N] + scales os [B, H*N/128] (BLOCK_N == 128)
        X_DTYPE: tl.constexpr,  # the activation dtype (what a merged x and QUANT_OUT round to)
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        UPCAST_DOT: tl.constexpr,  # interpreter only: float32 dot operands (see fp8_quant.interpreting)
        FP8_MAX_C: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_start(PDL)
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        head = tl.program_id(2).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < B
        n_ok = offs_n < N

        x_rows = x_ptr + head * stride_xh + offs_m[:, None].to(tl.int64) * stride_xb  # [BM, 1]
        x_ptrs = x_rows + offs_k[None, :]  # [BM, BK]
        w_ptrs = w_ptr + head * stride_wh + offs_k[:, None] * stride_wk + offs_n[None, :]  # [BK, BN]
        if BLOCK_N <= 128:  # the tile lies in one 128-column scale block: one scale per K block
            s_ptrs = s_ptr + head * stride_sh + (pid_n * BLOCK_N) // 128
        else:
            s_ptrs = s_ptr + head * stride_sh + offs_n // 128  # [BN]

        if MERGE:  # per row: the splits its request used, and the merge's max and denominator
            used = used_splits(tl.load(seq_lens_ptr + offs_m, mask=m_ok, other=0), num_splits, MIN_SPLIT)
            n_used = tl.max(tl.where(m_ok, used, 1))  # splits to visit: the most a row of the tile used
            used = used[:, None]  # [BM, 1]
            row_ok = m_ok[:, None]
            lse_ptrs = lse_ptr + head * stride_lh + offs_m[:, None].to(tl.int64) * stride_lb  # [BM, 1]
            mx, denom = merge_weights(lse_ptrs, 1, row_ok, used, n_used, MERGE_CHUNK)  # [BM, 1]

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                k_ok = offs_k < BLOCK_K
                b = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = k0 + offs_k < K
                b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if MERGE:  # o_lat's tile: the merge kernel's arithmetic, rounded as its store rounds
                a = merge_splits(
                    x_ptrs, stride_xs, k_ok[None, :], lse_ptrs, 1, row_ok, used,
                    n_used, mx, denom, MERGE_CHUNK,
                )  # fmt: skip
                a = a.to(X_DTYPE)  # [BM, BK]
            elif EVEN_K:
                a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            else:
                a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if W_FP8:
                kb = k0 // 128
                if BLOCK_N <= 128:
                    b_s = tl.load(s_ptrs + kb * stride_sk)
                else:
                    b_s = tl.load(s_ptrs + kb * stride_sk, mask=n_ok, other=0.0)[None, :]
                if QUANT_A:  # same arithmetic as quantize_act_ref
                    af = a.to(tl.float32)
                    a_s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(af), axis=1), 1e-12), FP8_MAX_C)  # [BM]
                    aq = round_e4m3(tl.clamp(tl.math.div_rn(af, a_s[:, None]), -FP8_MAX_C, FP8_MAX_C))
                    a = aq.to(b.dtype)
                    acc += tl.dot(a, b) * (a_s[:, None] * b_s)
                elif UPCAST_DOT:
                    acc += tl.dot(a.to(tl.float32), b.to(tl.float32)) * b_s
                else:  # W8A16: e4m3 -> x's dtype is exact
                    acc += tl.dot(a, b.to(a.dtype)) * b_s
            elif UPCAST_DOT:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
            else:
                acc = tl.dot(a, b, acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk

        o_ptrs = o_ptr + head * stride_oh + offs_m[:, None].to(tl.int64) * stride_ob + offs_n[None, :]
        o_mask = m_ok[:, None] & n_ok[None, :]
        if QUANT_OUT:  # each row of the tile is one 128-channel group of o_proj's input [B, H*N]
            q, q_s = quant_groups(cast_out(acc, X_DTYPE).to(tl.float32), FP8_MAX_C)  # the rounded output's
            tl.store(o_ptrs, q.to(o_ptr.dtype.element_ty), mask=o_mask)
            group = (head * N + pid_n * BLOCK_N) // BLOCK_N
            tl.store(os_ptr + offs_m.to(tl.int64) * stride_osb + group, q_s, mask=m_ok)
        else:
            tl.store(o_ptrs, cast_out(acc, o_ptr.dtype.element_ty), mask=o_mask)


_TL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _check_x(x: torch.Tensor | SplitKV) -> None:
    """x [B, H, K] bf16/fp16 with a contiguous last dim, or split partials that merge to one."""
    assert x.dtype in (torch.bfloat16, torch.float16), f"x must be bf16/fp16, got {x.dtype}"
    if not isinstance(x, SplitKV):
        assert x.dim() == 3, f"x must be [B, H, K], got {tuple(x.shape)}"
        assert x.stride(-1) == 1, f"x's last dim must be contiguous (strides {x.stride()})"
        return
    o, lse = x.o_part, x.lse_part
    assert o.dim() == 4 and o.dtype == torch.float32 and o.stride(-1) == 1, (o.shape, o.dtype, o.stride())
    assert lse.shape == o.shape[:3] and lse.dtype == torch.float32 and lse.stride(-1) == 1, lse.shape
    assert x.seq_lens.shape == o.shape[:1] and x.seq_lens.dtype == torch.int32 and x.seq_lens.is_contiguous()
    assert lse.device == x.seq_lens.device == o.device, (o.device, lse.device, x.seq_lens.device)


def _check_args(x, w, w_scale, quant_act: bool, quant_out: bool, cfg: HeadBmmConfig) -> None:
    _check_x(x)
    assert w.dim() == 3, f"w must be [H, K, N], got {tuple(w.shape)}"
    b, h, k = x.shape
    assert w.shape[:2] == (h, k), f"x {tuple(x.shape)} vs w {tuple(w.shape)}: w must be [H={h}, K={k}, N]"
    assert w.stride(-1) == 1, f"w's last dim must be contiguous (strides {w.stride()})"
    assert x.device == w.device, (x.device, w.device)
    for name, v in (("block_m", cfg.block_m), ("block_n", cfg.block_n), ("block_k", cfg.block_k)):
        assert v >= 16 and v & (v - 1) == 0, f"{name} must be a power of two >= 16: {cfg}"
    if quant_out:
        assert w.shape[2] % BLOCK == 0 and cfg.block_n == BLOCK, (
            f"quant_out needs whole 128-wide quantization groups (N % 128 == 0, block_n == 128): "
            f"N {w.shape[2]}, {cfg}"
        )
    if w_scale is None:
        assert w.dtype == x.dtype, f"an unscaled w must have x's dtype {x.dtype}, got {w.dtype}"
        assert not quant_act, "quant_act (W8A8) needs an FP8 weight with w_scale"
        return
    n = w.shape[2]
    assert w.dtype == FP8, f"w with a w_scale must be e4m3, got {w.dtype}"
    want = (h, math.ceil(k / BLOCK), math.ceil(n / BLOCK))
    assert tuple(w_scale.shape) == want, f"w_scale {tuple(w_scale.shape)}, expected {want}"
    assert w_scale.dtype == torch.float32 and w_scale.stride(-1) == 1, (
        "w_scale must be float32, last dim contiguous"
    )
    assert w_scale.device == w.device, (w_scale.device, w.device)
    assert BLOCK % cfg.block_k == 0, f"FP8 weights need block_k dividing 128: {cfg}"
    assert BLOCK % cfg.block_n == 0 or cfg.block_n % BLOCK == 0, (
        f"FP8 block_n must divide or be a multiple of 128: {cfg}"
    )
    assert not quant_act or cfg.block_k == BLOCK, f"W8A8 needs block_k == 128: {cfg}"


def _outputs(b: int, h: int, n: int, x, quant_out: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, N] in x's dtype, unused scales), or (e4m3 [B, H, N], scales [B, H*N/128])."""
    if not quant_out:
        out = torch.empty(b, h, n, dtype=x.dtype, device=x.device)
        return out, out
    q = torch.empty(b, h, n, dtype=FP8, device=x.device)
    return q, torch.empty(b, h * n // BLOCK, dtype=torch.float32, device=x.device)


def _result(out: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, quant_out: bool):
    return Fp8Act(out.view(out.shape[0], -1), scales, dtype) if quant_out else out


def head_bmm_triton(
    x: torch.Tensor | SplitKV,
    w: torch.Tensor,
    w_scale: torch.Tensor | None = None,
    *,
    quant_act: bool = False,
    quant_out: bool = False,
    config: HeadBmmConfig | None = None,
) -> torch.Tensor | Fp8Act:
    """Triton head_bmm: contract as `head_bmm_ref`, up to float32 summation order.

    x [B, H, K] (last dim contiguous), or split-KV partials that merge to it (`SplitKV`: merged
    while loaded, the bits of the merge kernel's o_lat); w [H, K, N] in x's dtype or e4m3 with
    w_scale. Returns a new contiguous [B, H, N] in x's dtype, or with `quant_out` its `Fp8Act`
    [B, H*N] (N % 128 == 0). One launch, no copies.
    """
    assert HAS_TRITON, "head_bmm_triton needs triton"
    split = isinstance(x, SplitKV)
    cfg = config or pick_config(x.shape[0], quant_act, whole_heads=split or quant_out)
    _check_args(x, w, w_scale, quant_act, quant_out, cfg)
    (b, h, k), n = x.shape, w.shape[2]
    out, scales = _outputs(b, h, n, x, quant_out)
    if out.numel() == 0 or k == 0:  # an output of zeros
        if quant_out:
            return Fp8Act(*quantize_act_ref(torch.zeros(b, h * n, dtype=x.dtype, device=x.device)), x.dtype)
        return out.zero_()
    fp8 = w_scale is not None
    s = w_scale if fp8 else w  # unused without FP8
    xt, lse, seq_lens = (x.o_part, x.lse_part, x.seq_lens) if split else (x, x, x)  # lse, seq_lens unused
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(b, cfg.block_m), h)
    _head_bmm_kernel[grid](
        xt, w, s, out, lse, seq_lens, scales,
        b, n, k,
        xt.stride(0), xt.stride(1), xt.stride(2) if split else 0,
        w.stride(0), w.stride(1), s.stride(0), s.stride(1),
        out.stride(0), out.stride(1),
        lse.stride(0) if split else 0, lse.stride(1) if split else 0, scales.stride(0),
        xt.shape[2] if split else 1,
        W_FP8=fp8, QUANT_A=quant_act,
        MERGE=split, MIN_SPLIT=x.min_split if split else 1, MERGE_CHUNK=cfg.merge_chunk, QUANT_OUT=quant_out,
        X_DTYPE=getattr(tl, _TL_DTYPES[x.dtype]),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0,
        UPCAST_DOT=interpreting() and not quant_act,
        FP8_MAX_C=FP8_MAX,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_launch(),
    )  # fmt: skip
    return _result(out, scales, x.dtype, quant_out)


def head_bmm(
    x: torch.Tensor | SplitKV,
    w: torch.Tensor,
    w_scale: torch.Tensor | None = None,
    *,
    quant_act: bool = False,
    quant_out: bool = False,
    use_triton: bool | None = None,
    config: HeadBmmConfig | None = None,
) -> torch.Tensor | Fp8Act:
    """out[b, h] = x[b, h] @ w[h]: [B, H, K] x [H, K, N] -> [B, H, N] in x's dtype.

    The stored format drives the math: an e4m3 `w` comes with its `w_scale`. x may be the unmerged
    split-KV partials of `mla_decode(merge=False)` (`SplitKV`), merged here. `quant_out` (N % 128
    == 0) returns instead the output's `Fp8Act` [B, H*N], the bits of `quantize_act_ref` of it,
    for an FP8 GEMM to read. Dispatches on device: Triton on CUDA for bf16/fp16 x, `head_bmm_ref`
    on CPU and for float32; `use_triton` forces either path.
    """
    if use_triton is None and x.dtype == torch.float32:
        use_triton = False  # the Triton path takes bf16/fp16; float32 math stays exact (no TF32)
    xt = x.o_part if isinstance(x, SplitKV) else x
    if _use_triton(xt, use_triton):
        return head_bmm_triton(x, w, w_scale, quant_act=quant_act, quant_out=quant_out, config=config)
    out = head_bmm_ref(merge_ref(x) if isinstance(x, SplitKV) else x, w, w_scale, quant_act=quant_act)
    if not quant_out:
        return out
    assert out.shape[2] % BLOCK == 0, f"quant_out needs N % 128 == 0, got N {out.shape[2]}"
    return Fp8Act(*quantize_act_ref(out.flatten(1)), out.dtype)


__all__ = [
    "CONFIGS",
    "HeadBmmConfig",
    "head_bmm",
    "head_bmm_ref",
    "head_bmm_triton",
    "pick_config",
    "quantize_head_weight",
]
