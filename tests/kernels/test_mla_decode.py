"""MLA decode (paged latent cache): Triton kernel against the float32 reference.

CPU: the Triton path under TRITON_INTERPRET=1 at small sizes. GPU (`-m gpu`): real sizes.
Tolerances (relative Frobenius error against the float32 reference): float32 inputs 1e-5 under the
interpreter (exact float32 dots) and 5e-3 on a GPU (tl.dot on float32 runs in tf32); bf16 inputs
1e-2 (bf16 operands, probabilities rounded to bf16, bf16 output); FP8 caches are compared with the
reference on the dequantized cache at the bf16 tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import HAS_CUDA, poison, rel_err

from mlac.kernels.attention.mla_decode import mla_decode, mla_decode_ref, mla_decode_triton
from mlac.kernels.attention.mla_decode_plan import choose_num_splits, default_config

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

# Buffers the wrappers allocate themselves (outputs, split-KV partials) start as NaN.
pytestmark = pytest.mark.usefixtures("poison_empty")


def make_case(batch_lens, heads, kv_lora, rope, page, q_dtype, kv_dtype, device, seed=0):
    """Random inputs; cache pages of each request scattered in random order, every slot that holds
    no token of any request set to NaN (a kernel that reads one fails), unused table entries -1."""
    g = torch.Generator().manual_seed(seed)
    b = len(batch_lens)
    pages = [-(-n // page) for n in batch_lens]
    max_blocks = max(pages) + 1
    num_blocks = sum(pages) + 3
    d = kv_lora + rope
    cache = torch.randn(num_blocks, page, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((b, max_blocks), -1, dtype=torch.int32)
    used = torch.zeros(num_blocks, page, dtype=torch.bool)
    nxt = 0
    for i, n in enumerate(batch_lens):
        for j in range(pages[i]):
            blk = perm[nxt].item()
            nxt += 1
            table[i, j] = blk
            used[blk, : min(page, n - j * page)] = True
    cache[~used] = float("nan")
    kv_scale = None
    if kv_dtype in FP8:
        kv_scale = torch.tensor([0.05 if kv_dtype == torch.float8_e4m3fn else 0.01], dtype=torch.float32)
        cache = (cache / kv_scale).to(kv_dtype)
    else:
        cache = cache.to(kv_dtype)
    q_nope = torch.randn(b, heads, kv_lora, generator=g).to(q_dtype)
    q_rope = torch.randn(b, heads, rope, generator=g).to(q_dtype)
    seq_lens = torch.tensor(batch_lens, dtype=torch.int32)
    scale = 1.0 / math.sqrt(d)
    to = dict(device=device)
    args = (q_nope.to(**to), q_rope.to(**to), cache.to(**to), table.to(**to), seq_lens.to(**to), scale)
    return args, (kv_scale.to(**to) if kv_scale is not None else None)


def tol(q_dtype, device) -> float:
    if q_dtype == torch.float32:
        return 1e-5 if device == "cpu" else 5e-3
    return 1e-2


def check(args, kv_scale, device, num_splits=None, config=None, return_lse=True):
    q_nope = args[0]
    o_ref, lse_ref = mla_decode_ref(*args, kv_scale=kv_scale)
    out = poison(torch.empty_like(q_nope))
    lse = poison(torch.empty(q_nope.shape[:2], dtype=torch.float32, device=q_nope.device))
    o, lse = mla_decode_triton(
        *args, kv_scale=kv_scale, return_lse=True, num_splits=num_splits, config=config, out=out, lse_out=lse
    )
    assert o.data_ptr() == out.data_ptr()
    err = rel_err(o, o_ref)
    assert err < tol(q_nope.dtype, device), f"o rel err {err}"
    assert torch.allclose(
        lse.cpu(), lse_ref.cpu(), rtol=1e-4, atol=1e-3 if tol(q_nope.dtype, device) < 1e-4 else 2e-2
    )


# Heads 1, 3 (padded head tile), 16, 20 (two head tiles); lengths 1, 7, 33, 130 in one batch.
@pytest.mark.parametrize(
    "heads,kv_lora,rope,page,num_splits",
    [
        (1, 32, 16, 16, 1),
        (3, 32, 16, 4, None),
        (16, 32, 16, 16, 3),
        (20, 64, 16, 5, 2),
        (3, 40, 12, 1, 1),  # dims that are not powers of two, one token per page
    ],
)
def test_mla_decode_sweep(triton_device, heads, kv_lora, rope, page, num_splits):
    args, kv_scale = make_case(
        [1, 7, 33, 130], heads, kv_lora, rope, page, torch.float32, torch.float32, triton_device
    )
    check(args, kv_scale, triton_device, num_splits)


@pytest.mark.parametrize("page", [8, 32])  # 32: tiles lie inside one page (one lookup per tile)
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, *FP8])
def test_mla_decode_dtypes(triton_device, kv_dtype, page):
    args, kv_scale = make_case([5, 33, 64], 4, 32, 16, page, torch.bfloat16, kv_dtype, triton_device, seed=1)
    check(args, kv_scale, triton_device, num_splits=2)


@pytest.mark.parametrize("tile_in_page", [True, False])
def test_mla_decode_other_tiles(triton_device, tile_in_page):
    # 32-head, 32-token tiles; page 64 holds two tiles (one lookup per tile) unless disabled.
    args, kv_scale = make_case(
        [1, 70, 130], 40, 32, 16, 64, torch.float32, torch.float32, triton_device, seed=7
    )
    cfg = dict(BLOCK_H=32, BLOCK_N=32, num_warps=4, num_stages=2, ctas_per_sm=1, tile_in_page=tile_in_page)
    cfg["min_split_tiles"] = 1
    check(args, kv_scale, triton_device, num_splits=2, config=cfg)


def test_mla_decode_more_splits_than_tiles(triton_device):
    # 9 splits of a 7-token request: most splits are empty and must merge as nothing.
    args, kv_scale = make_case([7, 2], 3, 32, 16, 4, torch.float32, torch.float32, triton_device, seed=2)
    check(args, kv_scale, triton_device, num_splits=9)


@pytest.mark.parametrize("min_split_tiles", [1, 3])
def test_mla_decode_splits_per_request(triton_device, min_split_tiles):
    # A grid of 16 splits (as a CUDA graph sized for a long context has) over requests of 1 to 200
    # tokens: each uses only the splits its length fills; the rest must not count in the merge.
    args, kv_scale = make_case(
        [1, 16, 17, 50, 200], 3, 32, 16, 8, torch.float32, torch.float32, triton_device, seed=4
    )
    cfg = {**default_config(3, torch.device(triton_device)), "min_split_tiles": min_split_tiles}
    check(args, kv_scale, triton_device, num_splits=16, config=cfg)


def test_mla_decode_strided_queries(triton_device):
    # q_nope_lat and q_rope as views of one [B, H, kv_lora + rope] tensor (non-contiguous rows).
    args, kv_scale = make_case([9, 20], 5, 32, 16, 8, torch.float32, torch.float32, triton_device, seed=3)
    q = torch.cat([args[0], args[1]], dim=-1)
    args = (q[..., :32], q[..., 32:], *args[2:])
    check(args, kv_scale, triton_device, num_splits=2)


def test_mla_decode_dispatch_cpu_uses_reference(monkeypatch, setting):
    import mlac.kernels.attention.mla_decode as mod

    setting("MLAC_FORCE_TRITON", None)

    def no_triton(*args, **kwargs):
        raise AssertionError("mla_decode picked Triton for CPU tensors")

    monkeypatch.setattr(mod, "mla_decode_triton", no_triton)
    args, kv_scale = make_case([3, 10], 2, 32, 16, 4, torch.float32, torch.float32, "cpu", seed=4)
    o = mla_decode(*args)
    torch.testing.assert_close(o, mla_decode_ref(*args)[0])


def test_mla_decode_ref_matches_dense_attention():
    # The reference itself against plain softmax attention on an unpaged copy.
    args, _ = make_case([6, 11], 3, 16, 8, 4, torch.float64, torch.float64, "cpu", seed=5)
    q_nope, q_rope, cache, table, seq_lens, scale = args
    o, lse = mla_decode_ref(*args)
    for i, n in enumerate(seq_lens.tolist()):
        kv = cache[table[i, : -(-n // 4)].long()].reshape(-1, 24)[:n]  # [n, 24]
        q = torch.cat([q_nope[i], q_rope[i]], -1)  # [H, 24]
        p = torch.softmax(q @ kv.t() * scale, -1)
        torch.testing.assert_close(o[i], (p @ kv[:, :16]).to(o.dtype), rtol=1e-5, atol=1e-6)  # float32 ref


def test_choose_num_splits():
    assert choose_num_splits(64, 1, 8192, 32, 264) == 4  # 256 programs fill one wave
    assert choose_num_splits(128, 2, 256, 32, 132) == 1
    assert choose_num_splits(1, 1, 65536, 32, 264) > 16  # one long request spreads over the chip


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_mla_decode_gpu_real_sizes(heads, kv_dtype):
    lens = [1, 100, 1000, 4097, 8192, 33]
    args, kv_scale = make_case(lens, heads, 512, 64, 64, torch.bfloat16, kv_dtype, "cuda", seed=6)
    check(args, kv_scale, "cuda")
    check(args, kv_scale, "cuda", num_splits=1)
    assert HAS_CUDA
