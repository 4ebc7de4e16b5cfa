"""Step: one forward step as host data, built once and turned into the eager path's device inputs."""

from __future__ import annotations

import pytest
import torch

from mlac.core.errors import MlacError
from mlac.runtime.kvcache.batch import ForwardBatch
from mlac.runtime.step import Step


def test_of_packs_chunks_and_to_device_matches_forward_batch():
    step = Step.of([[5, 6, 7], [9]], [0, 4], [[2], [3, 1]])
    assert step.token_ids == (5, 6, 7, 9) and step.q_lens == (3, 1) and step.num_seqs == 2
    assert not step.is_decode
    ids, batch = step.to_device(4, "cpu")
    want = ForwardBatch.build([0, 4], [3, 1], [[2], [3, 1]], 4)
    assert ids.tolist() == [5, 6, 7, 9]
    for name in ("positions", "slots", "block_tables", "seq_lens", "cu_seqlens_q", "kv_slots"):
        assert torch.equal(getattr(batch, name), getattr(want, name)), name


def test_decode_steps_and_scoring_steps():
    assert Step.of([[1], [2]], [3, 0], [[0], [1]]).is_decode
    assert not Step.of([[1]], [3], [[0]], every_token=True).is_decode  # scoring wants every token's logits


def test_bad_steps_are_refused():
    with pytest.raises(MlacError, match="non-empty, of one length"):
        Step.of([[1]], [0, 0], [[0]])
    with pytest.raises(MlacError, match="cannot hold"):
        Step.of([[1, 2, 3]], [2], [[0]]).to_device(4, "cpu")  # 5 tokens in one block of 4
