"""Start-up with the load overlapped: the weights stream in while the model is built and
its CUDA graphs are captured (loader.start_load, runner.build_runner). The overlapped load gives
the tensors of the plain load, bit for bit, at addresses fixed before any byte is read; the model
keeps those tensors (it computes nothing from them); a modified file is still one error and
nothing runs; a failed build stops the readers."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import mlac
from mlac.core.artifact import Manifest
from mlac.core.errors import MlacError
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.params import SamplingParams
from mlac.runtime.engine.scheduler import SchedulerConfig
from mlac.runtime.model.layers import Weights
from mlac.runtime.model.model import DeepseekModel
from mlac.runtime.serve.launch import startup_line
from mlac.runtime.worker import build as build_mod
from mlac.runtime.worker import readpass
from mlac.runtime.worker.build import RankJob, build_runner
from mlac.runtime.worker.loader import load_artifact, start_load
from mlac.runtime.worker.options import RuntimeOptions
from tests._cli import invoke, one_line_error

ROOT = Path(mlac.__file__).resolve().parent.parent
PROMPTS = [[5, 9, 14, 3, 27], [8, 8, 31], [40, 2, 19, 7, 7, 11, 4]]


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        assert (x.dtype, x.shape) == (y.dtype, y.shape), name
        assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), name


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def tamper(src: Path, dst: Path) -> Path:
    """A copy of artifact `src` at `dst` with one byte of its largest tensor file flipped (same size)."""
    import shutil

    shutil.copytree(src, dst)
    path = max(dst.glob("rank-*/*.safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("preset,fp8", [("tiny-v2-lite", False), ("tiny-v3", True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_overlapped_load_gives_the_plain_loads_bits(artifact, monkeypatch, preset, fp8, dtype):
    path = artifact(preset, fp8=fp8)
    plain = load_artifact(path, dtype=dtype)

    def no_allocation(*args):
        raise AssertionError("the readers allocate nothing: every place is made before they start")

    monkeypatch.setattr(readpass._Lane, "_destination", no_allocation)
    pending = start_load(path, dtype=dtype, threads=3)
    loaded = pending.join()
    same_bits(loaded.tensors, plain.tensors)
    assert loaded.tensors is pending.tensors
    assert loaded.stats.bytes == plain.stats.bytes and loaded.stats.verified


def test_derived_tensors_keep_their_address_and_get_their_values_at_join(artifact):
    """The router is cast to float32 (a tensor computed from its bytes): allocated up front,
    zero until join, then filled in place; a plain view keeps the file's allocation."""
    path = artifact("tiny-v3")
    plain = load_artifact(path, dtype=torch.bfloat16).tensors
    pending = start_load(path, dtype=torch.bfloat16)
    gate, embed = pending.tensors["layers.1.moe.gate"], pending.tensors["embed"]
    where = gate.data_ptr()
    assert gate.dtype == torch.float32 and not gate.any()  # nothing computes it before join
    pending.join()
    assert gate.data_ptr() == where and torch.equal(gate, plain["layers.1.moe.gate"])
    assert torch.equal(embed, plain["embed"]) and embed.untyped_storage().nbytes() > embed.nbytes


def test_the_model_keeps_the_pending_tensors_and_computes_nothing_from_them(artifact):
    """Every weight buffer of the model built on a pending load is one of its tensors (the same
    storage): a weight the model derived at construction would hold the zeros of before the load."""
    path = artifact("tiny-v3", fp8=True)
    pending = start_load(path, dtype=torch.bfloat16)
    model = DeepseekModel(Manifest.load(path).model, Weights(pending.tensors))
    pending.join()
    ours = {storage(t) for t in pending.tensors.values()}
    buffers = {name: b for name, b in model.named_buffers() if name != "rope.inv_freq"}  # from the config
    assert buffers and all(storage(b) in ours for b in buffers.values()), [
        n for n, b in buffers.items() if storage(b) not in ours
    ]


@pytest.mark.parametrize("preset,fp8", [("tiny-v2-lite", False), ("tiny-v3", True)])
def test_overlapped_and_plain_starts_give_the_same_greedy_tokens(artifact, preset, fp8):
    path = artifact(preset, fp8=fp8)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    plain = Engine.from_artifact(path, dtype=torch.float32, load_overlap=False)
    assert "load_graphs_s" not in plain.startup
    overlapped = Engine.from_artifact(path, dtype=torch.float32)
    assert {"load_s", "load_gb", "load_graphs_s"} <= overlapped.startup.keys()
    same_bits(dict(overlapped.runner.model.named_buffers()), dict(plain.runner.model.named_buffers()))
    want = [c.token_ids for c in plain.generate(PROMPTS, params)]
    assert [c.token_ids for c in overlapped.generate(PROMPTS, params)] == want


