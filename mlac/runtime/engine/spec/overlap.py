"""Overlap scheduling of greedy speculative steps: the host work of step N runs while the device
runs step N + 1 (engine/overlap.py does it for plain decoding; this is its speculative counterpart).

A one-replay chain step (spec_chain.py) leaves on the device all that the next step of the same
sequences needs but their block tables: each sequence's last token t_{n+a} and cached length
n + a (`ChainGraphs.nxt`), its MTP state and d_0 (its rows). So, in the steady state, the next
`Scheduler.step()`:

1. reserves each sequence's blocks for the worst case (K + 1 tokens accepted at N, then K + 1
   positions at N + 1: n - 1 + 2 (K + 1) tokens), launches N + 1 from N's results on the device
   (`SpecExecutor.launch`, first=None);
2. only then waits for N's results and lands them (`SpecDecoder.land_chain`: acceptance, appends,
   stop strings, finishes); its roll-back keeps the K blocks' worth past each sequence's tokens
   that N + 1 writes (`SpecDecoder.ahead`). The step returns N's news, one step late.

It is exact where N + 1 runs what the scheduler would run, or more: every sequence greedy, drafting
K at N and at N + 1 (the context far enough; a sequence that the scheduler would let draft fewer
near its max_tokens drafts K: its tokens are still the target's argmax, and its appends stop at
max_tokens, dropping the rest), no logprobs, no grammar, no abort pending, nothing waiting that
could be admitted, the running sequences exactly the flight's, and the worst-case blocks free
without a preemption. Anything else lands the flight first (`drain`) and schedules as before. A sequence that finishes at N (eos, a stop string) already
has rows in N + 1: it is released at N's landing and its N + 1 results are dropped. N + 1 wrote
its KV and MTP entries only at positions >= its computed length, in blocks freed after N + 1 was
launched (reused only by steps the device runs after it), never in a block the prefix cache keys.
One rank only (its `launch` is not mirrored to other ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from mlac.runtime.worker.spec_exec import Launched

if TYPE_CHECKING:
    from mlac.runtime.engine.overlap import SchedulerView
    from mlac.runtime.engine.sequence import Sequence
    from mlac.runtime.kvcache.blocks import BlockAllocator
    from mlac.runtime.worker.spec_exec import SpecExecutor


class Speculator(Protocol):
    """The SpecDecoder (decode.py) that owns a SpecOverlap, as the overlap sees it: the executor it
    launches on, K, the allocator it reserves from, and the landing of a chain step's results."""

    exec: SpecExecutor
    num_steps: int  # K: drafts per sequence and step
    allocator: BlockAllocator  # rank 0's blocks
    ahead: int  # tokens past each sequence's end that a step in flight writes (kept at roll-back)

    def land_chain(
        self, sched: SchedulerView, seqs: list[Sequence], found: list[list[int]], top: list[int]
    ) -> list[Sequence]:
        """Accept, append and roll back a one-replay chain step of `seqs`; those with news."""
        ...


@dataclass(eq=False)
class SpecFlight:
    """A chain step launched whose results the host has not read yet."""

    seqs: list[Sequence]  # its rows, in order
    launched: Launched


class SpecOverlap:
    """The one speculative step in flight of a SpecDecoder (module doc)."""

    def __init__(self, spec: Speculator):
        self.spec = spec
        self.flight: SpecFlight | None = None

    def start(self, plan: list[tuple[Sequence, int]]) -> bool:
        """Launch `plan` (greedy, every sequence K drafts, no logprobs; blocks reserved by the
        scheduler) as the flight; False (nothing launched) where it cannot be one replay."""
        seqs = [s for s, _ in plan]
        first = ([s.output_ids[-1] for s in seqs], [s.num_computed for s in seqs])
        launched = self.spec.exec.launch(
            [s.seq_id for s in seqs], self.spec.num_steps, [s.block_table for s in seqs], first
        )
        if launched is not None:
            self.flight = SpecFlight(seqs, launched)
        return launched is not None

    def advance(self, sched: SchedulerView) -> list[Sequence] | None:
        """The steady state: launch the next step from the flight's results on the device, then land
        the flight; its news. None (nothing done) when the next step is not that (the caller drains)."""
        flight = self.flight
        seqs = flight.seqs
        if not self._steady(sched, seqs) or not self._reserve(sched, seqs):
            return None
        launched = self.spec.exec.launch(
            [s.seq_id for s in seqs], self.spec.num_steps, [s.block_table for s in seqs], None
        )
        if launched is None:
            return None
        self.flight = SpecFlight(seqs, launched)
        try:
            news = self._land(sched, flight, self.spec.num_steps)
        except BaseException:
            self.flight = None  # launched from results that were never appended: never land it
            raise
        if all(s.finished for s in seqs):
            self.flight = None  # nothing left to land (its rows are all dropped)
        return news

    def drain(self, sched: SchedulerView) -> list[Sequence]:
        """Land the flight, if any; its news."""
        flight, self.flight = self.flight, None
        return [] if flight is None else self._land(sched, flight, 0)

    def _land(self, sched: SchedulerView, flight: SpecFlight, ahead: int) -> list[Sequence]:
        drafts, top = flight.launched.read()
        self.spec.ahead = ahead
        try:
            return self.spec.land_chain(sched, flight.seqs, drafts, top)
        finally:
            self.spec.ahead = 0

    def _steady(self, sched: SchedulerView, seqs: list[Sequence]) -> bool:
        """Whether the next step is the flight's sequences again, each drafting K whatever N accepts."""
        if sched.pending_aborts or sched.could_admit or len(seqs) != len(sched.running):
            return False
        if any(a is not b for a, b in zip(seqs, sched.running, strict=True)):
            return False
        k2 = 2 * self.spec.num_steps  # N accepts up to K + 1 tokens; N + 1's K drafts must fit the context
        return all(s.num_tokens + k2 + 1 <= sched.max_context for s in seqs)

    def _reserve(self, sched: SchedulerView, seqs: list[Sequence]) -> bool:
        """Blocks for each sequence's worst case at N + 1 (n - 1 + 2 (K + 1) tokens), if free
        without preempting (else nothing is reserved)."""
        alloc, k1 = self.spec.allocator, self.spec.num_steps + 1
        need = sum(alloc.blocks_for(s.num_computed + 2 * k1) - len(s.block_table) for s in seqs)
        if need > alloc.num_free:
            return False
        for s in seqs:
            alloc.reserve(s.block_table, s.num_computed + 2 * k1)
        return True
