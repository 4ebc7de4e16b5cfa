"""MLA decode: absorbed attention of one new token per request over a paged latent KV cache.

One cache per layer, `kv_cache [num_blocks, block_size, kv_lora + rope]`: each token stores its
latent (the first kv_lora dims, which are also the value) followed by its rope key. All query heads
share the one latent "head" (MQA), so a program loads a KV tile once and scores it against a tile of
heads with one matrix product:

    score[b, h, t] = softmax_scale * (q_nope_lat[b, h] . latent[t] + q_rope[b, h] . k_rope[t])
    o_lat[b, h]    = sum_t softmax_t(score[b, h, :]) * latent[t]

Long sequences are split into `num_splits` chunks computed in parallel (split-KV) and merged by
log-sum-exp (split_kv.py): by its merge kernel, or (`merge=False`) by the consumer of o_lat while
it loads it (`SplitKV`: head_bmm's v-absorb merges the partials in its x load, one launch fewer).
Rows of one sequence (a flattened extend or a speculative verify: consecutive rows, one block
table, seq_lens rising by one per row) may run grouped (`row_groups`): one program takes up to
ROWS of them, its dots' M is rows x heads, and each KV tile is loaded once for all of them (per
row, a prefix of 2,000 tokens was read once per row); each row keeps its own causal limit. The
group's longest row sets its split partition, which the merge then uses per row (SplitKV.seq_lens).
The tiles of both forms, the split count and the rule between the forms: mla_decode_plan.py.
FP8 caches (e4m3 / e5m2) carry one float32 scale per tensor (value = stored * scale); their
tiles are widened to fp16 and q is cast to fp16 for the dots (|q| must stay below 65504).
`mla_decode` dispatches: Triton on CUDA, the reference on CPU. Measured on an H200:
benchmarks/README.md ("Kernels, one H200"; benchmarks/kernels/attention.py).
"""

from __future__ import annotations

import torch

from mlac.kernels._triton import pdl_launch, pdl_start, tl, triton
from mlac.kernels._triton import use_triton as _use_triton
from mlac.kernels.attention.mla_decode_plan import FP8_KV_DTYPES, decode_num_splits, default_config
from mlac.kernels.attention.split_kv import SplitKV, merge_split_kv

if triton is not None:
    from mlac.kernels.attention.split_kv import used_splits

LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def gather_kv_ref(kv_cache: torch.Tensor, block_table: torch.Tensor, kv_scale: torch.Tensor | None):
    """Paged cache -> float32 [B, max_blocks * block_size, D], dequantized (positions past a
    request's length hold whatever its block-table entries point at; callers mask them)."""
    b, max_blocks = block_table.shape
    block_size, d = kv_cache.shape[1:]
    kv = kv_cache[block_table.long()].to(torch.float32)  # [B, max_blocks, block_size, D]
    if kv_scale is not None:
        kv = kv * kv_scale.to(torch.float32)
    return kv.reshape(b, max_blocks * block_size, d)