def test_a_modified_file_is_refused_after_the_overlapped_build(artifact, tmp_path, monkeypatch):
    """The hash fails in the background while the model is built: one MlacError at join, as the
    plain load says it, and no runner comes out."""
    bad = tmp_path / "bad"
    tamper(artifact("tiny-v3"), bad)
    built = []
    assemble = build_mod._assemble
    monkeypatch.setattr(build_mod, "_assemble", lambda *a: built.append(1) or assemble(*a))
    with pytest.raises(MlacError) as plain:
        load_artifact(bad)
    with pytest.raises(MlacError) as overlapped:
        build_runner(RankJob(str(bad), RuntimeOptions(device="cpu", load_overlap=True)), 0)
    assert built == [1]  # the model was built on the pending load before the hash failed
    assert str(overlapped.value) == str(plain.value)
    assert "sha256 does not match the manifest" in str(plain.value) and "\n" not in str(plain.value)


def test_the_cli_refuses_a_modified_file_in_one_line(artifact, tmp_path):
    path = tamper(artifact("tiny-v3"), tmp_path / "bad")
    r = invoke("generate", tmp_path / "bad", "--prompt", "hello", "--max-tokens", "2", "--device", "cpu")
    one_line_error(r, path.name, "sha256 does not match the manifest", code=3)


def test_a_failed_build_stops_the_readers(artifact, monkeypatch):
    """The build fails while the files are read (slowly here): the readers stop after their
    current read and are gone when the error comes out (nothing writes freed tensors)."""
    real, reads = readpass.read_exact, []

    def slow(*args):
        reads.append(1)
        time.sleep(0.2)
        real(*args)

    def broken(*args):
        raise MlacError("the build failed")

    path = artifact("tiny-v3")  # compiled (and checked) first
    monkeypatch.setattr(readpass, "read_exact", slow)
    monkeypatch.setattr(build_mod, "_assemble", broken)
    job = RankJob(str(path), RuntimeOptions(device="cpu", load_overlap=True))
    with pytest.raises(MlacError, match="the build failed"):
        build_runner(job, 0)
    assert not [t for t in threading.enumerate() if t.name.startswith("mlac-load")]
    assert len(reads) < len(list(path.rglob("*.*")))  # stopped before the end


def test_the_overlap_is_the_default_and_a_field():
    assert RuntimeOptions().load_overlap
    assert not RuntimeOptions.of(load_overlap=False).load_overlap


@pytest.mark.gpu
@pytest.mark.parametrize("preset,fp8", [("tiny-v2-lite", False), ("tiny-v3", True)])
def test_cuda_graphs_captured_while_loading_give_the_tokens_of_a_plain_start(artifact, preset, fp8):
    """The graphs captured while the weights stream in replay on the loaded weights: the same
    greedy tokens as graphs captured after a plain load (same buckets, same kernels)."""
    path = artifact(preset, fp8=fp8)
    kw = dict(device="cuda", dtype=torch.bfloat16, num_blocks=256, cuda_graph_max_bs=16,
              scheduler=SchedulerConfig(prefix_cache=False))  # fmt: skip
    plain = Engine.from_artifact(path, load_overlap=False, **kw)
    overlapped = Engine.from_artifact(path, **kw)
    assert "load_graphs_s" in overlapped.startup and overlapped.runner.graphs is not None
    pending = start_load(path, device="cuda", dtype=torch.bfloat16)
    assert all(len(lane.scratch) == 2 for lane in pending._pass.lanes)  # pinned before start_load returns
    pending.join()
    same_bits(dict(overlapped.runner.model.named_buffers()), dict(plain.runner.model.named_buffers()))
    g = torch.Generator().manual_seed(5)
    for n in (1, 3, 13):
        prompts = [torch.randint(3, 200, (4 + 3 * i,), generator=g).tolist() for i in range(n)]
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        want = [c.token_ids for c in plain.generate(prompts, params)]
        assert [c.token_ids for c in overlapped.generate(prompts, params)] == want, f"batch {n}"


def test_the_startup_line_gives_the_overlapped_wall():
    s = dict(ready_s=8.1, import_s=1.2, load_s=3.1, load_gb=31.4, graphs_s=3.0, load_graphs_s=3.4,
             graph_buckets=20, graph_max_bs=256, warmup_s=0.3, kv_tokens=812032, max_context=163840)  # fmt: skip
    line = startup_line(s, verified=True, kv_dtype="bf16")
    assert (
        "verify+load 3.1 s (31.4 GB, 10.1 GB/s), graphs 3.0 s (20 buckets), load+graphs 3.4 s, warm-up"
        in line
    )
    assert "load+graphs" not in startup_line(dict(s, graph_buckets=0), verified=True, kv_dtype="bf16")


def test_the_engine_process_imports_no_http_stack():
    """What the engine's child imports before its config comes (engine_process._child_main) holds
    torch and the engine, not the server's FastAPI / uvicorn (serve/engine_start.py)."""
    code = (
        "import sys; from mlac.runtime.engine import engine; from mlac.runtime.serve import engine_child; "
        "print(' '.join(m for m in ('fastapi', 'uvicorn', 'starlette', 'mlac.runtime.serve.launch',"
        " 'mlac.runtime.serve.app', 'transformers', 'mlac.compiler') if m in sys.modules))"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", out.stdout
