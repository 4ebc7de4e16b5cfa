"""Top-p (nucleus) filtering without a sort: logits [R, V] -> the same logits with every token outside
each row's nucleus at -inf, in a fixed number of launches, nothing waited for.

The rule (shared with the sort-based reference `top_p_filter_ref`): with e = exp(x - max(x)) and
s = sum(e), the cut is the largest value t such that the tokens with e >= t hold at least top_p * s;
the tokens with e >= t are kept. That is the smallest set of most likely tokens whose mass reaches
top_p, with every token exactly as likely as the last one kept kept too (a sort would keep some of
those ties and drop others by position). A row with top_p >= 1 keeps every token.

The kernels find t exactly without ordering anything. The bit patterns of non-negative float32
values order as the values do, and e lies in [0, 1]: t is searched among the integers [0, bits(1.0)].
Each search pass measures the mass at CANDS evenly spaced candidates of the current range at once
([CANDS, BLOCK] comparisons per block, summed in registers) and the next pass narrows the range to the
gap between the last candidate that holds enough mass and the next: 2^30 candidates shrink to one in
search_passes(CANDS) passes. A row is split over S programs (enough programs for the GPU at any batch):
each pass writes per-split partial masses [S, CANDS], and every program of the next launch sums them
and narrows the range itself (the first split also stores it for the launch after). Launches: the rows'
max (torch), the search passes, and the write (out = x where e >= t, else -inf); nothing is waited for,
and a CUDA graph can hold them.

The sort this replaces cost about 30% of a V2-Lite decode step at batch 256 on an H200
(benchmarks/results/sampler_h200.json); DeepSeek-V3's and R1's generation configs ask for
top_p 0.95 on every request.
"""

from __future__ import annotations

import torch

from mlac.kernels._triton import HAS_TRITON, pdl_launch, pdl_start, tl, triton
from mlac.kernels._triton import use_triton as _use_triton
from mlac.kernels.fp8_quant import interpreting

if HAS_TRITON:
    from triton.language.extra import libdevice
else:  # the CPU runtime must not need triton
    libdevice = None

ONE_BITS = 0x3F800000  # bits of 1.0f: e = exp(x - max) lies in [0, 1]
# The tiles: the fastest of benchmarks/kernels/top_p.py's sweep on an H200 from batch 32 up
# (benchmarks/results/kernels_top_p_h200.json): the passes are bound by the comparisons, CANDS of
# them per element, so few candidates and more passes won (8 candidates, 10 passes: 642 us at batch
# 256 over V2-Lite's vocabulary, against 1,091 with 32 candidates and the sort's 2,870).
BLOCK = 1024  # columns per step of a pass
CANDS = 8  # candidates measured per search pass
NUM_WARPS = 8
PROGRAMS = 1024  # programs a pass aims for (rows x splits): several per SM at any batch


