"""The shared experts inside fused MoE's decode launches (shared.py): as chunks that look like
experts, against fused_moe_ref of those chunks and of the separate MLP; where they run apart; a
compiled model's MoE layer; the kernels with shared chunks compiled for sm90.

Without CUDA the kernels run under TRITON_INTERPRET=1 on small shapes (test_moe_decode's helpers).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from _paths import REPO
from test_moe_decode import (
    config_mod,
    gemm_mod,
    grouped_mod,
    make_experts,
    make_routing,
    make_x,
    moe_mod,
    needs_triton,
    no_grouped_path,
    run_moe,
)

from tests.kernels import _util

shared_mod = _util.kernel_modules()["shared"]


def _shared_experts(d: int, i: int, n: int, fp8: bool, seed: int, calls: list | None = None):
    """n shared experts of intermediate i as one MLP (w13 [2S, D], w2 [D, S], S = n * i) and its
    separate path: fused_moe_ref of that one expert with weight 1.0, the model's MLP numerics (GEMM,
    silu * up, GEMM, each rounded to x's dtype; FP8: the intermediate quantized per 128 channels).
    Each call of the separate path is recorded in `calls`."""
    w13, w2, s13, s2 = make_experts(1, d, n * i, fp8, seed)

    def mlp(x, x_act):
        if calls is not None:
            calls.append(x.shape[0])
        one = torch.ones(x.shape[0], 1, device=x.device)
        expert0 = torch.zeros(x.shape[0], 1, dtype=torch.int64, device=x.device)
        return moe_mod.fused_moe_ref(x, w13, w2, one, expert0, s13, s2, x_act=x_act)

    scales = (None, None) if s13 is None else (s13[0], s2[0])
    return shared_mod.SharedExperts(w13[0], w2[0], *scales, mlp)


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
    "cuda-sum": config_mod.MoeDecodeConfig(32, 16, 256, 1, num_warps=8, fuse_sum=True),
    "dot-sum": config_mod.MoeDecodeConfig(
        64, 16, 512, 1, num_warps=8, num_stages=3, fuse_sum=True, dot=True
    ),  # FP8
    "dot-reduce": config_mod.MoeDecodeConfig(
        64, 32, 128, 1, num_warps=4, num_stages=3, dot=True
    ),  # bf16 default
    "cuda-reduce": config_mod.MoeDecodeConfig(32, 32, 256, 2, num_warps=4),
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
    no_grouped_path(monkeypatch)
    monkeypatch.setattr(moe_mod, "shared_widens_sum", lambda top_k, n: False)
    w13, w2, s13, s2 = make_experts(e, d, i, fp8, seed=t + i)
    weights, ids = make_routing(t, e, top_k, seed=t + n, n_invalid=n_invalid)
    x = make_x(t, d, seed=t + 1)
    calls = []
    shared = _shared_experts(d, i, n, fp8, seed=t + 2, calls=calls)
    x_act = gemm_mod.Fp8Act(*gemm_mod.quantize_act_ref(x), x.dtype) if fp8 and form == "cuda-sum" else None
    out = run_moe(x, w13, w2, weights, ids, s13, s2, FORMS[form], shared=shared, x_act=x_act)
    assert calls == [], "the shared MLP ran apart"
    chunked = _with_chunks_as_experts(w13, w2, s13, s2, weights, ids, shared, n)
    _util.assert_close(out, moe_mod.fused_moe_ref(x, *chunked, x_act=x_act))
    separate = shared.mlp(x, x_act)
    _util.assert_close(out, moe_mod.fused_moe_ref(x, w13, w2, weights, ids, s13, s2, separate, x_act))
    assert torch.equal(
        out, run_moe(x, w13, w2, weights, ids, s13, s2, FORMS[form], shared=shared, x_act=x_act)
    )


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
    w13, w2, s13, s2 = make_experts(e, d, i, fp8, seed=i)
    weights, ids = make_routing(t, e, top_k, seed=s)
    x = make_x(t, d, seed=t)
    calls = []
    shared = _shared_experts(d, s, 1, fp8, seed=3, calls=calls)
    config = config_mod.pick_moe_decode_config(ids.numel(), e, fp8) or grouped_mod.pick_moe_config(
        ids.numel(), e, fp8
    )
    out = run_moe(x, w13, w2, weights, ids, s13, s2, config, shared=shared)
    assert calls == [t]
    assert torch.equal(
        out, run_moe(x, w13, w2, weights, ids, s13, s2, config, shared_out=shared.mlp(x, None))
    )


def test_shared_chunks_that_widen_the_fused_sum_run_apart():
    """The fused sum's slot tile is top_k + n rounded up to a power of two: V2-Lite's 6 + 2 keep 8
    slots (inside), V3's 8 + 1 would double them (apart: measured slower on an H200)."""
    assert not shared_mod.shared_widens_sum(6, 2) and not shared_mod.shared_widens_sum(5, 3)
    assert (
        shared_mod.shared_widens_sum(8, 1)
        and shared_mod.shared_widens_sum(2, 2)
        and shared_mod.shared_widens_sum(4, 1)
    )


