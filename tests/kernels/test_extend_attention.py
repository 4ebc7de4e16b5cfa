"""Extend attention (varlen, cached prefix, causal): Triton kernel against the float32 reference.

Tolerances (relative Frobenius error): float32 inputs 1e-5 under the interpreter, 5e-3 on a GPU
(tf32 dots); bf16 inputs 1e-2.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import poison, rel_err

from mlac.kernels.attention.extend import (
    _split_head_dim,
    extend_attention,
    extend_attention_ref,
    extend_attention_triton,
)

# Buffers the wrappers allocate themselves (outputs, split-KV partials) start as NaN.
pytestmark = pytest.mark.usefixtures("poison_empty")


def make_case(q_lens, prefix_lens, heads, kv_heads, d_qk, d_v, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv_lens = [p + q for p, q in zip(prefix_lens, q_lens, strict=True)]
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_kv = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), heads, d_qk, generator=g).to(dtype)
    k = torch.randn(sum(kv_lens), kv_heads, d_qk, generator=g).to(dtype)
    v = torch.randn(sum(kv_lens), kv_heads, d_v, generator=g).to(dtype)
    to = dict(device=device)
    return q.to(**to), k.to(**to), v.to(**to), cu_q.to(**to), cu_kv.to(**to), max(q_lens), 1 / math.sqrt(d_qk)


def tol(dtype, device):
    if dtype == torch.float32:
        return 1e-5 if device == "cpu" else 5e-3
    return 1e-2


def check(case, causal=True, config=None):
    q, k, v, cu_q, cu_kv, max_q, scale = case
    o_ref, lse_ref = extend_attention_ref(q, k, v, cu_q, cu_kv, scale, causal)
    out = poison(torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device))
    o, lse = extend_attention_triton(q, k, v, cu_q, cu_kv, max_q, scale, causal, True, out, config)
    err = rel_err(o, o_ref)
    assert err < tol(q.dtype, q.device.type), f"rel err {err}"
    torch.testing.assert_close(
        lse.cpu(), lse_ref.cpu(), rtol=1e-4, atol=1e-3 if tol(q.dtype, q.device.type) < 1e-4 else 2e-2
    )


@pytest.mark.parametrize(
    "q_lens,prefix_lens,heads,kv_heads,d_qk,d_v",
    [
        ([1, 7, 33], [0, 0, 0], 1, 1, 32, 16),  # plain causal prefill
        ([7, 33, 1], [5, 130, 0], 3, 3, 48, 32),  # prefixes; d_qk = 32 + 16
        ([33, 2], [1, 17], 4, 2, 24, 20),  # grouped kv heads; odd head dims
        ([130], [9], 2, 2, 16, 16),
    ],
)
def test_extend_attention_sweep(triton_device, q_lens, prefix_lens, heads, kv_heads, d_qk, d_v):
    check(make_case(q_lens, prefix_lens, heads, kv_heads, d_qk, d_v, torch.float32, triton_device))


@pytest.mark.parametrize("block_m,block_n", [(32, 16), (16, 32)])
def test_extend_attention_other_tiles(triton_device, block_m, block_n):
    # Other tile shapes put the causal diagonal and the full/masked boundary elsewhere.
    case = make_case([33, 7], [19, 40], 2, 2, 32, 16, torch.float32, triton_device, seed=6)
    check(case, config=dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, num_stages=2))


def absorbed_case(q_lens, prefix_lens, heads, dtype, device, seed=0, kv_lora=512, rope=64):
    """DeepSeek's absorbed form: one latent kv head, d_qk = kv_lora + rope, v = a view of k's first kv_lora."""
    q, k, _, cu_q, cu_kv, max_q, _ = make_case(
        q_lens, prefix_lens, heads, 1, kv_lora + rope, 16, dtype, device, seed
    )
    return q, k, k[:, :, :kv_lora], cu_q, cu_kv, max_q, 1 / math.sqrt(192)


def test_extend_attention_absorbed_form(triton_device):
    check(absorbed_case([3, 17], [20, 0], 2, torch.float32, triton_device, seed=7))


def test_extend_attention_not_causal(triton_device):
    check(make_case([7, 20], [3, 0], 2, 2, 32, 32, torch.float32, triton_device, seed=1), causal=False)


def test_extend_attention_bf16(triton_device):
    check(make_case([17, 40], [30, 3], 3, 3, 48, 32, torch.bfloat16, triton_device, seed=2))


def test_extend_attention_dispatch_cpu_uses_reference(monkeypatch, setting):
    import mlac.kernels.attention.extend as mod

    setting("MLAC_FORCE_TRITON", None)

    def no_triton(*args, **kwargs):
        raise AssertionError("extend_attention picked Triton for CPU tensors")

    monkeypatch.setattr(mod, "extend_attention_triton", no_triton)
    q, k, v, cu_q, cu_kv, _, scale = make_case([3, 4], [2, 0], 2, 2, 16, 8, torch.float32, "cpu", seed=3)
    torch.testing.assert_close(
        extend_attention(q, k, v, cu_q, cu_kv, scale), extend_attention_ref(q, k, v, cu_q, cu_kv, scale)[0]
    )


def test_extend_attention_ref_matches_sdpa():
    # No prefix: the reference equals torch's causal scaled_dot_product_attention per sequence.
    q, k, v, cu_q, cu_kv, _, scale = make_case([5, 9], [0, 0], 2, 2, 16, 16, torch.float64, "cpu", seed=4)
    o, _ = extend_attention_ref(q, k, v, cu_q, cu_kv, scale)
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1),
            k[a:b].transpose(0, 1),
            v[a:b].transpose(0, 1),
            is_causal=True,
            scale=scale,
        ).transpose(0, 1)
        torch.testing.assert_close(o[a:b], ref, rtol=1e-5, atol=1e-6)  # the reference computes in float32


def test_split_head_dim():
    pytest.importorskip("triton")
    assert _split_head_dim(192) == (128, 64)
    assert _split_head_dim(128) == (128, 0)
    assert _split_head_dim(40) == (32, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_extend_attention_gpu_real_sizes(heads):
    # DeepSeek MHA form: d_qk = 128 + 64, d_v = 128; chunked prefill with prefixes.
    case = make_case(
        [1, 200, 1000, 513], [0, 3000, 17, 128], heads, heads, 192, 128, torch.bfloat16, "cuda", seed=5
    )
    check(case)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_extend_attention_gpu_absorbed_form(heads):
    check(absorbed_case([1, 64, 300, 17], [0, 2000, 17, 4096], heads, torch.bfloat16, "cuda", seed=8))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_lora,rope", [(256, 32), (128, 32), (256, 64)])
def test_extend_attention_gpu_absorbed_form_of_small_models(kv_lora, rope):
    # The trained small model's latent (256 + 32): 128/64/3 tiles asked for 276 KiB of shared
    # memory; 8 warps with a 32-wide rope tail miscompiled (an illegal address, wrong output).
    case = absorbed_case(
        [1, 64, 300], [0, 200, 17], 8, torch.bfloat16, "cuda", seed=9, kv_lora=kv_lora, rope=rope
    )
    check(case)


def shared_case(p, q_lens, own_prefix, shares, heads, d_qk, d_v, dtype, device, seed=0):
    """k/v rows: a shared prefix of p rows, then each sequence's own keys (its own cached ones and
    its new tokens); shares[i]: sequence i attends to the shared rows first."""
    q, k, v, cu_q, cu_kv, max_q, scale = make_case(
        q_lens, own_prefix, heads, heads, d_qk, d_v, dtype, "cpu", seed
    )
    g = torch.Generator().manual_seed(seed + 100)
    kp = torch.randn(p, heads, d_qk, generator=g).to(dtype)
    vp = torch.randn(p, heads, d_v, generator=g).to(dtype)
    k, v, cu_kv = torch.cat([kp, k]), torch.cat([vp, v]), cu_kv + p
    sh = (torch.tensor(shares, dtype=torch.int32, device=device), p)
    to = dict(device=device)
    return (q.to(**to), k.to(**to), v.to(**to), cu_q.to(**to), cu_kv.to(**to), max_q, scale), sh


def test_shared_prefix_reference_is_each_sequence_over_its_own_copy():
    """The reference with a shared prefix equals the plain one over each sharer's keys laid out as
    prefix + own keys (the causal diagonal aligned to the end)."""
    (q, k, v, cu_q, cu_kv, _, scale), sh = shared_case(
        21, [5, 3, 8], [4, 0, 2], [1, 0, 1], 2, 16, 8, torch.float64, "cpu", 11
    )
    o, lse = extend_attention_ref(q, k, v, cu_q, cu_kv, scale, True, sh)
    p, starts = sh[1], cu_kv.tolist()
    for i, shares in enumerate([1, 0, 1]):
        rows = (list(range(p)) if shares else []) + list(range(starts[i], starts[i + 1]))
        a, b = cu_q[i].item(), cu_q[i + 1].item()
        cu = torch.tensor([0, b - a], dtype=torch.int32)
        want, want_lse = extend_attention_ref(
            q[a:b], k[rows], v[rows], cu, torch.tensor([0, len(rows)], dtype=torch.int32), scale
        )
        torch.testing.assert_close(o[a:b], want)
        torch.testing.assert_close(lse[a:b], want_lse)


@pytest.mark.parametrize("p", [16, 37])
def test_extend_attention_shared_prefix(triton_device, p):
    """Sharers and a non-sharer in one launch, a prefix that is and is not a whole key tile."""
    case, sh = shared_case(
        p, [7, 20, 3], [3, 0, 5], [1, 1, 0], 2, 48, 32, torch.float32, triton_device, seed=12
    )
    q, k, v, cu_q, cu_kv, max_q, scale = case
    o_ref, lse_ref = extend_attention_ref(q, k, v, cu_q, cu_kv, scale, True, sh)
    o, lse = extend_attention_triton(q, k, v, cu_q, cu_kv, max_q, scale, True, True, shared=sh)
    assert rel_err(o, o_ref) < tol(q.dtype, q.device.type)
    torch.testing.assert_close(lse.cpu(), lse_ref.cpu(), rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
def test_extend_attention_gpu_shared_prefix():
    """DeepSeek's MHA form, bf16: 24 sequences of 64 new tokens after a 2,000-token shared prefix,
    two of them with own cached tokens, one not sharing."""
    q_lens, own = [64] * 24, [0] * 22 + [40, 300]
    case, sh = shared_case(2000, q_lens, own, [1] * 23 + [0], 16, 192, 128, torch.bfloat16, "cuda", seed=13)
    q, k, v, cu_q, cu_kv, max_q, scale = case
    o_ref, _ = extend_attention_ref(q, k, v, cu_q, cu_kv, scale, True, sh)
    o = extend_attention(q, k, v, cu_q, cu_kv, scale, max_seqlen_q=max_q, shared=sh)
    assert rel_err(o, o_ref) < tol(q.dtype, "cuda")
