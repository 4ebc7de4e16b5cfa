"""The shared-memory step channel (runtime/dist/shm_channel.py) alone, with readers in other processes,
and as the multi-rank step link (step_link.StepLink): the same tokens as one rank over the channel, over
gloo (LaunchSpec(step_channel="gloo")) and over both (small slots); nothing left in /dev/shm.

Every wait is bounded (timeout_s, join timeouts): a broken channel fails a test, never hangs it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mlac.compiler.pipeline import compile_checkpoint
from mlac.core.artifact import CompileOptions
from mlac.core.errors import MlacError
from mlac.runtime.dist import ranks as dist_mod
from mlac.runtime.dist.shm_channel import PREFIX, SHM_DIR, ShmChannel, pid_alive
from mlac.runtime.dist.step_link import STOP, SpecOp, decode, encode_spec, encode_step
from mlac.runtime.dist.world import LaunchSpec
from mlac.runtime.engine.engine import Engine
from mlac.runtime.step import Step

CAPACITY = 256  # bytes per slot in the channel tests: 1 message in 8 is larger (the other path)
SPIN_S = 1e-3  # this machine's cores are shared: spin little
CACHE = {"num_blocks": 32, "block_size": 16}
PROMPT = torch.randint(0, 1024, (40,), generator=torch.Generator().manual_seed(0)).tolist()


def message(i: int) -> bytes:
    """Message i of a run: random bytes, 0 to 1.25 slots long."""
    rng = random.Random(i)
    return rng.randbytes(rng.randrange(0, CAPACITY * 5 // 4 + 1))


def segments(pid: int) -> list[str]:
    """The channel segments process `pid` created that are still in /dev/shm."""
    return sorted(p.name for p in SHM_DIR.glob(f"{PREFIX}{pid}-*"))


def spawn(target, *args) -> mp.Process:
    p = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    p.start()
    return p


# ---- children (spawned: module level) ----------------------------------------------------------


def _read_all(name: str, reader: int, count: int) -> None:
    ch = ShmChannel.attach(name, reader, spin_s=SPIN_S)
    for i in range(count):
        got, want = ch.read(timeout_s=60), message(i)
        if got != (want if len(want) <= CAPACITY else None):
            print(f"reader {reader}: message {i} differs", file=sys.stderr)
            sys.exit(1)
    ch.close()


def _read_one_then_hang(name: str) -> None:
    ShmChannel.attach(name, 0, spin_s=SPIN_S).read(timeout_s=60)
    time.sleep(60)


def _write_one_then_hang(names: mp.Queue, attached) -> None:
    ch = ShmChannel.create(1, capacity=CAPACITY, spin_s=SPIN_S)
    names.put(ch.name)
    attached.wait(60)
    ch.unlink()  # as rank 0 does once its readers attached
    ch.write(b"hello")
    time.sleep(60)


# ---- the channel -------------------------------------------------------------------------------


@pytest.mark.parametrize("readers", [1, 3])
def test_every_reader_gets_every_message_in_order(readers):
    """3,000 messages through 4 slots (the ring wraps 750 times); those larger than a slot read
    as None (the caller's other path)."""
    count = 3000
    ch = ShmChannel.create(readers, slots=4, capacity=CAPACITY, spin_s=SPIN_S)
    procs = [spawn(_read_all, ch.name, r, count) for r in range(readers)]

    def alive() -> None:
        if any(p.exitcode not in (None, 0) for p in procs):
            raise MlacError("a reader failed")

    try:
        fits = [ch.write(message(i), alive, timeout_s=60) for i in range(count)]
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0] * readers
        assert fits == [len(message(i)) <= CAPACITY for i in range(count)]
        assert 0 < fits.count(False) < count
    finally:
        for p in procs:
            p.kill()
        ch.close()
    assert segments(os.getpid()) == []


