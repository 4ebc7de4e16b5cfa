"""Continuous batching over the paged KV cache: which tokens of which sequences run each step.

A Sequence holds one request: prompt, generated tokens, sampling state, block table, and how many
of its tokens are in the cache (`num_computed`). Each `Scheduler.step()`:

1. drops aborted sequences (their blocks are freed);
2. schedules the running sequences in priority order (arrival order, oldest first): a decoding
   sequence runs its one new token; a prefilling one runs its next chunk of prompt tokens, all
   prefill chunks of a step together at most `chunked_prefill_size` tokens. Blocks are
   allocated as a sequence grows; when none is free, the lowest-priority running sequence is
   preempted: its blocks are freed and it goes back to the waiting queue, to recompute its
   prompt and generated tokens when it is admitted again (sampling state is kept, so its
   output is the one it would have produced unpreempted);
3. admits waiting sequences (oldest first, no overtaking) while fewer than
   `max_running_requests` run, prefill budget is left, and their first chunk's blocks are free;
4. runs one forward over every scheduled token (prefill chunks and decodes mixed), samples a
   token for each sequence whose tokens are now all cached, and decides which ones finish.

With the prefix cache on (`SchedulerConfig.prefix_cache`, kvcache/radix.py), an admitted sequence
first takes the longest cached full-block prefix of its tokens (never all of them: the last one
runs, for its logits): those blocks head its table and count as computed. A sequence gives its
prompt's full blocks to the cache as soon as its prefill ends (it keeps using them), and the rest
of its computed full blocks when it finishes, is aborted or is preempted. A waiting request whose
prompt shares full blocks with one still being prefilled waits for them (n choices, a burst with
one system prompt: one prefill). Cached blocks that no sequence uses count as free (evicted on
demand), so eviction comes before preemption.

DP attention (a runner with several `kv_pools`, dp_attention.py): each rank has its own KV cache.
A sequence is assigned a rank when admitted (`dp_rank`, by dp_attention.route: the rank holding
its longest cached prefix if it has room, else the one with the most free blocks); its blocks,
prefix matches and preemption victims all come from that rank's pool.

Overlap (`SchedulerConfig.overlap`, overlap.py): a pure decode step is launched and sampled on the
device, and the next step launches its successor from the device-side ids before the host reads
and appends its tokens: a step returns the news of the step before it. Under speculation, greedy
one-replay chain steps do the same (spec/overlap.py).

The oldest sequence is never preempted by another, so it always progresses: no request is
dropped, and every request finishes. The scheduler is single-threaded; callers on other threads
go through an inbox (see server.EngineLoop).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence as Seq

from mlac.core.errors import MlacError
from mlac.runtime.engine.dp_route import route
from mlac.runtime.engine.options import SchedulerConfig
from mlac.runtime.engine.overlap import Overlap, can_overlap, on_by_default
from mlac.runtime.engine.prompt_logprobs import every_token, score_prompts
from mlac.runtime.engine.sequence import Sequence, sample_next, shares_past, unique
from mlac.runtime.engine.spec.decode import SpecDecoder
from mlac.runtime.step import Step


class Scheduler:
    """Continuous batching of Sequences over one runner (its forward and its paged cache)."""

    def __init__(
        self, runner, eos_token_ids: Seq[int], max_context: int, config: SchedulerConfig | None = None
    ):
        self.runner = runner
        self.cache = runner.cache
        self.eos_ids = frozenset(eos_token_ids)
        self.max_context = max_context
        self.config = config or SchedulerConfig()
        self.waiting: list[Sequence] = []  # by seq_id
        self.running: list[Sequence] = []  # by seq_id
        self.pending_aborts: set[int] = set()  # seq ids to abort at the next step
        self.num_preemptions = 0
        self.pools = runner.kv_pools  # one per DP-attention rank (else one: this cache's)
        self.pool = self.pools[0]  # rank 0's blocks
        self.prefix = self.pool.prefix if self.config.prefix_cache else None  # rank 0's
        self.prefix_hit_tokens = 0  # prompt tokens taken from the prefix cache (at admission)
        self.prefix_query_tokens = 0  # prompt tokens looked up in it
        self.last_step_tokens = 0  # tokens the last `step` launched a forward over (0: none)
        alloc = self.pool.allocator
        self._watermark = max(1, alloc.num_blocks // 100)  # blocks kept free when admitting
        on = self.config.overlap if self.config.overlap is not None else on_by_default(runner)
        k = self.config.speculative_num_steps
        self.spec = SpecDecoder(runner, k, overlap=on) if k else None  # speculative decoding (opt-in)
        self.overlap = Overlap(runner) if on and self.spec is None and can_overlap(runner) else None

    # ---- requests ----------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens > self.max_context:
            raise MlacError(f"sequence of {seq.num_tokens} tokens exceeds the context of {self.max_context}")
        bisect.insort(self.waiting, seq, key=lambda s: s.seq_id)

    def abort(self, seq_id: int) -> None:
        """Finish a sequence with reason "abort" at the next step (its blocks are freed then)."""
        self.pending_aborts.add(seq_id)

    def abort_all(self) -> list[Sequence]:
        """Abort every sequence now, freeing its blocks (shutdown, or after a failed step). Returns
        the aborted sequences, and those that the step in flight (overlap) finished first."""
        news = self._drain_quietly()
        self.pending_aborts.update(s.seq_id for s in self.waiting + self.running)
        return unique(news + self._apply_aborts())

    def _drain_quietly(self) -> list[Sequence]:
        """Land the step in flight, if any. If that fails (the device's error, say), its tokens stay
        unread: every sequence is being aborted anyway."""
        if not self.in_flight:
            return []
        try:
            return self._flier.drain(self)
        except Exception:  # noqa: BLE001  (the caller is aborting everything, maybe after this error)
            return []

    @property
    def in_flight(self) -> bool:
        """Whether a decode step's tokens are still on the device (overlap): the next step lands them."""
        return self._flier is not None and self._flier.flight is not None

    @property
    def _flier(self):
        """What launches steps ahead: overlap.py's Overlap, or speculation's own (spec/overlap.py)."""
        return self.spec.overlap if self.spec is not None else self.overlap

    @property
    def could_admit(self) -> bool:
        """Whether a waiting sequence has room to join the running ones (max_running_requests)."""
        return bool(self.waiting) and len(self.running) < self.config.max_running_requests

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (0..1), over every DP-attention rank's pool."""
        total = sum(p.allocator.num_blocks for p in self.pools)
        return 1.0 - sum(p.allocator.num_free for p in self.pools) / total

    # ---- one step ----------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Schedule and run one forward; returns the sequences with news: a new token, finished,
        or aborted. Finished sequences have left the scheduler and freed their blocks. With
        overlap, a decode step's news come with the next step (overlap.py)."""
        news, self.last_step_tokens = [], 0
        if self.in_flight:
            steady = self._flier.advance(self)
            if steady is not None:
                self.last_step_tokens = self._launched_rows()
                return steady
            news = self._flier.drain(self)
        news += self._apply_aborts()
        plan = self._schedule()
        if plan:
            self.last_step_tokens = sum(n for _, n in plan)
            news += self._dispatch(plan)
        elif self.waiting and not self.running:  # cannot happen while requests fit the context; never hang
            n, free = self.waiting[0].num_tokens, self.pool.allocator.num_free
            raise MlacError(f"cannot admit a request of {n} tokens ({free} free blocks)")
        return unique(news)

    def _launched_rows(self) -> int:
        """Tokens of the step the flier launched ahead: a decode row per sequence, and each one's
        drafts when speculating."""
        flight = self._flier.flight
        per_seq = 1 if self.spec is None else 1 + self.spec.num_steps
        return 0 if flight is None else len(flight.seqs) * per_seq

    def _dispatch(self, plan: list[tuple[Sequence, int]]) -> list[Sequence]:
        if self.spec is not None:
            return self.spec.run(self, plan)
        if self.overlap is not None and self.overlap.can_start(plan):
            self.overlap.start(plan)  # its news come with the next step
            return []
        return self._run(plan)

    def _apply_aborts(self) -> list[Sequence]:
        if not self.pending_aborts:
            return []
        gone = [s for s in self.waiting + self.running if s.seq_id in self.pending_aborts]
        for s in gone:
            s.finish_reason = s.finish_reason or "abort"
            self.release(s)
        self.pending_aborts.clear()
        return gone

    def release(self, seq: Sequence) -> None:
        """Give back `seq`'s blocks and take it out of the queues."""
        self._free_blocks(seq)
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)

    def _free_blocks(self, seq: Sequence) -> None:
        """Its computed full blocks to the prefix cache (when on), the others to the free list."""
        blocks, pool = seq.block_table, self.pools[seq.dp_rank]
        if seq.prefix is not None:
            blocks = pool.prefix.insert(seq.prefix, seq.tokens(0, seq.num_computed), blocks)
            seq.prefix = None
        pool.allocator.free(blocks)
        seq.block_table = []

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it recomputes prompt + output when admitted again."""
        self.release(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=lambda s: s.seq_id)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for `num_tokens` of `seq`, preempting lower-priority running sequences (the
        tail of its rank's) when the pool is short. False when `seq` itself had to be preempted."""
        alloc = self.pools[seq.dp_rank].allocator
        while alloc.blocks_for(num_tokens) - len(seq.block_table) > alloc.num_free:
            victim = next(s for s in reversed(self.running) if s.dp_rank == seq.dp_rank)
            self._preempt(victim)
            if victim is seq:
                return False
        alloc.reserve(seq.block_table, num_tokens)
        return True

    def _schedule(self) -> list[tuple[Sequence, int]]:
        """[(sequence, new tokens to run)] for this step, in priority order."""
        budget = self.config.chunked_prefill_size
        plan: list[tuple[Sequence, int]] = []
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            n = self._decode_tokens(seq) if seq.decoding else min(seq.num_tokens - seq.num_computed, budget)
            if n == 0:
                i += 1
                continue
            if not self._grow(seq, seq.num_computed + n):
                continue  # seq was its rank's tail and left `running`: the next one took index i
            budget -= 0 if seq.decoding else n
            plan.append((seq, n))
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            seq = self.waiting[0]
            if self.prefix is not None and self._prefilling_its_prefix(seq):
                break  # a step or two later its prefix is cached: it takes it instead of computing it
            n = self._admit(seq, budget)
            if n == 0:
                break  # oldest first: no younger request overtakes it
            self.waiting.pop(0)
            bisect.insort(self.running, seq, key=lambda s: s.seq_id)
            plan.append((seq, n))
            budget -= n
        return plan

    def _prefilling_its_prefix(self, seq: Sequence) -> bool:
        """Whether a running request is still prefilling a prompt that shares full blocks with
        `seq`'s beyond what the prefix cache already holds (the n choices of one request, a burst
        sharing a system prompt): its prompt enters the cache when its prefill ends (_cache_prompt)."""
        bs = self.pool.allocator.block_size
        mine = seq.prompt_ids[: seq.num_tokens - 1]  # its last token is always computed
        return any(
            s.num_computed < len(s.prompt_ids) and shares_past(s.prompt_ids, mine, s.num_cached_tokens, bs)
            for s in self.running
        )

    def _cache_prompt(self, seq: Sequence) -> None:
        """`seq`'s prompt is computed: its full blocks join the prefix cache now, not at its end."""
        pool = self.pools[seq.dp_rank]
        seq.prefix, replaced = pool.prefix.insert_running(seq.prefix, seq.prompt_ids, seq.block_table)
        pool.allocator.free(replaced)

    def _decode_tokens(self, seq: Sequence) -> int:
        """New tokens a decoding sequence runs: its last one, and its drafts when speculating."""
        return 1 if self.spec is None else 1 + self.spec.num_drafts(seq, self.max_context)

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Take `seq`'s cached prefix and the blocks of its first chunk; the chunk's length, or 0
        (holding nothing) when its blocks are not free."""
        if len(self.pools) > 1:
            need = self.pool.allocator.blocks_for(seq.num_computed + min(seq.num_tokens, budget))
            seq.dp_rank = route(self.pools, seq.tokens(0, seq.num_tokens), need, self.prefix is not None)
        pool = self.pools[seq.dp_rank]
        alloc = pool.allocator
        if self.prefix is not None and seq.params.prompt_logprobs is None:  # those are prefilled whole
            seq.prefix = pool.prefix.match(
                seq.tokens(0, seq.num_tokens), (seq.num_tokens - 1) // alloc.block_size
            )
            seq.block_table = pool.prefix.blocks(seq.prefix)
            seq.num_computed = len(seq.block_table) * alloc.block_size
        n = min(seq.num_tokens - seq.num_computed, budget)
        reserve = self._watermark if self.running else 0
        if alloc.blocks_for(seq.num_computed + n) - len(seq.block_table) + reserve > alloc.num_free:
            self._free_blocks(seq)
            seq.num_computed = 0
            return 0
        alloc.reserve(seq.block_table, seq.num_computed + n)
        if self.prefix is not None:
            self._count_hit(seq)
        return n

    def _count_hit(self, seq: Sequence) -> None:
        if seq.num_preemptions == 0:  # a recompute after preemption is not a prompt lookup
            seq.num_cached_tokens = seq.num_computed
            self.prefix_hit_tokens += seq.num_computed
            self.prefix_query_tokens += len(seq.prompt_ids)

    def check_blocks(self) -> dict[str, int]:
        """Check that every block is accounted for, exactly once: on the free list, cached and
        unreferenced, or in a running sequence's table (cached and referenced blocks among them,
        each referenced as often as running sequences hold it). Returns the counts; MlacError
        says what is wrong. Under DP attention, each rank's pool is checked and the counts summed."""
        counts = [self._check_pool(p, [s.block_table for s in self.running if s.dp_rank == r])
                  for r, p in enumerate(self.pools)]  # fmt: skip
        return {k: sum(c[k] for c in counts) for k in counts[0]}

    @staticmethod
    def _check_pool(pool, tables: list[list[int]]) -> dict[str, int]:
        alloc, prefix = pool.allocator, pool.prefix
        free = alloc.free_list()
        held = [b for t in tables for b in t]
        nodes = list(prefix.nodes())
        unref = [x.block for x in nodes if x.refs == 0]
        shared = {x.block: x.refs for x in nodes if x.refs > 0}
        counts = {b: held.count(b) for b in set(held)}
        private = [b for b, c in counts.items() if b not in shared and c != 1]
        wrong = [b for b, r in shared.items() if counts.get(b, 0) != r]
        everything = free + unref + list(counts)
        if private or wrong or len(set(everything)) != len(everything) or len(everything) != alloc.num_blocks:
            raise MlacError(
                f"KV blocks unaccounted for: {len(free)} free + {len(unref)} cached + {len(counts)} in use "
                f"!= {alloc.num_blocks}, or shared wrongly (private {private}, refs {wrong})"
            )
        if len(unref) != prefix.num_evictable:
            raise MlacError(
                f"prefix cache counts {prefix.num_evictable} evictable blocks, holds {len(unref)}"
            )
        return {"free": len(free), "cached": len(unref), "in_use": len(counts)}

    def _run(self, plan: list[tuple[Sequence, int]]) -> list[Sequence]:
        seqs = [s for s, _ in plan]
        chunks = [s.tokens(s.num_computed, s.num_computed + n) for s, n in plan]
        ranks = [s.dp_rank for s in seqs] if len(self.pools) > 1 else []
        every = every_token(plan)  # a sequence asks for its prompt's logprobs (prompt_logprobs.py)
        step = Step.of(chunks, [s.num_computed for s in seqs], [s.block_table for s in seqs], every, ranks)
        logits = self.runner.run(step)  # [B, V]: each sequence's last new token ([T, V] if every)
        if every:
            logits = score_prompts(plan, logits)
        for s, n in plan:
            s.num_computed += n
            if s.prefix is not None and s.num_computed - n < len(s.prompt_ids) <= s.num_computed:
                self._cache_prompt(s)
        rows = [j for j, s in enumerate(seqs) if s.num_computed == s.num_tokens]  # all cached: sample
        ready = [seqs[j] for j in rows]
        if ready:
            sample_next(ready, logits[rows], self.eos_ids, self.max_context)
        for s in ready:
            if s.finished:
                self.release(s)
        return ready