@needs_triton
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_widened_fused_sum_keeps_the_shared_mlp_apart(fp8, monkeypatch):
    """top-4 + 1 shared chunk: FP8 (the fused-sum form) runs the shared MLP apart, bf16 (GEMM2 +
    reduce, no slot tile) takes it in."""
    no_grouped_path(monkeypatch)
    t, e, top_k, d, i = 1, 8, 4, 256, 128
    w13, w2, s13, s2 = make_experts(e, d, i, fp8, seed=21)
    weights, ids = make_routing(t, e, top_k, seed=22)
    x = make_x(t, d, seed=23)
    calls = []
    shared = _shared_experts(d, i, 1, fp8, seed=24, calls=calls)
    config = config_mod.pick_moe_decode_config(ids.numel(), e, fp8)
    assert config is not None and config.fuse_sum == fp8
    out = run_moe(x, w13, w2, weights, ids, s13, s2, config, shared=shared)
    assert calls == ([t] if fp8 else [])
    if fp8:
        assert torch.equal(
            out, run_moe(x, w13, w2, weights, ids, s13, s2, config, shared_out=shared.mlp(x, None))
        )


@needs_triton
@pytest.mark.parametrize("preset,fp8", [("tiny-v2-lite", False), ("tiny-v2-lite", True), ("tiny-v3", True)])
def test_model_moe_layer_at_batch_1_takes_its_shared_experts_in(preset, fp8, artifact, monkeypatch):
    """A compiled artifact's MoE layer at batch 1 on the Triton path: its shared MLP does not run
    (the decode launches take the shared experts), and its partial sum is that of the same call with
    the shared MLP run apart (its output given as shared_out) up to the roundings
    test_shared_experts_ride_in_the_decode_launches names; with FP8 both for x and for x quantized
    by the norm (Fp8Act)."""
    import mlac.runtime.model.model as model_mod
    from mlac.runtime.engine.engine import Engine

    engine = Engine.from_artifact(artifact(preset, fp8=fp8), verify=False, num_blocks=16)
    moe = next(m for m in engine.runner.model.modules() if isinstance(m, model_mod.MoE))
    assert moe.shared is not None and (moe.w13_scale is not None) == fp8
    moe_calls = []

    def triton_moe(*args, **kwargs):
        moe_calls.append((args, kwargs))
        return moe_mod.fused_moe(*args, use_triton=True, **kwargs)

    monkeypatch.setattr(model_mod, "fused_moe", triton_moe)
    # the tiny presets' top-2/4 + shared chunks widen the FP8 fused sum (real V2-Lite's 6 + 2 do not):
    # take them in regardless, this test is about the layer's wiring
    monkeypatch.setattr(moe_mod, "shared_widens_sum", lambda top_k, n: False)
    calls = []
    real_shared = model_mod.MoE._shared
    monkeypatch.setattr(model_mod.MoE, "_shared", lambda self, *a: calls.append(1) or real_shared(self, *a))
    x = make_x(1, moe.gate.shape[1], seed=21)
    inputs = [x] + ([gemm_mod.Fp8Act(*gemm_mod.quantize_act_ref(x), x.dtype, x)] if fp8 else [])
    for x_in in inputs:
        fused = moe.partial(x_in)
        assert calls == []
        ((args, kwargs),) = moe_calls
        shared = kwargs.pop("shared")
        separate = moe_mod.fused_moe(
            *args, use_triton=True, **kwargs, shared_out=shared.mlp(args[0], kwargs["x_act"])
        )
        assert calls == [1]
        _util.assert_close(fused, separate)
        calls.clear()
        moe_calls.clear()


