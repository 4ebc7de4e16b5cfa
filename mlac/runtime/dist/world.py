"""Where each rank of a multi-rank artifact runs, decided before torch is imported: the launch
(one machine, --nnodes, torchrun), this process's place in it (World), and the node's other
ranks started from the manifest alone (start_node_ranks).

It imports nothing heavy (no torch; pydantic only to read a manifest), so that a node's first
process can spawn its other ranks (node_ranks.py) before it imports torch: they import theirs
meanwhile, instead of after it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from mlac.core.errors import MlacError
from mlac.runtime.dist.node_ranks import NodeRanks

if TYPE_CHECKING:
    from mlac.core.artifact import ParallelPlan

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
StepChannel = Literal["shm", "gloo"]
STEP_CHANNELS = ("shm", "gloo")


@dataclass(frozen=True)
class LaunchSpec:
    """How the processes of a multi-rank artifact find each other (torch.distributed rendezvous).

    One node (nnodes 1): ranks meet on a free port of 127.0.0.1 and master_* is not used. Several
    nodes: run the same command on each node with its node_rank; master_addr:master_port is
    where node 0's rank 0 listens. `timeout_s` bounds the start (meeting and loading) and each
    collective. `ranks`: this node's other ranks, spawned already (start_node_ranks), that the
    launch hands their work to instead of spawning them; whoever spawned them closes them (a
    no-op once handed over). `step_channel`: how rank 0 sends each step when every rank runs on
    its node: "shm", the shared-memory ring (shm_channel.py), or "gloo", the broadcast that
    several nodes need (tests run one node's steps that way too); across nodes always gloo."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    timeout_s: float = 600.0
    ranks: NodeRanks | None = field(default=None, compare=False, repr=False)
    step_channel: StepChannel = "shm"

    def __post_init__(self) -> None:
        if self.step_channel not in STEP_CHANNELS:
            raise MlacError(f"step_channel={self.step_channel!r}: say shm or gloo")


@dataclass(frozen=True)
class World:
    """Where one process sits: its global rank, the world, its node's ranks, how to meet."""

    rank: int
    size: int
    local_rank: int
    local_size: int  # ranks on this node
    master_addr: str
    master_port: int  # 0: rank 0's store picks a free port (one node)
    timeout_s: float = 600.0
    torchrun: bool = False
    step_channel: StepChannel = "shm"  # LaunchSpec.step_channel: rank 0's choice on one node

    @property
    def spawns_local_ranks(self) -> bool:
        """Whether this process starts the other ranks of its node (not under torchrun)."""
        return not self.torchrun and self.local_rank == 0 and self.local_size > 1

    def local_peer(self, local_rank: int) -> World:
        return replace(self, rank=self.rank - self.local_rank + local_rank, local_rank=local_rank)

    def local_peers(self) -> dict[int, World]:
        """The worlds of the other ranks of this node, by global rank (a node's first process)."""
        peers = (self.local_peer(i) for i in range(1, self.local_size))
        return {p.rank: p for p in peers}


def plan_world(
    plan: ParallelPlan, launch: LaunchSpec | None = None, env: Mapping[str, str] = os.environ
) -> World:
    """This process's place in the world the artifact needs; refuse a launch that does not fit it."""
    launch = launch or LaunchSpec()
    need, timeout, channel = plan.world_size, launch.timeout_s, launch.step_channel
    ranks = f"tp={plan.tp} ({need} rank{'s' if need > 1 else ''})"
    if all(k in env for k in TORCHRUN_ENV):
        size, rank, local_rank = int(env["WORLD_SIZE"]), int(env["RANK"]), int(env["LOCAL_RANK"])
        if size != need:
            raise MlacError(f"artifact compiled for {ranks}; this launch has {size}")
        if not 0 <= rank < size:
            raise MlacError(f"RANK={rank} out of range for WORLD_SIZE={size}")
        local_size = int(env.get("LOCAL_WORLD_SIZE", size))
        addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
        return World(rank, size, local_rank, local_size, addr, port, timeout, True, channel)
    if launch.nnodes < 1 or not 0 <= launch.node_rank < launch.nnodes:
        raise MlacError(f"node rank {launch.node_rank} out of range for {launch.nnodes} node(s)")
    if need % launch.nnodes:
        raise MlacError(f"artifact compiled for {ranks} cannot be split evenly over {launch.nnodes} nodes")
    local = need // launch.nnodes
    if launch.nnodes == 1:
        return World(0, need, 0, local, "127.0.0.1", 0, timeout, step_channel=channel)
    rank0 = launch.node_rank * local
    return World(rank0, need, 0, local, launch.master_addr, launch.master_port, timeout, step_channel=channel)


def launches_rank_0(launch: LaunchSpec | None = None, env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process becomes rank 0 (the one that gets a runner back and serves), before
    any artifact is read: not a torchrun process of RANK > 0, not a node of node_rank > 0. The
    others run their ranks inside make_runner, which ends their process."""
    if all(k in env for k in TORCHRUN_ENV):
        return int(env["RANK"]) == 0
    return launch is None or launch.node_rank == 0


def start_node_ranks(
    artifact: str | Path, launch: LaunchSpec | None = None, env: Mapping[str, str] = os.environ
) -> NodeRanks | None:
    """This node's other ranks, spawned now (each imports torch meanwhile) when the artifact's
    manifest says this process will spawn them (World.spawns_local_ranks); None otherwise, or when
    the manifest or the launch is refused (the load then says why). Hand them to the launch as
    LaunchSpec.ranks; close them if the load fails before it takes them."""
    from mlac.core.artifact import Manifest  # pydantic, not torch

    try:
        world = plan_world(Manifest.load(artifact).plan, launch, env)
    except MlacError:
        return None
    return NodeRanks.spawn(sorted(world.local_peers())) if world.spawns_local_ranks else None