def mla_decode_ref(
    q_nope_lat: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 reference. Returns (o_lat [B, H, kv_lora] in q's dtype, lse [B, H] float32, natural log).

    A request with seq_len 0 gets o = 0 and lse = -inf.
    """
    kv_lora = q_nope_lat.shape[-1]
    kv = gather_kv_ref(kv_cache, block_table, kv_scale)  # [B, S, kv_lora + rope]
    pos = torch.arange(kv.shape[1], device=kv.device)
    valid = pos[None, :] < seq_lens.to(kv.device).long()[:, None]  # [B, S]
    kv = kv.masked_fill(~valid[..., None], 0.0)  # slots past the end may hold anything (NaN too)
    q = torch.cat([q_nope_lat, q_rope], dim=-1).to(torch.float32)  # [B, H, kv_lora + rope]
    scores = torch.einsum("bhd,bsd->bhs", q, kv) * softmax_scale  # [B, H, S]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H]
    p = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    o = torch.einsum("bhs,bsd->bhd", p, kv[..., :kv_lora])
    return o.to(q_nope_lat.dtype), lse


# --------------------------------------------------------------------------------------------
# Triton
# --------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _mla_decode_split_kernel(
        q_nope, q_rope, kv, block_table, seq_lens, groups, kv_scale_ptr, o_ptr, lse_ptr,
        stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h,
        stride_kv_blk, stride_kv_tok, stride_bt_b, stride_g,
        stride_o_b, stride_o_h, stride_o_s, stride_l_b, stride_l_h, stride_l_s,
        H, qk_scale_log2, num_splits,
        MIN_SPLIT: tl.constexpr, PAGE: tl.constexpr, TILE_IN_PAGE: tl.constexpr,
        DL: tl.constexpr, DR: tl.constexpr, BLOCK_DL: tl.constexpr, BLOCK_DR: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, GROUPED: tl.constexpr, ROWS: tl.constexpr,
        HAS_SCALE: tl.constexpr, IS_FP8: tl.constexpr, STORE_LSE: tl.constexpr, LSE_LOG2: tl.constexpr,
        PRECISION: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """One program: BLOCK_H heads of request b over split s of its tokens; GROUPED, of the
        rows b .. b + n - 1 of one sequence (n <= ROWS, `groups`: see `row_groups`) at once, every
        KV tile loaded once for all of them: the dots' M is ROWS x BLOCK_H (row-major: m = r * BLOCK_H
        + head). The programs of rows that lead no group return at once.

        The split partition is that of `kv_len`: the request's seq_len, or GROUPED the group's
        longest row's (groups[1, b]). The program uses the first `used_splits(kv_len)` of the
        num_splits splits; the programs of the others return at once (num_splits is fixed by a CUDA
        graph's grid, seq_len is not). Each row attends only to its own first seq_len tokens.
        Writes o normalized by its own softmax denominator, and its lse (log2 domain when LSE_LOG2,
        for the merge; natural log otherwise). An empty split (of a row) writes o = 0, lse = -inf.
        """
        pdl_start(PDL)  # before the early return: see mlac.kernels._triton
        pid_h = tl.program_id(0)
        b = tl.program_id(1)
        pid_s = tl.program_id(2)

        if GROUPED:
            n_rows = tl.load(groups + b)  # 0: row b belongs to an earlier row's group
            if n_rows == 0:
                return
            kv_len = tl.load(groups + stride_g + b)
            offs_m = tl.arange(0, ROWS * BLOCK_H)  # [M]: (row, head) pairs
            offs_h = pid_h * BLOCK_H + offs_m % BLOCK_H
            row_m = b + offs_m // BLOCK_H  # [M] the row of each (row, head) pair
            mask_h = (offs_h < H) & (offs_m // BLOCK_H < n_rows)
            row_len = tl.load(seq_lens + row_m, mask=mask_h, other=0)  # [M] each row's own length
            rows = row_m[:, None]  # [M, 1]
        else:  # M = BLOCK_H: one row
            kv_len = tl.load(seq_lens + b)
            offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
            mask_h = offs_h < H
            row_m = b
            rows = b
        used = used_splits(kv_len, num_splits, MIN_SPLIT)
        if pid_s >= used:
            return
        split_len = tl.cdiv(tl.cdiv(kv_len, used), BLOCK_N) * BLOCK_N
        start = pid_s * split_len
        end = tl.minimum(start + split_len, kv_len)
        if GROUPED:
            row_end = tl.minimum(row_len, end)  # [M]

        offs_dl = tl.arange(0, BLOCK_DL)
        offs_dr = tl.arange(0, BLOCK_DR)
        mask_dl = offs_dl < DL
        mask_dr = offs_dr < DR

        qn_ptrs = q_nope + rows * stride_qn_b + offs_h[:, None] * stride_qn_h + offs_dl[None, :]
        qr_ptrs = q_rope + rows * stride_qr_b + offs_h[:, None] * stride_qr_h + offs_dr[None, :]
        q_n = tl.load(qn_ptrs, mask=mask_h[:, None] & mask_dl[None, :], other=0.0)  # [M, BDL]
        q_r = tl.load(qr_ptrs, mask=mask_h[:, None] & mask_dr[None, :], other=0.0)  # [M, BDR]
        if HAS_SCALE:
            kv_scale = tl.load(kv_scale_ptr).to(tl.float32)
            qk_scale_log2 = qk_scale_log2 * kv_scale

        m_i = tl.full([ROWS * BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([ROWS * BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([ROWS * BLOCK_H, BLOCK_DL], dtype=tl.float32)
        bt_row = block_table + b * stride_bt_b  # GROUPED: the rows share the leading row's table
        offs_t = tl.arange(0, BLOCK_N)
        # Loop-invariant offsets of a tile that lies inside one page: [BN, BDL] and [BN, BDR].
        tile_lat = offs_t[:, None] * stride_kv_tok + offs_dl[None, :]
        tile_rope = offs_t[:, None] * stride_kv_tok + DL + offs_dr[None, :]

        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + offs_t
            mask_n = offs_n < end
            if TILE_IN_PAGE:  # PAGE % BLOCK_N == 0 and n0 % BLOCK_N == 0: one page lookup per tile
                page = tl.load(bt_row + n0 // PAGE).to(tl.int64)
                tile = kv + page * stride_kv_blk + (n0 % PAGE) * stride_kv_tok
                lat_ptrs = tile + tile_lat
                rope_ptrs = tile + tile_rope
            else:  # a page lookup per token
                page = tl.load(bt_row + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
                row = page * stride_kv_blk + (offs_n % PAGE) * stride_kv_tok  # [BN] int64
                lat_ptrs = kv + row[:, None] + offs_dl[None, :]
                rope_ptrs = kv + row[:, None] + DL + offs_dr[None, :]
            lat_mask = mask_n[:, None] & mask_dl[None, :]
            kv_lat = tl.load(lat_ptrs, mask=lat_mask, other=0.0, eviction_policy="evict_last")  # [BN, BDL]
            if IS_FP8:
                # NOTE: a converted tile used by both dots is converted in registers twice and its
                # load is not pipelined. Load it twice instead (the second read hits L2), so that
                # each load has one use and both are pipelined through shared memory.
                v_lat = tl.load(lat_ptrs, mask=lat_mask, other=0.0, eviction_policy="evict_first")
                v_lat = v_lat.to(q_n.dtype)
                kv_lat = kv_lat.to(q_n.dtype)
            else:
                v_lat = kv_lat
            k_rope = tl.load(rope_ptrs, mask=mask_n[:, None] & mask_dr[None, :], other=0.0).to(q_n.dtype)

            s = tl.dot(q_n, tl.trans(kv_lat), input_precision=PRECISION)
            s = tl.dot(q_r, tl.trans(k_rope), s, input_precision=PRECISION)  # [M, BN] float32
            if GROUPED:  # each row's own causal limit
                s = tl.where(offs_n[None, :] < row_end[:, None], s * qk_scale_log2, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                # HAZARD: a row may have no token in this tile (its end is before it): m_new is
                # -inf there, and exp2(-inf - -inf) would be NaN. Subtract 0 instead (p = 0).
                m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                s = tl.where(mask_n[None, :], s * qk_scale_log2, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile has a valid token
                m_sub = m_new
            alpha = tl.exp2(m_i - m_sub)
            p = tl.exp2(s - m_sub[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v_lat.dtype), v_lat, input_precision=PRECISION)
            m_i = m_new

        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        if HAS_SCALE:
            out = out * kv_scale
        o_ptrs = (
            o_ptr + rows * stride_o_b + offs_h[:, None] * stride_o_h + pid_s * stride_o_s + offs_dl[None, :]
        )
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_dl[None, :])
        if STORE_LSE:
            lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
            if not LSE_LOG2:
                lse = lse * 0.6931471805599453
            l_ptrs = lse_ptr + row_m * stride_l_b + offs_h * stride_l_h + pid_s * stride_l_s
            tl.store(l_ptrs, lse, mask=mask_h)


def _dot_k(d: int) -> int:
    return max(16, triton.next_power_of_2(d))  # tl.dot needs K >= 16


def _check_inputs(q_nope_lat, q_rope, kv_cache, block_table, seq_lens, kv_scale, row_groups=None):
    b, h, kv_lora = q_nope_lat.shape
    if row_groups is not None:
        assert row_groups.shape == (2, b) and row_groups.dtype == torch.int32 and row_groups.stride(1) == 1
        assert row_groups.device == q_nope_lat.device
    rope = q_rope.shape[-1]
    assert q_rope.shape == (b, h, rope), f"q_rope {tuple(q_rope.shape)} vs q_nope_lat {(b, h, kv_lora)}"
    assert kv_cache.dim() == 3 and kv_cache.shape[2] == kv_lora + rope, (
        f"kv_cache {tuple(kv_cache.shape)}: last dim must be kv_lora + rope = {kv_lora + rope}"
    )
    assert block_table.dim() == 2 and block_table.shape[0] == b and block_table.dtype == torch.int32
    assert seq_lens.shape == (b,) and seq_lens.dtype == torch.int32
    assert q_nope_lat.stride(-1) == 1 and q_rope.stride(-1) == 1 and kv_cache.stride(-1) == 1
    assert block_table.stride(-1) == 1 and seq_lens.is_contiguous()
    assert q_rope.dtype == q_nope_lat.dtype
    if kv_cache.dtype in FP8_KV_DTYPES:
        assert kv_scale is not None and kv_scale.numel() == 1 and kv_scale.dtype == torch.float32, (
            "an FP8 cache needs kv_scale: a float32 tensor of one element"
        )
    else:
        assert kv_cache.dtype == q_nope_lat.dtype, f"kv_cache {kv_cache.dtype} vs q {q_nope_lat.dtype}"
    for t in (q_rope, kv_cache, block_table, seq_lens):
        assert t.device == q_nope_lat.device


def mla_decode_triton(
    q_nope_lat: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_scale: torch.Tensor | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
    config: dict | None = None,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    merge: bool = True,
    row_groups: torch.Tensor | None = None,
):
    """Triton path of `mla_decode` (same contract). `num_splits` and `config` override the defaults;
    `out` [B, H, kv_lora] and `lse_out` [B, H] float32 are written when given (else allocated).
    `merge=False` with num_splits > 1 returns the partials as a `SplitKV` (no merge launch).
    `row_groups` selects the grouped form (`mla_decode`); its groups must have at most the
    config's ROWS rows (`decode_group_rows`)."""
    _check_inputs(q_nope_lat, q_rope, kv_cache, block_table, seq_lens, kv_scale, row_groups)
    grouped = row_groups is not None
    assert merge or not return_lse, "merge=False returns no lse"
    b, h, kv_lora = q_nope_lat.shape
    rope = q_rope.shape[-1]
    page = kv_cache.shape[1]
    dev = q_nope_lat.device
    cfg = {**default_config(h, dev, kv_cache.dtype, grouped), **(config or {})}
    head_blocks = triton.cdiv(h, cfg["BLOCK_H"])
    if num_splits is None:
        num_splits = decode_num_splits(q_nope_lat, kv_cache, block_table, config, grouped)
    # [B] the length that sets each row's split partition (its group's longest row's when grouped)
    split_lens = row_groups[1] if grouped else seq_lens
    is_fp8 = kv_cache.dtype in FP8_KV_DTYPES
    has_scale = kv_scale is not None and is_fp8
    out_dtype = q_nope_lat.dtype
    if is_fp8:
        # fp8 -> fp16 is one instruction per pair on sm_90 (-> bf16 takes three more): the dots
        # of an FP8 cache run in fp16. Converting q here (not in the kernel) keeps it in shared
        # memory (in-kernel, Triton holds it in registers and spills). HAZARD: |q| < 65504.
        q_nope_lat, q_rope = q_nope_lat.to(torch.float16), q_rope.to(torch.float16)

    if out is None:
        out = torch.empty(b, h, kv_lora, dtype=out_dtype, device=dev)  # [B, H, kv_lora]
    assert out.shape == (b, h, kv_lora) and out.stride(-1) == 1 and out.dtype == out_dtype
    lse = None
    if return_lse:
        lse = lse_out if lse_out is not None else torch.empty(b, h, dtype=torch.float32, device=dev)
        assert lse.shape == (b, h) and lse.stride(-1) == 1 and lse.dtype == torch.float32
    if num_splits == 1:  # the split kernel writes the final output (and lse) directly
        o_part, so_s = out, 0
        lse_part, sl = (lse, (lse.stride(0), lse.stride(1), 0)) if return_lse else (out, (0, 0, 0))
    else:
        o_part = torch.empty(b, h, num_splits, kv_lora, dtype=torch.float32, device=dev)
        lse_part = torch.empty(b, h, num_splits, dtype=torch.float32, device=dev)
        so_s, sl = o_part.stride(2), lse_part.stride()

    tile_in_page = cfg["tile_in_page"] and page % cfg["BLOCK_N"] == 0
    min_split = cfg["min_split_tiles"] * cfg["BLOCK_N"]
    grid = (head_blocks, b, num_splits)
    _mla_decode_split_kernel[grid](
        q_nope_lat, q_rope, kv_cache, block_table, seq_lens, row_groups if grouped else seq_lens,
        kv_scale if has_scale else seq_lens, o_part, lse_part,
        q_nope_lat.stride(0), q_nope_lat.stride(1), q_rope.stride(0), q_rope.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0), row_groups.stride(0) if grouped else 0,
        o_part.stride(0), o_part.stride(1), so_s, *sl,
        h, softmax_scale * LOG2E, num_splits,
        MIN_SPLIT=min_split, PAGE=page, TILE_IN_PAGE=tile_in_page,
        DL=kv_lora, DR=rope, BLOCK_DL=_dot_k(kv_lora), BLOCK_DR=_dot_k(rope),
        BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], GROUPED=grouped, ROWS=cfg["ROWS"] if grouped else 1,
        HAS_SCALE=has_scale, IS_FP8=is_fp8,
        PRECISION="ieee" if kv_cache.dtype == torch.float32 else "tf32",  # a float32 cache: no TF32
        STORE_LSE=return_lse or num_splits > 1, LSE_LOG2=num_splits > 1,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(),
    )  # fmt: skip
    if num_splits > 1:
        partials = SplitKV(o_part, lse_part, split_lens, min_split, out_dtype)
        if not merge:
            return partials
        merge_split_kv(partials, out, lse)
    return (out, lse) if return_lse else out


