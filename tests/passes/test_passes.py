"""Unit tests of the passes' math, independent of checkpoints."""

from __future__ import annotations

import torch

from mlac.core.fp8 import dequantize_blocks, quantize_blocks
from mlac.core.lazy import concat_rows, eager, stack
from mlac.passes.fp8 import quantize_lazy
from mlac.passes.rope import deinterleave, row_permutation


def test_rope_deinterleave_matches_interleaved_rotation():
    """Permuted rows + rotate-half rope give the same q·k as interleaved rope on the original rows."""
    torch.manual_seed(0)
    rope, t = 16, 5
    q, k = torch.randn(t, rope, dtype=torch.float64), torch.randn(t, rope, dtype=torch.float64)
    theta = torch.rand(t, rope // 2, dtype=torch.float64) * 6
    cos, sin = theta.cos(), theta.sin()

    def interleaved(x):  # HF layout: pairs (x0, x1), (x2, x3) rotate together
        a, b = x[:, 0::2], x[:, 1::2]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(1)

    def rotate_half(x):
        c, s = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        x1, x2 = x.chunk(2, dim=-1)
        return x * c + torch.cat([-x2, x1], -1) * s

    perm = deinterleave(rope)
    ref = interleaved(q) @ interleaved(k).T
    got = rotate_half(q[:, perm]) @ rotate_half(k[:, perm]).T
    torch.testing.assert_close(got, ref)


def test_row_permutation_touches_only_rope_segments():
    idx = row_permutation(12, [2, 8], 4)
    assert idx.tolist() == [0, 1, 2, 4, 3, 5, 6, 7, 8, 10, 9, 11]


def test_quantize_blocks_error_and_partial_blocks():
    torch.manual_seed(0)
    w = torch.randn(200, 300) * torch.logspace(-3, 1, 300)  # columns of very different scale
    q, s = quantize_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3) and s.dtype == torch.float32
    err = (dequantize_blocks(q, s) - w).norm() / w.norm()
    assert err < 0.04, err  # e4m3 has 3 mantissa bits: ~2-3% relative error
    # each block's largest magnitude maps onto the top of the e4m3 range
    assert torch.allclose(q.float().abs().amax(), torch.tensor(448.0))


def test_quantize_lazy_part_by_part_equals_whole():
    torch.manual_seed(1)
    a, b = torch.randn(256, 160), torch.randn(100, 160)
    fused = concat_rows([eager(a), eager(b)])
    q, s = quantize_lazy(fused)
    q_ref, s_ref = quantize_blocks(torch.cat([a, b]))
    assert torch.equal(q.load().view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s.load(), s_ref)
    # streamed chunks carry the same bytes
    streamed = torch.cat([c.reshape(-1).view(torch.uint8) for c in q.chunks()])
    assert torch.equal(streamed, q_ref.reshape(-1).view(torch.uint8))


def test_quantize_lazy_stacked_experts_have_per_expert_blocks():
    torch.manual_seed(2)
    experts = [torch.randn(96, 130) * (e + 1) for e in range(3)]
    q, s = quantize_lazy(stack([eager(x) for x in experts]))
    assert q.shape == (3, 96, 130) and s.shape == (3, 1, 2)
    for e, x in enumerate(experts):
        torch.testing.assert_close(
            dequantize_blocks(q.load()[e], s.load()[e]), x, rtol=0.07, atol=0.07 * (e + 1)
        )
