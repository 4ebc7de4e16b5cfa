"""The decode MoE kernel (mlac/kernels/moe/decode.py) against fused_moe_ref, and its routing.

Without CUDA the kernel runs under TRITON_INTERPRET=1 on small shapes (set by tests/kernels/_util
before triton is imported); tests marked gpu run V2-Lite's real shapes and skip without CUDA.
"""

from __future__ import annotations

import functools
import importlib
import os
import subprocess
import sys

import pytest
import torch
from _paths import REPO

from tests.kernels import _util

needs_triton = pytest.mark.skipif(not _util.HAS_TRITON, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not _util.HAS_CUDA, reason="needs CUDA")
DEV = "cuda" if _util.HAS_CUDA else "cpu"


def _kernel_modules():
    """(fp8_gemm, moe_decode, moe), their kernels interpreted when there is no CUDA (reloaded if a
    module imported them compiled; moe_decode before moe, which imports from it)."""
    _, gemm, moe = _util.kernel_modules()
    dec = importlib.import_module("mlac.kernels.moe.decode")
    if _util.HAS_TRITON and not _util.HAS_CUDA:
        if type(dec._moe_decode_kernel).__name__ != "InterpretedFunction":
            importlib.reload(dec)
            importlib.reload(moe)
    return gemm, dec, moe


gemm_mod, dec_mod, moe_mod = _kernel_modules()

from mlac.kernels.moe.routing import RoutingSpec, route_ref  # noqa: E402


def _experts(e: int, d: int, i: int, fp8: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    if fp8:
        torch.manual_seed(seed)
        w13, s13 = _util.random_fp8_weight(2 * i, d, (e,), scale=0.02 / d**0.5)
        w2, s2 = _util.random_fp8_weight(d, i, (e,), scale=0.02 / i**0.5)
        return w13.to(DEV), w2.to(DEV), s13.to(DEV), s2.to(DEV)
    w13 = (torch.randn(e, 2 * i, d, generator=g) / d**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, d, i, generator=g) / i**0.5).to(torch.bfloat16)
    return w13.to(DEV), w2.to(DEV), None, None


def _routing(t: int, e: int, top_k: int, seed: int, n_invalid: int = 0):
    """Random top-k routing; `n_invalid` pairs point at another rank's experts (ids >= E or -1)."""
    g = torch.Generator().manual_seed(seed)
    weights, ids = route_ref(torch.randn(t, e, generator=g), RoutingSpec(e, top_k, "greedy", "softmax"))
    flat = ids.view(-1)
    bad = torch.randperm(flat.numel(), generator=g)[:n_invalid]
    flat[bad] = torch.where(torch.arange(bad.numel()) % 2 == 0, e + 5, -1)
    return weights.to(DEV), ids.to(DEV)


def _x(t: int, d: int, seed: int) -> torch.Tensor:
    return torch.randn(t, d, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).to(DEV)


def _decode_config(pairs: int, e: int, fp8: bool) -> dec_mod.MoeDecodeConfig | None:
    """The default where the decode kernel takes the shape by default (one token), else the tiles
    the kernel runs such a shape with when asked (tensor cores with several rows per expert, else
    GEMM2 per token with the top-k sum): the kernel stays correct past its default's reach."""
    default = dec_mod.pick_moe_decode_config(pairs, e, fp8)
    if default is not None or not dec_mod.ENABLED:  # switched off: the grouped path, as asked
        return default
    if pairs > e:
        return dec_mod.MoeDecodeConfig(64, 64, 128, 1, num_warps=4, num_stages=4, dot=True)
    return dec_mod.MoeDecodeConfig(32, 16, 256, 1, num_warps=8, fuse_sum=True)


def _run(x, w13, w2, weights, ids, s13, s2, config=None, **kw):
    if config is None:
        config = _decode_config(ids.numel(), w13.shape[0], s13 is not None)
    with _util.poisoned_empty():
        return moe_mod.fused_moe(x, w13, w2, weights, ids, s13, s2, use_triton=True, config=config, **kw)


def _no_grouped_path(monkeypatch):
    """The grouped GEMMs' first launch raises: a test that passes ran the decode kernel."""

    def no_align(*args, **kwargs):
        raise AssertionError("the grouped GEMM path ran")

    monkeypatch.setattr(moe_mod, "moe_align", no_align)


