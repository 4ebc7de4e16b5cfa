"""ModelRunner: one rank's model and KV cache tensors, running one forward step.

The Engine (and the scheduler) decide what to run: which tokens, which cache blocks. A runner
runs it. `make_runner` is the one place that decides how an artifact's ranks are run: a
1-rank artifact runs in this process; a multi-rank artifact runs one process per rank (dist.py),
and rank 0 gets a DistributedRunner with ModelRunner's interface.
"""

from __future__ import annotations

import atexit
import hashlib
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mlac.artifact import MANIFEST, Manifest
from mlac.config import ModelConfig
from mlac.errors import MlacError
from mlac.runtime.dist import (
    LaunchSpec,
    RankGroup,
    World,
    check_devices,
    end_process,
    plan_world,
    rank_device,
    recv_step,
    send_step,
)
from mlac.runtime.kv_cache import ForwardBatch, PagedKVCache
from mlac.runtime.layers import Weights
from mlac.runtime.loader import check_files, load_artifact
from mlac.runtime.model import DeepseekModel
from mlac.runtime.parallel import SINGLE, ParallelContext

__all__ = ["DistributedRunner", "LaunchSpec", "ModelRunner", "make_cache", "make_runner"]

DEFAULT_KV_CACHE_BYTES = 1 << 30


class ModelRunner:
    """Runs forward steps of one rank's model over its paged KV cache."""

    def __init__(self, model: DeepseekModel, cache: PagedKVCache):
        self.model = model
        self.cache = cache

    @property
    def device(self) -> torch.device:
        return self.model.device

    def forward(
        self, token_ids: torch.Tensor, batch: ForwardBatch, every_token: bool = False
    ) -> torch.Tensor:
        """token_ids [T] of the batch's new tokens -> float32 logits [T, V] if every_token,
        else of each sequence's last token [B, V]."""
        hidden = self.model(token_ids, batch, self.cache)
        return self.model.logits(hidden if every_token else hidden[batch.last_token_indices])

    def close(self) -> None:
        """Release what the runner holds beyond this process (nothing for one rank)."""


