"""The warm-up meets every Triton kernel variant that an eager step of 1..max_tokens tokens picks
(kernels/step_variants.py): the FP8 GEMM's decode tiles and M class (or, where a product takes
cuBLAS, act_quant's m_major layout), the grouped FP8 MoE's K splits, the reduce's BLOCK_T, the
skinny GEMM and the router.

On CPU the kernels' wrappers run on meta tensors (real DeepSeek shapes, nothing allocated) with every
kernel replaced by a recorder: what each launch would compile (its constexprs, the class of each
integer Triton specializes, the dtypes) is compared between all step sizes and the warm-up's counts.
On a GPU: a real warm-up, then eager steps of many sizes, and Triton's compile counter stays at 0.
"""

from __future__ import annotations

import json

import pytest
import torch

from mlac.core.fp8 import BLOCK, FP8
from mlac.kernels import fp8_quant
from mlac.kernels.fp8_quant import Fp8Act
from mlac.kernels.gemm import fp8_cublas, fp8_gemm, gemv, gemv_configs
from mlac.kernels.gemm.fp8_cublas import cublas_takes
from mlac.kernels.gemm.fp8_gemm import int_class
from mlac.kernels.moe import align as moe_align
from mlac.kernels.moe import decode as moe_decode
from mlac.kernels.moe import decode_sum as moe_decode_sum
from mlac.kernels.moe import fused as moe
from mlac.kernels.moe import grouped as moe_grouped
from mlac.kernels.moe import reduce as moe_reduce
from mlac.kernels.moe import router_gemv
from mlac.kernels.moe import routing as moe_routing
from mlac.kernels.moe.routing import RoutingSpec
from mlac.kernels.step_variants import MoeShape, StepShapes, step_variants, warmup_token_counts

KERNEL_MODULES = (
    fp8_gemm,
    fp8_quant,
    gemv,
    moe_align,
    moe_grouped,
    moe_reduce,
    moe_decode,
    moe_decode_sum,
    moe_routing,
    router_gemv,
)

# (N, K) of one rank's dense weights at tp 1 (q_a+kv_a fused, wq_b or wq, wo, dense w13 / w2, shared
# w13 / w2), the experts (E, top-k, D, I) and the routing
V3 = dict(
    linears=(
        (2112, 7168),
        (24576, 1536),
        (7168, 16384),
        (36864, 7168),
        (7168, 18432),
        (4096, 7168),
        (7168, 2048),
    ),
    moe=(256, 8, 7168, 2048),
    routing=RoutingSpec(256, 8, "noaux_tc", "sigmoid", 8, 4, True, 2.5),
)
V2_LITE = dict(
    linears=(
        (3072, 2048),
        (576, 2048),
        (2048, 2048),
        (21888, 2048),
        (2048, 10944),
        (5632, 2048),
        (2048, 2816),
    ),
    moe=(64, 6, 2048, 1408),
    routing=RoutingSpec(64, 6, "greedy", "softmax"),
)
# the GPU test's model (GPU_MODEL below): V3's experts at widths whose FP8 GEMM1 splits K 4, 2 and 1
# ways within the smallest tile config (steps of 2-8, 9-16 and 17-768 tokens on 132 SMs)
V3_NARROW = dict(
    linears=((288, 2048), (256, 128), (2048, 128), (2048, 2048), (2048, 1024), (512, 2048), (2048, 256)),
    moe=(256, 8, 2048, 256),
    routing=V3["routing"],
)
MODELS = {"v3": V3, "v2-lite": V2_LITE, "v3-narrow": V3_NARROW}


def shapes_of(model: dict, fp8: bool, sms: int, cublas: bool = False) -> StepShapes:
    """The step shapes of `model`; with linears=() its MoE layers alone. `cublas`: its FP8 linears
    take cuBLAS where fp8_cublas.cublas_takes (StepShapes.fp8_cublas)."""
    linears = model["linears"]
    moe = MoeShape(*model["moe"], fp8)
    return StepShapes(sms, linears if fp8 else (), () if fp8 else linears, moe, fp8_cublas=cublas)


