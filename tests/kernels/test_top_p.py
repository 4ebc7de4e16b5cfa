"""Top-p without a sort (kernels/top_p.py): the Triton kernel keeps exactly the tokens the sort-based
reference keeps, ties at the cut, -inf columns, top_p 1 and a tiny top_p included."""

from __future__ import annotations

import pytest
import torch

from mlac.kernels import top_p as tp

pytestmark = pytest.mark.usefixtures("poison_empty")


def logits(rows: int, v: int, seed: int, ties: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(rows, v, generator=g)
    if ties:  # bf16 logits: many tokens share a value, the cut among them
        x = x.to(torch.bfloat16).float()
    return x


def kept(x: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(x)


def test_search_passes_narrow_the_range_to_one_value():
    assert [tp.search_passes(c) for c in (16, 32, 64)] == [8, 6, 5]
    assert tp.PASSES == tp.search_passes(tp.CANDS)


def test_reference_keeps_the_smallest_nucleus_and_its_ties():
    x = torch.tensor([0.05, 0.5, 0.15, 0.3]).log().expand(4, 4).clone()
    out = tp.top_p_filter_ref(x, torch.tensor([0.7, 0.5, 0.81, 1.0]))
    assert kept(out).tolist() == [[False, True, False, True], [False, True, False, False],
                                  [False, True, True, True], [True] * 4]  # fmt: skip
    tie = torch.tensor([[0.4, 0.2, 0.2, 0.2]]).log()  # the cut falls among three equal tokens
    assert kept(tp.top_p_filter_ref(tie, torch.tensor([0.5]))).tolist() == [[True] * 4]
    assert kept(tp.top_p_filter_ref(tie, torch.tensor([0.4]))).tolist() == [[True, False, False, False]]


@pytest.mark.parametrize(
    "v,ties,splits,cands",
    [(1000, False, None, 8), (3001, True, None, 32), (700, True, 1, 8), (3001, False, 5, 16)],
)
def test_kernel_keeps_what_the_reference_keeps(triton_device, v, ties, splits, cands):
    x = logits(6, v, seed=v, ties=ties)
    x[2, ::3] = float("-inf")  # filtered before (top-k, logit_bias): mass 0
    x[4] = x[4] / 20  # a flat row: the nucleus holds most of the vocabulary
    x[1] = torch.arange(v) * 3e-7  # neighbours ~5 ulps of e apart: a cut off by a few ulps shows
    p = torch.tensor([0.9, 0.95, 0.5, 1.0, 0.99, 1e-4])
    want = tp.top_p_filter_ref(x, p)
    got = tp.top_p_filter_triton(
        x.to(triton_device), p.to(triton_device), block=128, cands=cands, splits=splits
    ).cpu()
    assert torch.equal(kept(got), kept(want)), (kept(got) != kept(want)).sum(dim=-1)
    assert torch.equal(got[kept(want)], x[kept(want)])  # kept logits unchanged
    assert kept(got)[3].all()  # top_p 1: every token
    assert kept(got)[5].sum() == (x[5] == x[5].max()).sum()  # tiny: the top token (and its ties)


def test_splits_cover_the_row_with_enough_programs():
    for rows, vocab in ((1, 102_400), (32, 102_400), (256, 129_280), (3, 700), (1, 100)):
        s, chunk = tp.splits_for(rows, vocab)
        assert chunk % tp.BLOCK == 0 and (s - 1) * chunk < vocab <= s * chunk, (rows, vocab, s, chunk)
        assert rows * s >= min(tp.PROGRAMS, rows * -(-vocab // tp.BLOCK)) // 2, (rows, vocab, s)


def test_kernel_on_strided_rows_and_no_rows(triton_device):
    wide = logits(3, 1200, seed=5).to(triton_device)
    x = wide[:, :1000]  # row stride 1200
    p = torch.full((3,), 0.8, device=triton_device)
    assert torch.equal(kept(tp.top_p_filter_triton(x, p)).cpu(), kept(tp.top_p_filter_ref(x.cpu(), p.cpu())))
    assert tp.top_p_filter_triton(x[:0], p[:0]).shape == (0, 1000)
