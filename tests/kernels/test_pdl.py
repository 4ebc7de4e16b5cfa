"""Programmatic dependent launch (mlac.kernels._triton): the switch, the pattern every kernel
follows (checked on the source), the compiled variant it selects, and on a GPU that CUDA graphs
captured with PDL give the logits of graphs captured without it, bit for bit."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _paths import REPO

from mlac import settings
from mlac.kernels import _triton

ROOT = REPO
KERNELS = ROOT / "mlac" / "kernels"
NOT_YET: set[str] = set()  # every kernel file follows the pattern


@pytest.fixture
def fresh_switch():
    """pdl_on() decides once per process: forget that decision before and after the test."""
    switch = _triton.pdl_on  # the cached function itself (a test may monkeypatch the name)
    switch.cache_clear()
    yield
    switch.cache_clear()


def _pretend_gpu(monkeypatch, major: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (major, 0))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_pdl_needs_hopper_cuda_and_no_interpreter(monkeypatch):
    pytest.importorskip("triton")
    _pretend_gpu(monkeypatch, 9)
    assert _triton.pdl_supported()
    _pretend_gpu(monkeypatch, 8)
    assert not _triton.pdl_supported()  # Ampere: no griddepcontrol
    _pretend_gpu(monkeypatch, 9)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not _triton.pdl_supported()  # the interpreter must never see a gdc op
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not _triton.pdl_supported()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU default")
def test_pdl_is_off_on_cpu(fresh_switch):
    assert not _triton.pdl_on()
    assert _triton.pdl_launch() == {"PDL": False, "launch_pdl": False}


def test_the_switch_follows_mlac_pdl(monkeypatch, setting, fresh_switch):
    monkeypatch.setattr(_triton, "pdl_supported", lambda: True)
    setting("MLAC_PDL", None)
    assert _triton.pdl_launch() == {"PDL": True, "launch_pdl": True}  # on by default
    _triton.pdl_on.cache_clear()
    setting("MLAC_PDL", "0")
    assert _triton.pdl_launch() == {"PDL": False, "launch_pdl": False}


@pytest.mark.parametrize("value,requested", [(None, True), ("1", True), ("0", False)])
def test_mlac_pdl_is_read_at_first_use_not_at_import(value, requested):
    """Importing the kernels reads no setting: a process that sets MLAC_PDL after its imports (a
    spawned rank, node_ranks.py) launches as that value says."""
    env = {k: v for k, v in os.environ.items() if k != "MLAC_PDL"}
    code = (
        "import os, sys; from mlac import settings; from mlac.kernels import _triton; v = sys.argv[1];"
        " os.environ.update({} if v == 'unset' else {'MLAC_PDL': v}); print(settings.PDL.get())"
    )
    out = subprocess.run([sys.executable, "-c", code, value or "unset"], env={**env, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(requested)


# ---- the pattern, on the source: a missing wait is a silent race that no numeric test sees -------


def _kernel_files() -> list[Path]:
    """Every file of mlac/kernels and mlac/runtime that may define a Triton kernel."""
    files = sorted(KERNELS.rglob("*.py")) + sorted((ROOT / "mlac" / "runtime").rglob("*.py"))
    return [p for p in files if p.name not in NOT_YET | {"_triton.py"} and "jit" in p.read_text()]


def _is_jit(fn: ast.FunctionDef) -> bool:
    for dec in fn.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if ast.unparse(target) in ("jit", "triton.jit"):
            return True
    return False


def _launches(tree: ast.Module, jitted: set[str]) -> list[ast.Call]:
    """The calls `kernel[grid](...)` of the given jit functions."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Subscript)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id in jitted
    ]


def _first_statement(fn: ast.FunctionDef) -> str:
    """The first statement after the docstring."""
    docstring = isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant)
    return ast.unparse(fn.body[1 if docstring else 0])


def test_every_kernel_waits_first_and_launches_with_the_switch():
    kernels = 0
    for path in _kernel_files():
        tree = ast.parse(path.read_text())
        jitted = {fn.name: fn for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) and _is_jit(fn)}
        launches = _launches(tree, set(jitted))
        for name in {call.func.value.id for call in launches}:
            kernels += 1
            fn = jitted[name]
            params = {a.arg: ast.unparse(a.annotation) if a.annotation else "" for a in fn.args.args}
            assert params.get("PDL") == "tl.constexpr", f"{path.name}: {name} has no PDL constexpr"
            assert _first_statement(fn) == "pdl_start(PDL)", f"{path.name}: {name} must begin so"
        for call in launches:
            spread = [ast.unparse(k.value) for k in call.keywords if k.arg is None]
            assert "pdl_launch()" in spread, (
                f"{path.name}: a launch of {call.func.value.id} lacks **pdl_launch()"
            )
    assert kernels >= 10  # norm, silu, prep, decode split + merge, head bmm, quant, gemm, route, extend


