"""merge_attention: the Triton kernel against the reference, and both against softmax attention over
the union of the two key sets; with and without a row list, rows the list leaves out untouched."""

from __future__ import annotations

import pytest
import torch

from mlac.kernels.attn_merge import merge_attention, merge_attention_ref


def partials(t, h, d, keys, split, seed=0):
    """(scores, values, (o_a, lse_a), (o_b, lse_b)): attention of [T, H] rows over `keys` keys,
    split into [0, split) and [split, keys), each normalized on its own."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(t, h, keys, generator=g) * 2
    v = torch.randn(keys, d, generator=g)

    def part(a, b):
        return torch.softmax(s[..., a:b], -1) @ v[a:b], torch.logsumexp(s[..., a:b], -1)

    return s, v, part(0, split), part(split, keys)


@pytest.mark.parametrize("t,h,d", [(5, 3, 12), (9, 16, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_every_row(triton_device, t, h, d, dtype):
    s, v, (oa, la), (ob, lb) = partials(t, h, d, keys=30, split=11)
    want = torch.softmax(s, -1) @ v
    ref = merge_attention_ref(oa.to(dtype).clone(), la, ob.to(dtype), lb, None)
    dev = triton_device
    got = merge_attention(
        oa.to(dtype).to(dev), la.to(dev), ob.to(dtype).to(dev), lb.to(dev), None, use_triton=True
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ref.float(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(
        got.cpu().float(), ref.float(), rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 8e-3
    )


def test_merge_listed_rows(triton_device):
    t, h, d = 8, 4, 16
    s, v, (oa, la), (ob, lb) = partials(t, h, d, keys=20, split=7, seed=1)
    rows = torch.tensor([6, 1, 3])
    o = oa.clone()
    want = o.clone()
    want[rows] = (torch.softmax(s, -1) @ v)[rows]
    ref = merge_attention_ref(o.clone(), la, ob[rows], lb[rows], rows)
    dev = triton_device
    got = merge_attention(
        o.to(dev), la.to(dev), ob[rows].to(dev), lb[rows].to(dev), rows.to(dev), use_triton=True
    )
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)  # the others untouched, bit for bit
    others = [i for i in range(t) if i not in rows.tolist()]
    assert torch.equal(got.cpu()[others], oa[others])
