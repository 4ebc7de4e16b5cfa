"""CUDA graphs of the decode step under DP attention (dp_attention.py).

Each rank captures the ladder's buckets (largest first, one pool) as graphs.DecodeGraphs does, but
a bucket here is a count of rows per rank: rank r's graph runs its own rows (its sequences'
decode tokens, or the flattened rows of short extends) padded to the bucket, with the token
exchange inside. Every rank knows every rank's row count from the Step, so all ranks replay the
same bucket: the smallest one that holds the busiest rank's rows. A rank with no rows replays it
on padding rows only, which keeps every collective of the step lined up.

Inside the graph, with `bs` rows per rank and `N` ranks:

    all_ids [N, bs]     every rank's token ids (padding 0): the vocab-parallel embedding runs over
                        all of them (all-reduce) and each rank keeps its own bs rows
    attention           this rank's rows only, over its own cache (padding rows: the scratch block)
    MLP / MoE           over all N·bs rows (all-gather), partial sums reduce-scattered back
    logits [N·bs, V]    every rank's rows gathered, then the vocab-parallel head

After the replay each sequence's logits are picked by (its rank, its last row). Overlap
scheduling's decode steps hand their token ids on the device in step order: each goes to the row
(its rank, its place among that rank's sequences) of all_ids on the device (`rank_slots`).

A decode step with more than max_bs rows on some rank replays in pieces (graphs.py's module
docstring), each at most max_bs rows on every rank (`pieces`): every rank computes the same pieces
and buckets from the whole Step, so their collectives stay lined up.
"""

from __future__ import annotations

import torch

from mlac.runtime.device_copy import to_device
from mlac.runtime.kvcache.paged import PagedKVCache
from mlac.runtime.model.dp_attention import DPRank, TokenExchange
from mlac.runtime.model.model import DeepseekModel
from mlac.runtime.step import Step
from mlac.runtime.worker.graphs import DecodeGraphs, pick_bucket


class DPDecodeGraphs(DecodeGraphs):
    """DecodeGraphs of one DP-attention rank: buckets of rows per rank (module docstring)."""

    def __init__(
        self, model: DeepseekModel, cache: PagedKVCache, buckets: list[int], max_context: int, dp: DPRank
    ):
        super().__init__(model, cache, buckets, max_context, row_groups=False)  # its own _step, per-row
        self.dp = dp
        self.warm_once = False  # every rank warms every bucket: their collectives line up
        device, n = model.device, dp.size
        self.all_ids = torch.zeros(n, self.max_bs, dtype=torch.int64, device=device)  # [N, max_bs]
        vocab = model.config.vocab_size
        self.logits = torch.empty(n * self.max_bs, vocab, dtype=torch.float32, device=device)  # [N·max_bs, V]
        self.idle = Step.of([[0]], [0], [[cache.scratch_block]])  # one padding row

    def _step(self, bs: int) -> None:
        n = self.dp.size
        _, batch = self.inputs.batch(bs)
        ids = self.all_ids[:, :bs].reshape(n * bs)  # rank r's rows at r·bs
        exchange = TokenExchange((bs,) * n, self.dp.rank, self.dp.group)
        hidden = self.model(ids, batch, self.cache, exchange)  # [bs, D]: this rank's rows
        self.model.logits_into(exchange.gather(hidden), self.logits[: n * bs])  # [N·bs, V]

    def fits(self, step: Step) -> bool:
        """Logits of each sequence's last new token, at most max_bs rows on every rank."""
        return not step.every_token and max(step.rank_tokens(self.dp.size)) <= self.max_bs

    def pieces(self, step: Step) -> list[list[int]]:
        """A decode step above max_bs rows on some rank, in pieces of at most max_bs rows on every
        rank: piece p holds the sequences that are their rank's p·max_bs-th to (p + 1)·max_bs - 1-th,
        in step order. Every rank holds the whole Step: all take the same pieces and buckets."""
        seen, out = [0] * self.dp.size, []
        for i in range(step.num_seqs):
            r = step.rank_of(i)
            p, seen[r] = seen[r] // self.max_bs, seen[r] + 1
            if p == len(out):  # the first rank to reach piece p opens it
                out.append([])
            out[p].append(i)
        return out

    def _replay(self, step: Step, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, V] float32 of each sequence's last new token, in step order. A bucket that
        was not captured (on CPU, where nothing is) runs the same padded step eagerly."""
        n, dev = self.dp.size, self.all_ids.device
        bs = pick_bucket(self.buckets, max(step.rank_tokens(n)))
        parts = [step.part(r) for r in range(n)]
        mine = parts[self.dp.rank]
        self.inputs.fill(mine if mine is not None else self.idle, bs)  # its ids unused: all_ids's are
        if ids is None:
            rows = [list(p.token_ids) if p is not None else [] for p in parts]
            padded = [t for row in rows for t in row + [0] * (bs - len(row))]  # [N·bs], rank r's at r·bs
            self.all_ids[:, :bs].copy_(to_device(padded, torch.int64, dev).view(n, bs))
        else:  # a decode step's ids [B] on the device, step order (overlap): each to its rank's row
            self.all_ids[:, :bs].zero_()
            slots = [r * self.max_bs + j for r, j in rank_slots(step, n)]  # flat in [N, max_bs]
            self.all_ids.view(-1).index_copy_(0, to_device(slots, torch.int64, dev), ids)
        graph = self.graphs.get(bs)
        if graph is not None:
            graph.replay()
        else:
            self._step(bs)
        return self.logits[to_device(last_rows(step, n, bs), torch.int64, self.logits.device)]


def rank_slots(step: Step, size: int) -> list[tuple[int, int]]:
    """(rank, row among that rank's rows) of each sequence of a decode step, in step order."""
    used, out = [0] * size, []
    for i in range(step.num_seqs):
        r = step.rank_of(i)
        out.append((r, used[r]))
        used[r] += 1
    return out


def last_rows(step: Step, size: int, bs: int) -> list[int]:
    """Row of each sequence's last new token in the gathered [size·bs] rows, in step order."""
    used, out = [0] * size, []
    for i, q in enumerate(step.q_lens):
        r = step.rank_of(i)
        used[r] += q
        out.append(r * bs + used[r] - 1)
    return out
