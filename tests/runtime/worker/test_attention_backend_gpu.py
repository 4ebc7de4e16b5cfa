"""On a GPU with flashinfer installed: `--attention-backend flashinfer` against mlac's Triton path on a
tiny synthetic bf16 model with DeepSeek's latent dims (kv_lora_rank 512, rope 64: the dims FlashInfer's
MLA kernels are built for), eager and with CUDA graphs, over sequences that share cached prefix
blocks; and an artifact prepared for both backends starts and serves with no JIT compile at all.

The two kernels sum in other orders, so an attention output may differ in its last bf16 bit, and a
logit (bf16 out of the head: 1/16 apart at magnitude 8-16, as this random model's are) by a step or
two. A greedy token may then flip only where the Triton path's top two are within TIE of each other;
free-running sequences are compared up to such a tie, and step by step with the same tokens fed to
both (teacher-forced: no divergence to follow), where every step's logits must agree within
rounding. Anything else is a difference in what the kernel computes.

The model is dense (no MoE layer): a router's top-k is discontinuous, so a last-bit difference in an
attention output can pick another expert at one token and move that row's logits far past rounding.
Measured on an H200 with the MoE layers in: at one step of twelve, one row of mlac's own Triton path was
0.094 (rel L2) from the logits of exact float32 attention and FlashInfer's 0.009, every other step both
0.007-0.011 (its argmax unchanged: an expert picked otherwise is the likely cause, not either kernel).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlac.runtime.engine.engine import Engine
from mlac.runtime.step import Step
from mlac.runtime.worker.backend_check import flashinfer_installed
from mlac.synth.presets import TINY_V2_LITE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not flashinfer_installed(), reason="flashinfer is not installed"),
]

# TINY_V2_LITE with DeepSeek's latent dims and V2-Lite's 16 heads, every layer dense (module docstring)
CONFIG = {**TINY_V2_LITE, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_attention_heads": 16,
          "num_key_value_heads": 16, "first_k_dense_replace": TINY_V2_LITE["num_hidden_layers"]}  # fmt: skip
TIE = 0.25  # nats (= logits) between the top two: four bf16 steps at this model's logit magnitudes
REL_L2 = 0.05  # of one step's logits, the same tokens fed to both
LIMITS = dict(max_running_requests=8, chunked_prefill_size=256, cuda_graph_max_bs=8)
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def mla512(tmp_path_factory) -> Path:
    """The tiny model with 512 + 64 latents, synthesized and compiled (bf16) once."""
    from mlac.compiler.pipeline import compile_checkpoint
    from mlac.core.artifact import CompileOptions
    from mlac.synth import synthesize

    where = tmp_path_factory.mktemp("mla512")
    (where / "config.json").write_text(json.dumps(CONFIG))
    ckpt = synthesize(where / "ckpt", config_path=where / "config.json", seed=0)
    compile_checkpoint(ckpt, where / "art", CompileOptions(accuracy_check=False))
    return where / "art"


def engine(art: Path, backend: str, graphs: bool) -> Engine:
    return Engine.from_artifact(art, device="cuda", attention_backend=backend, cuda_graph=graphs,
                                num_blocks=256, verify=False, **LIMITS)  # fmt: skip


@pytest.fixture(scope="module", params=[False, True], ids=["eager", "cuda-graphs"])
def pair(mla512, request) -> tuple[Engine, Engine]:
    """(Triton's, FlashInfer's) engines over the artifact, both eager or both with CUDA graphs."""
    return engine(mla512, "triton", request.param), engine(mla512, "flashinfer", request.param)


PREFIX = [5 + (7 * i) % 900 for i in range(40)]  # two full blocks of 16 and a part: cached, shared
PROMPTS = [PREFIX + [11, 12], PREFIX + [13], PREFIX + [14, 15, 16], [21, 22, 23, 24]]


def greedy(e: Engine) -> list:
    return e.generate(PROMPTS, max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)


def test_flashinfer_gives_the_triton_greedy_tokens(pair):
    want, got = greedy(pair[0]), greedy(pair[1])
    assert pair[1].runner.attention.name == "flashinfer"
    for w, g in zip(want, got, strict=True):
        for i, (a, b) in enumerate(zip(w.token_ids, g.token_ids, strict=True)):
            top = w.logprobs[i].top
            if top[0][1] - top[1][1] < TIE:
                break  # a tie: either token is the greedy one, and the sequences may part here
            assert a == b, f"token {i}: {b} for {a} where Triton's margin is {top[0][1] - top[1][1]:.3f}"


def test_flashinfer_decode_steps_over_shared_prefix_blocks(pair):
    """Two sequences share blocks 0 and 1 (a cached 32-token prefix), each with blocks of its own,
    decoded 12 steps with the same tokens (the Triton path's greedy ones) under both backends: every
    step's logits within REL_L2, their argmax equal but at a tie."""
    ta, tf = pair
    tables = [[0, 1, 2, 4], [0, 1, 3, 5]]  # 64 tokens of room each
    for e in pair:  # the same cache contents in both: A's 40 tokens, then B's 3 after A's first 32
        e.runner.run(Step.of([[3 + i for i in range(40)]], [0], [tables[0]]))
        e.runner.run(Step.of([[50, 51, 52]], [32], [tables[1]]))
    ids, ctx = [60, 61], [40, 35]
    for k in range(12):
        step = Step.of([[i] for i in ids], ctx, tables)
        want, got = ta.runner.run(step).float().cpu(), tf.runner.run(step).float().cpu()  # [2, V]
        assert float((got - want).norm() / want.norm()) < REL_L2, k
        top = want.topk(2, dim=-1).values
        flipped = got.argmax(-1) != want.argmax(-1)
        assert not (flipped & (top[:, 0] - top[:, 1] >= TIE)).any(), k
        ids, ctx = want.argmax(-1).tolist(), [c + 1 for c in ctx]


START_AND_COUNT = r"""
import json, sys
from mlac.runtime.engine.engine import Engine
from mlac.runtime.worker.jit_compiles import JitCompiles
art, limits = sys.argv[1], json.loads(sys.argv[2])
with JitCompiles() as start:
    e = Engine.from_artifact(art, device="cuda", attention_backend="flashinfer", kernel_cache="require", **limits)
    e.warmup()
with JitCompiles() as requests:
    e.generate([[3 + i for i in range(n)] for n in (5, 37, 130)], max_tokens=8, ignore_eos=True)
print(json.dumps({"triton_start": start.compiled, "triton_requests": requests.compiled,
                  "flashinfer": list(e.runner.attention.compiled)}))
"""


def test_a_prepared_artifact_starts_with_no_compile_under_require_prepared(mla512, tmp_path):
    """Prepared for both backends in a fresh process (`mlac prepare`), then started in another with
    --require-prepared, an empty Triton home and an empty FlashInfer workspace: nothing compiles."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE")}
    env.update(
        PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}", TRITON_HOME=str(tmp_path / "home")
    )
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in LIMITS.items()]
    cmd = [sys.executable, "-m", "mlac.cli", "prepare", str(mla512), *flags,
           "--attention-backend", "triton", "--attention-backend", "flashinfer"]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    env.update(TRITON_HOME=str(tmp_path / "home2"), FLASHINFER_WORKSPACE_BASE=str(tmp_path / "fi-empty"))
    cmd = [sys.executable, "-c", START_AND_COUNT, str(mla512), json.dumps(LIMITS)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"triton_start": [], "triton_requests": [], "flashinfer": []}, got
