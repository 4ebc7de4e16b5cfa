"""Overlap scheduling over a tp-2 artifact on two GPUs (NCCL, CUDA graphs), with and without DP
attention: the fed steps' ids reach rank 1 by a broadcast on the device (under DP attention each
rank then lays them out by rank inside its own graphs' inputs). Skipped without two GPUs."""

from __future__ import annotations

import pytest
import torch
from test_overlap import assert_graph_tokens_with_overlap

from mlac.compiler.pipeline import compile_checkpoint
from mlac.core.artifact import CompileOptions
from mlac.runtime.engine.engine import Engine
from mlac.runtime.worker import distributed as distributed_mod

pytestmark = pytest.mark.gpu(2)


@pytest.mark.parametrize("dp", [False, True], ids=["tp2", "tp2-dp-attention"])
def test_cuda_graphs_give_the_same_greedy_tokens_with_overlap(checkpoint, tmp_path, monkeypatch, dp):
    """On CUDA by default: greedy tokens identical to the serial scheduler's at batch sizes 1,
    3 and 17 (same max_tokens, no prefix cache: both runs replay the same buckets step by step),
    through fed steps."""
    out = tmp_path / f"tiny-v2-lite-tp2{'-dp' if dp else ''}"
    compile_checkpoint(checkpoint("tiny-v2-lite"), out, CompileOptions(tp=2, dp_attention=dp, accuracy_check=False))
    fed, send = [], distributed_mod.send_fed
    monkeypatch.setattr(distributed_mod, "send_fed", lambda *a: fed.append(1) or send(*a))
    with Engine.from_artifact(out, device="cuda", dtype=torch.bfloat16, verify=False, num_blocks=512,
                              cuda_graph_max_bs=32) as engine:  # fmt: skip
        assert (engine.runner.dp is not None) == dp
        assert_graph_tokens_with_overlap(engine)
    assert fed
