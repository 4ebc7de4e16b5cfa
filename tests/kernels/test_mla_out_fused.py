"""The fused MLA decode output: head_bmm merging mla_decode's split-KV partials in its x load, and
quantizing its output for an FP8 o_proj, against the separate launches it replaces.

The fused kernels must give the same bits as split + merge kernel + head_bmm (+ act_quant): the
merge runs the merge kernel's own Triton helpers and the quantization `quant_groups`, so these
tests compare with `torch.equal`, with the same head_bmm tile config on both sides (a different
N tile could change the dot's summation order). Against the float32 references they use the
bf16 tolerance of the other kernel tests.
CPU: the Triton path under TRITON_INTERPRET=1 (conftest) at small sizes; GPU (`-m gpu`): V2-Lite.
"""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from test_mla_decode import make_case

from mlac.kernels.attention import head_bmm as hb
from mlac.kernels.attention.mla_decode import mla_decode_ref, mla_decode_triton
from mlac.kernels.attention.split_kv import SplitKV, merge_ref
from mlac.kernels.fp8_quant import Fp8Act, act_quant
from mlac.kernels.gemm.fp8_gemm import quantize_act_ref
from mlac.runtime.model import attention as attention_forms

pytestmark = pytest.mark.usefixtures("poison_empty")  # buffers the wrappers allocate start as NaN

# Lengths 1, 7, 33, 130 in one batch: 1, 1, 3 and 5 of 5 splits used (16-token splits on CPU).
LENS = [1, 7, 33, 130]


def _case(device, heads=3, kv_lora=64, v=128, lens=LENS, kv_dtype=torch.bfloat16, seed=0, rope=16, page=16):
    args, kv_scale = make_case(lens, heads, kv_lora, rope, page, torch.bfloat16, kv_dtype, device, seed)
    g = torch.Generator().manual_seed(seed + 1)
    w_vc = (torch.randn(heads, kv_lora, v, generator=g) / kv_lora**0.5).to(torch.bfloat16).to(device)
    return args, kv_scale, w_vc


def _both(args, kv_scale, num_splits):
    """(SplitKV partials, o_lat merged by the merge kernel) of the same inputs: the split kernel is
    deterministic, so the merge kernel merged exactly these partials."""
    parts = mla_decode_triton(*args, kv_scale=kv_scale, num_splits=num_splits, merge=False)
    return parts, mla_decode_triton(*args, kv_scale=kv_scale, num_splits=num_splits)


@pytest.mark.parametrize(
    "heads,kv_lora,num_splits,lens",
    [
        (3, 64, 5, LENS),
        (1, 96, 2, [50]),  # K = 96: not a multiple of the 128-wide K tile
        (20, 64, 3, [0, 16, 17, 5] * 5),  # 20 rows: two row tiles; an empty request
    ],
)
def test_merging_head_bmm_is_bitwise_split_merge_head_bmm(triton_device, heads, kv_lora, num_splits, lens):
    args, kv_scale, w_vc = _case(triton_device, heads, kv_lora, 96, lens)
    parts, o_lat = _both(args, kv_scale, num_splits)
    assert isinstance(parts, SplitKV) and parts.o_part.shape[2] == num_splits
    cfg = hb.CONFIGS["decode_heads"]
    fused = hb.head_bmm(parts, w_vc, use_triton=True, config=cfg)
    assert torch.equal(fused, hb.head_bmm(o_lat, w_vc, use_triton=True, config=cfg))
    # and the merged o_lat is the attention's (bf16 tolerance against the float32 reference)
    o_ref, _ = mla_decode_ref(*args, kv_scale=kv_scale)
    assert rel_err(o_lat, o_ref) < 1e-2
    assert rel_err(merge_ref(parts), o_ref) < 1e-2
    assert rel_err(fused, hb.head_bmm_ref(o_ref, w_vc)) < 1e-2


def test_fp8_cache_partials_merge_bitwise(triton_device):
    args, kv_scale, w_vc = _case(triton_device, kv_dtype=torch.float8_e4m3fn, seed=3)
    parts, o_lat = _both(args, kv_scale, 4)
    cfg = hb.CONFIGS["decode_heads"]
    assert torch.equal(
        hb.head_bmm(parts, w_vc, use_triton=True, config=cfg),
        hb.head_bmm(o_lat, w_vc, config=cfg, use_triton=True),
    )


