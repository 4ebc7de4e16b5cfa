"""The step broadcast of a multi-rank artifact: rank 0's one message per step (a Step, a
speculative-decoding op, or stop) as int64, and the link that carries it to the other ranks.

The link (StepLink) goes through the node's shared-memory ring (shm_channel.py) when every rank
runs on rank 0's node, else by two broadcasts over a gloo group of its own; dist.RankGroup opens
it. A message larger than a channel slot goes over gloo too (the channel tells the readers so).

A fed step (overlap scheduling, overlap.py) is a decode Step whose token ids are rank 0's sampled
ids of the step before, still on its device: its message (op FED) carries placeholder ids, and
right after it rank 0 broadcasts the real ones over the model's group (`share_ids`), in stream
order: no rank waits on the host for them.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlac.runtime.dist.shm_channel import Alive, ShmChannel
from mlac.runtime.step import Step

STOP, STEP, SPEC, FED = 0, 1, 2, 3  # header opcodes (FED: a Step whose ids follow on the device)

# One message per step, int64: header [7] = op, every_token (SPEC: the op's code), T (new tokens;
# SPEC: integers), B (sequences), W (block table width), has ranks, N (payload length); then the
# payload [N]: token ids [T], ctx_lens [B], q_lens [B], table lens [B], block tables [B·W]
# (row-major, padded), then the DP-attention ranks of the sequences [B] when the Step has them.

HEADER = 7


def encode_step(step: Step, fed: bool = False) -> list[int]:
    """The message of one forward step (header and payload); `fed`: its ids follow (FedStep)."""
    b, width = step.num_seqs, max(len(t) for t in step.block_tables)
    lens = [len(t) for t in step.block_tables]
    tables = [x for t in step.block_tables for x in (*t, *[0] * (width - len(t)))]  # padded; lens say how far
    payload = [*step.token_ids, *step.ctx_lens, *step.q_lens, *lens, *tables, *step.ranks]
    return [FED if fed else STEP, int(step.every_token), len(step.token_ids), b, width, int(bool(step.ranks)), len(payload),
            *payload]  # fmt: skip


def encode_spec(code: int, ints: list[int]) -> list[int]:
    return [SPEC, code, len(ints), 0, 0, 0, len(ints), *ints]


def decode(msg: list[int]) -> Step | FedStep | SpecOp | None:
    """A message back into what rank 0 encoded: a Step, a FedStep, a SpecOp, or None for stop."""
    op, every_token, t, b, w, has_ranks, _ = msg[:HEADER]
    if op == STOP:
        return None
    if op == SPEC:
        return SpecOp(every_token, msg[HEADER : HEADER + t])
    parts, at = [], HEADER
    for n in (t, b, b, b, b * w, b if has_ranks else 0):
        parts.append(msg[at : at + n])
        at += n
    ids, ctx_lens, q_lens, lens, tables, ranks = parts
    rows = [tables[i * w : i * w + n] for i, n in enumerate(lens)]
    step = Step(tuple(ids), tuple(ctx_lens), tuple(q_lens), tuple(map(tuple, rows)), bool(every_token),
                tuple(ranks))  # fmt: skip
    return FedStep(step) if op == FED else step


@dataclass(frozen=True)
class SpecOp:
    """One op of speculative decoding (runtime/spec_exec.py): its code and integers."""

    code: int
    ints: list[int]


@dataclass(frozen=True)
class FedStep:
    """A decode step whose token ids (step.token_ids: placeholders) rank 0 broadcasts on the device
    right after its message (share_ids)."""

    step: Step


def share_ids(ids: torch.Tensor) -> torch.Tensor:
    """Rank 0's token ids [B] int64 on every rank: rank 0 passes its ids, the others a tensor of
    that shape and device, which this fills. A broadcast over the model's group (torch.distributed's
    default: NCCL on CUDA, enqueued on the current stream, so the host does not wait; gloo on CPU).
    NOTE: every rank must call it at the same point of the step order (after a FED message)."""
    dist.broadcast(ids, src=0)
    return ids


class StepLink:
    """How rank 0's step messages reach the other ranks: through the node's shared-memory channel
    (shm_channel.py) when every rank runs on rank 0's node, else by two broadcasts over the gloo
    `group`, header then payload. A message larger than a channel slot goes over gloo too (the
    channel tells the readers so). `alive` raises when the other side is gone (RankGroup)."""

    def __init__(
        self, group: dist.ProcessGroup, channel: ShmChannel | None = None, alive: Alive = lambda: None
    ):
        self.group = group
        self.channel = channel
        self.alive = alive

    def send(self, msg: list[int]) -> None:
        """Rank 0: one message to every other rank."""
        if self.channel is not None and self.channel.write(array("q", msg), self.alive):
            return
        dist.broadcast(torch.tensor(msg[:HEADER]), src=0, group=self.group)
        if len(msg) > HEADER:
            dist.broadcast(torch.tensor(msg[HEADER:], dtype=torch.int64), src=0, group=self.group)

    def recv(self) -> list[int]:
        """Other ranks: the next message."""
        if self.channel is not None and (data := self.channel.read(self.alive)) is not None:
            return memoryview(data).cast("q").tolist()
        header = torch.empty(HEADER, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.group)
        payload = torch.empty(int(header[-1]), dtype=torch.int64)
        if payload.numel():
            dist.broadcast(payload, src=0, group=self.group)
        return header.tolist() + payload.tolist()

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()


def send_step(link: StepLink, step: Step) -> None:
    """Rank 0: one forward step, to every rank (on CPU)."""
    link.send(encode_step(step))


def send_fed(link: StepLink, ids: torch.Tensor, step: Step) -> None:
    """Rank 0: a decode step whose token ids are `ids` [B] on the device (its step.token_ids are
    not read): the message, then the ids to every rank (share_ids)."""
    link.send(encode_step(step, fed=True))
    share_ids(ids)


def send_spec(link: StepLink, code: int, ints: list[int]) -> None:
    """Rank 0: one speculative-decoding op, to every rank (on CPU)."""
    link.send(encode_spec(code, ints))


def send_stop(link: StepLink) -> None:
    link.send([STOP, 0, 0, 0, 0, 0, 0])


def recv_step(link: StepLink) -> Step | FedStep | SpecOp | None:
    """Other ranks: the next Step (FedStep, SpecOp) as rank 0 sent it, None on stop. After a
    FedStep the caller takes its ids with share_ids before anything else."""
    return decode(link.recv())
