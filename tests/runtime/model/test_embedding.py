"""VocabParallelEmbedding on one rank: one lookup, nothing around it (the masked form serves the
ranks of a sliced vocabulary: tests/runtime/model/test_dp_attention.py runs it over gloo)."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mlac.runtime.model.layers import Weights
from mlac.runtime.model.parallel import SINGLE, VocabParallelEmbedding


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def test_one_rank_looks_the_rows_up_in_one_operation():
    weight = torch.randn(50, 8)
    emb = VocabParallelEmbedding(Weights({"embed": weight}), "embed", 50, SINGLE)
    ids = torch.tensor([0, 49, 7, 7, 13])
    with Ops() as ops:
        out = emb(ids)
    assert torch.equal(out, weight[ids])
    assert ops.seen == Counter({"aten.embedding": 1})
