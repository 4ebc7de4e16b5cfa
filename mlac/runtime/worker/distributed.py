"""A multi-rank artifact's ranks: each rank's process joins the group and builds its runner
(build.py); rank 0 drives them through a DistributedRunner (ModelRunner's interface), the others
run every step rank 0 broadcasts (serve_steps) until it stops them."""

from __future__ import annotations

import atexit
from collections.abc import Callable
from typing import Any

import torch

from mlac.runtime.dist.node_ranks import NodeRanks
from mlac.runtime.dist.ranks import RankGroup, check_devices, end_process, rank_device
from mlac.runtime.dist.step_link import FedStep, SpecOp, recv_step, send_fed, send_spec, send_step, share_ids
from mlac.runtime.dist.world import World
from mlac.runtime.kvcache.pool import BlockPool
from mlac.runtime.model.dp_attention import DPRank
from mlac.runtime.step import Step
from mlac.runtime.worker.build import RankJob, build_runner
from mlac.runtime.worker.graphs import DecodeGraphs
from mlac.runtime.worker.runner import ModelRunner
from mlac.runtime.worker.spec_exec import SpecExecutor


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
    device = rank_device(world, job.options.device)
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
    (step_link.FedStep), so no rank waits on the host for them. A failure of any rank raises
    MlacError naming it, and stops every rank.
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

    @property
    def failed(self) -> str | None:
        """Why the ranks were stopped (a rank failed during a step): no step runs again."""
        return self.group.failed

    def trouble(self) -> tuple[str, bool] | None:
        """(why, dead) for a rank on this node that exited (dead) or is stopped; None while all run
        (RankGroup.trouble: any thread, without the ranks' cooperation)."""
        return self.group.trouble()

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