def mla_decode(
    q_nope_lat: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_scale: torch.Tensor | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    use_triton: bool | None = None,
    merge: bool = True,
    num_splits: int | None = None,
    row_groups: torch.Tensor | None = None,
):
    """Absorbed MLA decode over a paged latent cache.

    q_nope_lat [B, H, kv_lora] (query absorbed through w_kc), q_rope [B, H, rope],
    kv_cache [num_blocks, block_size, kv_lora + rope] (q's dtype, or FP8 with kv_scale, a float32
    one-element tensor), block_table [B, max_blocks] int32, seq_lens [B] int32 (tokens to attend,
    the new one included), softmax_scale (YaRN mscale^2 included).
    Returns o_lat [B, H, kv_lora] in q's dtype, and with return_lse also lse [B, H] float32 (natural
    log). `out`, when given, receives o_lat. Triton on CUDA (use_triton=None), the float32
    reference on CPU.
    `merge=False` (no lse): where the Triton path splits the sequences (num_splits > 1, fixed by
    static sizes), it returns the unmerged `SplitKV` instead of o_lat, for head_bmm to merge.
    `num_splits`: the Triton path's split count when the caller has it (`decode_num_splits`).
    `row_groups` [2, B] int32 (`row_groups`, rows contiguous), when given, selects the grouped form:
    consecutive rows of one sequence (one block table, seq_lens rising by one per row: a flattened
    extend) share one program per head tile and split, every KV tile loaded once for them all.
    row_groups[0, r]: rows of the group row r leads (1..ROWS of `decode_group_rows`), 0 for the
    other rows of a group; row_groups[1, r]: the seq_len of the last row of r's group. Rows of a
    group use the first row's block table. Same result as without it; the reference ignores it.
    """
    if _use_triton(q_nope_lat, use_triton):
        return mla_decode_triton(
            q_nope_lat, q_rope, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, return_lse,
            num_splits=num_splits, out=out, merge=merge, row_groups=row_groups,
        )  # fmt: skip
    o, lse = mla_decode_ref(q_nope_lat, q_rope, kv_cache, block_table, seq_lens, softmax_scale, kv_scale)
    if out is not None:
        o = out.copy_(o)
    return (o, lse) if return_lse else o
