"""Extend (prefill) attention over variable-length sequences with a cached prefix.

Sequences are packed cu_seqlens style. Sequence i has q_len_i new tokens (rows
cu_seqlens_q[i] : cu_seqlens_q[i+1] of q) and kv_len_i = prefix_len_i + q_len_i keys and values
(rows cu_seqlens_kv[i] : cu_seqlens_kv[i+1] of k and v: the decompressed cached prefix, then the new
tokens). New token j sits at position prefix_len_i + j and, when causal, attends to positions
0 .. prefix_len_i + j (the causal diagonal aligned to the end of the keys).

    q [T_q, H, d_qk], k [T_kv, H_kv, d_qk], v [T_kv, H_kv, d_v] -> o [T_q, H, d_v]

H_kv must divide H: H_kv == H in DeepSeek's MHA form (d_qk 192, d_v 128); H_kv == 1 in its absorbed
form (d_qk 576 = latent + rope, v = the latent's first 512 columns: MQA over the cached latents). Flash-attention tiling: one program per
(query tile, head, sequence), online softmax over key tiles, the tiles left of the diagonal run
unmasked. `extend_attention` dispatches: Triton on CUDA, the reference on CPU.

Shared prefix (`shared=(shares, P)`): the first P rows of k and v are a prefix that the sequences
with shares[i] != 0 all have before their own keys (a prompt the prefix cache serves to several
sequences of one step). Such a sequence attends to those P keys, all of them (they precede every
new token), then to its own range of cu_seqlens_kv causally, as if its keys were the P shared ones
followed by its own: the shared keys are scored once per query tile, not copied per sequence.
"""

from __future__ import annotations

import torch

from mlac.kernels._triton import pdl_launch, pdl_start, tl, triton
from mlac.kernels._triton import use_triton as _use_triton

LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def extend_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    softmax_scale: float,
    causal: bool = True,
    shared: tuple[torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 reference, one sequence at a time. Returns (o [T_q, H, d_v] in q's dtype,
    lse [T_q, H] float32, natural log). `shared`: (shares [B], P), module docstring."""
    t_q, h, _ = q.shape
    group = h // k.shape[1]
    o = torch.empty(t_q, h, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(t_q, h, dtype=torch.float32, device=q.device)
    cq, ckv = cu_seqlens_q.tolist(), cu_seqlens_kv.tolist()
    shares, p = ([0] * (len(cq) - 1), 0) if shared is None else (shared[0].tolist(), shared[1])
    for i in range(len(cq) - 1):
        own = list(range(ckv[i], ckv[i + 1]))
        rows = (list(range(p)) if shares[i] else []) + own  # the shared keys first, then its own
        qi = q[cq[i] : cq[i + 1]].to(torch.float32)  # [Lq, H, d_qk]
        ki = k[rows].to(torch.float32).repeat_interleave(group, dim=1)  # [Lkv, H, d_qk]
        vi = v[rows].to(torch.float32).repeat_interleave(group, dim=1)  # [Lkv, H, d_v]
        lq, lkv = qi.shape[0], ki.shape[0]
        s = torch.einsum("qhd,khd->hqk", qi, ki) * softmax_scale  # [H, Lq, Lkv]
        if causal:
            allowed = torch.arange(lkv)[None, :] <= (lkv - lq) + torch.arange(lq)[:, None]  # [Lq, Lkv]
            s = s.masked_fill(~allowed.to(s.device), float("-inf"))
        lse_i = torch.logsumexp(s, dim=-1)  # [H, Lq]
        o[cq[i] : cq[i + 1]] = torch.einsum("hqk,khd->qhd", torch.exp(s - lse_i[..., None]), vi).to(q.dtype)
        lse[cq[i] : cq[i + 1]] = lse_i.t()
    return o, lse


# --------------------------------------------------------------------------------------------
# Triton
# --------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _attn_tile(
        acc, m_i, l_i, q_a, q_b, k_ptrs_a, k_ptrs_b, v_ptrs, offs_n0, n0, kv_len, limit,
        stride_k_t, stride_v_t, qk_scale_log2,
        MASK_D: tl.constexpr, DB: tl.constexpr, DQK: tl.constexpr, DA: tl.constexpr,
        DV: tl.constexpr, BLOCK_DV: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        """Online-softmax update of one key tile starting at key position n0."""
        offs_n = n0 + offs_n0
        if MASKED:
            mask_n = offs_n < kv_len
            k_a = tl.load(k_ptrs_a + n0 * stride_k_t, mask=mask_n[:, None], other=0.0)  # [BN, DA]
        else:
            k_a = tl.load(k_ptrs_a + n0 * stride_k_t)
        s = tl.dot(q_a, tl.trans(k_a), input_precision=PRECISION)  # [BM, BN] float32
        if DB > 0:
            mask_db = (DA + tl.arange(0, DB)) < DQK
            if MASKED:
                k_b = tl.load(k_ptrs_b + n0 * stride_k_t, mask=mask_n[:, None] & mask_db[None, :], other=0.0)
            else:
                k_b = tl.load(k_ptrs_b + n0 * stride_k_t, mask=mask_db[None, :], other=0.0)
            s = tl.dot(q_b, tl.trans(k_b), s, input_precision=PRECISION)
        s = s * qk_scale_log2
        if MASKED:
            keep = mask_n[None, :]
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= limit[:, None])
            s = tl.where(keep, s, float("-inf"))
            mask_dv = tl.arange(0, BLOCK_DV) < DV
            v = tl.load(v_ptrs + n0 * stride_v_t, mask=mask_n[:, None] & mask_dv[None, :], other=0.0)
        elif MASK_D:
            v = tl.load(v_ptrs + n0 * stride_v_t, mask=(tl.arange(0, BLOCK_DV) < DV)[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs + n0 * stride_v_t)  # [BN, BLOCK_DV]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return acc, m_new, l_i

    @triton.jit
    def _extend_attention_kernel(
        q, k, v, o, lse_ptr, cu_q, cu_kv, shares, shared_len,
        stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
        stride_o_t, stride_o_h, stride_l_t, stride_l_h,
        qk_scale_log2, GROUP: tl.constexpr,
        DQK: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, STORE_LSE: tl.constexpr,
        SHARED: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """q/k head dims split as DA (a power of two) + a DB-wide masked tail (DB = 0: none).
        SHARED: a sequence with shares[seq] != 0 first attends to rows 0..shared_len-1 of k and v,
        unmasked (module docstring)."""
        pdl_start(PDL)  # before the early return: see mlac.kernels._triton
        pid_m = tl.program_id(0)
        h = tl.program_id(1)
        seq = tl.program_id(2)
        q_start = tl.load(cu_q + seq)
        q_len = tl.load(cu_q + seq + 1) - q_start
        if pid_m * BLOCK_M >= q_len:
            return
        kv_start = tl.load(cu_kv + seq)
        kv_len = tl.load(cu_kv + seq + 1) - kv_start
        prefix = kv_len - q_len
        kv_h = h // GROUP

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < q_len
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_a = tl.arange(0, DA)
        offs_dv = tl.arange(0, BLOCK_DV)
        q_rows = q + (q_start + offs_m).to(tl.int64)[:, None] * stride_q_t + h * stride_q_h
        q_a = tl.load(q_rows + offs_a[None, :], mask=mask_m[:, None], other=0.0)  # [BM, DA]
        k_rows = k + (kv_start + offs_n0).to(tl.int64)[:, None] * stride_k_t + kv_h * stride_k_h
        k_ptrs_a = k_rows + offs_a[None, :]
        if DB > 0:
            offs_b = DA + tl.arange(0, DB)
            q_b = tl.load(q_rows + offs_b[None, :], mask=mask_m[:, None] & (offs_b < DQK)[None, :], other=0.0)
            k_ptrs_b = k_rows + offs_b[None, :]
        else:
            q_b = q_a
            k_ptrs_b = k_ptrs_a
        v_ptrs = (
            v + (kv_start + offs_n0).to(tl.int64)[:, None] * stride_v_t + kv_h * stride_v_h + offs_dv[None, :]
        )

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        limit = prefix + offs_m  # [BM] last key position each row may see (causal)
        if SHARED:
            if tl.load(shares + seq) != 0:  # the shared keys: before every row, none masked
                ks_rows = k + offs_n0.to(tl.int64)[:, None] * stride_k_t + kv_h * stride_k_h
                ks_a = ks_rows + offs_a[None, :]
                if DB > 0:
                    ks_b = ks_rows + offs_b[None, :]
                else:
                    ks_b = ks_a
                vs_ptrs = (
                    v + offs_n0.to(tl.int64)[:, None] * stride_v_t + kv_h * stride_v_h + offs_dv[None, :]
                )
                shared_full = shared_len // BLOCK_N * BLOCK_N
                for n0 in range(0, shared_full, BLOCK_N):
                    acc, m_i, l_i = _attn_tile(
                        acc, m_i, l_i, q_a, q_b, ks_a, ks_b, vs_ptrs, offs_n0, n0, shared_len, limit,
                        stride_k_t, stride_v_t, qk_scale_log2,
                        BLOCK_DV != DV, DB, DQK, DA, DV, BLOCK_DV, False, False, PRECISION,
                    )  # fmt: skip
                for n0 in range(shared_full, shared_len, BLOCK_N):
                    acc, m_i, l_i = _attn_tile(
                        acc, m_i, l_i, q_a, q_b, ks_a, ks_b, vs_ptrs, offs_n0, n0, shared_len, limit,
                        stride_k_t, stride_v_t, qk_scale_log2,
                        BLOCK_DV != DV, DB, DQK, DA, DV, BLOCK_DV, True, False, PRECISION,
                    )  # fmt: skip
        if CAUSAL:
            full_end = (prefix + pid_m * BLOCK_M) // BLOCK_N * BLOCK_N  # every row sees keys < this
            hi = tl.minimum(kv_len, prefix + (pid_m + 1) * BLOCK_M)
        else:
            full_end = kv_len // BLOCK_N * BLOCK_N
            hi = kv_len
        for n0 in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attn_tile(
                acc, m_i, l_i, q_a, q_b, k_ptrs_a, k_ptrs_b, v_ptrs, offs_n0, n0, kv_len, limit,
                stride_k_t, stride_v_t, qk_scale_log2,
                BLOCK_DV != DV, DB, DQK, DA, DV, BLOCK_DV, False, CAUSAL, PRECISION,
            )  # fmt: skip
        for n0 in range(full_end, hi, BLOCK_N):
            acc, m_i, l_i = _attn_tile(
                acc, m_i, l_i, q_a, q_b, k_ptrs_a, k_ptrs_b, v_ptrs, offs_n0, n0, kv_len, limit,
                stride_k_t, stride_v_t, qk_scale_log2,
                BLOCK_DV != DV, DB, DQK, DA, DV, BLOCK_DV, True, CAUSAL, PRECISION,
            )  # fmt: skip

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = o + (q_start + offs_m).to(tl.int64)[:, None] * stride_o_t + h * stride_o_h + offs_dv[None, :]
        tl.store(o_ptrs, out.to(o.dtype.element_ty), mask=mask_m[:, None] & (offs_dv < DV)[None, :])
        if STORE_LSE:
            lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
            tl.store(lse_ptr + (q_start + offs_m) * stride_l_t + h * stride_l_h, lse, mask=mask_m)


def _split_head_dim(d: int) -> tuple[int, int]:
    """d -> (DA, DB): DA the largest power of two <= d (at least 16), DB a power of two covering the
    rest (0 when none). 192 -> (128, 64), 128 -> (128, 0), 40 -> (32, 16)."""
    da = max(16, 1 << (d.bit_length() - 1))
    rest = d - da
    return da, (0 if rest <= 0 else max(16, triton.next_power_of_2(rest)))


def default_config(d_qk: int, d_v: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict:
    cfg = _tiles(d_qk, d_v, device, dtype)
    if device.type == "cuda" and 0 < _split_head_dim(d_qk)[1] < 64:
        # HAZARD (Triton 3.6, H200): 8 warps with a 16/32-wide head-dim tail tile miscompile: at
        # 256 + 32 an illegal address, at 128 + 32 wrong output (0.34 rel. error); 4 warps are
        # exact for every shape tried, and tails of 64 (DeepSeek's rope) are fine with 8.
        cfg["num_warps"] = 4
    return cfg


def _tiles(d_qk: int, d_v: int, device: torch.device, dtype: torch.dtype) -> dict:
    if device.type != "cuda":
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    if dtype == torch.float32:  # exact-check path: float32 tiles need twice the shared memory
        block = 32 if d_v <= 256 else 16
        return dict(BLOCK_M=block, BLOCK_N=block, num_warps=4, num_stages=1)
    if d_v > 128 or d_qk > 256:
        # absorbed form (V2/V3: 576 / 512, one latent head; smaller models e.g. 288 / 256): the
        # [BM, d_v] accumulator and the padded q tile bound BM; 128/64/3 needs 276 KiB of shared
        # memory at 288 / 256 (H200 has 227). 64/64/1 is 7% ahead of 64/32/2 at 576 / 512.
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=1)
    if d_qk + d_v > 256:  # DeepSeek MHA form (192 / 128): 3 stages beat 2 by 15-20% on an H200
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)


def extend_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    max_seqlen_q: int,
    softmax_scale: float,
    causal: bool = True,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    shared: tuple[torch.Tensor, int] | None = None,
):
    """Triton path of `extend_attention` (same contract); `out` [T_q, H, d_v] is written when given."""
    t_q, h, d_qk = q.shape
    t_kv, h_kv, d_v = v.shape
    assert k.shape == (t_kv, h_kv, d_qk), f"k {tuple(k.shape)} vs q {tuple(q.shape)}, v {tuple(v.shape)}"
    assert h % h_kv == 0, f"kv heads {h_kv} must divide heads {h}"
    assert d_qk >= 16, "head dim of q/k must be at least 16 (tl.dot)"
    assert q.dtype == k.dtype == v.dtype and q.device == k.device == v.device
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    n_seq = cu_seqlens_q.numel() - 1
    assert (
        cu_seqlens_kv.shape == cu_seqlens_q.shape and cu_seqlens_q.dtype == cu_seqlens_kv.dtype == torch.int32
    )
    if out is None:
        out = torch.empty(t_q, h, d_v, dtype=q.dtype, device=q.device)
    assert out.shape == (t_q, h, d_v) and out.stride(-1) == 1 and out.dtype == q.dtype
    lse = torch.empty(t_q, h, dtype=torch.float32, device=q.device) if return_lse else out
    cfg = {**default_config(d_qk, d_v, q.device, q.dtype), **(config or {})}
    da, db = _split_head_dim(d_qk)
    grid = (triton.cdiv(max(max_seqlen_q, 1), cfg["BLOCK_M"]), h, n_seq)
    if shared is not None:
        assert shared[0].shape == (n_seq,) and shared[0].dtype == torch.int32 and 0 <= shared[1] <= t_kv
    shares, shared_len = (cu_seqlens_q, 0) if shared is None else shared
    _extend_attention_kernel[grid](
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_kv, shares, shared_len,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0) if return_lse else 0, lse.stride(1) if return_lse else 0,
        softmax_scale * LOG2E, GROUP=h // h_kv,
        DQK=d_qk, DA=da, DB=db, DV=d_v, BLOCK_DV=max(16, triton.next_power_of_2(d_v)),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal, STORE_LSE=return_lse, SHARED=shared is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 in, float32 math (no TF32)
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(),
    )  # fmt: skip
    return (out, lse) if return_lse else out


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    softmax_scale: float,
    causal: bool = True,
    max_seqlen_q: int | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    use_triton: bool | None = None,
    shared: tuple[torch.Tensor, int] | None = None,
):
    """Varlen attention of new tokens over [cached prefix + new tokens], MHA or MQA form.

    q [T_q, H, d_qk], k [T_kv, H_kv, d_qk], v [T_kv, H_kv, d_v] (one dtype, last dim contiguous),
    cu_seqlens_q / cu_seqlens_kv [N + 1] int32 (kv_len_i >= q_len_i; the prefix is the difference),
    softmax_scale (YaRN mscale^2 included). causal aligns the diagonal to the end of the keys.
    max_seqlen_q sizes the Triton grid (computed from cu_seqlens_q, a host sync, when None).
    Returns o [T_q, H, d_v] in q's dtype, and with return_lse also lse [T_q, H] float32 (natural log).
    shared: (shares [B] int32, P), a prefix in the first P rows of k and v (module docstring).
    """
    if _use_triton(q, use_triton):
        if max_seqlen_q is None:
            max_seqlen_q = (
                int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item()) if cu_seqlens_q.numel() > 1 else 0
            )
        return extend_attention_triton(
            q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, softmax_scale, causal, return_lse, out,
            shared=shared,
        )  # fmt: skip
    o, lse = extend_attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_kv, softmax_scale, causal, shared)
    if out is not None:
        o = out.copy_(o)
    return (o, lse) if return_lse else o


__all__ = ["extend_attention", "extend_attention_ref", "extend_attention_triton"]