@pytest.mark.parametrize("name", ["large", "large_w8a8"])
def test_large_batch_tiles_merge_bitwise(triton_device, name):
    """The B > 64 tiles (merge_chunk 2, 64-wide K steps for "large"), here on 20 requests."""
    args, kv_scale, w_vc = _case(triton_device, heads=2, lens=[0, 16, 17, 5, 130] * 4, seed=11)
    parts, o_lat = _both(args, kv_scale, 5)
    cfg = hb.CONFIGS[name]
    plain = hb.head_bmm(o_lat, w_vc, use_triton=True, config=cfg)
    assert torch.equal(hb.head_bmm(parts, w_vc, use_triton=True, config=cfg), plain)
    act = hb.head_bmm(parts, w_vc, quant_out=True, use_triton=True, config=cfg)
    q, sc = quantize_act_ref(plain.flatten(1))
    assert torch.equal(act.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(act.scale, sc)


def test_one_split_returns_o_lat(triton_device):
    """num_splits == 1: the split kernel writes o_lat itself; merge=False returns it as it is."""
    args, kv_scale, _ = _case(triton_device)
    o = mla_decode_triton(*args, kv_scale=kv_scale, num_splits=1, merge=False)
    assert isinstance(o, torch.Tensor)
    assert torch.equal(o, mla_decode_triton(*args, kv_scale=kv_scale, num_splits=1))


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("v", [128, 256])
def test_quant_out_is_bitwise_act_quant_of_output(triton_device, split, v):
    args, kv_scale, w_vc = _case(triton_device, v=v, seed=v + split)
    parts, o_lat = _both(args, kv_scale, 5)
    cfg = hb.CONFIGS["decode_heads"]
    plain = hb.head_bmm(o_lat, w_vc, use_triton=True, config=cfg)  # [B, H, v]
    act = hb.head_bmm(parts if split else o_lat, w_vc, quant_out=True, use_triton=True, config=cfg)
    assert isinstance(act, Fp8Act) and act.dtype == torch.bfloat16
    q_ref, s_ref = quantize_act_ref(plain.flatten(1))
    assert act.q.shape == q_ref.shape and act.scale.shape == s_ref.shape == (len(LENS), 3 * v // 128)
    assert torch.equal(act.q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(act.scale, s_ref)
    q_k, s_k = act_quant(plain.flatten(1))  # the launch it replaces
    assert torch.equal(act.q.view(torch.uint8), q_k.view(torch.uint8)) and torch.equal(act.scale, s_k)


def test_quant_out_needs_whole_groups(triton_device):
    args, kv_scale, w_vc = _case(triton_device, v=96)
    with pytest.raises(AssertionError, match="128"):
        hb.head_bmm(args[0], w_vc, quant_out=True, use_triton=True)


def test_reference_path_merges_and_quantizes():
    """On CPU without Triton, head_bmm merges SplitKV by merge_ref and quantizes by quantize_act_ref."""
    g = torch.Generator().manual_seed(5)
    b, h, s, c = 3, 2, 4, 128
    lse = torch.randn(b, h, s, generator=g)
    lse[0, :, 1:] = float("nan")  # request 0 used one split: the others are never read
    parts = SplitKV(
        torch.randn(b, h, s, c, generator=g),
        lse,
        torch.tensor([10, 40, 64], dtype=torch.int32),
        16,
        torch.bfloat16,
    )
    w = torch.randn(h, c, 128, generator=g).bfloat16()
    o_lat = merge_ref(parts)
    assert torch.isfinite(o_lat).all()
    assert torch.equal(o_lat[0], parts.o_part[0, :, 0].bfloat16())  # one split: its own o
    out = hb.head_bmm(parts, w, use_triton=False)
    assert torch.equal(out, hb.head_bmm_ref(o_lat, w))
    act = hb.head_bmm(parts, w, quant_out=True, use_triton=False)
    q, sc = quantize_act_ref(out.flatten(1))
    assert torch.equal(act.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(act.scale, sc)


@pytest.mark.parametrize("fp8_wo", [False, True])
def test_decode_absorbed_fused_equals_separate_launches(triton_device, monkeypatch, fp8_wo, setting):
    """decode_absorbed's fuse_out on against off (ModelOptions.fused_mla_out): on launches no
    merge kernel, and gives the same o (or o_proj's Fp8Act of it) within bf16 tolerance: the two
    paths tile head_bmm's N differently (128 against 64), which may change the dot's summation
    order on a GPU (the kernel tests above compare bits at equal tiles)."""
    import mlac.kernels.attention.split_kv as md

    args, kv_scale, w_vc = _case(triton_device, heads=3, kv_lora=64, v=128)
    q_lat, q_rope, cache, table, seq_lens, scale = args
    g = torch.Generator().manual_seed(9)
    w_kc = (torch.randn(3, 32, 64, generator=g) / 32**0.5).bfloat16().to(triton_device)
    q_nope = torch.randn(len(LENS), 3, 32, generator=g).bfloat16().to(triton_device)
    setting("MLAC_FORCE_TRITON", "1")

    def run(fuse_out: bool = True):
        return attention_forms.decode_absorbed(
            q_nope,
            q_rope,
            cache,
            table,
            seq_lens,
            scale,
            kv_scale,
            w_kc,
            w_vc,
            quant_out=fp8_wo,
            fuse_out=fuse_out,
        )

    merges = []
    real_merge = md._mla_decode_merge_kernel
    monkeypatch.setattr(md, "_mla_decode_merge_kernel", _Counting(real_merge, merges))
    off = run(fuse_out=False)
    assert merges, "this case must split the sequences (num_splits > 1)"
    assert isinstance(off, torch.Tensor) and off.shape == (len(LENS), 3 * 128)
    merges.clear()
    on = run()
    assert not merges, "the fused path launched the merge kernel"
    monkeypatch.setattr(attention_forms, "FUSED_MERGE_MAX_SPLITS", 1)  # more splits merge in their own launch
    apart = run()
    assert merges, "splits above FUSED_MERGE_MAX_SPLITS must go to the merge kernel"
    assert type(apart) is type(on)  # o_proj's Fp8Act still comes from head_bmm
    if fp8_wo:
        assert rel_err(_dequant(apart.q, apart.scale), _dequant(on.q, on.scale)) < 1e-2
    else:
        assert rel_err(apart, on) < 1e-2
    if not fp8_wo:
        assert isinstance(on, torch.Tensor) and on.shape == off.shape and rel_err(on, off) < 1e-2
        return
    assert isinstance(on, Fp8Act) and on.dtype == off.dtype
    q_off, s_off = quantize_act_ref(off)  # what o_proj's act_quant makes of the separate launches' o
    assert on.q.shape == q_off.shape and on.scale.shape == s_off.shape
    assert rel_err(_dequant(on.q, on.scale), _dequant(q_off, s_off)) < 1e-2


def _dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.repeat_interleave(128, dim=-1)


class _Counting:
    """A kernel whose launches are recorded: `kernel[grid](...)` appends grid to `seen`."""

    def __init__(self, kernel, seen: list):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        self.seen.append(grid)
        return self.kernel[grid]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_splits", [None, 7, 64])
def test_real_sizes_bitwise_gpu(kv_dtype, num_splits):
    """V2-Lite: 16 heads, kv_lora 512, rope 64, v 128, 64-token pages; the default tiles."""
    lens = [1, 700, 4096, 20000]
    args, kv_scale, w_vc = _case("cuda", 16, 512, 128, lens, kv_dtype, seed=1, rope=64, page=64)
    parts = mla_decode_triton(*args, kv_scale=kv_scale, num_splits=num_splits, merge=False)
    o_lat = mla_decode_triton(*args, kv_scale=kv_scale, num_splits=num_splits)
    if not isinstance(parts, SplitKV):  # the default chose one split: o_lat itself
        assert num_splits is None and torch.equal(parts, o_lat)
        parts = o_lat
    cfg = hb.CONFIGS["decode_heads"]
    plain = hb.head_bmm(o_lat, w_vc, config=cfg)
    assert torch.equal(hb.head_bmm(parts, w_vc, config=cfg), plain)
    act = hb.head_bmm(parts, w_vc, quant_out=True, config=cfg)
    q_k, s_k = act_quant(plain.flatten(1))
    assert torch.equal(act.q.view(torch.uint8), q_k.view(torch.uint8)) and torch.equal(act.scale, s_k)
    o_ref, _ = mla_decode_ref(*args, kv_scale=kv_scale)
    assert rel_err(plain, hb.head_bmm_ref(o_ref, w_vc)) < 1e-2
