"""benchmarks/kernels/moe_peers.py: the rows it hands DeepGEMM's grouped GEMM are each pair's token, grouped
by expert in segments padded to DeepGEMM's alignment, and its pipeline (GEMM1, silu_mul_quant, GEMM2)
computes fused MoE's pair outputs. CPU, small shapes, DeepGEMM stood in for by a per-row reference of
its contiguous grouped GEMM (same arguments, same layout)."""

from __future__ import annotations

import types

import pytest
import torch
from _paths import REPO, load_script

from mlac.core.fp8 import BLOCK, dequantize_blocks
from mlac.kernels.moe.fused import fused_moe_ref

ALIGN = 4


def grouped_ref(lhs, rhs, out, m_indices):
    """DeepGEMM's m_grouped_gemm_fp8_fp8_bf16_nt_contiguous, row by row: out[r] = lhs[r] @ rhs[m_indices[r]].T."""
    (a, a_s), (w, s) = lhs, rhs
    af = a.float() * a_s.repeat_interleave(BLOCK, dim=1)[:, : a.shape[1]]
    for r in range(a.shape[0]):
        e = int(m_indices[r])
        out[r] = (af[r] @ dequantize_blocks(w[e], s[e]).t()).to(out.dtype)


@pytest.fixture(scope="module")
def mp():
    mod = load_script(REPO / "benchmarks" / "kernels" / "moe_peers.py")
    mod.DEV = "cpu"
    return mod


def test_deepgemm_rows_are_pairs_grouped_by_expert_and_give_fused_moes_outputs(mp):
    dg = types.SimpleNamespace(
        get_m_alignment_for_contiguous_layout=lambda: ALIGN,
        get_col_major_tma_aligned_tensor=lambda t: t,
        m_grouped_gemm_fp8_fp8_bf16_nt_contiguous=grouped_ref,
    )
    torch.manual_seed(0)
    e, top_k, d, i, t = 4, 2, 256, 128, 5
    w13, s13 = mp.experts(e, 2 * i, d)
    w2, s2 = mp.experts(e, d, i)
    x = torch.randn(t, d, dtype=torch.bfloat16)
    ids = torch.rand(t, e).topk(top_k, dim=1).indices.to(torch.int32).contiguous()
    call, row_of_pair, y = mp.deepgemm_pipeline(dg, x, ids, w13, s13, w2, s2)

    counts = torch.bincount(ids.flatten().long(), minlength=e)
    assert y.shape[0] == int(((counts + ALIGN - 1) // ALIGN * ALIGN).sum())  # padded segments
    assert row_of_pair.unique().numel() == t * top_k  # one row per pair
    starts = torch.cumsum((counts + ALIGN - 1) // ALIGN * ALIGN, 0) - (counts + ALIGN - 1) // ALIGN * ALIGN
    for p, row in enumerate(row_of_pair.tolist()):  # each pair inside its expert's segment
        expert = int(ids.flatten()[p])
        assert int(starts[expert]) <= row < int(starts[expert]) + int(counts[expert])

    call()
    want = fused_moe_ref(x, w13, w2, torch.ones(t, top_k), ids, s13, s2).float()  # [T, D]: top-k summed
    got = y[row_of_pair].float().view(t, top_k, d).sum(dim=1)
    assert ((got - want).norm() / want.norm()).item() < 0.01