COMPILE_SM90 = r"""
import inspect, json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mlac.kernels.moe import decode as dec
from mlac.kernels.moe import decode_sum
from mlac.kernels.moe import reduce

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
    compile_sm90(decode_sum._moe_decode_down_sum_kernel, down, dict(TOP_K=6, N_SHARED=2, KPAD=8, A_MODE=2, FP8_W=True,
                 HAS_SHARED=False, BLOCK_N=16, SUB=4, FP8_MAX_C=448.0, PDL=True), 8),
    compile_sm90(dec._moe_decode_dot_kernel, bf16, dict(GATED=False, A_MODE=0, FP8_W=False, ROUND_BF16=True,
                 N_SHARED=2, BLOCK_N=64, BLOCK_K=128, PAIRS=32, UPCAST_DOT=False, FP8_MAX_C=448.0, PDL=True), 4),
    compile_sm90(reduce._moe_reduce_kernel, {"y_ptr": "*bf16", "ids_ptr": "*i64", "out_ptr": "*bf16",
                 "shared_ptr": "*bf16"}, dict(TOP_K=6, BLOCK_T=1, BLOCK_D=1024, N_SHARED=2, PDL=True), 4),
]
print(json.dumps(out))
"""


@needs_triton
def test_kernels_with_shared_chunks_compile_for_sm90(tmp_path):
    """The interpreter runs what the GPU compiler may refuse (pointer selects, say): the decode
    kernels with two shared chunks, and the top-k reduce with two shared rows, compile for sm90 (on
    the CPU; nothing is run), each with its PDL wait."""
    script = tmp_path / "compile_sm90.py"
    script.write_text(COMPILE_SM90)
    root = str(REPO)
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": root, "TRITON_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[true, true, true, true]"


def test_shared_chunks_counts_what_fits():
    """n = S / I where the layout fits (V2-Lite: I = 1408 = 11 * 128, two shared experts)."""
    w13 = torch.empty(64, 2 * 1408, 2048, dtype=torch.float8_e4m3fn)
    s13 = torch.empty(64, 22, 16)

    def shared(s, fp8=True, dtype=torch.float8_e4m3fn):
        scales = (torch.empty(2 * s // 128, 16), torch.empty(16, s // 128)) if fp8 else (None, None)
        w = torch.empty(2 * s, 2048, dtype=dtype), torch.empty(2048, s, dtype=dtype)
        return shared_mod.SharedExperts(*w, *scales, mlp=None)

    assert shared_mod.shared_chunks(shared(2816), w13, s13) == 2  # tp 1
    assert shared_mod.shared_chunks(shared(1408), w13, s13) == 1  # ep = tp = 2: whole experts, shared halved
    assert shared_mod.shared_chunks(shared(704 + 64), w13, s13) == 0  # not a multiple of I
    assert (
        shared_mod.shared_chunks(shared(2816, fp8=False, dtype=torch.bfloat16), w13, s13) == 0
    )  # other format
    assert shared_mod.shared_chunks(None, w13, s13) == 0
