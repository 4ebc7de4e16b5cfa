"""Overlap scheduling: the host work of decode step N runs while the device runs step N + 1.

Without it a decode step is serial: schedule, build the Step, launch, sample, wait for the ids
(`.tolist()`), append each token (detokenize, stop strings, eos, max_tokens): the device idles
through everything but the launch. With it, a pure decode step whose every row samples without
the host (no grammar: temperature, top-k/p, min-p, seeds, logprobs and the penalties, whose
counts grow on the device (penalties.py), are device ops) is launched,
sampled on the device and its ids (and logprobs) copied to pinned host memory behind an event:
the step is *in flight* (`Flight`). The next `Scheduler.step()` then, in the steady state:

1. launches step N + 1 over the same sequences, one position further, its token ids taken from
   step N's sampled ids on the device (`DecodeGraphs.run(step, ids=...)`: no host round trip);
2. only then waits for step N's event and appends its tokens (`land`): the host work of N runs
   while the device runs N + 1. The step returns N's news, one step late.

The steady state is a plan the scheduler would make anyway: no abort pending, nothing waiting that
could be admitted, every running sequence in the flight, and every new block free without a
preemption. Anything else (an admission, an abort, a preemption, a prefill chunk, a grammar row)
first drains (`drain`: lands the flight) and schedules as before; `Scheduler.abort_all` drains too.

A sequence that finishes at step N (eos, a stop string) already has a row in step N + 1: its
sampled token is dropped. That row wrote the KV of N's token, which the sequence holds (its
`num_computed` counts it), at a slot in a block it owned at launch: the KV matches its tokens, so
the prefix cache may key it, and a block freed at N's landing is reused only by a step launched
later, which the device runs after N + 1. A sequence whose N's token surely ends it (max_tokens,
the context) gets no row in N + 1.

Multi-rank too (one node or several; `can_overlap`): rank 0's DistributedRunner sends step N + 1
as a fed step (step_link.FedStep), whose token ids follow the message as a broadcast over the
model's group on the device, in stream order after step N's sampling: every rank launches N + 1
before rank 0's host reads N's ids, and only rank 0 samples. Under DP attention too: the ids
come in step order, and every rank lays them out by rank itself from the Step's `ranks`
(dp_attention.py, dp_graphs.py); a sequence's next block comes from its own rank's pool. Off under
speculative decoding, which has its own device-side chain (spec/decode.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from mlac.runtime.device_copy import to_device
from mlac.runtime.engine.penalties import PenaltyStep
from mlac.runtime.engine.sampling import NOT_A_DISTRIBUTION, logprob_tensors, read_logprobs, sample_apart
from mlac.runtime.step import Step

if TYPE_CHECKING:
    from mlac.runtime.engine.sequence import Sequence
    from mlac.runtime.kvcache.pool import BlockPool


class SchedulerView(Protocol):
    """The scheduler (scheduler.py) as a step launched ahead sees it, here and in spec/overlap.py:
    what it reads to tell the steady state, and `release` for a sequence that its landing finishes."""

    running: list[Sequence]  # by seq_id
    pending_aborts: set[int]  # seq ids to abort at the next step
    pools: list[BlockPool]  # one per DP-attention rank (else one): a sequence's blocks in pools[seq.dp_rank]
    eos_ids: frozenset[int]
    max_context: int

    @property
    def could_admit(self) -> bool:
        """Whether a waiting sequence has room to join the running ones."""
        ...

    def release(self, seq: Sequence) -> None:
        """Give back `seq`'s blocks and take it out of the queues."""
        ...


def on_by_default(runner) -> bool:
    """Overlap where the config does not say: on CUDA, one rank or several. Multi-rank overlap
    (the fed steps' NCCL broadcast next to the collectives of the CUDA graphs) ran on 2xH200:
    tests/runtime/dist/test_overlap_multirank_gpu.py, and tp2 batch 1 416 tok/s against tp1's 387
    (benchmarks/results/bench_v2-lite_bf16_tp2_h200x2.json, ..._tp1_h200x2.json)."""
    return runner.device.type == "cuda"


