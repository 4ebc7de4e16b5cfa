"""The attention backend of a runner's decode steps, chosen once at start from
RuntimeOptions.attention_backend (SGLang's --attention-backend): which kernel the absorbed MLA
decode runs between its two head_bmms (model/attention.decode_absorbed).

    triton      mlac's mla_decode: it reads each step's block tables and lengths as they are;
                nothing to plan. The CUDA graphs may capture its grouped form too.
    flashinfer  FlashInfer's MLA (kernels/attention/flashinfer_mla.py) over the same pools and
                block tables: planned once per step on the host, run by every layer. Eager decode
                steps plan one wrapper (`eager`); each CUDA-graph bucket has a wrapper of its own with
                fixed index buffers (`graph_wrappers`), planned before each replay (graphs.DecodeGraphs).

Both run the same steps: prefill and extend steps (the MHA, absorbed and shared-prefix forms)
keep mlac's kernels under either backend, and so do the steps that build their own batches
(speculative decoding's draft and chain steps, DP attention, which backend_check refuses).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from mlac.kernels.attention.flashinfer_mla import WORKSPACE_BYTES, PagedMLA, jit_modules
from mlac.runtime.kvcache.batch import ForwardBatch
from mlac.runtime.kvcache.paged import PagedKVCache
from mlac.runtime.model.model import DeepseekModel

log = logging.getLogger("mlac.runtime")


class TritonAttention:
    """mlac's own decode kernel: every batch runs as it is built."""

    name = "triton"
    groups_rows = True  # DecodeGraphs may capture mla_decode's grouped form
    compiled: tuple[str, ...] = ()  # no module built at start (Triton's compiles: jit_compiles.py)

    def eager(self, batch: ForwardBatch) -> ForwardBatch:
        return batch

    def graph_wrappers(self, buckets: list[int], max_pages: int) -> dict[int, None]:
        return dict.fromkeys(buckets)


TRITON = TritonAttention()


class FlashInferAttention:
    """FlashInfer's MLA decode over `cache`'s pools for `model`'s attention (its heads, dims, scale).
    Built once per runner, after the KV cache and before the CUDA graphs: FlashInfer's module is
    loaded (or JIT-compiled, named in `compiled`) here, not inside a capture or a request.
    Memory beyond the memory plan (its reserve covers it): the float workspace (WORKSPACE_BYTES, one
    per runner), the buckets' page ids, and 8 MiB on the device plus 8 MiB pinned per wrapper (one
    eager, one per bucket: V2-Lite's 20 buckets, 168 MiB of each)."""

    name = "flashinfer"
    groups_rows = False  # FlashInfer plans each row on its own: no grouped graphs

    def __init__(self, model: DeepseekModel, cache: PagedKVCache):
        attn = model.layers[0].attn  # every layer has the same heads, dims and scale
        device = model.device
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.shape = dict(heads=attn.n_local_heads, kv_lora=attn.kv_lora, rope=attn.rope, page=cache.block_size,
                          scale=attn.scale, dtype=cache.storage_dtype)  # fmt: skip
        start = time.perf_counter()
        self.eager_mla = PagedMLA(self.workspace, **self.shape)
        before = jit_modules()
        # one row on the scratch block: loads FlashInfer's module, or builds it in its workspace
        self.eager_mla.plan(torch.full((1, 1), cache.scratch_block, dtype=torch.int32, device=device), [1])
        self.compiled = tuple(sorted(jit_modules() - before))
        how = f"compiled {', '.join(self.compiled)}" if self.compiled else "loaded"
        log.info("attention backend flashinfer: module %s in %.1f s", how, time.perf_counter() - start)

    def eager(self, batch: ForwardBatch) -> ForwardBatch:
        """A decode batch with FlashInfer's wrapper planned for its rows; any other batch as it is."""
        if not batch.is_decode:
            return batch
        lens = [c + q for c, q in zip(batch.ctx_lens, batch.q_lens, strict=True)]
        self.eager_mla.plan(batch.block_tables, lens)
        return replace(batch, paged_mla=self.eager_mla)

    def graph_wrappers(self, buckets: list[int], max_pages: int) -> dict[int, PagedMLA]:
        """A wrapper per CUDA-graph bucket (`rows` its size) over tables of up to `max_pages` blocks,
        their page ids in one shared buffer [max bucket · max_pages] int32 (V2-Lite at 163,840
        tokens and 256 rows: 10 MiB)."""
        indices = torch.zeros(max(buckets) * max_pages, dtype=torch.int32, device=self.workspace.device)
        return {bs: PagedMLA(self.workspace, **self.shape, rows=bs, indices=indices) for bs in buckets}


AttentionBackend = TritonAttention | FlashInferAttention


def make_attention(name: str, model: DeepseekModel, cache: PagedKVCache) -> AttentionBackend:
    """The backend RuntimeOptions.attention_backend names (checked before loading: backend_check.py)."""
    return FlashInferAttention(model, cache) if name == "flashinfer" else TRITON
