"""A node's other ranks spawned early (node_ranks.py, world.start_node_ranks): before the first
process imports torch, from the manifest alone; handed their work when the launch joins them; a
failure of one, before or after it got its work, stops the start with its message; none is left
behind, whatever happens first (a failed load, a closed or killed first process).

On CPU (gloo), one tp-2 artifact; each spawned rank is a fresh interpreter (seconds).
"""

from __future__ import annotations

from _paths import REPO

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from _cli import invoke, one_line_error
from _procs import spawned

from mlac.compiler.pipeline import compile_checkpoint
from mlac.core.artifact import CompileOptions, ParallelPlan
from mlac.core.errors import MlacError
from mlac.runtime.dist.node_ranks import NodeRanks
from mlac.runtime.dist.world import LaunchSpec, plan_world, start_node_ranks
from mlac.runtime.engine.engine import Engine
from mlac.runtime.serve import ServerConfig, ServerThread
from mlac.runtime.serve.engine_process import EngineProcess
from mlac.runtime.serve.engine_start import startup_line

CACHE = {"num_blocks": 32, "block_size": 16}
TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


@pytest.fixture(autouse=True)
def nothing_left_behind():
    before = spawned()
    yield
    deadline = time.monotonic() + 20  # a rank that was importing torch exits once its pipe reads EOF
    while spawned() - before:
        assert time.monotonic() < deadline, "processes started by the test outlived it"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, checkpoint) -> Path:
    out = tmp_path_factory.mktemp("tp2") / "tiny-v2-lite-tp2"
    compile_checkpoint(checkpoint("tiny-v2-lite"), out, CompileOptions(tp=2, accuracy_check=False))
    return out


@pytest.fixture(scope="module")
def tp1(artifact) -> Path:
    return artifact("tiny-v2-lite")


def start(path: Path, ranks: NodeRanks | None, **kw) -> Engine:
    return Engine.from_artifact(path, dtype=torch.float32, launch=LaunchSpec(ranks=ranks), **CACHE, **kw)


# ---- which ranks, from the manifest ------------------------------------------------------------


def test_the_peers_of_a_nodes_first_process():
    assert sorted(plan_world(ParallelPlan(tp=4)).local_peers()) == [1, 2, 3]
    node1 = plan_world(ParallelPlan(tp=8), LaunchSpec(nnodes=2, node_rank=1))
    assert {r: w.local_rank for r, w in node1.local_peers().items()} == {5: 1, 6: 2, 7: 3}


def test_nothing_is_spawned_where_this_process_spawns_no_rank(tp1, tp2, tmp_path):
    assert start_node_ranks(tp1) is None  # one rank
    assert start_node_ranks(tp2, env=TORCHRUN) is None  # torchrun starts every rank
    assert start_node_ranks(tmp_path) is None  # no manifest: the load says so
    assert start_node_ranks(tp2, LaunchSpec(nnodes=2)) is None  # tp=2 over 2 nodes: one rank each
    assert start_node_ranks(tp2, LaunchSpec(nnodes=3)) is None  # refused: the load says why
    assert spawned() == set()


# ---- handed their work -------------------------------------------------------------------------


def test_early_ranks_run_the_artifact_and_exit_with_it(tp2, tp1):
    ranks = start_node_ranks(tp2)
    assert ranks is not None and ranks.ranks == [1]
    early = ranks.procs[1]
    with start(tp2, ranks) as engine:
        assert engine.runner.group.procs == {1: early} and ranks.procs == {}  # handed over, not respawned
        assert engine.runner.startup["ranks_met_s"] >= 0.0
        got = engine.score([5, 6, 7, 8])
    ranks.close()  # a no-op once handed over
    assert early.exitcode == 0
    with Engine.from_artifact(tp1, dtype=torch.float32, **CACHE) as one:
        want = one.score([5, 6, 7, 8])
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def _write_env(path: str, name: str, world) -> None:
    Path(path).write_text(os.environ.get(name, "<unset>"))