def can_overlap(runner) -> bool:
    """Whether `runner` can take a decode step's token ids from the device (`run_decode`: a
    ModelRunner or a multi-rank DistributedRunner, with or without DP attention)."""
    return callable(getattr(runner, "run_decode", None))


@dataclass(eq=False)
class Flight:
    """A decode step launched and sampled on the device whose tokens the host has not read yet."""

    seqs: list[Sequence]  # [B] its rows, in order
    ids: torch.Tensor  # [B] int64 on the device: the sampled tokens (the next step's input)
    host: list[torch.Tensor]  # host copies: ids [B], then logprob values and ids [R, 1 + k] if asked
    done: torch.cuda.Event | None  # recorded after the copies (None on CPU: nothing to wait for)
    errors: dict[int, Exception] = field(default_factory=dict)  # rows whose draw raised: they fail
    bad: torch.Tensor | None = None  # host copy [B] bool: rows that were no distribution: they fail


def to_host(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Start copying `tensors` to pinned host memory; (copies, the event after them). CPU: as is."""
    if tensors[0].device.type != "cuda":
        return tensors, None
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors]
    done = torch.cuda.Event()
    done.record()
    return host, done


class Overlap:
    """The one decode step in flight over a runner that `can_overlap` (module docstring)."""

    def __init__(self, runner):
        self.runner = runner
        self.flight: Flight | None = None
        self.ranked = getattr(runner, "dp", None) is not None  # DP attention: steps say each row's rank

    @staticmethod
    def can_start(plan: list[tuple[Sequence, int]]) -> bool:
        """A plan of decoding sequences only, one token each, none with a grammar."""
        return all(n == 1 and s.decoding and s.matcher is None for s, n in plan)

    def start(self, plan: list[tuple[Sequence, int]]) -> None:
        """Launch `plan` (can_start; its blocks reserved by the scheduler) as the flight."""
        seqs = [s for s, _ in plan]
        chunks = [s.tokens(s.num_computed, s.num_computed + 1) for s in seqs]
        self.flight = self._launch(seqs, self._step(seqs, chunks), None)

    def advance(self, sched: SchedulerView) -> list[Sequence] | None:
        """The steady state: launch the next step from the flight's ids, then land the flight and
        return its news. None (nothing done) when the next plan is not that (the caller drains)."""
        flight = self.flight
        rows = self._next_rows(sched, flight)
        if not rows or not self._grow(sched, [flight.seqs[j] for j in rows]):
            return None
        seqs = [flight.seqs[j] for j in rows]
        self.flight = self._launch(seqs, self._step(seqs, [[0]] * len(seqs)), take_rows(flight.ids, rows))
        try:
            return self.land(sched, flight)
        except BaseException:
            self.flight = None  # its rows assumed tokens that were never appended: never land it
            raise

    def drain(self, sched: SchedulerView) -> list[Sequence]:
        """Land the flight, if any; its news."""
        flight, self.flight = self.flight, None
        return [] if flight is None else self.land(sched, flight)

    @staticmethod
    def _next_rows(sched: SchedulerView, flight: Flight) -> list[int]:
        """Rows of the flight that run again in the next step; [] when it is not the steady state."""
        live = [s for s in flight.seqs if not s.finished]
        if sched.pending_aborts or sched.could_admit or len(live) != len(sched.running):
            return []
        if any(a is not b for a, b in zip(live, sched.running, strict=True)):
            return []
        return [
            j for j, s in enumerate(flight.seqs) if not s.finished and not ends_next(s, sched.max_context)
        ]

    def _step(self, seqs: list[Sequence], chunks: list[list[int]]) -> Step:
        """The decode step of `seqs` (their new tokens `chunks`: placeholders when the ids come from
        the device), with each one's rank under DP attention."""
        ranks = [s.dp_rank for s in seqs] if self.ranked else []
        return Step.of(chunks, [s.num_computed for s in seqs], [s.block_table for s in seqs], ranks=ranks)

    @staticmethod
    def _grow(sched: SchedulerView, seqs: list[Sequence]) -> bool:
        """Blocks for one more token of each of `seqs`, each from its rank's pool, if free there
        without preempting (else nothing)."""
        need = [0] * len(sched.pools)
        for s in seqs:
            alloc = sched.pools[s.dp_rank].allocator
            need[s.dp_rank] += alloc.blocks_for(s.num_computed + 1) - len(s.block_table)
        if any(n > pool.allocator.num_free for n, pool in zip(need, sched.pools, strict=True)):
            return False
        for s in seqs:
            sched.pools[s.dp_rank].allocator.reserve(s.block_table, s.num_computed + 1)
        return True

    @torch.inference_mode()
    def _launch(self, seqs: list[Sequence], step: Step, ids: torch.Tensor | None) -> Flight:
        """Run `step` (token ids from `ids` [B] on the device when given), sample on the device,
        start the copies to the host. Counts each row's token as computed."""
        logits = self.runner.run_decode(step, ids)  # [B, V] (the graphs' view: sampled before the next step)
        penalized = PenaltyStep.of([s.penalties for s in seqs], logits)  # counts grow on the device
        shaped = logits if penalized is None else penalized.apply(logits)
        # deferred: a row that is no distribution is known when the flight lands (no wait here)
        tokens, errors, bad = sample_apart(
            shaped, [s.params for s in seqs], [s.generator for s in seqs], deferred=True
        )  # [B]
        if penalized is not None:
            penalized.count(tokens)  # a failed row's placeholder too: that row ends
        lps = logprob_tensors(logits, tokens, [s.params.logprobs for s in seqs])
        host, done = to_host([tokens, *(lps or ()), *(() if bad is None else (bad,))])
        for s in seqs:
            s.num_computed += 1
        return Flight(seqs, tokens, host[: len(host) - (bad is not None)], done, errors,
                      None if bad is None else host[-1])  # fmt: skip

    @staticmethod
    def land(sched: SchedulerView, flight: Flight) -> list[Sequence]:
        """Wait for the flight's tokens and append them (a sequence that finished meanwhile drops
        its row; one whose draw raised fails, as one that finishes here: its row in the step
        launched since is dropped); release the sequences that finish. Returns those with news."""
        if flight.done is not None:
            flight.done.synchronize()
        tokens, *lp_host = (x.tolist() for x in flight.host)
        num_top = [s.params.logprobs for s in flight.seqs]
        lps = read_logprobs(*lp_host, num_top) if lp_host else [None] * len(tokens)
        bad = [False] * len(tokens) if flight.bad is None else flight.bad.tolist()
        news = []
        for j, (s, t, lp) in enumerate(zip(flight.seqs, tokens, lps, strict=True)):
            if s.finished:
                continue
            if j in flight.errors:
                s.fail(flight.errors[j])
            elif bad[j]:
                s.fail(ValueError(NOT_A_DISTRIBUTION))
            else:
                s.append_token(t, lp, sched.eos_ids, sched.max_context)
            if s.finished:
                sched.release(s)
            news.append(s)
        return news


def take_rows(ids: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """ids [B] -> ids[rows] [R], on the device without waiting for it (a slice when a prefix)."""
    if rows == list(range(len(rows))):
        return ids[: len(rows)]
    return ids.index_select(0, to_device(rows, torch.int64, ids.device))


def ends_next(seq: Sequence, max_context: int) -> bool:
    """Whether the token in flight surely finishes `seq` (max_tokens or the context reached)."""
    return len(seq.output_ids) + 1 >= seq.params.max_tokens or seq.num_tokens + 1 >= max_context
