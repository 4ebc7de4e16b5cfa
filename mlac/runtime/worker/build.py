"""One rank's runner built from its own files: the model loaded strictly, a fresh KV cache and,
on CUDA, its decode steps captured as CUDA graphs (with the load streaming in meanwhile)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mlac.core.artifact import MANIFEST, Manifest
from mlac.core.config import ModelConfig
from mlac.runtime.kvcache.paged import DEFAULT_KV_SCALE, PagedKVCache
from mlac.runtime.model.dp_attention import DPRank
from mlac.runtime.model.layers import Weights
from mlac.runtime.model.model import DeepseekModel
from mlac.runtime.model.parallel import SINGLE, ParallelContext
from mlac.runtime.worker.attention_backend import make_attention
from mlac.runtime.worker.dp_graphs import DPDecodeGraphs
from mlac.runtime.worker.graphs import DecodeGraphs
from mlac.runtime.worker.loader import load_artifact, start_load
from mlac.runtime.worker.options import RuntimeOptions
from mlac.runtime.worker.runner import ModelRunner
from mlac.runtime.worker.spec_graphs import DraftGraphs

DEFAULT_KV_CACHE_BYTES = 1 << 30


def make_cache(
    config: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    num_blocks: int | None = None,
    kv_cache_bytes: int | None = None,
    block_size: int = 16,
    kv_dtype: str = "bf16",
    kv_scales: list[float] | None = None,
    extra_layers: int = 0,
) -> PagedKVCache:
    """`num_blocks`, else a byte budget (default 1 GiB, capped at 4 sequences of max context: the
    CPU default; on CUDA make_runner passes the memory plan's num_blocks); `kv_dtype` is the
    artifact's options.kv_cache_dtype, `kv_scales` its quantization.kv_scales (one per layer;
    None: DEFAULT_KV_SCALE for every layer); `extra_layers`: pools for the MTP layers (speculative
    decoding), counted in the byte budget."""
    scale, extra = DEFAULT_KV_SCALE if kv_scales is None else kv_scales, extra_layers
    if num_blocks is None and kv_cache_bytes is not None:
        return PagedKVCache.from_budget(
            config, kv_cache_bytes, block_size, dtype, device, kv_dtype, scale, extra
        )
    if num_blocks is None:
        per_block = PagedKVCache.bytes_per_block(config, block_size, dtype, kv_dtype, extra)
        fits = DEFAULT_KV_CACHE_BYTES // per_block
        num_blocks = max(1, min(fits, -(-4 * config.max_position_embeddings // block_size)))
    return PagedKVCache(config, num_blocks, block_size, dtype, device, kv_dtype, scale, extra)


@dataclass(frozen=True)
class RankJob:
    """What every rank builds its part from (picklable: spawned ranks receive it). `options.device`
    is "cpu", "cuda" (each rank on cuda:<local rank>), or the device of a 1-rank artifact."""

    path: str
    options: RuntimeOptions = RuntimeOptions()

    def fingerprint(self, runner: ModelRunner) -> str:
        """What every rank must agree on: the artifact, the compute dtype, the KV cache geometry."""
        digest = hashlib.sha256((Path(self.path) / MANIFEST).read_bytes()).hexdigest()[:16]
        c, g = runner.cache, runner.graphs
        graphs = f"CUDA graphs {g.buckets}" if g is not None else "no CUDA graphs"
        dp = ", DP attention" if runner.dp is not None else ""
        dtype = self.options.dtype
        return f"manifest {digest}, {dtype}, {c.kv_dtype} KV cache of {c.num_blocks}x{c.block_size}, {graphs}{dp}"


def build_runner(
    job: RankJob, rank: int, group: dist.ProcessGroup | None = None, device: torch.device | None = None
) -> ModelRunner:
    """Rank `rank`'s model (from its own files only) and a KV cache, on `device` (default
    job.options.device); `group` joins the ranks of a multi-rank artifact (None for one rank).

    With job.options.load_overlap on cpu or cuda the load runs in the background (loader.start_load)
    while this thread builds the model on the tensors' final addresses and captures the CUDA graphs
    (every rank at once, as without the overlap); then the load is joined: a short or modified file
    raises its MlacError here (nothing is served), else the derived tensors are recomputed in place
    and every tensor holds its value before anything replays a graph or runs a step. Without it:
    load, then build."""
    o = job.options
    device = torch.device(o.device if device is None else device)
    if o.load_overlap and device.type in ("cpu", "cuda"):
        return _build_while_loading(job, rank, group, device)
    loaded = load_artifact(job.path, rank=rank, device=device, dtype=o.torch_dtype, verify=o.verify)
    runner = _assemble(job, rank, group, device, loaded.manifest, loaded.tensors)
    runner.startup.update(load_s=loaded.stats.seconds, load_gb=loaded.stats.bytes / 1e9)
    return runner


def _build_while_loading(
    job: RankJob, rank: int, group: dist.ProcessGroup | None, device: torch.device
) -> ModelRunner:
    """build_runner with the load in the background: _assemble on the pending tensors, then join."""
    start = time.perf_counter()
    o = job.options
    pending = start_load(job.path, rank=rank, device=device, dtype=o.torch_dtype, verify=o.verify)
    try:
        runner = _assemble(job, rank, group, device, pending.manifest, pending.tensors)
    except BaseException:
        pending.cancel()  # NOTE: the readers stop before the tensors they write are freed
        raise
    try:
        loaded = pending.join()
    except BaseException:
        runner.release_graphs()  # captured on bytes that failed their check: never replayed
        raise
    wall = time.perf_counter() - start  # load and capture together
    runner.startup.update(load_s=loaded.stats.seconds, load_gb=loaded.stats.bytes / 1e9, load_graphs_s=wall)
    return runner


def _assemble(
    job: RankJob,
    rank: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    manifest: Manifest,
    tensors: dict[str, torch.Tensor],
) -> ModelRunner:
    """The runner over `tensors` (their values maybe still loading: nothing here reads them but the
    captures' forwards, whose graphs keep only addresses): model, KV cache, attention backend, CUDA
    graphs."""
    cfg, plan = manifest.model, manifest.plan
    ctx = SINGLE if group is None else ParallelContext(rank, plan.tp, plan.ep, group)
    source = job.path if plan.world_size == 1 else f"{job.path} (rank {rank})"
    model = DeepseekModel(cfg, Weights(tensors, source=source), ctx, plan.dp_attention, job.options.model)
    dp = DPRank(rank, plan.tp, group) if plan.dp_attention else None
    o = job.options
    kv_dtype, kv_scales = manifest.options.kv_cache_dtype, manifest.quantization.kv_scales
    cache = make_cache(
        cfg, device, o.torch_dtype, o.num_blocks, o.kv_cache_bytes, o.block_size, kv_dtype, kv_scales,
        o.draft_layers,
    )  # fmt: skip
    attention = make_attention(o.attention_backend, model, cache)  # FlashInfer's module loads here
    startup: dict[str, float] = {}
    graphs = draft = None
    if o.graphs_on(device):
        start = time.perf_counter()
        max_context = min(o.max_model_len or cfg.max_position_embeddings, cache.capacity_tokens)
        buckets = o.graph_buckets(manifest)  # under DP attention: rows per rank
        if dp is None:
            graphs = DecodeGraphs(
                model, cache, buckets, max_context, keep_hidden=o.draft_layers > 0, attention=attention
            )
        else:
            graphs = DPDecodeGraphs(model, cache, buckets, max_context, dp)
        graphs.capture()  # every rank at once: the collectives inside the graphs line up
        if o.draft_layers:  # speculative decoding: the MTP layer's steps too, in the same pool
            draft = DraftGraphs(model, cache, buckets, max_context)
            draft.capture(graphs.pool)
        startup["graphs_s"] = time.perf_counter() - start
        startup.update({f"graphs_{k}": v for k, v in graphs.timings.items()})  # eager runs, captures
    runner = ModelRunner(model, cache, graphs, startup, dp, attention)
    runner.draft_graphs = draft
    return runner