def test_a_rank_runs_with_the_environment_of_the_hand_over(tmp_path, monkeypatch):
    """What the first process sets after the spawn (the artifact's kernel cache: TRITON_CACHE_DIR)
    reaches the early rank with its work; without it the rank compiled every kernel again."""
    monkeypatch.delenv("MLAC_TEST_HANDED_OVER", raising=False)
    ranks = NodeRanks.spawn([1], preload="os")
    monkeypatch.setenv("MLAC_TEST_HANDED_OVER", str(tmp_path / "cache"))
    out = tmp_path / "seen"
    (proc,) = ranks.hand_over(_write_env, (str(out), "MLAC_TEST_HANDED_OVER"), {1: None}).values()
    proc.join(60)
    assert proc.exitcode == 0 and out.read_text() == str(tmp_path / "cache")


def test_a_mismatched_spawn_is_not_used(tp2):
    """Ranks spawned for another plan (the manifest changed meanwhile): the launch spawns its own."""
    other = NodeRanks.spawn([3])
    try:
        with start(tp2, other) as engine:
            assert sorted(engine.runner.group.procs) == [1] and other.ranks == [3]
            engine.score([1, 2, 3])
    finally:
        other.close()
    assert other.procs == {}


# ---- failures ----------------------------------------------------------------------------------


def test_an_early_rank_that_dies_before_its_work_stops_the_start(tp2):
    ranks = NodeRanks.spawn([1], preload="mlac.no_such_module")  # dies importing (exit code 1)
    t = time.monotonic()
    with pytest.raises(
        MlacError, match=r"rank 1 failed while the ranks met: exited unexpectedly \(exit code 1\)"
    ):
        start(tp2, ranks)
    assert time.monotonic() - t < 30


def test_an_early_rank_that_fails_to_load_stops_the_start_with_its_error(tp2, tmp_path):
    bad = Path(shutil.copytree(tp2, tmp_path / "bad"))
    layer = bad / "rank-00001-of-00002" / "layer-00001.safetensors"
    data = bytearray(layer.read_bytes())
    data[-3] ^= 0xFF
    layer.write_bytes(data)
    ranks = start_node_ranks(bad)
    early = ranks.procs[1]
    t = time.monotonic()
    with pytest.raises(MlacError, match=r"rank 1 failed .*layer-00001.safetensors: sha256 does not match"):
        start(bad, ranks)
    assert time.monotonic() - t < 30 and early.exitcode is not None


def test_early_ranks_that_get_no_work_exit(tp2):
    """Closed by their first process (its load failed first), or their pipe closed (it died)."""
    ranks = start_node_ranks(tp2)
    early = ranks.procs[1]
    ranks.close()
    assert early.exitcode is not None and ranks.procs == {}
    ranks = start_node_ranks(tp2)
    early = ranks.procs[1]
    for pipe in ranks._pipes.values():  # as when the first process dies: the rank reads EOF
        pipe.close()
    early.join(60)
    assert early.exitcode == 0


# ---- under `mlac serve` -------------------------------------------------------------------------


def test_the_engine_process_spawns_rank_1_before_it_is_configured(tp2):
    """The engine's process spawns rank 1 from the manifest at once (before it imports torch, and
    long before the server sends its config); killed unconfigured, it leaves nothing behind."""
    process = EngineProcess.start(tp2)
    try:
        deadline = time.monotonic() + 30
        while not spawned(psutil.Process(process.process.pid)):
            assert time.monotonic() < deadline, "the engine process spawned no rank"
            time.sleep(0.02)
    finally:
        process.close()


def test_a_load_that_fails_before_it_needs_the_early_ranks_stops_them(tp2):
    config = ServerConfig.of(artifact=tp2, dtype="float32", verify=False, engine_process=True, drain_timeout=5.0,
                          max_model_len=100_000_000)  # fmt: skip
    with pytest.raises(MlacError, match="loading failed: --max-model-len 100000000"):
        ServerThread(config).start(timeout=120)