def test_a_reader_that_dies_fails_the_writer():
    ch = ShmChannel.create(1, slots=2, capacity=CAPACITY, spin_s=SPIN_S)
    p = spawn(_read_one_then_hang, ch.name)
    try:
        assert ch.write(b"one", timeout_s=30)
        deadline = time.monotonic() + 30
        while ch._consumed(ch._slot(1), 0) != 1 and time.monotonic() < deadline:  # read
            time.sleep(0.01)
        os.kill(p.pid, signal.SIGKILL)  # not joined: a zombie is dead too
        ch.write(b"two")  # the ring has room for these two
        ch.write(b"three")
        t = time.monotonic()
        with pytest.raises(MlacError, match=rf"reader 0 \(pid {p.pid}\) exited"):
            ch.write(b"four", timeout_s=30)  # its slot holds "two", never read
        assert time.monotonic() - t < 5
    finally:
        p.kill()
        p.join(10)
        ch.close()


def test_a_writer_that_dies_fails_the_readers():
    ctx = mp.get_context("spawn")
    names, attached = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_write_one_then_hang, args=(names, attached), daemon=True)
    p.start()
    try:
        ch = ShmChannel.attach(names.get(timeout=60), 0, spin_s=SPIN_S)
        attached.set()
        assert ch.read(timeout_s=30) == b"hello"
        assert segments(p.pid) == []  # unlinked, still mapped
        os.kill(p.pid, signal.SIGKILL)
        t = time.monotonic()
        with pytest.raises(MlacError, match=rf"writer \(pid {p.pid}\) exited"):
            ch.read(timeout_s=30)
        assert time.monotonic() - t < 5
        ch.close()
    finally:
        p.kill()
        p.join(10)


def test_waits_end_when_alive_says_so_or_at_the_timeout():
    writer = ShmChannel.create(1, slots=1, capacity=CAPACITY, spin_s=SPIN_S)
    reader = ShmChannel.attach(writer.name, 0, spin_s=SPIN_S)
    try:

        def stopped() -> None:
            raise MlacError("rank 0 stopped the ranks")

        with pytest.raises(MlacError, match="rank 0 stopped the ranks"):
            reader.read(stopped, timeout_s=30)
        assert writer.write(b"x" * CAPACITY)
        assert reader.read() == b"x" * CAPACITY
        assert not writer.write(b"x" * (CAPACITY + 1))
        with pytest.raises(MlacError, match="no progress after 0s"):
            writer.write(b"y", timeout_s=0)  # the one slot holds the unread marker
        assert reader.read() is None
    finally:
        reader.close()
        writer.close()
    assert segments(os.getpid()) == []


def test_attach_refuses_what_is_not_a_channel():
    ch = ShmChannel.create(1, capacity=CAPACITY)
    try:
        with pytest.raises(MlacError, match="is not a step channel with a reader 1"):
            ShmChannel.attach(ch.name, 1)
        with pytest.raises(MlacError, match="cannot open the step channel"):
            ShmChannel.attach(f"{PREFIX}missing", 0)
    finally:
        ch.close()
    assert not pid_alive(2**22 + 1)  # above the kernel's pid_max: no such process


# ---- the step messages -------------------------------------------------------------------------


def test_messages_decode_to_what_was_encoded():
    steps = [
        Step((5, 6, 7, 8), (0, 3), (3, 1), ((1, 2), (4,)), every_token=True),
        Step((9,), (17,), (1,), ((3, 4),), ranks=(1,)),
    ]
    for step in steps:
        assert decode(encode_step(step)) == step
    assert decode(encode_spec(3, [1, 2, 3])) == SpecOp(3, [1, 2, 3])
    assert decode(encode_spec(4, [])) == SpecOp(4, [])
    assert decode([STOP, 0, 0, 0, 0, 0, 0]) is None


