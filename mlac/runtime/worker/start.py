"""make_runner: how an artifact's ranks are run, the one place that decides it. Its checks come
first, before anything is loaded: the launch against the artifact's plan, the context, the KV
cache against the GPU's memory (plan_kv), the rank folders of this process's ranks."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from mlac.core.artifact import Manifest
from mlac.core.errors import IntegrityError
from mlac.core.validity import check_artifact
from mlac.runtime.dist.ranks import rank_device
from mlac.runtime.dist.world import LaunchSpec, World, plan_world
from mlac.runtime.expect import check_expected
from mlac.runtime.kvcache.paged import PagedKVCache
from mlac.runtime.worker.build import RankJob, build_runner
from mlac.runtime.worker.distributed import DistributedRunner, run_rank
from mlac.runtime.worker.memory_plan import KVPlan, bucket_plan, check_max_model_len, plan_ranks
from mlac.runtime.worker.options import RuntimeOptions
from mlac.runtime.worker.runner import ModelRunner

log = logging.getLogger("mlac.runtime")


def make_runner(
    path: str | Path,
    manifest: Manifest,
    options: RuntimeOptions | None = None,
    launch: LaunchSpec | None = None,
) -> ModelRunner | DistributedRunner:
    """The runner for an artifact: its model loaded strictly on `options.device`, with a fresh KV
    cache and, on CUDA, its decode steps captured as CUDA graphs (`options`).

    A 1-rank artifact runs in this process. A tp-N artifact runs one process per rank, each
    loading only its own files (distributed.py): on one machine this process becomes rank 0 and spawns
    the others (or hands their work to launch.ranks, spawned early: world.start_node_ranks);
    with `launch` (nnodes > 1) each node's process spawns that node's ranks; under
    torchrun every process calls make_runner. Rank 0 gets a DistributedRunner once every rank
    has loaded. Any other rank serves steps inside this call until rank 0 closes, then exits its
    process with sys.exit(0) (or 1 after a failure): code after make_runner runs on rank 0 only.
    Refuses (MlacError) a launch that does not fit the artifact's plan, and, before anything is
    loaded, a KV cache that does not fit (plan_kv).
    """
    options = options or RuntimeOptions()
    check_expected(manifest, options.dp_attention, options.tensor_parallel_size, options.kv_cache_dtype)
    world = plan_world(manifest.plan, launch)
    check_max_model_len(options.max_model_len, manifest.model.max_position_embeddings)
    here = torch.device(options.device) if world.size == 1 else rank_device(world, options.device)
    planned = plan_kv(manifest, here, options)
    if planned is not None:  # every rank gets the same block count (RankJob.fingerprint checks it)
        options = replace(options, num_blocks=planned.num_blocks)
    if world.size == 1:
        return build_runner(RankJob(str(path), options), rank=0)
    check_local_ranks(Path(path), manifest, world)
    # each rank on its own device: "cuda" is cuda:<its local rank> (rank_device)
    job = RankJob(str(path), replace(options, device=torch.device(options.device).type))
    return run_rank(job, world, spawned=launch.ranks if launch is not None else None)


def plan_kv(manifest: Manifest, device: torch.device, options: RuntimeOptions) -> KVPlan | None:
    """On CUDA with neither num_blocks nor kv_cache_bytes: the KV blocks of the artifact's memory
    plan (memory_plan.py), on `device`'s memory measured now, before any weight is loaded; its
    warnings are logged. None elsewhere (make_cache's default then). Every rank gets the smallest
    of the ranks' plans, computed here from this GPU's memory: the ranks of a node have identical
    GPUs, and every node's process plans alike (a node that differs fails the fingerprint check).
    The blocks are sized on what the pools will take (kv_bytes_per_token): the plan's bytes per
    token assume bf16 compute and count the main layers only."""
    if device.type != "cuda" or options.num_blocks is not None or options.kv_cache_bytes is not None:
        return None
    free, total = torch.cuda.mem_get_info(device)
    kv = plan_ranks(
        bucket_plan(manifest), total, max_position_embeddings=manifest.model.max_position_embeddings,
        block_size=options.block_size, gpu_memory_utilization=options.gpu_memory_utilization,
        max_model_len=options.max_model_len, free_bytes=free, cuda_graphs=options.graphs_on(device),
        kv_bytes_per_token=kv_bytes_per_token(manifest, options),
    )  # fmt: skip
    for warning in kv.warnings:
        log.warning(warning)
    return kv


def kv_bytes_per_token(manifest: Manifest, options: RuntimeOptions) -> int:
    """The bytes one token takes in the pools make_cache allocates for `options`: every layer's
    pool (options.draft_layers MTP pools included) in the storage dtype of the artifact's
    kv_cache_dtype under options.dtype (a "bf16" cache stores the compute dtype: 4 bytes in float32)."""
    kv_dtype = manifest.options.kv_cache_dtype
    return PagedKVCache.bytes_per_block(
        manifest.model, 1, options.torch_dtype, kv_dtype, options.draft_layers
    )


def check_local_ranks(root: Path, manifest: Manifest, world: World) -> None:
    """Before any rank starts: the rank folders of this process's ranks (its node's, or its own
    under torchrun) exist and hold their files at their sizes (hashes are each rank's to check).
    A missing folder is then one clean error here, not a failure inside a spawned rank."""
    first = world.rank - world.local_rank
    ranks = [world.rank] if world.torchrun else range(first, first + world.local_size)
    for rank in ranks:
        folder = manifest.rank_dir(rank)
        if not (root / folder).is_dir():
            raise IntegrityError(f"{root}: rank folder {folder}/ is missing (the artifact is incomplete)")
    check_artifact(root, ranks=list(ranks), hashes=False)