CASES = [  # T, E, top_k, D, I, invalid pairs
    (1, 8, 2, 200, 96, 0),  # K tails (D, I not multiples of the K block)
    (1, 10, 6, 256, 200, 1),  # E not a power of two, a pair of another rank
    (2, 6, 3, 256, 128, 0),  # experts hit by both tokens
    (5, 10, 6, 200, 96, 3),  # 30 pairs over 10 experts: several rows per expert, chunked by rows
    (9, 40, 4, 128, 96, 2),  # 36 pairs (> SMALL_PAIRS) over 40 experts: GEMM2 per token, rows=1
    (9, 12, 4, 128, 96, 2),  # 36 pairs over 12 experts: GEMM2 per expert, rows=4
]


@needs_triton
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("t,e,top_k,d,i,n_invalid", CASES)
def test_decode_matches_reference(t, e, top_k, d, i, n_invalid, fp8, monkeypatch):
    _no_grouped_path(monkeypatch)
    w13, w2, s13, s2 = _experts(e, d, i, fp8, seed=t * 31 + d)
    weights, ids = _routing(t, e, top_k, seed=t + i, n_invalid=n_invalid)
    x = _x(t, d, seed=t)
    ref = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2)
    _util.assert_close(_run(x, w13, w2, weights, ids, s13, s2), ref)


@needs_triton
@pytest.mark.parametrize(
    "rows,block_n,block_k,fuse_sum", [(1, 32, 128, False), (4, 64, 512, False), (2, 16, 256, True)]
)
def test_decode_configs(rows, block_n, block_k, fuse_sum, monkeypatch):
    """Other tiles: one row per pass (an expert's 5 rows take 5 passes), 4 rows, wider N blocks,
    K steps past K (512 > 256 and 160: masked 128-blocks); GEMM2 per token with the top-k sum
    where experts are shared by several tokens."""
    _no_grouped_path(monkeypatch)
    t, e, top_k, d, i = 5, 3, 2, 256, 160
    w13, w2, s13, s2 = _experts(e, d, i, True, seed=rows)
    weights, ids = _routing(t, e, top_k, seed=rows + 1)
    x = _x(t, d, seed=rows + 2)
    cfg = dec_mod.MoeDecodeConfig(block_n, block_n, block_k, rows, num_warps=2, fuse_sum=fuse_sum)
    ref = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2)
    _util.assert_close(_run(x, w13, w2, weights, ids, s13, s2, cfg), ref)


@needs_triton
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize(
    "t,e,top_k,fuse_sum",
    [(2, 10, 3, True), (5, 10, 6, False), (20, 3, 2, False)],
    ids=["fused", "few", "chunked"],
)
def test_decode_tensor_cores(t, e, top_k, fuse_sum, fp8, monkeypatch):
    """The tensor-core form (dot: 16 rows a pass; 20 tokens over 3 experts take two passes)."""
    _no_grouped_path(monkeypatch)
    d, i = 200, 160
    w13, w2, s13, s2 = _experts(e, d, i, fp8, seed=t + e)
    weights, ids = _routing(t, e, top_k, seed=t + 1, n_invalid=1)
    x = _x(t, d, seed=t + 2)
    cfg = dec_mod.MoeDecodeConfig(32, 16, 128, 1, num_warps=4, fuse_sum=fuse_sum, dot=True)
    ref = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2)
    _util.assert_close(_run(x, w13, w2, weights, ids, s13, s2, cfg), ref)
    if fp8 and fuse_sum:  # Fp8Act input
        x_act = gemm_mod.Fp8Act(*gemm_mod.quantize_act_ref(x), x.dtype)
        ref = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2, x_act=x_act)
        _util.assert_close(_run(x, w13, w2, weights, ids, s13, s2, cfg, x_act=x_act), ref)


@needs_triton
@pytest.mark.parametrize("t", [1, 5])
def test_decode_fp8_act_input(t, monkeypatch):
    """x already quantized by its producer (Fp8Act): GEMM1 reads q and scale, not x."""
    _no_grouped_path(monkeypatch)
    e, top_k, d, i = 10, 4, 256, 200
    w13, w2, s13, s2 = _experts(e, d, i, True, seed=t)
    weights, ids = _routing(t, e, top_k, seed=t + 3)
    x = _x(t, d, seed=t + 4)
    x_act = gemm_mod.Fp8Act(*gemm_mod.quantize_act_ref(x), x.dtype)
    ref = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2, x_act=x_act)
    out = _run(x, w13, w2, weights, ids, s13, s2, x_act=x_act)
    _util.assert_close(out, ref)
    # x itself is not read: a zeroed x gives the same bits
    assert torch.equal(out, _run(torch.zeros_like(x), w13, w2, weights, ids, s13, s2, x_act=x_act))