CASES = [(name, fp8, sms) for name in ("v3", "v2-lite") for fp8 in (True, False) for sms in (132, 78)]
CASES += [("v3", True, 132, True), ("v2-lite", True, 132, True)]  # the FP8 linears partly on cuBLAS


@pytest.mark.parametrize("name, fp8, sms, cublas", [(*c, False)[:4] for c in CASES])
def test_every_step_size_picks_only_variants_the_counts_pick(name, fp8, sms, cublas):
    shapes = shapes_of(MODELS[name], fp8, sms, cublas)
    counts = warmup_token_counts(shapes, 8192)
    met = {v for t in counts for v in step_variants(t, shapes)}
    for t in range(1, 8193):
        missed = [v for v in step_variants(t, shapes) if v not in met]
        assert not missed, f"a step of {t} tokens picks {missed[0]}, which no warm-up count picks"
    assert counts == sorted(set(counts)) and counts[0] == 1 and counts[-1] <= 8192
    assert len(counts) <= 16  # V3 FP8: 14 prefills, the largest 3,073 tokens (the chunk is run anyway)


def test_the_counts_of_v3_and_v2_lite():
    v3_fp8, v2_lite_bf16 = shapes_of(V3, True, 132), shapes_of(V2_LITE, False, 132)
    # 2: GEMM1 splits K in 2 (V3's SPLIT_K variant); 16, 17, 32, 33, 48, 65, 80, 257, 272: the FP8
    # GEMM's tiles and M classes; 769, 3073: the grouped MoE's tile configs (V2-Lite's 5: the skinny
    # GEMM's M class 16)
    assert warmup_token_counts(v3_fp8, 8192) == [1, 2, 3, 16, 17, 32, 33, 48, 65, 80, 257, 272, 769, 3073]
    assert warmup_token_counts(v2_lite_bf16, 2048) == [1, 2, 3, 5, 257, 1025, 1366]
    # every V3 FP8 linear takes cuBLAS above 64 rows: no prefill tiles of fp8_gemm (257, 272) to meet
    v3_cublas = shapes_of(V3, True, 132, cublas=True)
    assert warmup_token_counts(v3_cublas, 8192) == [1, 2, 3, 16, 17, 32, 33, 48, 65, 80, 769, 3073]


def test_the_moe_configs_largest_counts_miss_a_split_k_variant():
    # the warm-up before (the largest count of each grouped-MoE tile config: 768, 3,072, 8,192 for V3
    # FP8) met SPLIT_K 1 only
    shapes = StepShapes(132, moe=MoeShape(*V3["moe"], fp8=True))
    met = {v for t in (768, 3072, 8192) for v in step_variants(t, shapes)}
    assert ("moe_gemm1", moe_grouped.pick_moe_config(16, 256, True), 2) in set(step_variants(2, shapes)) - met


# ---- the wrappers, on meta tensors: does the variant name everything a launch compiles? ---------


class Recorder:
    """Stands in for a Triton kernel: `kernel[grid](*args, **kwargs)` records what Triton would key
    its compile on (constexprs and options by value, specialized integers by class, dtypes)."""

    def __init__(self, name: str, kernel, seen: list):
        self.name, self.seen = name, seen
        self.arg_names = kernel.arg_names
        spec = (
            kernel.kwargs.get("do_not_specialize")
            if isinstance(getattr(kernel, "kwargs", None), dict)
            else None
        )
        spec = getattr(kernel, "do_not_specialize", ()) if spec is None else spec
        self.dynamic = {self.arg_names[s] if isinstance(s, int) else s for s in spec or ()}
        self.constexprs = {n for n, a in kernel.fn.__annotations__.items() if "constexpr" in str(a)}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.seen.append(self.key(args, kwargs))

    def key(self, args, kwargs) -> tuple:
        out = []
        for name, v in zip(self.arg_names, args, strict=False):  # the rest come by name
            if isinstance(v, torch.Tensor):
                out.append((name, str(v.dtype)))
            elif isinstance(v, bool) or name in self.constexprs:
                out.append((name, v))
            elif isinstance(v, int):
                out.append((name, "dynamic" if name in self.dynamic else int_class(v)))
        return (self.name, tuple(out), tuple(sorted(kwargs.items())))