def test_mlac_serve_on_a_second_node_spawns_its_ranks_early_and_exits_with_node_0(tmp_path, checkpoint):
    """tp=4 over 2 "nodes" on this machine: node 1 is `mlac serve --nnodes 2 --node-rank 1` (no
    HTTP: its process spawns rank 3 before it imports torch, runs rank 2, and exits 0 once node 0,
    here in this process, closes)."""
    tp4 = tmp_path / "tp4"
    compile_checkpoint(checkpoint("tiny-v2-lite"), tp4, CompileOptions(tp=4, accuracy_check=False))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "mlac.cli", "serve", str(tp4), "--nnodes", "2", "--node-rank", "1",
           "--master-port", str(port), "--dtype", "float32", "--num-blocks", "32", "--no-verify"]  # fmt: skip
    node1 = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60  # rank 3 comes before node 0 listens (a late spawn waits for it)
        while not spawned(psutil.Process(node1.pid)):
            assert node1.poll() is None and time.monotonic() < deadline, "node 1 spawned no rank"
            time.sleep(0.02)
        launch = LaunchSpec(nnodes=2, node_rank=0, master_port=port)
        with Engine.from_artifact(tp4, dtype=torch.float32, launch=launch, verify=False, **CACHE) as engine:
            assert sorted(engine.runner.group.procs) == [1]
            engine.score([1, 2, 3])
        out, _ = node1.communicate(timeout=60)
        assert node1.returncode == 0, out
    finally:
        node1.kill()
        node1.wait()


def test_the_engine_closes_the_early_ranks_its_load_did_not_take(tp2):
    """engine_child's load wrapper: the load failed before make_runner took the ranks."""
    from mlac.runtime.serve.engine_child import _closing

    def failing_load():
        raise MlacError("failed before the ranks were needed")

    ranks = start_node_ranks(tp2)
    early = ranks.procs[1]
    with pytest.raises(MlacError, match="before the ranks were needed"):
        _closing(failing_load, ranks)()
    assert early.exitcode is not None and ranks.procs == {}


def test_the_startup_line_gives_the_wait_for_the_ranks():
    s = dict(ready_s=9.8, import_s=1.2, load_s=3.1, load_gb=31.4, graphs_s=1.9, graph_buckets=20,
             graph_max_bs=256, warmup_s=2.0, kv_tokens=812032, max_context=163840)  # fmt: skip
    assert "ranks met" not in startup_line(s, verified=True, kv_dtype="bf16")
    line = startup_line(dict(s, ranks_met_s=0.04), verified=True, kv_dtype="bf16")
    assert line.startswith("ready in 9.8 s: import 1.2 s, ranks met 0.0 s, verify+load 3.1 s")


# ---- the other commands -----------------------------------------------------------------------


def _spy_early_spawns(monkeypatch) -> list:
    """NodeRanks (or None) of each world.start_node_ranks call the CLI makes."""
    import mlac.runtime.dist.world as world

    seen, real = [], world.start_node_ranks
    monkeypatch.setattr(world, "start_node_ranks", lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1])
    return seen


def test_generate_starts_the_ranks_early_and_gives_the_one_rank_tokens(tp2, tp1, monkeypatch):
    """`mlac generate` (like bench and eval) spawns rank 1 before it imports torch and hands it its
    work: greedy text equal to the 1-rank artifact's."""
    seen = _spy_early_spawns(monkeypatch)
    args = [
        "--prompt",
        "hello",
        "--max-tokens",
        "6",
        "--temperature",
        "0",
        "--dtype",
        "float32",
        "--device",
        "cpu",
    ]
    two = invoke("generate", tp2, *args)
    assert two.exit_code == 0, two.output
    assert len(seen) == 1 and seen[0] is not None and seen[0].procs == {}  # spawned, then handed over
    one = invoke("generate", tp1, *args)
    assert one.exit_code == 0 and seen[1] is None  # one rank: nothing spawned
    assert two.output == one.output


def test_bad_input_stops_the_ranks_spawned_early(tp2, monkeypatch):
    """Refused before the load (a one-line error): the ranks it spawned never get work and are stopped
    (the autouse check: nothing outlives the test)."""
    seen = _spy_early_spawns(monkeypatch)
    one_line_error(invoke("bench", tp2, "--batch-sizes", "one", "--device", "cpu"), "--batch-sizes 'one'")
    assert len(seen) == 1 and seen[0] is not None and seen[0].procs == {}  # closed by the command's end