@needs_triton
@pytest.mark.parametrize("fuse_sum", [False, True], ids=["reduce", "fused-sum"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_decode_adds_shared_out_and_is_deterministic(fp8, fuse_sum, monkeypatch):
    _no_grouped_path(monkeypatch)
    t, e, top_k, d, i = 2, 6, 3, 200, 96
    cfg = dec_mod.MoeDecodeConfig(fuse_sum=fuse_sum)
    w13, w2, s13, s2 = _experts(e, d, i, fp8, seed=5)
    weights, ids = _routing(t, e, top_k, seed=6, n_invalid=1)
    x = _x(t, d, seed=7)
    shared = _x(t, d, seed=8)
    ref = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2, shared_out=shared)
    out = _run(x, w13, w2, weights, ids, s13, s2, cfg, shared_out=shared)
    _util.assert_close(out, ref)
    assert torch.equal(out, _run(x, w13, w2, weights, ids, s13, s2, cfg, shared_out=shared))


@needs_triton
def test_decode_no_local_expert_gives_shared_out(monkeypatch):
    _no_grouped_path(monkeypatch)
    w13, w2, _, _ = _experts(4, 96, 64, False, seed=1)
    x = _x(3, 96, seed=1)
    shared = _x(3, 96, seed=2)
    ids = torch.tensor([[4, 7], [-1, 9], [5, 4]], device=DEV)
    out = _run(x, w13, w2, torch.rand(3, 2, device=DEV), ids, None, None, shared_out=shared)
    assert torch.equal(out, shared)


def test_pick_decode_config_bounds(monkeypatch):
    """By default one token's top-k only (measured: the grouped GEMMs win from 4 tokens on); the
    switch turns it off."""
    assert dec_mod.pick_moe_decode_config(6, 64, fp8=True).fuse_sum  # V2-Lite batch 1
    assert dec_mod.pick_moe_decode_config(6, 64, fp8=False).dot
    assert dec_mod.pick_moe_decode_config(8, 256, fp8=True) is not None  # V3 batch 1
    assert dec_mod.pick_moe_decode_config(12, 64, fp8=False) is None  # batch 2
    assert dec_mod.pick_moe_decode_config(192, 64, fp8=False) is None  # batch 32
    assert dec_mod.pick_moe_decode_config(300, 256, fp8=True) is None  # too many pairs
    assert dec_mod.pick_moe_decode_config(64 * 6, 64, fp8=True) is None  # prefill-like rows per expert
    assert dec_mod.pick_moe_decode_config(40, 8, fp8=True) is None
    monkeypatch.setattr(dec_mod, "ENABLED", False)
    assert dec_mod.pick_moe_decode_config(6, 64, fp8=True) is None


@needs_triton
def test_switch_off_runs_grouped_gemms(monkeypatch):
    """MLAC_MOE_DECODE_KERNEL=0 (ENABLED False): a decode shape runs the grouped GEMMs."""

    def no_decode(*args, **kwargs):
        raise AssertionError("the decode kernel ran")

    monkeypatch.setattr(dec_mod, "ENABLED", False)
    monkeypatch.setattr(moe_mod, "moe_decode_gate_up", no_decode)
    w13, w2, _, _ = _experts(8, 96, 64, False, seed=3)
    weights, ids = _routing(1, 8, 2, seed=4)
    x = _x(1, 96, seed=5)
    _util.assert_close(
        _run(x, w13, w2, weights, ids, None, None), moe_mod.fused_moe_ref(x, w13, w2, weights, ids)
    )


def test_switch_is_read_from_the_environment():
    code = "import mlac.kernels.moe.decode as d; print(d.ENABLED)"
    env = {**os.environ, "MLAC_MOE_DECODE_KERNEL": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- shared experts inside the decode launches ----------------------------------------------------------


def _shared_experts(d: int, i: int, n: int, fp8: bool, seed: int, calls: list | None = None):
    """n shared experts of intermediate i as one MLP (w13 [2S, D], w2 [D, S], S = n * i) and its
    separate path: fused_moe_ref of that one expert with weight 1.0, the model's MLP numerics (GEMM,
    silu * up, GEMM, each rounded to x's dtype; FP8: the intermediate quantized per 128 channels).
    Each call of the separate path is recorded in `calls`."""
    w13, w2, s13, s2 = _experts(1, d, n * i, fp8, seed)

    def mlp(x, x_act):
        if calls is not None:
            calls.append(x.shape[0])
        one = torch.ones(x.shape[0], 1, device=x.device)
        expert0 = torch.zeros(x.shape[0], 1, dtype=torch.int64, device=x.device)
        return moe_mod.fused_moe_ref(x, w13, w2, one, expert0, s13, s2, x_act=x_act)

    scales = (None, None) if s13 is None else (s13[0], s2[0])
    return moe_mod.SharedExperts(w13[0], w2[0], *scales, mlp)


def _with_chunks_as_experts(w13, w2, s13, s2, weights, ids, shared, n):
    """The routed experts with the n shared chunks appended as experts E .. E + n - 1, routed to by
    every token with weight 1.0 (other ranks' ids made -1, which stay invalid): fused_moe_ref of this
    is the fused launches' arithmetic (each chunk's output rounded, all summed in float32, once)."""
    e, two_i, _ = w13.shape
    i = two_i // 2
    s = n * i
    g13 = [
        torch.cat([shared.w13[c * i : (c + 1) * i], shared.w13[s + c * i : s + (c + 1) * i]])
        for c in range(n)
    ]
    g2 = [shared.w2[:, c * i : (c + 1) * i] for c in range(n)]
    w13 = torch.cat([w13, torch.stack(g13)])
    w2 = torch.cat([w2, torch.stack(g2)])
    if s13 is not None:
        b, bs = i // 128, s // 128
        sc13 = [torch.cat([shared.w13_scale[c * b : (c + 1) * b], shared.w13_scale[bs + c * b : bs + (c + 1) * b]])
                for c in range(n)]  # fmt: skip
        s13 = torch.cat([s13, torch.stack(sc13)])
        s2 = torch.cat([s2, torch.stack([shared.w2_scale[:, c * b : (c + 1) * b] for c in range(n)])])
    t = ids.shape[0]
    ids = torch.where((ids >= 0) & (ids < e), ids, -1)
    chunk_ids = (e + torch.arange(n, device=ids.device)).expand(t, n)
    weights = torch.cat([weights, torch.ones(t, n, dtype=weights.dtype, device=weights.device)], dim=1)
    return w13, w2, weights, torch.cat([ids, chunk_ids], dim=1), s13, s2


FORMS = {  # the decode forms a MoeDecodeConfig selects
    "cuda-sum": dec_mod.MoeDecodeConfig(32, 16, 256, 1, num_warps=8, fuse_sum=True),
    "dot-sum": dec_mod.MoeDecodeConfig(
        64, 16, 512, 1, num_warps=8, num_stages=3, fuse_sum=True, dot=True
    ),  # FP8
    "dot-reduce": dec_mod.MoeDecodeConfig(
        64, 32, 128, 1, num_warps=4, num_stages=3, dot=True
    ),  # bf16 default
    "cuda-reduce": dec_mod.MoeDecodeConfig(32, 32, 256, 2, num_warps=4),
}
SHARED_CASES = [  # T, E, top_k, D, I, shared chunks n, invalid pairs
    (1, 8, 2, 256, 128, 2, 0),  # V2-Lite's form: one token, two shared experts
    (1, 10, 6, 200, 256, 1, 1),  # D tail, one shared expert, a pair of another rank (expert parallel)
    (3, 6, 2, 256, 128, 3, 1),  # several tokens: the chunks' rows P + c * T + t
]


@needs_triton
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("t,e,top_k,d,i,n,n_invalid", SHARED_CASES)
def test_shared_experts_ride_in_the_decode_launches(t, e, top_k, d, i, n, n_invalid, fp8, form, monkeypatch):
    """The shared MLP is not run apart; the result is the chunks-as-experts reference's (the same
    arithmetic), and the separate MLP's up to rounding: there the shared output is rounded to bf16
    once before the float32 sum, here each chunk's output is (and the float32 sums run in another
    order), so the two differ by bf16 roundings of partial sums (relative error well under 1e-2).
    The kernels must be right for any slot tile, so chunks that widen the fused sum go in here too."""
    _no_grouped_path(monkeypatch)
    monkeypatch.setattr(moe_mod, "shared_widens_sum", lambda top_k, n: False)
    w13, w2, s13, s2 = _experts(e, d, i, fp8, seed=t + i)
    weights, ids = _routing(t, e, top_k, seed=t + n, n_invalid=n_invalid)
    x = _x(t, d, seed=t + 1)
    calls = []
    shared = _shared_experts(d, i, n, fp8, seed=t + 2, calls=calls)
    x_act = gemm_mod.Fp8Act(*gemm_mod.quantize_act_ref(x), x.dtype) if fp8 and form == "cuda-sum" else None
    out = _run(x, w13, w2, weights, ids, s13, s2, FORMS[form], shared=shared, x_act=x_act)
    assert calls == [], "the shared MLP ran apart"
    chunked = _with_chunks_as_experts(w13, w2, s13, s2, weights, ids, shared, n)
    _util.assert_close(out, moe_mod.fused_moe_ref(x, *chunked, x_act=x_act))
    separate = shared.mlp(x, x_act)
    _util.assert_close(out, moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2, separate, x_act))
    assert torch.equal(out, _run(x, w13, w2, weights, ids, s13, s2, FORMS[form], shared=shared, x_act=x_act))


@needs_triton
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_shared_switch_off_is_the_separate_mlp(fp8, monkeypatch):
    """MLAC_MOE_SHARED_FUSED=0 (SHARED_FUSED False): the shared MLP runs apart, once, and the result
    is the bits of today's path (its output given as shared_out)."""
    _no_grouped_path(monkeypatch)
    t, e, top_k, d, i, n = 1, 8, 2, 256, 128, 2
    w13, w2, s13, s2 = _experts(e, d, i, fp8, seed=11)
    weights, ids = _routing(t, e, top_k, seed=12)
    x = _x(t, d, seed=13)
    calls = []
    shared = _shared_experts(d, i, n, fp8, seed=14, calls=calls)
    monkeypatch.setattr(dec_mod, "SHARED_FUSED", False)
    out = _run(x, w13, w2, weights, ids, s13, s2, shared=shared)
    assert calls == [t]
    assert torch.equal(out, _run(x, w13, w2, weights, ids, s13, s2, shared_out=shared.mlp(x, None)))


@needs_triton
@pytest.mark.parametrize(
    "fp8,i,s,t",
    [(True, 96, 192, 1), (False, 128, 64, 1), (False, 64, 128, 4)],
    ids=["fp8-I-not-128", "S-not-multiple-of-I", "grouped-shape"],
)
def test_shared_runs_apart_where_it_does_not_fit(fp8, i, s, t, monkeypatch):
    """FP8 with I % 128 != 0 (a chunk would split scale blocks), S not a multiple of I (expert
    parallel with the shared experts sliced finer), or a shape the grouped GEMMs take: the shared
    MLP runs apart and its output is added as shared_out (the same bits)."""
    e, top_k, d = 6, 2, 256
    w13, w2, s13, s2 = _experts(e, d, i, fp8, seed=i)
    weights, ids = _routing(t, e, top_k, seed=s)
    x = _x(t, d, seed=t)
    calls = []
    shared = _shared_experts(d, s, 1, fp8, seed=3, calls=calls)
    config = dec_mod.pick_moe_decode_config(ids.numel(), e, fp8) or moe_mod.pick_moe_config(
        ids.numel(), e, fp8
    )
    out = _run(x, w13, w2, weights, ids, s13, s2, config, shared=shared)
    assert calls == [t]
    assert torch.equal(out, _run(x, w13, w2, weights, ids, s13, s2, config, shared_out=shared.mlp(x, None)))


def test_shared_chunks_that_widen_the_fused_sum_run_apart():
    """The fused sum's slot tile is top_k + n rounded up to a power of two: V2-Lite's 6 + 2 keep 8
    slots (inside), V3's 8 + 1 would double them (apart: measured slower on an H200)."""
    assert not dec_mod.shared_widens_sum(6, 2) and not dec_mod.shared_widens_sum(5, 3)
    assert (
        dec_mod.shared_widens_sum(8, 1)
        and dec_mod.shared_widens_sum(2, 2)
        and dec_mod.shared_widens_sum(4, 1)
    )


@needs_triton
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_widened_fused_sum_keeps_the_shared_mlp_apart(fp8, monkeypatch):
    """top-4 + 1 shared chunk: FP8 (the fused-sum form) runs the shared MLP apart, bf16 (GEMM2 +
    reduce, no slot tile) takes it in."""
    _no_grouped_path(monkeypatch)
    t, e, top_k, d, i = 1, 8, 4, 256, 128
    w13, w2, s13, s2 = _experts(e, d, i, fp8, seed=21)
    weights, ids = _routing(t, e, top_k, seed=22)
    x = _x(t, d, seed=23)
    calls = []
    shared = _shared_experts(d, i, 1, fp8, seed=24, calls=calls)
    config = dec_mod.pick_moe_decode_config(ids.numel(), e, fp8)
    assert config is not None and config.fuse_sum == fp8
    out = _run(x, w13, w2, weights, ids, s13, s2, config, shared=shared)
    assert calls == ([t] if fp8 else [])
    if fp8:
        assert torch.equal(
            out, _run(x, w13, w2, weights, ids, s13, s2, config, shared_out=shared.mlp(x, None))
        )


@needs_triton
@pytest.mark.parametrize("preset,fp8", [("tiny-v2-lite", False), ("tiny-v2-lite", True), ("tiny-v3", True)])
def test_model_moe_layer_at_batch_1_takes_its_shared_experts_in(preset, fp8, artifact, monkeypatch):
    """A compiled artifact's MoE layer at batch 1 on the Triton path: its shared MLP does not run
    (the decode launches take the shared experts), and its partial sum is the separate MLP's
    (MLAC_MOE_SHARED_FUSED=0) up to the roundings test_shared_experts_ride_in_the_decode_launches
    names; with FP8 both for x and for x quantized by the norm (Fp8Act)."""
    import mlac.runtime.model.model as model_mod
    from mlac.runtime.engine.engine import Engine

    engine = Engine.from_artifact(artifact(preset, fp8=fp8), verify=False, num_blocks=16)
    moe = next(m for m in engine.runner.model.modules() if isinstance(m, model_mod.MoE))
    assert moe.shared is not None and (moe.w13_scale is not None) == fp8
    monkeypatch.setattr(model_mod, "fused_moe", functools.partial(moe_mod.fused_moe, use_triton=True))
    # the tiny presets' top-2/4 + shared chunks widen the FP8 fused sum (real V2-Lite's 6 + 2 do not):
    # take them in regardless, this test is about the layer's wiring
    monkeypatch.setattr(moe_mod, "shared_widens_sum", lambda top_k, n: False)
    calls = []
    real_shared = model_mod.MoE._shared
    monkeypatch.setattr(model_mod.MoE, "_shared", lambda self, *a: calls.append(1) or real_shared(self, *a))
    x = _x(1, moe.gate.shape[1], seed=21)
    inputs = [x] + ([gemm_mod.Fp8Act(*gemm_mod.quantize_act_ref(x), x.dtype, x)] if fp8 else [])
    for x_in in inputs:
        fused = moe.partial(x_in)
        assert calls == []
        monkeypatch.setattr(dec_mod, "SHARED_FUSED", False)
        separate = moe.partial(x_in)
        assert calls == [1]
        _util.assert_close(fused, separate)
        monkeypatch.setattr(dec_mod, "SHARED_FUSED", True)
        calls.clear()


COMPILE_SM90 = r"""
import inspect, json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mlac.kernels.moe import decode as dec
from mlac.kernels.moe import grouped as moe

def compile_sm90(kernel, ptrs, consts, warps):
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "*fp32") if n.endswith("_ptr") else "i32"
           for n in inspect.signature(kernel.fn).parameters}
    k = triton.compile(ASTSource(kernel, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "launch_pdl": True})
    return "griddepcontrol.wait" in k.asm["ptx"]

fp8 = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "sb_ptr": "*fp8e4nv", "c_ptr": "*bf16", "ids_ptr": "*i64"}
bf16 = {n: "*bf16" for n in ("a_ptr", "as_ptr", "b_ptr", "bs_ptr", "sb_ptr", "sbs_ptr", "c_ptr")} | {"ids_ptr": "*i64"}
down = {"h_ptr": "*bf16", "b_ptr": "*fp8e4nv", "sb_ptr": "*fp8e4nv", "ids_ptr": "*i64", "out_ptr": "*bf16",
        "shared_ptr": "*bf16"}
out = [
    compile_sm90(dec._moe_decode_kernel, fp8, dict(GATED=True, A_MODE=1, FP8_W=True, ROUND_BF16=True, N_SHARED=2,
                 ROWS=1, BLOCK_N=32, SUB=4, PAIRS=32, FP8_MAX_C=448.0, PDL=True), 8),
    compile_sm90(dec._moe_decode_down_sum_kernel, down, dict(TOP_K=6, N_SHARED=2, KPAD=8, A_MODE=2, FP8_W=True,
                 HAS_SHARED=False, BLOCK_N=16, SUB=4, FP8_MAX_C=448.0, PDL=True), 8),
    compile_sm90(dec._moe_decode_dot_kernel, bf16, dict(GATED=False, A_MODE=0, FP8_W=False, ROUND_BF16=True,
                 N_SHARED=2, BLOCK_N=64, BLOCK_K=128, PAIRS=32, UPCAST_DOT=False, FP8_MAX_C=448.0, PDL=True), 4),
    compile_sm90(moe._moe_reduce_kernel, {"y_ptr": "*bf16", "ids_ptr": "*i64", "out_ptr": "*bf16",
                 "shared_ptr": "*bf16"}, dict(TOP_K=6, BLOCK_T=1, BLOCK_D=1024, N_SHARED=2, PDL=True), 4),
]
print(json.dumps(out))
"""


@needs_triton
def test_kernels_with_shared_chunks_compile_for_sm90(tmp_path):
    """The interpreter runs what the GPU compiler may refuse (pointer selects, say): the decode
    kernels with two shared chunks, and moe.py's reduce with two shared rows, compile for sm90 (on
    the CPU; nothing is run), each with its PDL wait."""
    script = tmp_path / "compile_sm90.py"
    script.write_text(COMPILE_SM90)
    root = str(REPO)
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": root, "TRITON_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[true, true, true, true]"


def test_shared_chunks_counts_what_fits(monkeypatch):
    """n = S / I where the layout fits (V2-Lite: I = 1408 = 11 * 128, two shared experts)."""
    w13 = torch.empty(64, 2 * 1408, 2048, dtype=torch.float8_e4m3fn)
    s13 = torch.empty(64, 22, 16)

    def shared(s, fp8=True, dtype=torch.float8_e4m3fn):
        scales = (torch.empty(2 * s // 128, 16), torch.empty(16, s // 128)) if fp8 else (None, None)
        w = torch.empty(2 * s, 2048, dtype=dtype), torch.empty(2048, s, dtype=dtype)
        return dec_mod.SharedExperts(*w, *scales, mlp=None)

    assert dec_mod.shared_chunks(shared(2816), w13, s13) == 2  # tp 1
    assert dec_mod.shared_chunks(shared(1408), w13, s13) == 1  # ep = tp = 2: whole experts, shared halved
    assert dec_mod.shared_chunks(shared(704 + 64), w13, s13) == 0  # not a multiple of I
    assert dec_mod.shared_chunks(shared(2816, fp8=False, dtype=torch.bfloat16), w13, s13) == 0  # other format
    assert dec_mod.shared_chunks(None, w13, s13) == 0
    monkeypatch.setattr(dec_mod, "SHARED_FUSED", False)
    assert dec_mod.shared_chunks(shared(2816), w13, s13) == 0


def test_shared_switch_is_read_from_the_environment():
    code = "import mlac.kernels.moe.decode as d; print(d.SHARED_FUSED)"
    for value, expected in (("0", "False"), ("1", "True")):
        env = {**os.environ, "MLAC_MOE_SHARED_FUSED": value}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == expected


# ---- GPU: V2-Lite's real shapes -------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 4, 32])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_decode_v2_lite(fp8, t, monkeypatch):
    """E=64, top-6, D=2048, I=1408: the decode kernel against the reference (exact expert products)
    and against the grouped GEMMs; the same bits on a second run."""
    monkeypatch.setattr(moe_mod, "fp8_linear_ref", _util.fp8_linear_ref64)
    e, top_k, d, i = 64, 6, 2048, 1408
    w13, w2, s13, s2 = _experts(e, d, i, fp8, seed=t)
    weights, ids = _routing(t, e, top_k, seed=t + 1, n_invalid=t // 4)
    x = _x(t, d, seed=t)
    # from 4 tokens on the grouped GEMMs win and the server gives them these shapes; the decode
    # kernels must still be right there (a MoeDecodeConfig asks for them)
    cfg = moe_mod.pick_moe_decode_config(ids.numel(), e, fp8)
    assert (cfg is not None) == (t == 1)
    cfg = cfg or dec_mod.MoeDecodeConfig(fuse_sum=fp8, dot=not fp8)
    ref = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2)
    out = _run(x, w13, w2, weights, ids, s13, s2, cfg)
    _util.assert_close(out, ref)
    grouped = _run(x, w13, w2, weights, ids, s13, s2, moe_mod.pick_moe_config(ids.numel(), e, fp8))
    _util.assert_close(out, grouped)
    assert torch.equal(out, _run(x, w13, w2, weights, ids, s13, s2, cfg))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fuse_sum", [False, True], ids=["reduce", "fused-sum"])
def test_gpu_decode_fp8_act_v2_lite(fuse_sum, monkeypatch):
    """V2-Lite FP8 at batch 4 with the activation quantized by its producer, both GEMM2 forms."""
    monkeypatch.setattr(moe_mod, "fp8_act_linear_ref", _fp8_act_linear_ref64)
    monkeypatch.setattr(moe_mod, "fp8_linear_ref", _util.fp8_linear_ref64)
    e, top_k, d, i, t = 64, 6, 2048, 1408, 4
    w13, w2, s13, s2 = _experts(e, d, i, True, seed=9)
    weights, ids = _routing(t, e, top_k, seed=10)
    x = _x(t, d, seed=11)
    x_act = gemm_mod.Fp8Act(*gemm_mod.quantize_act_ref(x), x.dtype)
    cfg = dec_mod.MoeDecodeConfig(32, 16, 256, 1, num_warps=8, fuse_sum=fuse_sum)
    ref = moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2, x_act=x_act)
    _util.assert_close(_run(x, w13, w2, weights, ids, s13, s2, cfg, x_act=x_act), ref)


def _fp8_act_linear_ref64(x_act, w, w_scale, out_dtype=None):
    """fp8_act_linear_ref with the product in float64 (exact expert products on the GPU)."""
    from mlac.core.fp8 import BLOCK, expand_block_scale

    k = x_act.q.shape[-1]
    x_deq = x_act.q.double() * x_act.scale.double().repeat_interleave(BLOCK, dim=-1)[:, :k]
    w_deq = w.double() * expand_block_scale(w_scale.double(), *w.shape)
    return (x_deq @ w_deq.t()).to(out_dtype or x_act.dtype)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 32])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_decode_in_cuda_graph(fp8, t):
    """Captured in a CUDA graph (no host sync), replayed on new routings and inputs copied into the
    captured buffers: the eager call's bits."""
    e, top_k, d, i = 64, 6, 2048, 1408
    w13, w2, s13, s2 = _experts(e, d, i, fp8, seed=t)
    weights, ids = _routing(t, e, top_k, seed=t + 1)
    x = _x(t, d, seed=t + 2)

    def call():
        return moe_mod.fused_moe(x, w13, w2, weights, ids, s13, s2)

    call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for seed in (3, 4):
        new_weights, new_ids = _routing(t, e, top_k, seed=seed + 100 * t)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        x.copy_(_x(t, d, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, call())


def test_config_override_replaces_the_picked_tiles(monkeypatch):
    """MLAC_MOE_DECODE_CONFIG (JSON per weight kind) replaces the tiles of that kind only; anything
    else (not JSON, an unknown kind or field) is a one-line MlacError naming the variable."""
    from mlac.core.errors import MlacError

    monkeypatch.setattr(
        dec_mod, "CONFIG_TEXT", '{"fp8": {"block_n1": 64, "block_n2": 16, "dot": true, "fuse_sum": true}}'
    )
    picked = dec_mod.pick_moe_decode_config(6, 64, fp8=True)
    assert picked == dec_mod.MoeDecodeConfig(64, 16, dot=True, fuse_sum=True)
    assert dec_mod.pick_moe_decode_config(6, 64, fp8=False) == dec_mod.MoeDecodeConfig(
        64, 32, 128, 1, 4, 3, dot=True
    )
    assert dec_mod.config_override(None) == {} and dec_mod.config_override("") == {}
    for bad in ('{"fp8": {"block_q": 1}}', "fp8:64", '{"fp16": {}}', "[1]"):
        with pytest.raises(MlacError, match="MLAC_MOE_DECODE_CONFIG") as err:
            dec_mod.config_override(bad)
        assert "\n" not in str(err.value)
