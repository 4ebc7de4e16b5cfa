"""ModelRunner: one rank's model and KV cache tensors, running one forward step.

The Engine (and the scheduler) decide what to run: which tokens, which cache blocks. A runner
runs it. `make_runner` is the one place that decides how an artifact's ranks are run: a
1-rank artifact runs in this process; a multi-rank artifact runs one process per rank (dist.py),
and rank 0 gets a DistributedRunner with ModelRunner's interface.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mlac.core.artifact import MANIFEST, Manifest, ParallelPlan
from mlac.core.config import ModelConfig
from mlac.core.errors import IntegrityError, MlacError
from mlac.core.plan import MAX_BS as MAX_GRAPH_BS
from mlac.core.plan import decode_buckets
from mlac.core.validity import check_artifact
from mlac.runtime.dist.node_ranks import NodeRanks
from mlac.runtime.dist.ranks import RankGroup, check_devices, end_process, rank_device
from mlac.runtime.dist.step_link import FedStep, SpecOp, recv_step, send_fed, send_spec, send_step, share_ids
from mlac.runtime.dist.world import LaunchSpec, World, plan_world
from mlac.runtime.kvcache.batch import ForwardBatch
from mlac.runtime.kvcache.paged import DEFAULT_KV_SCALE, PagedKVCache
from mlac.runtime.kvcache.pool import BlockPool
from mlac.runtime.model.dp_attention import DPRank
from mlac.runtime.model.layers import Weights
from mlac.runtime.model.model import DeepseekModel
from mlac.runtime.model.parallel import SINGLE, ParallelContext
from mlac.runtime.step import Step
from mlac.runtime.worker.dp_graphs import DPDecodeGraphs
from mlac.runtime.worker.graphs import DecodeGraphs
from mlac.runtime.worker.loader import load_artifact, start_load
from mlac.runtime.worker.memory_plan import KVPlan, bucket_plan, check_max_model_len, plan_ranks
from mlac.runtime.worker.spec_exec import Fail, Send, SpecExecutor
from mlac.runtime.worker.spec_graphs import DraftGraphs

__all__ = ["DistributedRunner", "LaunchSpec", "ModelRunner", "RuntimeOptions", "make_cache", "make_runner"]

log = logging.getLogger("mlac.runtime")

DEFAULT_KV_CACHE_BYTES = 1 << 30
GRAPH_DTYPES = (torch.bfloat16, torch.float16)  # every kernel of the step is a Triton one
LOAD_OVERLAP_ENV = "MLAC_LOAD_OVERLAP"  # "0": load, then build and capture (the A/B of the overlap)


class ModelRunner:
    """Runs forward steps of one rank's model over its paged KV cache: decode steps through the
    CUDA graphs when it has them and the batch fits a bucket, every other step eagerly. Under DP
    attention (`dp`) it runs its own part of every Step (dp_attention.py)."""

    def __init__(
        self,
        model: DeepseekModel,
        cache: PagedKVCache,
        graphs: DecodeGraphs | None = None,
        startup: dict[str, float] | None = None,
        dp: DPRank | None = None,
    ):
        self.model = model
        self.cache = cache
        self.graphs = graphs
        self.dp = dp
        self.pool = BlockPool(cache.num_blocks, cache.block_size)  # its blocks, as rank 0 schedules them
        # what the start cost, for the start-up log (build_runner): load_s, load_gb, graphs_s, and
        # with the overlap load_graphs_s (the wall of the two together), multi-rank ranks_met_s (dist.py)
        self.startup = startup or {}
        self.draft_graphs: DraftGraphs | None = None  # speculative decoding's MTP steps (spec_graphs.py)
        self._spec: SpecExecutor | None = None

    def spec_executor(self, send: Send | None = None, fail: Fail | None = None) -> SpecExecutor:
        """The device side of speculative decoding over this rank's runner (made once)."""
        if self._spec is None:
            self._spec = SpecExecutor(self, send, fail)
        return self._spec

    @property
    def device(self) -> torch.device:
        return self.model.device

    def run(self, step: Step) -> torch.Tensor:
        """Float32 logits of `step`: [T, V] if step.every_token, else [B, V] (each sequence's last
        new token; with CUDA graphs a view that the next step overwrites)."""
        if self.graphs is not None and self.graphs.can_run(step):  # alike on every rank
            return self.graphs.run(step)
        if self.dp is not None:
            return self.dp.run(self.model, self.cache, step)
        token_ids, batch = step.to_device(self.cache.block_size, self.device)
        return self.forward(token_ids, batch, step.every_token)

    def run_decode(self, step: Step, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits [B, V] of a decode `step` (not under DP attention), its token ids from
        `ids` [B] int64 on the device when given (else step.token_ids): the CUDA graphs when they
        take it, else eager. Overlap scheduling's steps (overlap.py)."""
        if self.graphs is not None and self.graphs.can_run(step):  # alike on every rank
            return self.graphs.run(step, ids=ids)
        token_ids, batch = step.to_device(self.cache.block_size, self.device)
        return self.forward(token_ids if ids is None else ids, batch)

    def forward(
        self, token_ids: torch.Tensor, batch: ForwardBatch, every_token: bool = False
    ) -> torch.Tensor:
        """token_ids [T] of the batch's new tokens -> float32 logits [T, V] if every_token,
        else of each sequence's last token [B, V]."""
        hidden = self.model(token_ids, batch, self.cache)
        return self.model.logits(hidden if every_token else hidden[batch.last_token_indices])

    @property
    def kv_pools(self) -> list[BlockPool]:
        """The KV block pools a scheduler allocates from, one per DP-attention rank: this cache's."""
        return [self.pool]

    def close(self) -> None:
        """Release what the runner holds beyond this process (nothing for one rank)."""

    def release_graphs(self) -> None:
        """Drop the CUDA graphs and their memory pool. NOTE: must run before the process group is
        destroyed: graphs that captured NCCL collectives must not outlive their communicator."""
        if self.graphs is not None or self.draft_graphs is not None:
            torch.cuda.synchronize()
            self.graphs = self.draft_graphs = None
            if self._spec is not None:
                self._spec.release_graphs()  # its chain graphs (spec_chain.py), in the same pool


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
class RuntimeOptions:
    """How a rank runs an artifact: the KV cache's size (`num_blocks`, else `kv_cache_bytes`, as
    `make_cache`; on CUDA with neither, the memory plan under `gpu_memory_utilization`, see
    `plan_kv`), the longest context (`max_model_len`, default the model's) and the CUDA graphs of
    decode steps (on CUDA, in a GRAPH_DTYPES compute dtype: float32 runs parts of the step through
    torch references that cannot be captured). `load_overlap` (default: on unless the environment
    sets MLAC_LOAD_OVERLAP=0): the weights stream in while the model is built and its graphs are
    captured (build_runner); off: load, then build."""

    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    block_size: int = 16
    cuda_graph: bool = True
    cuda_graph_max_bs: int = 256
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    draft_layers: int = 0  # KV pools for the MTP layers (speculative decoding, spec_decode.py)
    dp_attention: bool | None = None  # what the launch expects of the artifact's plan (None: any)
    load_overlap: bool = field(default_factory=lambda: os.environ.get(LOAD_OVERLAP_ENV, "1") != "0")

    def __post_init__(self) -> None:
        if not 1 <= self.cuda_graph_max_bs <= MAX_GRAPH_BS:
            raise MlacError(f"cuda_graph_max_bs={self.cuda_graph_max_bs}: must be in [1, {MAX_GRAPH_BS}]")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise MlacError(f"--gpu-memory-utilization {self.gpu_memory_utilization}: must be in (0, 1]")

    def graphs_on(self, device: torch.device | str, dtype: torch.dtype) -> bool:
        return self.cuda_graph and torch.device(device).type == "cuda" and dtype in GRAPH_DTYPES

    def graph_buckets(self, manifest: Manifest) -> list[int]:
        """The artifact's decode buckets (the buckets pass's, or its default ladder for an
        artifact compiled without them) up to cuda_graph_max_bs, and that size itself."""
        plan = manifest.buckets
        ladder = plan.decode_batch_sizes if plan is not None else decode_buckets(MAX_GRAPH_BS)
        return sorted({b for b in ladder if b < self.cuda_graph_max_bs} | {self.cuda_graph_max_bs})


def make_runner(
    path: str | Path,
    manifest: Manifest,
    device: torch.device | str,
    dtype: torch.dtype,
    verify: bool = True,
    launch: LaunchSpec | None = None,
    options: RuntimeOptions | None = None,
) -> ModelRunner | DistributedRunner:
    """The runner for an artifact: its model loaded strictly, with a fresh KV cache and, on CUDA,
    its decode steps captured as CUDA graphs (`options`).

    A 1-rank artifact runs in this process. A tp-N artifact runs one process per rank, each
    loading only its own files (dist.py): on one machine this process becomes rank 0 and spawns
    the others (or hands their work to launch.ranks, spawned early: world.start_node_ranks);
    with `launch` (nnodes > 1) each node's process spawns that node's ranks; under
    torchrun every process calls make_runner. Rank 0 gets a DistributedRunner once every rank
    has loaded. Any other rank serves steps inside this call until rank 0 closes, then exits its
    process with sys.exit(0) (or 1 after a failure): code after make_runner runs on rank 0 only.
    Refuses (MlacError) a launch that does not fit the artifact's plan, and, before anything is
    loaded, a KV cache that does not fit (plan_kv).
    """
    options = options or RuntimeOptions()
    check_dp_attention(manifest.plan, options.dp_attention)
    world = plan_world(manifest.plan, launch)
    check_max_model_len(options.max_model_len, manifest.model.max_position_embeddings)
    here = torch.device(device) if world.size == 1 else rank_device(world, device)
    planned = plan_kv(manifest, here, dtype, options)
    if planned is not None:  # every rank gets the same block count (RankJob.fingerprint checks it)
        layers = manifest.model.num_hidden_layers  # the plan's bytes per block; the MTP pools share them
        options = replace(options, num_blocks=planned.num_blocks * layers // (layers + options.draft_layers))
    if world.size == 1:
        return build_runner(RankJob(str(path), str(device), dtype, verify, options), rank=0)
    check_local_ranks(Path(path), manifest, world)
    job = RankJob(str(path), torch.device(device).type, dtype, verify, options)
    return run_rank(job, world, spawned=launch.ranks if launch is not None else None)


def check_dp_attention(plan: ParallelPlan, expected: bool | None) -> None:
    """Refuse a launch that expects DP attention of an artifact compiled without it, or the other
    way (the tensors differ: attention whole on every rank, or sharded by heads)."""
    if expected is None or expected == plan.dp_attention:
        return
    how = "with" if plan.dp_attention else "without"
    fix = "drop --no-dp-attention" if plan.dp_attention else "recompile with --dp-attention"
    raise MlacError(
        f"artifact compiled {how} --dp-attention (tp={plan.tp}); this launch asks otherwise: {fix}"
    )


def plan_kv(
    manifest: Manifest, device: torch.device, dtype: torch.dtype, options: RuntimeOptions
) -> KVPlan | None:
    """On CUDA with neither num_blocks nor kv_cache_bytes: the KV blocks of the artifact's memory
    plan (memory_plan.py), on `device`'s memory measured now, before any weight is loaded; its
    warnings are logged. None elsewhere (make_cache's default then). Every rank gets the smallest
    of the ranks' plans, computed here from this GPU's memory: the ranks of a node have identical
    GPUs, and every node's process plans alike (a node that differs fails the fingerprint check)."""
    if device.type != "cuda" or options.num_blocks is not None or options.kv_cache_bytes is not None:
        return None
    free, total = torch.cuda.mem_get_info(device)
    kv = plan_ranks(
        bucket_plan(manifest), total, max_position_embeddings=manifest.model.max_position_embeddings,
        block_size=options.block_size, gpu_memory_utilization=options.gpu_memory_utilization,
        max_model_len=options.max_model_len, free_bytes=free, cuda_graphs=options.graphs_on(device, dtype),
    )  # fmt: skip
    for warning in kv.warnings:
        log.warning(warning)
    return kv


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
    check_artifact(root, ranks=ranks, hashes=False)


@dataclass(frozen=True)
class RankJob:
    """What every rank builds its part from (picklable: spawned ranks receive it)."""

    path: str
    device: str  # "cpu", "cuda" (each rank on cuda:<local rank>), or a device of a 1-rank artifact
    dtype: torch.dtype
    verify: bool
    options: RuntimeOptions = RuntimeOptions()

    def fingerprint(self, runner: ModelRunner) -> str:
        """What every rank must agree on: the artifact, the compute dtype, the KV cache geometry."""
        digest = hashlib.sha256((Path(self.path) / MANIFEST).read_bytes()).hexdigest()[:16]
        c, g = runner.cache, runner.graphs
        graphs = f"CUDA graphs {g.buckets}" if g is not None else "no CUDA graphs"
        dp = ", DP attention" if runner.dp is not None else ""
        return f"manifest {digest}, {self.dtype}, {c.kv_dtype} KV cache of {c.num_blocks}x{c.block_size}, {graphs}{dp}"


def build_runner(
    job: RankJob, rank: int, group: dist.ProcessGroup | None = None, device: torch.device | None = None
) -> ModelRunner:
    """Rank `rank`'s model (from its own files only) and a KV cache, on `device` (default job.device);
    `group` joins the ranks of a multi-rank artifact (None for one rank).

    With job.options.load_overlap on cpu or cuda the load runs in the background (loader.start_load)
    while this thread builds the model on the tensors' final addresses and captures the CUDA graphs
    (every rank at once, as without the overlap); then the load is joined: a short or modified file
    raises its MlacError here (nothing is served), else the derived tensors are recomputed in place
    and every tensor holds its value before anything replays a graph or runs a step. Without it:
    load, then build."""
    device = torch.device(job.device if device is None else device)
    if job.options.load_overlap and device.type in ("cpu", "cuda"):
        return _build_while_loading(job, rank, group, device)
    loaded = load_artifact(job.path, rank=rank, device=device, dtype=job.dtype, verify=job.verify)
    runner = _assemble(job, rank, group, device, loaded.manifest, loaded.tensors)
    runner.startup.update(load_s=loaded.stats.seconds, load_gb=loaded.stats.bytes / 1e9)
    return runner


def _build_while_loading(
    job: RankJob, rank: int, group: dist.ProcessGroup | None, device: torch.device
) -> ModelRunner:
    """build_runner with the load in the background: _assemble on the pending tensors, then join."""
    start = time.perf_counter()
    pending = start_load(job.path, rank=rank, device=device, dtype=job.dtype, verify=job.verify)
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
    captures' forwards, whose graphs keep only addresses): model, KV cache, CUDA graphs."""
    cfg, plan = manifest.model, manifest.plan
    ctx = SINGLE if group is None else ParallelContext(rank, plan.tp, plan.ep, group)
    source = job.path if plan.world_size == 1 else f"{job.path} (rank {rank})"
    model = DeepseekModel(cfg, Weights(tensors, source=source), ctx, plan.dp_attention)
    dp = DPRank(rank, plan.tp, group) if plan.dp_attention else None
    o = job.options
    kv_dtype, kv_scales = manifest.options.kv_cache_dtype, manifest.quantization.kv_scales
    cache = make_cache(
        cfg, device, job.dtype, o.num_blocks, o.kv_cache_bytes, o.block_size, kv_dtype, kv_scales,
        o.draft_layers,
    )  # fmt: skip
    startup: dict[str, float] = {}
    graphs = draft = None
    if o.graphs_on(device, job.dtype):
        start = time.perf_counter()
        max_context = min(o.max_model_len or cfg.max_position_embeddings, cache.capacity_tokens)
        buckets = o.graph_buckets(manifest)  # under DP attention: rows per rank
        if dp is None:
            graphs = DecodeGraphs(model, cache, buckets, max_context, keep_hidden=o.draft_layers > 0)
        else:
            graphs = DPDecodeGraphs(model, cache, buckets, max_context, dp)
        graphs.capture()  # every rank at once: the collectives inside the graphs line up
        if o.draft_layers:  # speculative decoding: the MTP layer's steps too, in the same pool
            draft = DraftGraphs(model, cache, buckets, max_context)
            draft.capture(graphs.pool)
        startup["graphs_s"] = time.perf_counter() - start
        startup.update({f"graphs_{k}": v for k, v in graphs.timings.items()})  # eager runs, captures
    runner = ModelRunner(model, cache, graphs, startup, dp)
    runner.draft_graphs = draft
    return runner


def run_rank(
    job: RankJob,
    world: World,
    target: Callable[[RankJob, World], Any] | None = None,
    spawned: NodeRanks | None = None,
) -> DistributedRunner:
    """This process's rank of a multi-rank artifact. A node's first process has the node's other
    ranks run `target(job, its world)` (default: run_rank), in the processes `spawned` early
    (LaunchSpec.ranks) or in ones it spawns now. Rank 0 returns once every rank is loaded; any
    other rank serves steps and then exits the process."""
    device = rank_device(world, job.device)
    check_devices(world, device)
    group = RankGroup.join(world, target or run_rank, (job,), spawned)
    build = lambda process_group: build_runner(job, world.rank, process_group, device)  # noqa: E731
    try:
        runner = group.start(device, build, job.fingerprint)
        if world.rank == 0:
            runner.startup["ranks_met_s"] = group.met_s  # the start-up log's "ranks met" phase
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
    while (step := recv_step(group.control)) is not None:
        if isinstance(step, SpecOp):
            runner.spec_executor().apply(step.code, step.ints)  # speculative decoding (spec_exec.py)
        elif isinstance(step, FedStep):  # overlap scheduling: the ids come from rank 0's device
            ids = torch.empty(len(step.step.token_ids), dtype=torch.int64, device=runner.device)
            runner.run_decode(step.step, share_ids(ids))
        else:
            runner.run(step)  # the logits are rank 0's
    runner.release_graphs()  # before the caller leaves the group


class DistributedRunner:
    """Rank 0 of a multi-rank artifact, with ModelRunner's interface.

    `run` broadcasts the Step (token ids, ctx_lens, q_lens, block tables, every_token) so that
    every rank runs the same forward (the same CUDA graph), runs rank 0's part, and returns the
    whole logits [*, V]. `run_decode` does so for overlap scheduling, whose token ids may be rank
    0's sampled ids on its device: they reach the other ranks by a broadcast on the device
    (step_link.FedStep), so no rank waits on the host for them. A failure of any rank raises MlacError naming it, and stops every rank.
    `close` (also run at interpreter exit) stops the other ranks and waits for them to exit.
    """

    def __init__(self, local: ModelRunner, group: RankGroup):
        self.local = local
        self.group = group
        self.model = local.model
        self.cache = local.cache  # rank 0 allocates blocks; every rank's cache has the same geometry
        c, others = local.cache, group.world.size - 1 if local.dp is not None else 0
        self._pools = [local.pool] + [BlockPool(c.num_blocks, c.block_size) for _ in range(others)]
        atexit.register(self.close)

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def world_size(self) -> int:
        return self.group.world.size

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self.local.graphs

    @property
    def dp(self) -> DPRank | None:
        return self.local.dp

    @property
    def startup(self) -> dict[str, float]:
        return self.local.startup  # rank 0's

    @property
    def kv_pools(self) -> list:
        """The KV block pools rank 0's scheduler allocates from: under DP attention one per rank
        (rank 0's, then the others'), else rank 0's alone (every rank caches
        the same latents)."""
        return self._pools

    def spec_executor(self) -> SpecExecutor:
        """Rank 0's SpecExecutor, broadcasting each op so that every rank runs it."""
        return self.local.spec_executor(send=self._send_spec, fail=self.group.fail)

    def _send_spec(self, code: int, ints: list[int]) -> None:
        self.group.check_usable()
        try:
            send_spec(self.group.control, code, ints)
        except BaseException as e:
            error = self.group.fail(e)
            if isinstance(e, Exception):
                raise error from e
            raise

    def run(self, step: Step) -> torch.Tensor:
        """As ModelRunner.run, on every rank."""
        return self._on_every_rank(lambda: send_step(self.group.control, step), lambda: self.local.run(step))

    def run_decode(self, step: Step, ids: torch.Tensor | None = None) -> torch.Tensor:
        """As ModelRunner.run_decode, on every rank: `ids` [B] (rank 0's device) go to the others
        on the device, after the step's message (send_fed)."""
        link = self.group.control
        send = (lambda: send_step(link, step)) if ids is None else (lambda: send_fed(link, ids, step))
        return self._on_every_rank(send, lambda: self.local.run_decode(step, ids))

    def _on_every_rank(self, send: Callable[[], None], run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`send` the step to the other ranks, then `run` rank 0's part. A failure stops the group."""
        self.group.check_usable()
        try:
            send()
            return run()
        except BaseException as e:
            error = self.group.fail(e)  # names the failed rank and stops the group
            if isinstance(e, Exception):
                raise error from e
            raise

    def close(self) -> None:
        """Stop the other ranks (after their current step) and close the process groups. Idempotent."""
        atexit.unregister(self.close)
        self.local.release_graphs()
        self.group.shutdown()
