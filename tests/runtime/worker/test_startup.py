"""Start-up: the KV cache sized from the memory plan on CUDA (with a fake
GPU's memory), --max-model-len, the flags of serve / generate / bench, the one-line refusals (a plan
that does not fit, a busy port) and the start-up summary line and /health's phases."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from click.testing import CliRunner

import mlac
from mlac.cli import main
from mlac.core.artifact import Manifest
from mlac.core.errors import MlacError
from mlac.runtime.engine.engine import Engine
from mlac.runtime.serve import ServerConfig, ServerThread
from mlac.runtime.serve.launch import startup_line
from mlac.runtime.worker import build as build_mod
from mlac.runtime.worker import kernel_cache
from mlac.runtime.worker import start as start_mod
from mlac.runtime.worker.memory_plan import RESERVE_BYTES
from mlac.runtime.worker.options import RuntimeOptions
from mlac.runtime.worker.start import make_runner, plan_kv

GiB = 1 << 30
ROOT = Path(mlac.__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def art(artifact) -> Path:
    return artifact("tiny-v3")


@pytest.fixture
def gpu(monkeypatch):
    """A fake GPU: gpu(free, total) makes torch.cuda report it; loading anything is an error."""

    def fake(free: int, total: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
        monkeypatch.setattr(kernel_cache, "current_target", lambda device: None)  # no real GPU to name

    def no_load(*args, **kwargs):
        raise AssertionError("the plan must be decided before anything is loaded")

    monkeypatch.setattr(build_mod, "load_artifact", no_load)
    return fake


def fixed_bytes(manifest: Manifest, cuda_graphs: bool = True) -> int:
    """Everything of the plan but the KV cache (memory_plan.py's docstring), rank 0."""
    b = manifest.buckets
    transient = (
        b.graph_pool_bytes + b.prefill_activation_bytes
        if cuda_graphs
        else max(b.prefill_activation_bytes, *b.activation_bytes)
    )
    return b.weight_bytes[0] + transient + RESERVE_BYTES


def per_block(manifest: Manifest, bytes_per_element: int = 2, draft_layers: int = 0) -> int:
    """One 16-token block of the pools: the plan's bytes (2-byte elements, the main layers) scaled."""
    layers = manifest.model.num_hidden_layers
    per_layer_token = manifest.buckets.kv_bytes_per_token // layers // 2 * bytes_per_element
    return per_layer_token * (layers + draft_layers) * 16


def blocks(manifest: Manifest, budget: int, cuda_graphs: bool = True, **kw) -> int:
    """The blocks the allocator hands out: what the budget leaves, less the pools' scratch block."""
    return (budget - fixed_bytes(manifest, cuda_graphs)) // per_block(manifest, **kw) - 1


# ---- KV sizing through the runtime ---------------------------------------------------------------


def test_cuda_kv_blocks_come_from_the_plan_on_the_measured_memory(art, gpu):
    m = Manifest.load(art)
    gpu(free=8 * GiB, total=8 * GiB)
    kv = plan_kv(m, torch.device("cuda"), RuntimeOptions())
    assert kv.num_blocks == blocks(m, int(8 * GiB * 0.9))
    half = plan_kv(m, torch.device("cuda"), RuntimeOptions(gpu_memory_utilization=0.5))
    assert half.num_blocks == blocks(m, 4 * GiB)
    # no graphs: the graph pool is not held
    eager = plan_kv(m, torch.device("cuda"), RuntimeOptions(cuda_graph=False))
    assert eager.num_blocks == blocks(m, int(8 * GiB * 0.9), cuda_graphs=False)
    assert eager.num_blocks > kv.num_blocks


def test_float32_compute_stores_a_bf16_cache_in_4_byte_elements(art, gpu):
    # the artifact's kv_cache_dtype is bf16: under float32 compute its pools hold float32 (paged.py)
    m = Manifest.load(art)
    assert m.options.kv_cache_dtype == "bf16"
    gpu(free=8 * GiB, total=8 * GiB)
    bf16 = plan_kv(m, torch.device("cuda"), RuntimeOptions(cuda_graph=False))
    fp32 = plan_kv(m, torch.device("cuda"), RuntimeOptions(dtype=torch.float32))  # no graphs either
    assert fp32.num_blocks == blocks(m, int(8 * GiB * 0.9), cuda_graphs=False, bytes_per_element=4)
    assert fp32.num_blocks + 1 == (bf16.num_blocks + 1) // 2 and fp32.kv_bytes <= bf16.kv_bytes


def test_the_mtp_layers_pools_are_counted(art, gpu):
    m = Manifest.load(art)
    assert len(m.mtp.prefixes) == 1
    gpu(free=8 * GiB, total=8 * GiB)
    spec = plan_kv(m, torch.device("cuda"), RuntimeOptions(draft_layers=1))
    assert spec.num_blocks == blocks(m, int(8 * GiB * 0.9), draft_layers=1)
    assert spec.max_context == min(spec.num_blocks * 16, m.model.max_position_embeddings)


@pytest.mark.parametrize(
    "dtype, draft_layers", [(torch.bfloat16, 0), (torch.float32, 0), (torch.bfloat16, 1), (torch.float32, 1)]
)
def test_the_pools_fit_the_planned_bytes(art, gpu, monkeypatch, dtype, draft_layers):
    # the cache make_runner's blocks build (on the meta device: sizes only) takes the plan's kv_bytes,
    # within what the budget leaves after everything else
    m = Manifest.load(art)
    gpu(free=8 * GiB, total=8 * GiB)
    monkeypatch.setattr(start_mod, "build_runner", lambda job, rank: job.options)
    options = RuntimeOptions(device="cuda", dtype=dtype, draft_layers=draft_layers)
    planned = plan_kv(m, torch.device("cuda"), options)
    got = make_runner(art, m, options)
    assert got.num_blocks == planned.num_blocks
    kv_dtype = m.options.kv_cache_dtype
    cache = build_mod.make_cache(
        m.model, "meta", dtype, got.num_blocks, None, 16, kv_dtype, None, draft_layers
    )
    pools = sum(t.numel() * t.element_size() for t in cache.layers)
    assert pools == planned.kv_bytes
    assert pools <= int(8 * GiB * 0.9) - fixed_bytes(m, cuda_graphs=options.graphs_on("cuda"))


def test_free_memory_smaller_than_the_budget_sizes_on_it(art, gpu):
    m = Manifest.load(art)
    gpu(free=2 * GiB, total=80 * GiB)
    kv = plan_kv(m, torch.device("cuda"), RuntimeOptions())
    assert kv.num_blocks == blocks(m, 2 * GiB)


def test_explicit_sizes_and_cpu_keep_the_old_default(art, gpu):
    m = Manifest.load(art)
    gpu(free=8 * GiB, total=8 * GiB)
    assert plan_kv(m, torch.device("cuda"), RuntimeOptions(num_blocks=7)) is None
    assert plan_kv(m, torch.device("cuda"), RuntimeOptions(kv_cache_bytes=GiB)) is None
    assert plan_kv(m, torch.device("cpu"), RuntimeOptions()) is None


def test_an_artifact_without_a_memory_plan_gets_the_buckets_pass_plan(art, gpu):
    m = Manifest.load(art)
    old = m.model_copy(update={"buckets": None})  # compiled before the buckets pass
    gpu(free=8 * GiB, total=8 * GiB)
    got = plan_kv(old, torch.device("cuda"), RuntimeOptions())
    assert got == plan_kv(m, torch.device("cuda"), RuntimeOptions())


def test_make_runner_passes_the_planned_blocks_to_the_rank(art, gpu, monkeypatch):
    m = Manifest.load(art)
    gpu(free=8 * GiB, total=8 * GiB)
    monkeypatch.setattr(start_mod, "build_runner", lambda job, rank: job.options)
    options = make_runner(art, m, RuntimeOptions(device="cuda", max_model_len=100))
    assert options.num_blocks == blocks(m, int(8 * GiB * 0.9))
    assert options.max_model_len == 100


def test_a_cache_smaller_than_one_context_is_a_warning(art, gpu, caplog):
    m = Manifest.load(art)
    gpu(free=fixed_bytes(m) + 11 * per_block(m), total=80 * GiB)  # 10 blocks and the scratch block
    with caplog.at_level(logging.WARNING, logger="mlac.runtime"):
        kv = plan_kv(m, torch.device("cuda"), RuntimeOptions())
    assert kv.num_blocks == 10 and kv.max_context == 160
    text = caplog.text
    assert "holds 160 tokens, less than one full context of 4,096" in text and "free of 80.00 GiB" in text


def test_does_not_fit_is_refused_before_loading(art, gpu):
    gpu(free=GiB, total=GiB)  # 0.9 GiB: less than the 1 GiB reserve alone
    with pytest.raises(MlacError, match="leave no room for one KV block"):
        Engine.from_artifact(art, device="cuda")


# ---- --max-model-len -------------------------------------------------------------------------------


def test_max_model_len_caps_the_context(art):
    engine = Engine.from_artifact(art, dtype=torch.float32, verify=False, max_model_len=64)
    assert engine.max_context == 64 < engine.config.max_position_embeddings
    assert engine.generate(list(range(3, 13)), max_tokens=2).completion_tokens == 2
    with pytest.raises(MlacError, match="prompt of 65 tokens exceeds max_model_len=64"):
        engine.generate(list(range(3, 68)), max_tokens=1)


def test_max_model_len_beyond_the_model_is_refused_before_loading(art, monkeypatch):
    monkeypatch.setattr(build_mod, "load_artifact", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(MlacError, match=r"--max-model-len 5000: must be in 1\.\.4,096"):
        Engine.from_artifact(art, max_model_len=5000)


# ---- the CLI ------------------------------------------------------------------------------------------


def one_error_line(result) -> str:
    assert result.exit_code == 1, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_cli_does_not_fit_is_one_line_before_loading(art, gpu, command):
    gpu(free=80 * GiB, total=80 * GiB)
    extra = ["--prompt", "hi"] if command == "generate" else []
    # the alias: 0.01 of 80 GiB = 0.8 GiB, under the 1 GiB reserve
    r = CliRunner().invoke(
        main, [command, str(art), "--device", "cuda", "--mem-fraction-static", "0.01", *extra]
    )
    line = one_error_line(r)
    assert "leave no room for one KV block" in line and "(--gpu-memory-utilization 0.01)" in line


def test_cli_bad_utilization_is_one_line(art):
    r = CliRunner().invoke(main, ["generate", str(art), "--prompt", "hi", "--gpu-memory-utilization", "1.5"])
    assert "--gpu-memory-utilization 1.5: must be in (0, 1]" in one_error_line(r)


def test_serve_flags_reach_the_server_config(art, monkeypatch):
    import mlac.runtime.serve as serve_pkg

    seen = []
    monkeypatch.setattr(serve_pkg, "serve", lambda config, log_level, **_: seen.append(config))
    args = ["serve", str(art), "--mem-fraction-static", "0.5", "--max-model-len", "64"]
    assert CliRunner().invoke(main, args).exit_code == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert CliRunner().invoke(main, ["serve", str(art), "--gpu-memory-utilization", "0.8"]).exit_code == 0
    (cpu, cuda) = (config.engine.runtime for config in seen)
    assert (cpu.gpu_memory_utilization, cpu.max_model_len, cpu.device) == (0.5, 64, "cpu")
    assert (cuda.gpu_memory_utilization, cuda.max_model_len, cuda.device) == (0.8, None, "cuda")
    assert isinstance(seen[0].process_start, float)


def test_serve_on_a_busy_port_is_one_line_before_loading(art):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "mlac.cli", "serve", str(art), "--port", str(port), "--device", "cpu"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == (
        f"error: port {port} is in use (on 127.0.0.1): stop what holds it or pick another --port"
    )


# ---- the start-up summary -----------------------------------------------------------------------------


def test_startup_summary_line_and_health(art, caplog):
    config = ServerConfig.of(artifact=art, dtype="float32", verify=False, max_model_len=1000)
    with caplog.at_level(logging.INFO, logger="mlac.server"), ServerThread(config) as srv:
        startup = httpx.get(f"{srv.url}/health").json()["startup"]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ready in ")]
    assert len(lines) == 1, caplog.text
    assert re.search(r", load \d+\.\d s \(0\.0 GB, ", lines[0]) and ", graphs off, warm-up " in lines[0]
    assert lines[0].endswith("tokens (bf16), max context 1,000, CUDA graphs off")
    assert startup["max_context"] == 1000 and startup["graph_buckets"] == 0
    assert startup["load_gb"] > 0 and startup["ready_s"] >= startup["load_s"] > 0
    assert {"import_s", "warmup_s", "kv_tokens"} <= startup.keys()


def test_startup_line_on_a_gpu():
    s = dict(ready_s=9.8, import_s=1.2, load_s=3.1, load_gb=31.4, graphs_s=1.9, graph_buckets=20,
             graph_max_bs=256, warmup_s=2.0, kv_tokens=812032, max_context=163840)  # fmt: skip
    assert startup_line(s, verified=True, kv_dtype="fp8_e4m3") == (
        "ready in 9.8 s: import 1.2 s, verify+load 3.1 s (31.4 GB, 10.1 GB/s), graphs 1.9 s (20 buckets), "
        "warm-up 2.0 s; KV cache 812,032 tokens (fp8_e4m3), max context 163,840, CUDA graphs up to batch 256"
    )
