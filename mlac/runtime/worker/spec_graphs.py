"""CUDA graphs of speculative decoding's draft steps: the MTP layer and its head over a
decode-shaped batch (one row per position), one graph per batch-size bucket.

The verify step needs none of its own: spec/decode.verify_step makes it a decode step (one row
per verified token), which the main DecodeGraphs replay (with `keep_hidden`, for the MTP layer).
The draft steps (the chain, and the refresh after a verify) are MTP forwards over rows that read
a hidden state each: `DraftGraphs` captures them like DecodeGraphs captures the main model, with
one more static input, the hidden rows [bs, D], and two outputs, g [bs, D] and the MTP head's
logits [bs, V]. Padding rows write the cache's scratch block (graphs.DecodeInputs). A bucket that
was not captured (on CPU, where nothing is) runs the same padded step eagerly.
"""

from __future__ import annotations

import torch

from mlac.runtime.kvcache.paged import PagedKVCache
from mlac.runtime.model.model import DeepseekModel
from mlac.runtime.step import Step
from mlac.runtime.worker.graphs import DecodeInputs, capture_buckets, pick_bucket


class DraftGraphs:
    """One captured MTP step per bucket; `run(step, x)` replays the right one."""

    def __init__(self, model: DeepseekModel, cache: PagedKVCache, buckets: list[int], max_context: int):
        self.model, self.cache, self.buckets = model, cache, list(buckets)
        device, max_bs = model.device, buckets[-1]
        self.inputs = DecodeInputs(max_bs, -(-max_context // cache.block_size), cache, device)
        d, v = model.config.hidden_size, model.config.vocab_size
        self.x = torch.zeros(max_bs, d, dtype=model.dtype, device=device)  # input hidden rows
        self.g = torch.empty(max_bs, d, dtype=model.dtype, device=device)
        self.logits = torch.empty(max_bs, v, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    @property
    def max_bs(self) -> int:
        return self.buckets[-1]

    def _step(self, bs: int) -> None:
        ids, batch = self.inputs.batch(bs)
        g = self.model.draft(self.x[:bs], ids, batch, self.cache)
        self.g[:bs].copy_(g)
        self.logits[:bs].copy_(self.model.mtp[0].head(g).float())

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Capture every bucket, largest first, into one pool (`pool`: share another's)."""
        self.graphs, self.pool = capture_buckets(self.buckets, self._step, pool)

    def can_run(self, step: Step) -> bool:
        return step.is_decode and step.num_seqs <= self.max_bs

    @torch.inference_mode()
    def run(
        self, step: Step, x: torch.Tensor, ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(g [N, D], logits [N, V] float32) of the MTP layer over hidden rows x [N, D] and the
        decode-shaped `step` (views of the static outputs: valid until the next replay). `ids` [N]:
        the step's token ids on the device, in place of step.token_ids (DecodeInputs.fill)."""
        n = step.num_seqs
        bs = pick_bucket(self.buckets, n)
        self.inputs.fill(step, bs, ids)
        self.x[:n].copy_(x)
        graph = self.graphs.get(bs)
        if graph is not None:
            graph.replay()
        else:
            self._step(bs)
        return self.g[:n], self.logits[:n]