@pytest.fixture
def launches(monkeypatch):
    """Every kernel of the families step_variants covers replaced by a Recorder; the list it fills."""
    seen: list = []
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton on meta tensors (use_triton's check)
    for mod in KERNEL_MODULES:
        for name, obj in list(vars(mod).items()):
            if name.endswith("_kernel") and hasattr(obj, "arg_names"):
                monkeypatch.setattr(mod, name, Recorder(name, obj, seen))

    def scaled_mm(a, b, *args, out_dtype=None, **kwargs):  # cuBLAS: no Triton variant, a meta result
        return torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    yield seen
    gemv_configs.pick_config.cache_clear()  # configs planned for a patched SM count


def on_sms(monkeypatch, sms: int) -> None:
    """The wrappers plan for a GPU of `sms` SMs (gemv_configs caches its configs: emptied both ways)."""
    for mod in (fp8_gemm, gemv_configs, moe_grouped, router_gemv):
        monkeypatch.setattr(mod, "sm_count", lambda device: sms)
    gemv_configs.pick_config.cache_clear()  # and again after the test (`launches`)


def run_step(t: int, model: dict, fp8: bool, cublas: bool = False) -> None:
    """The kernels of a model step of t tokens, as the layers call them, on meta tensors; `cublas`:
    the FP8 linears take cuBLAS where cublas_takes (torch._scaled_mm patched by `launches`)."""
    meta = dict(device="meta")
    for n, k in model["linears"]:  # () for the MoE alone
        x = torch.empty(t, k, dtype=torch.bfloat16, **meta)
        if fp8:
            w = torch.empty(n, k, dtype=FP8, **meta)
            scale = torch.empty(-(-n // BLOCK), -(-k // BLOCK), dtype=torch.float32, **meta)
            if cublas and cublas_takes(t, n, k):
                fp8_cublas.cublas_fp8_linear(x, w, scale, use_triton=True)
            else:
                fp8_gemm.fp8_gemm(x, w, scale)
        elif gemv_configs.skinny_applies(x, w := torch.empty(n, k, dtype=torch.bfloat16, **meta), None):
            gemv.skinny_linear(x, w)
    e, top_k, d, i = model["moe"]
    x = torch.empty(t, d, dtype=torch.bfloat16, **meta)
    gate, bias = torch.empty(e, d, **meta), torch.empty(e, **meta)
    noaux = model["routing"].method == "noaux_tc"
    router_gemv.gate_and_route(x, gate, model["routing"], bias if noaux else None, use_triton=True)
    ids, weights = torch.empty(t, top_k, dtype=torch.int64, **meta), torch.empty(t, top_k, **meta)
    wdt = FP8 if fp8 else torch.bfloat16
    w13, w2 = torch.empty(e, 2 * i, d, dtype=wdt, **meta), torch.empty(e, d, i, dtype=wdt, **meta)
    s13 = torch.empty(e, -(-2 * i // BLOCK), -(-d // BLOCK), **meta) if fp8 else None
    s2 = torch.empty(e, -(-d // BLOCK), -(-i // BLOCK), **meta) if fp8 else None
    x_act = Fp8Act(torch.empty(t, d, dtype=FP8, **meta), torch.empty(t, -(-d // BLOCK), **meta), x.dtype)
    moe.fused_moe_triton(x, w13, w2, weights, ids, s13, s2, x_act=x_act if fp8 else None)


WRAPPER_CASES = [
    ("v3", True, 132, False),
    ("v3", True, 78, False),
    ("v3", False, 132, False),
    ("v2-lite", True, 132, False),
    ("v2-lite", False, 78, False),
    ("v3", True, 132, True),  # the FP8 linears on cuBLAS where cublas_takes
    ("v2-lite", True, 132, True),  # some of them (w2 and the shared w2 stay on fp8_gemm)
]
WRAPPER_CASES += [
    ("v3-narrow", True, 132, False),
    ("v3-narrow-moe", True, 132, False),
]  # splits change at 9, 17
MODELS["v3-narrow-moe"] = {**V3_NARROW, "linears": ()}  # alone: no other variant changes with them


@pytest.mark.parametrize("name, fp8, sms, cublas", WRAPPER_CASES)
def test_the_counts_launch_every_kernel_variant_a_step_launches(
    name, fp8, sms, cublas, launches, monkeypatch
):
    model, max_tokens = MODELS[name], 1024
    on_sms(monkeypatch, sms)
    counts = warmup_token_counts(shapes_of(model, fp8, sms, cublas), max_tokens)
    for t in counts:
        run_step(t, model, fp8, cublas)
    met, kernels = set(launches), {key[0] for key in launches}
    assert {"_moe_gemm_kernel", "_moe_reduce_kernel", "_router_kernel"} <= kernels
    assert ("_fp8_gemm_kernel" in kernels) == (fp8 and bool(model["linears"]))
    # act_quant's m_major layout (scales M-major: stride_sm 1 over several groups) where cuBLAS takes a product
    quant = [dict(key[1]) for key in met if key[0] == "_act_quant_kernel"]
    assert any(q["stride_sm"] == "1" and q["groups"] != "1" for q in quant) == cublas
    for t in range(1, max_tokens + 1):
        launches.clear()
        run_step(t, model, fp8, cublas)
        missed = [key for key in launches if key not in met]
        assert not missed, f"a step of {t} tokens launches a variant no warm-up count launches: {missed[0]}"


# ---- on a GPU: no JIT compile after the warm-up -----------------------------------------------------

# V3_NARROW's shapes: tiny-v3 with V3's experts and routing, hidden 2048, expert width 256
GPU_MODEL = dict(n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, hidden_size=2048)
GPU_MODEL.update(
    moe_intermediate_size=256, intermediate_size=1024, num_hidden_layers=2, num_nextn_predict_layers=0
)
STEP_SIZES = (1, 2, 3, 5, 7, 9, 13, 16, 17, 20, 31, 33, 47, 50, 64, 65, 77, 100, 130, 200, 256, 257, 300)
STEP_SIZES += (500, 700, 767, 768, 769, 1000, 1500, 2047, 2048, 2500)


@pytest.mark.gpu
def test_after_the_warmup_eager_steps_of_any_size_compile_nothing(tmp_path):
    from mlac.compiler.pipeline import compile_checkpoint
    from mlac.core.artifact import CompileOptions
    from mlac.runtime.engine import sampling
    from mlac.runtime.engine.engine import Engine
    from mlac.runtime.engine.params import SamplingParams
    from mlac.runtime.engine.scheduler import SchedulerConfig
    from mlac.runtime.worker.jit_compiles import JitCompiles
    from mlac.synth import synthesize
    from mlac.synth.presets import TINY_V3

    (tmp_path / "config.json").write_text(json.dumps({**TINY_V3, **GPU_MODEL}))
    ckpt = synthesize(tmp_path / "ckpt", config_path=tmp_path / "config.json")
    compile_checkpoint(ckpt, tmp_path / "art", CompileOptions(fp8=True))
    limits = SchedulerConfig(max_running_requests=8, chunked_prefill_size=2048)
    engine = Engine.from_artifact(tmp_path / "art", device="cuda", scheduler=limits)
    engine.warmup()
    vocab = engine.config.vocab_size
    with JitCompiles() as jit:
        for k, n in enumerate(STEP_SIZES):  # distinct prompts: none is a cached prefix of another
            engine.generate(
                [3 + (j * 11 + k * 17) % (vocab - 3) for j in range(n)], max_tokens=1, ignore_eos=True
            )
        rows = 16  # the sampler's top-p kernels (warmed up on one row: the rows are no specialization)
        sampling.sample(
            torch.zeros(rows, vocab, device="cuda"),
            [SamplingParams(temperature=1.0, top_p=0.9)] * rows,
            [None] * rows,
        )
    assert jit.compiled == [], f"compiled after the warm-up: {sorted(set(jit.compiled))}"