def search_passes(cands: int) -> int:
    """Passes that narrow [0, bits(1.0)] to one value: each leaves at most ceil(range / cands)."""
    span, passes = ONE_BITS + 1, 0
    while span > 1:
        span, passes = -(-span // cands), passes + 1
    return passes


PASSES = search_passes(CANDS)  # 10


def nucleus_cut(desc: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """desc [R, C] each row's logits in descending order (-inf allowed past the first), top_p [R] ->
    the logit of the last token the rule keeps, [R, 1]: the tokens at or above it hold at least
    top_p of the row's mass, those strictly above it less; -inf where top_p >= 1 (every token)."""
    e = (desc - desc[:, :1]).exp()  # [R, C] in [0, 1]
    before = e.cumsum(dim=-1) - e  # mass of the tokens sorted ahead
    target = top_p.to(e.dtype)[:, None] * e.sum(dim=-1, keepdim=True)  # [R, 1]
    last = ((before < target).sum(dim=-1, keepdim=True) - 1).clamp(min=0)  # the last kept position
    return desc.gather(1, last).masked_fill(top_p[:, None] >= 1, float("-inf"))


def top_p_filter_ref(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The rule by a sort: x [R, V] float32 logits, top_p [R] -> x with the tokens outside each row's
    nucleus at -inf (module docstring: ties at the cut all kept; top_p >= 1 keeps every token)."""
    cut = nucleus_cut(x.sort(dim=-1, descending=True).values, top_p)
    return x.masked_fill(x < cut, float("-inf"))


if triton is not None:

    @triton.jit
    def _exp_shifted(x, m, EXACT_EXP: tl.constexpr):
        """exp(x - m) as torch computes it on CUDA (libdevice's expf; tl.exp is ex2.approx). The
        interpreter has no libdevice, and its tl.exp (numpy's) is already accurate."""
        if EXACT_EXP:
            return libdevice.exp(x - m)
        return tl.exp(x - m)

    @triton.jit
    def _narrowed(part_ptr, range_ptr, p_ptr, row, R, S, PASS, CANDS: tl.constexpr):
        """The range [lo, hi) after pass PASS - 1: its stored range narrowed by its partial masses
        (summed over the S splits) against top_p times the row's mass (pass 0's first candidate, 0,
        holds every token). Invariant: mass(e >= lo) >= target > mass(e >= hi)."""
        j = tl.arange(0, CANDS)
        part = part_ptr + ((PASS - 1) * R + row) * S * CANDS
        mass = tl.zeros((CANDS,), tl.float32)
        total = tl.zeros((), tl.float32)
        for i in range(0, S):
            mass += tl.load(part + i * CANDS + j)
            total += tl.load(part_ptr + row * S * CANDS + i * CANDS)
        target = tl.load(p_ptr + row) * total
        lo = tl.load(range_ptr + ((PASS - 1) * R + row) * 2)
        span = tl.load(range_ptr + ((PASS - 1) * R + row) * 2 + 1) - lo
        n = tl.maximum(tl.sum((mass >= target).to(tl.int64), axis=0), 1)  # candidates holding enough
        hi = tl.where(n < CANDS, lo + (span * n + CANDS - 1) // CANDS, lo + span)
        return lo + (span * (n - 1) + CANDS - 1) // CANDS, hi

    @triton.jit(do_not_specialize=["S", "CHUNK", "PASS"])
    def _top_p_search_kernel(
        x_ptr, m_ptr, p_ptr, part_ptr, range_ptr, V, stride_x, S, CHUNK, PASS,
        BLOCK: tl.constexpr, CANDS: tl.constexpr, ONE: tl.constexpr, FIRST: tl.constexpr,
        EXACT_EXP: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Program (row, split): the mass at CANDS candidates of the row's range over columns
        [split * CHUNK, (split + 1) * CHUNK) -> part[PASS, row, split, :]; split 0 stores the range
        in range[PASS, row]. part [PASSES, R, S, CANDS] float32, range [PASSES, R, 2] int64."""
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        R = tl.num_programs(0)
        if FIRST:
            lo = tl.zeros((), tl.int64)
            hi = lo + ONE + 1
        else:
            lo, hi = _narrowed(part_ptr, range_ptr, p_ptr, row, R, S, PASS, CANDS)
        if split == 0:
            tl.store(range_ptr + (PASS * R + row) * 2, lo)
            tl.store(range_ptr + (PASS * R + row) * 2 + 1, hi)
        j = tl.arange(0, CANDS).to(tl.int64)
        cand = (lo + ((hi - lo) * j + CANDS - 1) // CANDS).to(tl.int32)  # [CANDS], ascending; cand[0] = lo
        m = tl.load(m_ptr + row)
        x_row = x_ptr + row * stride_x
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros((CANDS, BLOCK), tl.float32)
        for start in range(split * CHUNK, split * CHUNK + CHUNK, BLOCK):
            v = tl.load(x_row + start + offs, mask=start + offs < V, other=float("-inf"))
            e = _exp_shifted(v, m, EXACT_EXP)  # [BLOCK]; 0 past V
            bits = e.to(tl.int32, bitcast=True)
            acc += tl.where(bits[None, :] >= cand[:, None], e[None, :], 0.0)
        out = part_ptr + ((PASS * R + row) * S + split) * CANDS
        tl.store(out + tl.arange(0, CANDS), tl.sum(acc, axis=1))

    @triton.jit(do_not_specialize=["S", "CHUNK", "PASS"])
    def _top_p_write_kernel(
        x_ptr, out_ptr, m_ptr, p_ptr, part_ptr, range_ptr, V, stride_x, stride_out, S, CHUNK, PASS,
        BLOCK: tl.constexpr, CANDS: tl.constexpr, EXACT_EXP: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Program (row, split): the cut from the last pass (PASS = its index + 1), then the chunk
        written: x where e >= the cut, else -inf (top_p >= 1: every token)."""
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        lo, _ = _narrowed(part_ptr, range_ptr, p_ptr, row, tl.num_programs(0), S, PASS, CANDS)
        cut = tl.where(tl.load(p_ptr + row) >= 1.0, 0, lo).to(tl.int32)
        m = tl.load(m_ptr + row)
        x_row = x_ptr + row * stride_x
        out_row = out_ptr + row * stride_out
        offs = tl.arange(0, BLOCK)
        for start in range(split * CHUNK, split * CHUNK + CHUNK, BLOCK):
            ok = start + offs < V
            v = tl.load(x_row + start + offs, mask=ok, other=float("-inf"))
            bits = _exp_shifted(v, m, EXACT_EXP).to(tl.int32, bitcast=True)
            tl.store(out_row + start + offs, tl.where(bits >= cut, v, float("-inf")), mask=ok)


def splits_for(rows: int, vocab: int, block: int = BLOCK, splits: int | None = None) -> tuple[int, int]:
    """(S, CHUNK): each row split into about `splits` chunks of CHUNK columns (a multiple of block);
    by default so that rows x S comes near PROGRAMS, each chunk at least one block."""
    want = splits or max(1, min(-(-PROGRAMS // rows), -(-vocab // block)))
    chunk = -(-vocab // (want * block)) * block
    return -(-vocab // chunk), chunk


def top_p_filter_triton(
    x: torch.Tensor,
    top_p: torch.Tensor,
    block: int = BLOCK,
    cands: int = CANDS,
    num_warps: int = NUM_WARPS,
    splits: int | None = None,
) -> torch.Tensor:
    """The Triton launches: x [R, V] float32 (unit column stride), top_p [R] float32 on x's device ->
    a new [R, V] tensor, as top_p_filter_ref computes it (the sums in another order). `block`,
    `cands` (powers of two), `num_warps` and `splits` (S; default splits_for's): the defaults unless
    a sweep (benchmarks/kernels/top_p.py) or a test."""
    assert HAS_TRITON, "top_p_filter_triton needs triton"
    assert x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1, (x.shape, x.dtype, x.stride())
    assert top_p.shape == (x.shape[0],) and top_p.dtype == torch.float32, (top_p.shape, top_p.dtype)
    out = torch.empty_like(x)
    (r, v), passes = x.shape, search_passes(cands)
    if r == 0:
        return out
    s, chunk = splits_for(r, v, block, splits)
    m = x.amax(dim=1)  # [R]
    part = torch.empty(passes, r, s, cands, dtype=torch.float32, device=x.device)
    ranges = torch.empty(passes, r, 2, dtype=torch.int64, device=x.device)
    p = top_p.contiguous()
    exact = not interpreting()
    for k in range(passes):
        _top_p_search_kernel[(r, s)](
            x, m, p, part, ranges, v, x.stride(0), s, chunk, k,
            BLOCK=block, CANDS=cands, ONE=ONE_BITS, FIRST=k == 0, EXACT_EXP=exact,
            num_warps=num_warps, **pdl_launch(),
        )  # fmt: skip
    _top_p_write_kernel[(r, s)](
        x, out, m, p, part, ranges, v, x.stride(0), out.stride(0), s, chunk, passes,
        BLOCK=block, CANDS=cands, EXACT_EXP=exact, num_warps=num_warps, **pdl_launch(),
    )  # fmt: skip
    return out


def top_p_filter(x: torch.Tensor, top_p: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
    """x [R, V] float32 logits, top_p [R] float32 -> a new [R, V] with the tokens outside each row's
    nucleus at -inf: the Triton launches on CUDA (or `use_triton`), the sort elsewhere."""
    if _use_triton(x, use_triton):
        return top_p_filter_triton(x, top_p)
    return top_p_filter_ref(x, top_p)