# ---- the compiled variant (an sm90 compile runs on CPU; it is not run) ---------------------------

COMPILE_SILU = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mlac.kernels.activation import _silu_mul_kernel

sig = {"x": "*bf16", "y": "*bf16", "y_scale": "*fp32", "stride_x": "i64", "stride_y": "i64",
       "stride_s": "i64", "I": "i32", "BLOCK": "constexpr", "EXACT_EXP": "constexpr", "QUANT": "constexpr",
       "GROUP_SIZE": "constexpr", "FP8_MAX_C": "constexpr", "PDL": "constexpr"}
out = {}
for pdl in (False, True):
    consts = {"BLOCK": 1024, "EXACT_EXP": True, "QUANT": False, "GROUP_SIZE": 128, "FP8_MAX_C": 448.0,
              "PDL": pdl}
    k = triton.compile(ASTSource(_silu_mul_kernel, signature=sig, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "launch_pdl": pdl})
    out[str(pdl)] = {"wait": "griddepcontrol.wait" in k.asm["ptx"],
                     "launch": "griddepcontrol.launch_dependents" in k.asm["ptx"],
                     "launch_pdl": bool(k.metadata.launch_pdl), "hash": k.hash}
print(json.dumps(out))
"""


def test_pdl_compiles_a_variant_of_its_own(tmp_path):
    """With PDL the kernel holds the gdc instructions and launches with PDL; without, it holds none.
    The two have different cache keys: a prepared cache of one is never loaded for the other."""
    pytest.importorskip("triton")
    script = tmp_path / "compile_silu.py"
    script.write_text(COMPILE_SILU)
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT), "TRITON_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["True"] | {"hash": 0} == {"wait": True, "launch": True, "launch_pdl": True, "hash": 0}
    assert res["False"] | {"hash": 0} == {"wait": False, "launch": False, "launch_pdl": False, "hash": 0}
    assert res["True"]["hash"] != res["False"]["hash"]


# ---- on a GPU: graphs with PDL give the logits of graphs without, bit for bit --------------------


@pytest.mark.gpu
@pytest.mark.parametrize("preset,fp8", [("tiny-v2-lite", False), ("tiny-v3", True)])
def test_graphs_with_pdl_give_the_logits_of_graphs_without(artifact, preset, fp8, monkeypatch, fresh_switch):
    """PDL changes when kernels start, never what they compute: the same decode steps replayed from
    graphs captured with and without it give identical logits (and so identical tokens)."""
    from mlac.runtime.engine.engine import Engine
    from mlac.runtime.engine.params import SamplingParams
    from mlac.runtime.engine.scheduler import SchedulerConfig
    from mlac.runtime.worker.graphs import DecodeGraphs

    if not (settings.PDL.get() and _triton.pdl_supported()):
        pytest.skip("PDL needs an sm90+ GPU (and MLAC_PDL not 0)")
    kw = dict(device="cuda", dtype=torch.bfloat16, verify=False, num_blocks=256, cuda_graph_max_bs=8,
              scheduler=SchedulerConfig(prefix_cache=False))  # fmt: skip
    engine = Engine.from_artifact(artifact(preset, fp8=fp8), **kw)
    with_pdl = engine.runner.graphs
    assert _triton.pdl_on() and with_pdl is not None
    monkeypatch.setattr(_triton, "pdl_on", lambda: False)  # the graphs captured next launch without
    without = DecodeGraphs(engine.runner.model, engine.cache, with_pdl.buckets, engine.max_context)
    without.capture()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 200, (5 + 4 * i,), generator=g).tolist() for i in range(3)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    runs = []
    for graphs in (with_pdl, without):
        engine.runner.graphs, logits = graphs, []
        replay = graphs.run
        monkeypatch.setattr(
            graphs, "run", lambda step, ids=None, r=replay, out=logits: _keep(r(step, ids), out)
        )
        tokens = [c.token_ids for c in engine.generate(prompts, params)]
        runs.append((tokens, logits))
    (tokens_pdl, logits_pdl), (tokens_plain, logits_plain) = runs
    assert tokens_pdl == tokens_plain
    assert len(logits_pdl) == len(logits_plain) >= 7  # every decode step went through the graphs
    for a, b in zip(logits_pdl, logits_plain, strict=True):
        assert torch.equal(a, b)


def _keep(logits: torch.Tensor, out: list[torch.Tensor]) -> torch.Tensor:
    out.append(logits.clone())
    return logits