# ---- as the multi-rank step link ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tp(tmp_path_factory, checkpoint):
    """tp(n) -> tiny-v2-lite compiled for tp=n."""
    made: dict[int, Path] = {}

    def get(n: int) -> Path:
        if n not in made:
            made[n] = tmp_path_factory.mktemp("shm") / f"tp{n}"
            compile_checkpoint(
                checkpoint("tiny-v2-lite"), made[n], CompileOptions(tp=n, accuracy_check=False)
            )
        return made[n]

    return get


class SmallSlots(ShmChannel):
    """Rank 0's channel with 128-byte slots: decode steps fit, prefills go over gloo. Counts both."""

    sent: list[bool] = []

    @classmethod
    def create(cls, readers: int, **kw) -> ShmChannel:
        return super().create(readers, capacity=128)

    def write(self, data, alive=lambda: None, timeout_s=None) -> bool:
        fits = super().write(data, alive, timeout_s)
        SmallSlots.sent.append(fits)
        return fits


@pytest.mark.parametrize("mode", ["shm", "gloo", "small-slots"])
def test_tp2_gives_the_one_rank_tokens(mode, tp, monkeypatch):
    launch = LaunchSpec(step_channel="gloo" if mode == "gloo" else "shm")
    if mode == "small-slots":
        monkeypatch.setattr(dist_mod, "ShmChannel", SmallSlots)
    prompts = [PROMPT, PROMPT[:9]]
    with Engine.from_artifact(tp(1), dtype=torch.float32, **CACHE) as one:
        want = [c.token_ids for c in one.generate(prompts, max_tokens=8, temperature=0)]
    with Engine.from_artifact(tp(2), dtype=torch.float32, launch=launch, **CACHE) as engine:
        link = engine.runner.group.control
        assert (link.channel is None) == (mode == "gloo")
        assert segments(os.getpid()) == []  # unlinked once rank 1 attached
        assert [c.token_ids for c in engine.generate(prompts, max_tokens=8, temperature=0)] == want
    if mode == "small-slots":
        assert True in SmallSlots.sent and False in SmallSlots.sent
    assert segments(os.getpid()) == []


def test_a_killed_rank_leaves_nothing_in_dev_shm(tp):
    with Engine.from_artifact(tp(2), dtype=torch.float32, **CACHE) as engine:
        engine.score([1, 2, 3])
        rank1 = engine.runner.group.procs[1]
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join(10)
        with pytest.raises(MlacError, match=r"rank 1 failed during a step: exited unexpectedly"):
            engine.score([1, 2, 3])
    assert segments(os.getpid()) == []


RANK_0 = """
import sys, time, torch
from mlac.runtime.engine.engine import Engine
engine = Engine.from_artifact(sys.argv[1], dtype=torch.float32, num_blocks=32, block_size=16)
engine.score([1, 2, 3])
print(engine.runner.group.procs[1].pid, flush=True)
time.sleep(120)
"""


def test_the_other_ranks_exit_when_rank_0_is_killed(tp):
    """Rank 0 killed while its ranks wait on the channel: they see it and exit."""
    rank0 = subprocess.Popen([sys.executable, "-c", RANK_0, str(tp(2))], stdout=subprocess.PIPE, text=True)
    try:
        rank1 = int(rank0.stdout.readline())
        assert pid_alive(rank1) and segments(rank0.pid) == []
        rank0.kill()
        rank0.wait(10)
        deadline = time.monotonic() + 10
        while pid_alive(rank1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(rank1)
    finally:
        rank0.kill()


def test_an_unknown_step_channel_is_a_one_line_error(tp):
    """A step channel other than shm or gloo is refused when the launch is made, naming the
    field: no rank starts, nothing is left in /dev/shm."""
    with pytest.raises(MlacError, match=r"step_channel='tcp': say shm or gloo"):
        Engine.from_artifact(tp(2), dtype=torch.float32, launch=LaunchSpec(step_channel="tcp"), **CACHE)
    assert segments(os.getpid()) == []