def make_cache(
    config: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    num_blocks: int | None = None,
    kv_cache_bytes: int | None = None,
    block_size: int = 16,
    kv_dtype: str = "bf16",
) -> PagedKVCache:
    """`num_blocks`, else a byte budget (default 1 GiB, capped at 4 sequences of max context);
    `kv_dtype` is the artifact's options.kv_cache_dtype."""
    if num_blocks is None and kv_cache_bytes is not None:
        return PagedKVCache.from_budget(config, kv_cache_bytes, block_size, dtype, device, kv_dtype)
    if num_blocks is None:
        fits = DEFAULT_KV_CACHE_BYTES // PagedKVCache.bytes_per_block(config, block_size, dtype, kv_dtype)
        num_blocks = max(1, min(fits, -(-4 * config.max_position_embeddings // block_size)))
    return PagedKVCache(config, num_blocks, block_size, dtype, device, kv_dtype)


def make_runner(
    path: str | Path,
    manifest: Manifest,
    device: torch.device | str,
    dtype: torch.dtype,
    verify: bool = True,
    launch: LaunchSpec | None = None,
    **cache_args,
) -> ModelRunner | DistributedRunner:
    """The runner for an artifact: its model loaded strictly, with a fresh KV cache
    (`cache_args`: num_blocks, kv_cache_bytes, block_size, as `make_cache`).

    A 1-rank artifact runs in this process. A tp-N artifact runs one process per rank, each
    loading only its own files (dist.py): on one machine this process becomes rank 0 and spawns
    the others; with `launch` (nnodes > 1) each node's process spawns that node's ranks; under
    torchrun every process calls make_runner. Rank 0 gets a DistributedRunner once every rank
    has loaded. Any other rank serves steps inside this call until rank 0 closes, then exits its
    process with sys.exit(0) (or 1 after a failure): code after make_runner runs on rank 0 only.
    Refuses (MlacError) a launch that does not fit the artifact's plan.
    """
    world = plan_world(manifest.plan, launch)
    if world.size == 1:
        return build_runner(RankJob(str(path), str(device), dtype, verify, cache_args), rank=0)
    check_local_ranks(Path(path), manifest, world)
    return run_rank(RankJob(str(path), torch.device(device).type, dtype, verify, cache_args), world)


def check_local_ranks(root: Path, manifest: Manifest, world: World) -> None:
    """Before any rank starts: the rank folders of this process's ranks (its node's, or its own
    under torchrun) exist and hold their files at their sizes (hashes are each rank's to check).
    A missing folder is then one clean error here, not a failure inside a spawned rank."""
    first = world.rank - world.local_rank
    ranks = [world.rank] if world.torchrun else range(first, first + world.local_size)
    for rank in ranks:
        folder = manifest.rank_dir(rank)
        if not (root / folder).is_dir():
            raise MlacError(f"{root}: rank folder {folder}/ is missing (the artifact is incomplete)")
        check_files(root, manifest, verify=False, rank=rank)


@dataclass(frozen=True)
class RankJob:
    """What every rank builds its part from (picklable: spawned ranks receive it)."""

    path: str
    device: str  # "cpu", "cuda" (each rank on cuda:<local rank>), or a device of a 1-rank artifact
    dtype: torch.dtype
    verify: bool
    cache_args: dict[str, Any] = field(default_factory=dict)

    def fingerprint(self, runner: ModelRunner) -> str:
        """What every rank must agree on: the artifact, the compute dtype, the KV cache geometry."""
        digest = hashlib.sha256((Path(self.path) / MANIFEST).read_bytes()).hexdigest()[:16]
        c = runner.cache
        return f"manifest {digest}, {self.dtype}, {c.kv_dtype} KV cache of {c.num_blocks}x{c.block_size}"


def build_runner(
    job: RankJob, rank: int, group: dist.ProcessGroup | None = None, device: torch.device | None = None
) -> ModelRunner:
    """Rank `rank`'s model (from its own files only) and a KV cache, on `device` (default job.device);
    `group` joins the ranks of a multi-rank artifact (None for one rank)."""
    device = job.device if device is None else device
    loaded = load_artifact(job.path, rank=rank, device=device, dtype=job.dtype, verify=job.verify)
    cfg, plan = loaded.manifest.model, loaded.manifest.plan
    ctx = SINGLE if group is None else ParallelContext(rank, plan.tp, plan.ep, group)
    source = job.path if plan.world_size == 1 else f"{job.path} (rank {rank})"
    model = DeepseekModel(cfg, Weights(loaded.tensors, source=source), ctx)
    kv_dtype = loaded.manifest.options.kv_cache_dtype
    return ModelRunner(model, make_cache(cfg, device, job.dtype, **job.cache_args, kv_dtype=kv_dtype))


def run_rank(
    job: RankJob, world: World, target: Callable[[RankJob, World], Any] | None = None
) -> DistributedRunner:
    """This process's rank of a multi-rank artifact. A node's first process spawns the node's
    other ranks, each running `target(job, its world)` (default: run_rank). Rank 0 returns once
    every rank is loaded; any other rank serves steps and then exits the process."""
    device = rank_device(world, job.device)
    check_devices(world, device)
    if world.local_rank != 0 and not world.torchrun:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops the others
    group = RankGroup.join(world, target or run_rank, (job,))
    build = lambda process_group: build_runner(job, world.rank, process_group, device)  # noqa: E731
    try:
        runner = group.start(device, build, job.fingerprint)
        if world.rank == 0:
            return DistributedRunner(runner, group)
        serve_steps(runner, group)
    except SystemExit:
        raise
    except BaseException as e:
        if world.rank == 0:
            raise  # the group is stopped and `e` names the rank that failed
        group.report(e)  # before this process exits and breaks the others' collectives
        group.terminate_local()
        end_process(world, 1)
    group.leave()
    end_process(world, 0)


def serve_steps(runner: ModelRunner, group: RankGroup) -> None:
    """Ranks other than 0: run every step rank 0 broadcasts, until it broadcasts stop."""
    while (step := recv_step(group.control, runner.cache.block_size, runner.device)) is not None:
        token_ids, batch, every_token = step
        runner.forward(token_ids, batch, every_token)  # the logits are rank 0's


class DistributedRunner:
    """Rank 0 of a multi-rank artifact, with ModelRunner's interface.

    `forward` broadcasts the step (token ids, the batch's ctx_lens, q_lens and block tables, and
    every_token) so that every rank runs the same forward, runs rank 0's part, and returns the
    whole logits [*, V]. A failure of any rank raises MlacError naming it, and stops every rank.
    `close` (also run at interpreter exit) stops the other ranks and waits for them to exit.
    """

    def __init__(self, local: ModelRunner, group: RankGroup):
        self.local = local
        self.group = group
        self.model = local.model
        self.cache = local.cache  # rank 0 allocates blocks; every rank's cache has the same geometry
        atexit.register(self.close)

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def world_size(self) -> int:
        return self.group.world.size

    def forward(
        self, token_ids: torch.Tensor, batch: ForwardBatch, every_token: bool = False
    ) -> torch.Tensor:
        """As ModelRunner.forward, on every rank."""
        self.group.check_usable()
        try:
            send_step(self.group.control, token_ids, batch, every_token)
            return self.local.forward(token_ids, batch, every_token)
        except BaseException as e:
            error = self.group.fail(e)  # names the failed rank and stops the group
            if isinstance(e, Exception):
                raise error from e
            raise

    def close(self) -> None:
        """Stop the other ranks (after their current step) and close the process groups. Idempotent."""
        atexit.unregister(self.close)
        self.group.shutdown()
