"""The ranks of a multi-rank artifact: who runs where, how they meet, how rank 0 drives them.

One process per rank. Three ways to start them, one code path (start.make_runner):

    one machine      the process that loads the artifact becomes rank 0 and spawns ranks 1..tp-1
    --nnodes N       each node's process spawns its tp/N local ranks: global rank
                     node_rank·(tp/N) + local rank; node 0's first process is rank 0
    torchrun         every process is started by torchrun (env RANK, WORLD_SIZE, LOCAL_RANK,
                     MASTER_ADDR, MASTER_PORT) and spawns nothing

Who runs where is decided in world.py (no torch). A node's first process has node_ranks.py
spawn its other ranks: when it joins (RankGroup.join), or earlier, before it imports torch itself
(world.start_node_ranks, passed as LaunchSpec.ranks: `mlac serve`'s engine process), so that
the ranks import torch while it does, not after it.

Rendezvous goes through a TCPStore (rank 0 hosts it; under torchrun, torchrun's). Besides the
process groups, the store carries the control protocol:

    joined/<r>   rank r reached the store; rank 0 opens the process groups only when all have
    loaded/<r>   rank r built its model and KV cache; the value (manifest digest, dtype, cache
                 geometry) must equal rank 0's
    go           "run" once every rank loaded, "abort" when one failed (the others then exit)
    error/<r>    rank r failed: "<sequence>:<message>"; the lowest sequence is the first failure

Rank 0 polls these and the liveness of the processes it spawned, so a rank that fails or dies
while loading stops the launch with its message instead of a hang. During steps a dead peer
breaks the collectives; rank 0 then reads the store (and exit codes) to name the failed rank.

Each step rank 0 sends one message of int64 (a header and a payload; step_link.encode_step) to the
others (step_link.StepLink): when every rank runs on its node, through a shared-memory ring (shm_channel.py:
microseconds; rank 0 creates it before "go", puts its name in the store under `channel`, and
unlinks it once every rank set `attached/<r>`); else, or for a message larger than a slot, or
with LaunchSpec.step_channel "gloo", by two broadcasts over a gloo group of its own (CPU, no
timeout: ranks wait there while the server idles). The model's collectives run on the default group
(gloo on CPU, NCCL on CUDA) with the launch timeout.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from mlac.core.errors import MlacError
from mlac.runtime.dist.node_ranks import NodeRanks
from mlac.runtime.dist.shm_channel import ShmChannel, pid_stopped
from mlac.runtime.dist.step_link import StepLink, send_stop
from mlac.runtime.dist.world import (  # noqa: F401  (LaunchSpec, plan_world, launches_rank_0: re-exported)
    LaunchSpec,
    World,
    launches_rank_0,
    plan_world,
)

IDLE_TIMEOUT = timedelta(days=3650)  # followers wait for the next step as long as the server lives
POLL_S = 0.02
FAILURE_GRACE_S = 1.0  # after a broken collective: how long to wait for a rank to report why

log = logging.getLogger("mlac.runtime")


def rank_device(world: World, device: torch.device | str) -> torch.device:
    """The device of a rank: cuda:<local rank> for CUDA ("cuda" or "cuda:<its local rank>"), else as given."""
    d = torch.device(device)
    if d.type != "cuda":
        return d
    if d.index is not None and d.index != world.local_rank:
        where = f"cuda:{world.local_rank}"
        raise MlacError(f"device {d}: rank {world.rank} of a multi-rank artifact runs on {where}; say 'cuda'")
    return torch.device("cuda", world.local_rank)


def check_devices(world: World, device: torch.device | str, gpus: int | None = None) -> None:
    """Refuse a CUDA launch whose node has fewer GPUs than it has ranks (one GPU per rank)."""
    if torch.device(device).type != "cuda":
        return
    have = torch.cuda.device_count() if gpus is None else gpus
    if world.local_size > have:
        nodes = world.size // world.local_size
        plan = f"tp={world.size}" if nodes == 1 else f"tp={world.size} over {nodes} nodes"
        raise MlacError(f"artifact needs {world.local_size} GPUs ({plan}), this machine has {have}")


def end_process(world: World, code: int) -> NoReturn:
    """End a rank's process after it left the group. A spawned rank skips interpreter teardown
    (seconds of freeing modules that nobody waits for); a process the user started exits normally,
    unless this is not its main thread (sys.exit would end only the thread)."""
    spawned = world.local_rank != 0 and not world.torchrun
    if spawned or threading.current_thread() is not threading.main_thread():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def describe(exc: BaseException) -> str:
    text = str(exc) if isinstance(exc, MlacError) else f"{type(exc).__name__}: {exc}"
    return text[:4000]


def describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


class RankGroup:
    """This process's membership in the world: rendezvous store, process groups, the processes it
    spawned, and the failure protocol (module docstring). Rank 0 drives; the others follow."""

    def __init__(self, world: World, store: dist.Store, procs: dict[int, Any]):
        self.world = world
        self.store = store  # NOTE: on rank 0 (not under torchrun) this object is the store's server
        self.ctl = dist.PrefixStore("mlac/ctl", store)
        self.procs = procs  # global rank -> the local process running it (spawned by this process)
        self.control: StepLink | None = None  # how the steps go from rank 0 to the others
        self.failed: str | None = None  # why the group stopped (rank 0)
        self.closed = False
        self.met_s = 0.0  # rank 0: how long start() waited for the other ranks to reach the store

    # ---- start -------------------------------------------------------------------------------

    @classmethod
    def join(
        cls, world: World, target: Callable[..., Any], args: tuple = (), spawned: NodeRanks | None = None
    ) -> RankGroup:
        """Open the store and, on a node's first process, have the node's other ranks run
        `target(*args, world_of_that_rank)`: in the processes `spawned` already (node_ranks.py:
        started before this process imported torch), or in ones spawned now."""
        if dist.is_initialized():  # NOTE: the model's collectives use torch.distributed's default group
            raise MlacError("a multi-rank runner is already running in this process; close() it first")
        store = open_store(world)
        if world.rank == 0 and world.master_port == 0:
            world = replace(world, master_port=store.port)  # the free port rank 0's store took
        procs = {}
        if world.spawns_local_ranks:
            peers = world.local_peers()
            if spawned is None or spawned.ranks != sorted(peers):  # (a mismatch: the caller closes it)
                spawned = NodeRanks.spawn(sorted(peers))
            procs = spawned.hand_over(target, args, peers)
        return cls(world, store, procs)

    def start(
        self, device: torch.device, build: Callable[[dist.ProcessGroup], Any], geometry: Callable[[Any], str]
    ):
        """Meet the other ranks, build this rank's part with the process group, return it once every
        rank has built theirs. Any rank's failure raises MlacError here on rank 0, naming it."""
        w = self.world
        try:
            if w.rank == 0:
                t = time.monotonic()
                self._wait_all("joined")
                self.met_s = time.monotonic() - t  # ~0 once the ranks imported torch while rank 0 did
            else:
                self.ctl.set(f"joined/{w.rank}", "1")
            if device.type == "cuda":
                torch.cuda.set_device(device)
            timeout = timedelta(seconds=w.timeout_s)
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.PrefixStore(
                "mlac/pg", self.store), rank=w.rank, world_size=w.size, timeout=timeout)  # fmt: skip
            gloo = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
            part = build(dist.group.WORLD)
            if w.rank == 0:
                self._wait_all("loaded", expect=geometry(part))
                self.control = self._open_link(gloo)
                self.ctl.set("go", "run")
                if self.control.channel is not None:
                    self._wait_all("attached")
                    self.control.channel.unlink()  # mapped by every rank: nothing stays in /dev/shm
                return part
        except BaseException as e:
            if w.rank == 0:
                self.abort()
                if isinstance(e, Exception) and not isinstance(e, MlacError):
                    raise MlacError(f"rank 0 failed to start: {describe(e)}") from e
            raise
        self.ctl.set(f"loaded/{w.rank}", geometry(part))
        self.ctl.wait(["go"], timedelta(seconds=w.timeout_s))
        if self.ctl.get("go") != b"run":
            self.leave()
            end_process(w, 1)  # another rank failed; rank 0 reports it
        self.control = self._attach_link(gloo)
        return part

    def _open_link(self, gloo: dist.ProcessGroup) -> StepLink:
        """Rank 0: the step channel of a one-node world (unless the launch says gloo, or /dev/shm
        cannot hold it), its name in the store ("gloo" for none)."""
        w = self.world
        channel = None
        if w.step_channel == "shm" and w.local_size == w.size:
            try:
                channel = ShmChannel.create(readers=w.size - 1)
            except MlacError as e:
                log.warning("%s; the steps go over gloo", e)
        self.ctl.set("channel", "gloo" if channel is None else channel.name)
        return StepLink(gloo, channel, self._followers_alive)

    def _attach_link(self, gloo: dist.ProcessGroup) -> StepLink:
        """Other ranks: attach to rank 0's step channel (if it made one), tell rank 0."""
        name = self.ctl.get("channel").decode()
        try:
            channel = None if name == "gloo" else ShmChannel.attach(name, reader=self.world.rank - 1)
        except MlacError as e:
            raise MlacError(
                f"{e} (rank 0 sends the steps over gloo with LaunchSpec(step_channel='gloo'))"
            ) from e
        self.ctl.set(f"attached/{self.world.rank}", "1")
        return StepLink(gloo, channel, self._rank_0_alive)

    def _followers_alive(self) -> None:
        """Rank 0 waiting on the channel: MlacError if a rank it spawned exited (the channel
        itself watches every reader's pid)."""
        if any(p.exitcode is not None for p in self.procs.values()):
            raise MlacError("a rank exited")

    def _rank_0_alive(self) -> None:
        """Other ranks waiting on the channel: MlacError if rank 0 stopped the ranks or its store
        went away (the channel itself watches rank 0's pid)."""
        try:
            go = self.ctl.get("go")
        except Exception as e:  # noqa: BLE001  the store went away with rank 0
            raise MlacError(f"rank 0 went away: {describe(e)}") from e
        if go != b"run":
            raise MlacError("rank 0 stopped the ranks")

    def _wait_all(self, stage: str, expect: str | None = None) -> None:
        """Rank 0: wait until every other rank set `<stage>/<r>` (equal to `expect` if given)."""
        deadline = time.monotonic() + self.world.timeout_s
        pending = list(range(1, self.world.size))
        while pending:
            self.raise_failure(f"while the ranks {'met' if stage == 'joined' else 'loaded'}")
            done = [r for r in pending if self.ctl.check([f"{stage}/{r}"])]
            for r in done:
                got = self.ctl.get(f"{stage}/{r}").decode()
                if expect is not None and got != expect:
                    raise MlacError(f"rank {r} loaded {got}; rank 0 loaded {expect}: every rank needs the "
                                    "same artifact, dtype and KV cache options")  # fmt: skip
            pending = [r for r in pending if r not in done]
            if pending and time.monotonic() > deadline:
                raise MlacError(f"rank(s) {pending} not {stage} after {self.world.timeout_s:.0f}s")
            time.sleep(POLL_S)

    # ---- failures ----------------------------------------------------------------------------

    def report(self, exc: BaseException) -> None:
        """A follower failed: tell rank 0 why (before this process exits and breaks the collectives).
        Rank 0 prints the error; a traceback is printed here only for a bug (not an MlacError)."""
        if not isinstance(exc, MlacError):
            traceback.print_exception(exc, file=sys.stderr)
        try:
            seq = self.ctl.add("errors", 1)
            self.ctl.set(f"error/{self.world.rank}", f"{seq}:{describe(exc)}")
        except Exception:  # noqa: BLE001  the store went away with rank 0: nobody to tell
            pass

    def find_failure(self) -> tuple[int, str] | None:
        """Rank 0: (rank, why) of the first rank that failed, or None. A spawned rank that exited
        without a report (crash, kill) comes first: the others' reports may be its echo."""
        reported: dict[int, tuple[int, str]] = {}
        for r in range(1, self.world.size):
            if self.ctl.check([f"error/{r}"]):
                seq, _, msg = self.ctl.get(f"error/{r}").decode().partition(":")
                reported[r] = (int(seq), msg)
        for r, p in sorted(self.procs.items()):
            if r not in reported and p.exitcode is not None:
                return r, f"exited unexpectedly ({describe_exit(p.exitcode)})"
        if not reported:
            return None
        first = min(reported, key=lambda r: reported[r][0])
        return first, reported[first][1]

    def trouble(self) -> tuple[str, bool] | None:
        """Rank 0, from any thread: (why, dead) for the first rank it spawned that exited (dead) or
        is stopped (SIGSTOP, a debugger: it answers no collective until it runs again); None
        while they all run. Ranks on other nodes are not seen here: a step they break says so."""
        for r, p in sorted(self.procs.items()):
            if p.exitcode is not None:
                return f"rank {r} exited unexpectedly ({describe_exit(p.exitcode)})", True
            if pid_stopped(p.pid):
                return f"rank {r} is stopped: it answers nothing until it runs again", False
        return None

    def raise_failure(self, when: str) -> None:
        found = self.find_failure()
        if found is not None:
            raise MlacError(f"rank {found[0]} failed {when}: {found[1]}")

    def fail(self, exc: BaseException) -> MlacError:
        """Rank 0, a step failed: name the rank that broke it, stop the group, return the error."""
        deadline = time.monotonic() + FAILURE_GRACE_S
        found = self.find_failure()
        while found is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
            found = self.find_failure()
        rank, why = found if found is not None else (0, describe(exc))
        self.failed = f"rank {rank} failed during a step: {why}"
        self.abort()
        return MlacError(self.failed)

    def check_usable(self) -> None:
        """Before rank 0 sends a step: MlacError if the group was stopped or closed, or if one of
        its local ranks has exited (that fails the group now: a broadcast to a dead peer can block
        instead of failing)."""
        if self.failed is not None:
            raise MlacError(f"the ranks were stopped ({self.failed}); load the artifact again")
        if self.closed:
            raise MlacError("the runner is closed")
        if any(p.exitcode is not None for p in self.procs.values()):  # waitpid(WNOHANG): microseconds
            raise self.fail(MlacError("a rank exited"))

    # ---- stop --------------------------------------------------------------------------------

    def abort(self) -> None:
        """Stop every rank without their cooperation: local processes are terminated; remote ones
        see the store answer "abort", or their collectives break when the groups go."""
        try:
            self.ctl.set("go", "abort")
        except Exception:  # noqa: BLE001
            pass
        self._reap(grace_s=0.5)
        self.leave()

    def shutdown(self) -> None:
        """Rank 0: tell every rank to stop after its current step, wait for them, close the groups."""
        if self.closed:
            return
        if self.failed is None:
            try:
                send_stop(self.control)
            except Exception:  # noqa: BLE001  a rank died meanwhile: reaped below
                pass
        self._reap(grace_s=10.0)
        self.leave()

    def leave(self) -> None:
        """Close this process's groups (idempotent); a node's first process also reaps its ranks."""
        self.closed = True
        if self.control is not None:
            self.control.close()  # rank 0's also unlinks the channel if no one did
        if dist.is_initialized():
            dist.destroy_process_group()
        self._reap(grace_s=10.0)

    def terminate_local(self) -> None:
        """A failed follower: stop the ranks it spawned, leave the groups to process exit."""
        self.closed = True
        self._reap(grace_s=0.5)

    def _reap(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
                p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join()


def open_store(world: World) -> dist.Store:
    """The rendezvous store: torchrun's (env://), else a TCPStore that rank 0 hosts."""
    timeout = timedelta(seconds=world.timeout_s)
    if world.torchrun:
        store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
        return store
    try:
        return dist.TCPStore(world.master_addr, world.master_port, world.size, world.rank == 0, timeout,
                             wait_for_workers=False)  # fmt: skip
    except (RuntimeError, dist.DistError) as e:
        where = f"{world.master_addr}:{world.master_port}"
        raise MlacError(
            f"rank {world.rank}: cannot {'listen on' if world.rank == 0 else 'reach'} {where}: {e}"
        ) from e
