"""Speculative decoding with the checkpoint's MTP (NextN) layer as the draft, inside the scheduler.

A decoding sequence holds n tokens t_0..t_{n-1}: the main layers have cached positions < n - 1,
t_{n-1} is the last sampled token. The MTP layer's pool (cache layer num_hidden_layers, in the
same blocks) holds position p's entry, computed from the target's hidden state h_p and t_{p+1},
for every p < n - 1. Between steps the sequence keeps one `Draft`: d_0, the MTP's prediction of
t_n, and g, the MTP's output at position n - 2. One step (`SpecDecoder.run`) for the planned
sequences (decoding ones verify k <= K drafts; prefilling ones run their chunk as usual):

1. draft: chain the MTP layer k - 1 times, each a decode step at position n - 2 + j over
   (g, d_{j-1}) -> g, d_j (its pool entries at n - 1.. are provisional: step 4 overwrites them);
2. verify: ONE target forward, an extend of [t_{n-1}, d_0..d_{k-1}] (q_len k + 1) after n - 1
   cached tokens, mixed with the prefill chunks; logits of every verified position;
3. accept (spec/sampling.py): the longest prefix of drafts equal to the target's argmax, then
   the target's token after it (greedy); rejection sampling otherwise. The a + 1 emitted tokens
   are appended; the sequence's length now says which cache entries are valid, and blocks past
   it are freed (rolled back: nothing of a rejected token stays allocated);
4. refresh: the MTP layer runs over the positions the target just ran and kept (a decoding
   sequence's n - 1 .. n - 1 + a, a prefill chunk's positions), from the target's hidden states
   and the tokens one ahead, rewriting its pool there; its output at the last position gives the
   next step's Draft.

With the prefix cache, a block shared from another sequence carries that sequence's MTP entries:
the entry at a block's last position was computed from the token after the block, which the
cache key does not cover. It can only make a draft worse (the verify is exact), never an output.
A preempted sequence recomputes its tokens as a prefill, which refreshes the MTP pool as it goes
and ends with a new Draft: it resumes as it would have run. Greedy output is token-identical with
and without speculation: every emitted token is the target's argmax after the tokens before it.
The device work (target, heads, MTP layer) goes through spec_exec.py, which a multi-rank
artifact's other ranks mirror. A step without prefill chunks is decode-shaped (verify_step), so
its verify replays the decode CUDA graphs and its draft steps the MTP layer's (spec_graphs.py).

A step whose sequences all decode greedily (`_fast`) runs steps 1-2 as one executor op
(SpecExecutor.chain): the drafts feed the next draft and the verify on the device, and one host
sync brings back the drafts and the target's argmax of every verified row. A greedy Draft's d_0
stays on the device (the executor's `tokens`), so the refresh needs no sync either: a greedy
speculative step is K draft replays (K - 1 chained, one refresh), one verify replay and ONE host
sync (the host-side flow: K + 1). With CUDA graphs, when every sequence drafts K and none asks for
logprobs, the whole of it (drafts, verify, acceptance, refresh) is ONE graph replay
(spec_chain.py): the host writes one buffer, replays, reads one back, and here only appends the
tokens and keeps the books (`land_chain`; `_refresh` only when a sequence left). With overlap
scheduling (spec/overlap.py, one rank) the next such step is launched from this one's results on
the device before the host lands them. Sampled requests, grammars and steps with prefill chunks
take the host-side flow above (a sync per draft step).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mlac.core.errors import MlacError
from mlac.runtime.engine.sampling import token_logprobs
from mlac.runtime.engine.sequence import sample_next
from mlac.runtime.engine.spec.overlap import SpecOverlap
from mlac.runtime.engine.spec.sampling import accept_greedy, accept_sampled, draw, filtered_probs
from mlac.runtime.step import Step
from mlac.runtime.worker.spec_exec import to_host

if TYPE_CHECKING:
    from mlac.runtime.engine.overlap import SchedulerView


@dataclass
class Draft:
    """A decoding sequence's draft between steps (its MTP output g at n - 2 is in the executor's
    store, on the device)."""

    token: int | None  # d_0: the MTP's prediction of the token after the sequence's last (None:
    # greedy, kept on the device: SpecExecutor.tokens)
    probs: torch.Tensor | None  # [V] the distribution d_0 was drawn from (None: greedy)


GREEDY = Draft(None, None)  # every greedy sequence's Draft (its d_0 is on the device); never changed


@dataclass
class SpecStats:
    """Counters for /metrics: accepted tokens per verify = (emitted) / (verifies)."""

    verifies: int = 0  # sequence-steps that verified drafts
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens accepted
    emitted: int = 0  # tokens emitted by verifies (accepted + one each)

    @property
    def accept_length(self) -> float:
        """Mean tokens emitted per sequence per verify step (1.0 = no gain)."""
        return self.emitted / self.verifies if self.verifies else 0.0


def check_spec(num_steps: int, has_mtp: bool, dp_attention: bool = False) -> None:
    """Refuse a speculative configuration this artifact cannot run (one line)."""
    if num_steps < 0:
        raise MlacError(f"--speculative-num-steps {num_steps}: must be >= 0")
    if num_steps and dp_attention:
        raise MlacError("--speculative-num-steps: not with a --dp-attention artifact (compile it without)")
    if num_steps and not has_mtp:
        raise MlacError(
            "--speculative-num-steps: the artifact has no MTP layer (compile a checkpoint with one, without --no-mtp)"
        )


def verify_step(chunks: list[list[int]], ctx_lens: list[int], tables: list, decode_only: bool) -> Step:
    """The target (or MTP) step over `chunks` (sequence i's tokens after its ctx_lens[i] cached ones).
    With decode_only (every sequence verifies drafts), decode-shaped: one row per token, row p of
    a sequence a one-token "sequence" of p + 1 tokens in the same blocks. Every row's latent is
    written before any row attends (per layer), so row p sees the rows before it: the same
    causal attention as an extend, through the decode path and its CUDA graphs (graphs.py)."""
    if not decode_only:
        return Step.of(chunks, ctx_lens, tables)
    rows = [(t, c + i, table) for chunk, c, table in zip(chunks, ctx_lens, tables, strict=True)
            for i, t in enumerate(chunk)]  # fmt: skip
    return Step.of([[t] for t, _, _ in rows], [c for _, c, _ in rows], [table for *_, table in rows])


def sample_one(sched: SchedulerView, seq, logits: torch.Tensor) -> None:
    """Sample and append seq's next token from logits [1, V], as Scheduler._run does."""
    sample_next([seq], logits, sched.eos_ids, sched.max_context)


class SpecDecoder:
    """Runs a scheduler's steps with K draft tokens per decoding sequence (see the module doc).
    The host side: which tokens, which rows, what is accepted; the device work goes through the
    runner's SpecExecutor (spec_exec.py), on every rank."""

    def __init__(self, runner, num_steps: int, overlap: bool = False):
        cache, model = runner.cache, runner.model
        check_spec(num_steps, len(model.mtp) > 0)
        if cache.extra_layers < 1:
            raise MlacError("speculative decoding needs a KV cache with the MTP layer's pool (extra_layers)")
        self.exec, self.allocator, self.num_steps = (
            runner.spec_executor(),
            runner.kv_pools[0].allocator,
            num_steps,
        )
        # the one-replay greedy step's graphs (spec_chain.py), where the runner can have them
        self.exec.prepare(num_steps)
        self.drafts: dict[int, Draft] = {}  # by seq_id
        self.stats = SpecStats()
        # greedy chain steps launched one ahead (spec/overlap.py): one rank only
        self.overlap = SpecOverlap(self) if overlap and self.exec.send is None else None
        self.ahead = 0  # tokens past each sequence's end that a step in flight writes (kept at roll-back)

    def num_drafts(self, seq, max_context: int) -> int:
        """Drafts to verify for decoding `seq`: K, fewer near its context or max_tokens end; none
        without a Draft (a preempted sequence whose recompute the prefix cache served whole), and
        none for a request constrained by a grammar (`matcher`: its drafts would need its mask) or
        penalized (its drafts would need its penalties: penalties.py)."""
        if seq.seq_id not in self.drafts or seq.matcher is not None or seq.penalties is not None:
            return 0
        left = seq.params.max_tokens - len(seq.output_ids) - 1
        return max(0, min(self.num_steps, max_context - seq.num_tokens, left))

    # ---- one step ----------------------------------------------------------------------------

    def run(self, sched: SchedulerView, plan: list) -> list:
        """Run `plan` [(sequence, new tokens)] (a decoding sequence: 1 + its drafts) as one verify
        step; returns the sequences with news, as Scheduler._run."""
        if self._fast(plan):
            return self._run_fast(sched, plan)
        drafts = self._chain(plan)
        chunks = [
            [s.output_ids[-1], *drafts[s.seq_id][0]] if s.seq_id in drafts
            else s.tokens(s.num_computed, s.num_computed + n)
            for s, n in plan
        ]  # fmt: skip
        ctx_lens, tables = [s.num_computed for s, _ in plan], [s.block_table for s, _ in plan]
        decode_only = all(s.seq_id in drafts for s, _ in plan)  # no prefill chunk: decode-shaped steps
        self.exec.target(verify_step(chunks, ctx_lens, tables, decode_only))
        starts = [0, *itertools.accumulate(len(c) for c in chunks)]
        rows, where = self._logit_rows(plan, drafts, starts)
        logits = self.exec.logits("hidden", rows) if rows else None  # [R, V]
        top = to_host(logits.argmax(dim=-1)) if logits is not None else []  # one sync for every row
        return self._finish(sched, plan, drafts, starts, where, logits, top, decode_only)

    def _fast(self, plan: list) -> bool:
        """Whether `plan` runs as one device-side chain: every sequence decodes greedily, without a
        grammar or penalties (a greedy Draft's d_0 is on the device)."""
        return all(
            s.decoding and s.params.greedy and s.matcher is None and s.penalties is None for s, _ in plan
        )

    def _run_fast(self, sched: SchedulerView, plan: list) -> list:
        """`run` of a greedy decode-only plan: drafts and verify in one executor op, one sync."""
        ks = [n - 1 for _, n in plan]
        base = Step.of([[s.output_ids[-1]] for s, _ in plan], [s.num_computed for s, _ in plan],
                       [s.block_table for s, _ in plan])  # fmt: skip
        want_logits = any(s.params.logprobs is not None for s, _ in plan)
        if self.overlap is not None and not want_logits and all(k == self.num_steps for k in ks):
            if self.overlap.start(plan):
                return []  # its news come with the next step
        found, top, logits, refreshed = self.exec.chain([s.seq_id for s, _ in plan], ks, base, self.num_steps,
                                                        want_logits)  # fmt: skip
        if refreshed:
            return self.land_chain(sched, [s for s, _ in plan], found, top)
        drafts = {s.seq_id: (d, [None] * len(d)) for (s, _), d in zip(plan, found, strict=True)}
        starts = [0, *itertools.accumulate(k + 1 for k in ks)]
        where = list(itertools.pairwise(starts))
        return self._finish(sched, plan, drafts, starts, where, logits, top, True, refreshed)

    def land_chain(self, sched: SchedulerView, seqs: list, found: list[list[int]], top: list[int]) -> list:
        """`_finish` of a one-replay chain step of `seqs` (every one greedy, K drafts, refreshed on
        the device): per sequence its acceptance, appends and roll-back; the books only when a
        sequence left (in the steady state every Draft stays as it is, on the device). A sequence
        that finished meanwhile (overlap: at the step before) drops its rows."""
        k1, news = self.num_steps + 1, []
        for j, s in enumerate(seqs):
            if not s.finished:
                self._verify(sched, s, None, top[j * k1 : (j + 1) * k1], found[j], ())
                news.append(s)
        gone = [s for s in news if s.finished]
        for s in gone:
            sched.release(s)
        if gone or len(self.drafts) != len(news):  # else: the same sequences keep the same Drafts
            self._refresh([(s, 0, 0, 1) for s in news if not s.finished], sched, True, True)
        return news

    def _finish(
        self,
        sched: SchedulerView,
        plan: list,
        drafts: dict,
        starts: list[int],
        where: list[tuple[int, int]],
        logits: torch.Tensor | None,
        top: list[int],
        decode_only: bool,
        refreshed: bool = False,
    ) -> list:
        """Accept, append, release, then refresh (steps 3-4 of the module doc) for `plan`, whose
        sequence j ran the verify's rows from starts[j] and has logits [R, V] (argmax `top`; None:
        greedy without logprobs) at rows where[j] = [a, b); returns the sequences with news.
        `refreshed`: the device already refreshed every sequence (spec_chain.py)."""
        kept, news = [], []
        for j, (s, n) in enumerate(plan):
            start, (a, b) = s.num_computed, where[j]
            if s.seq_id in drafts:
                mine = logits[a:b] if logits is not None else None
                try:
                    emitted = self._verify(sched, s, mine, top[a:b], *drafts[s.seq_id])
                except Exception as e:  # noqa: BLE001  (its acceptance: this request fails alone)
                    s.fail(e)
                    emitted = 0
            else:
                s.num_computed += n
                emitted = b - a
                if emitted:
                    sample_one(sched, s, logits[a:b])
            if emitted or s.error is not None:
                news.append(s)
            if s.finished:
                sched.release(s)
            else:
                kept.append((s, start, starts[j], s.num_computed - start))
        self._refresh(kept, sched, decode_only, refreshed)
        return news

    def _logit_rows(self, plan: list, drafts: dict, starts: list[int]) -> tuple[list[int], list]:
        """Rows of the target's hidden states that need logits (every verified position, the last
        position of a prefill that ends its sequence's tokens), and per sequence its [a, b) of them."""
        rows, where = [], []
        for j, (s, n) in enumerate(plan):
            if s.seq_id in drafts:
                mine = list(range(starts[j], starts[j + 1]))
            else:
                mine = [starts[j + 1] - 1] if s.num_computed + n == s.num_tokens else []
            where.append((len(rows), len(rows) + len(mine)))
            rows += mine
        return rows, where

    def _chain(self, plan: list) -> dict[int, tuple[list[int], list]]:
        """Drafts of the decoding sequences of `plan`, by seq_id: ([d_0..d_{k-1}], their
        distributions). d_0 is the sequence's Draft; d_j comes from the MTP layer at position
        n - 2 + j over (g, d_{j-1}), one decode step over every sequence that still needs one."""
        want = {s.seq_id: n - 1 for s, n in plan if s.decoding}
        seqs = [s for s, _ in plan if want.get(s.seq_id)]
        d0 = self._first_drafts([s.seq_id for s in seqs])
        out = {s.seq_id: ([d0[s.seq_id]], [self.drafts[s.seq_id].probs]) for s in seqs}
        src, rows = "store", [s.seq_id for s in seqs]  # the chain's first inputs: each g at n - 2
        for j in range(1, max(want.values(), default=0)):
            active = [i for i, s in enumerate(seqs) if want[s.seq_id] > j]
            step = Step.of(
                [[out[seqs[i].seq_id][0][-1]] for i in active], [seqs[i].num_tokens - 2 + j for i in active],
                [seqs[i].block_table for i in active],
            )  # fmt: skip
            self.exec.draft(src, [rows[i] for i in active], step)
            logits = self.exec.logits("g", list(range(len(active))))
            picked = self._pick([seqs[i] for i in active], logits, [seqs[i].num_tokens + j for i in active])
            for r, (i, (t, q)) in enumerate(zip(active, picked, strict=True)):
                out[seqs[i].seq_id][0].append(t)
                out[seqs[i].seq_id][1].append(q)
                rows[i] = r  # its g is row r of this draft step's
            src = "g"
        return {i: (out[i][0][:k], out[i][1][:k]) if k else ([], []) for i, k in want.items()}

    def _first_drafts(self, seq_ids: list[int]) -> dict[int, int]:
        """d_0 of each sequence on the host: a greedy one's from the device (one sync for all)."""
        out = {i: self.drafts[i].token for i in seq_ids}
        on_device = [i for i, t in out.items() if t is None]
        if on_device:
            self.exec.evacuate()
            tokens = to_host(torch.stack([self.exec.tokens[i] for i in on_device]))
            out.update(zip(on_device, tokens, strict=True))
        return out

    def _pick(self, seqs: list, logits: torch.Tensor, at: list[int]) -> list[tuple[int, torch.Tensor | None]]:
        """Drafts of the sequences' tokens at indices `at` from the MTP's logits [B, V]: argmax
        (greedy), else drawn from the request's filtered distribution (returned, for rejection
        sampling)."""
        top = to_host(self.exec.pick(logits, [s.seq_id for s in seqs], at))
        out: list[tuple[int, torch.Tensor | None]] = []
        for i, s in enumerate(seqs):
            if s.params.greedy:
                out.append((top[i], None))
            else:
                q = filtered_probs(logits[i : i + 1], [s.params])[0]
                out.append((draw(q, s.generator), q))
        return out

    def _verify(
        self, sched: SchedulerView, seq, logits: torch.Tensor, top: list[int], drafts: list[int], probs: list
    ) -> int:
        """Accept drafts against the target's logits [k + 1, V] (argmax `top`); append the emitted
        tokens, advance num_computed over the kept ones, free the blocks past the sequence.
        Returns how many tokens were appended. Without drafts it is a plain decode step (sampled
        exactly as Scheduler._run samples, a grammar's mask included)."""
        if not drafts:
            sample_one(sched, seq, logits)
            seq.num_computed += 1
            self._roll_back(seq)
            return 1
        if seq.params.greedy:
            emitted = accept_greedy(drafts, top)  # (logits: None in a chain step, without logprobs)
        else:
            p = filtered_probs(logits, [seq.params] * len(top))
            q = torch.stack(probs) if drafts else p[:0]
            emitted = accept_sampled(p, q, drafts, seq.generator)
        lps = [None] * len(emitted)
        if seq.params.logprobs is not None:
            lps = token_logprobs(
                logits[: len(emitted)], torch.tensor(emitted), [seq.params.logprobs] * len(emitted)
            )
        appended = 0
        for t, lp in zip(emitted, lps, strict=True):
            seq.append_token(t, lp, sched.eos_ids, sched.max_context)
            appended += 1
            if seq.finished:
                break
        self._count(len(drafts), len(emitted) - 1, appended)
        seq.num_computed += appended  # t_{n-1} and the accepted drafts before the last emitted token
        self._roll_back(seq)
        return appended

    def _count(self, drafted: int, accepted: int, emitted: int) -> None:
        s = self.stats
        s.verifies += 1
        s.drafted += drafted
        s.accepted += accepted
        s.emitted += emitted

    def _roll_back(self, seq) -> None:
        """Free the blocks past the sequence's tokens (those that held only rejected drafts), but
        those of the `ahead` positions after them that a step in flight writes."""
        keep = self.allocator.blocks_for(seq.num_tokens + self.ahead)
        if len(seq.block_table) > keep:
            self.allocator.free(seq.block_table[keep:])
            del seq.block_table[keep:]

    def _refresh(self, kept: list, sched: SchedulerView, decode_only: bool, refreshed: bool = False) -> None:
        """The MTP layer over the target's kept positions [(seq, first position, first hidden
        row, count)]; a sequence now decoding gets its next Draft from its last row. Drafts of
        sequences that left or no longer decode are dropped. `refreshed` (every kept sequence is
        greedy, its next state already on the device): only the bookkeeping."""
        kept = [k for k in kept if k[3]]
        ready: list = []
        if refreshed:
            ready = [(s, -1) for s, *_ in kept if s.decoding]
        elif kept:
            step = verify_step(
                [s.tokens(c + 1, c + 1 + m) for s, c, _, m in kept], [c for _, c, _, _ in kept],
                [s.block_table for s, _, _, _ in kept], decode_only,
            )  # fmt: skip
            self.exec.draft("hidden", [r + i for _, _, r, m in kept for i in range(m)], step)
            last = list(itertools.accumulate(m for *_, m in kept))
            ready = [(s, last[j] - 1) for j, (s, *_) in enumerate(kept) if s.decoding]
        sampled = [(s, r) for s, r in ready if not s.params.greedy]
        if sampled:  # drawn on the host; a greedy d_0 stays on the device (keep)
            logits = self.exec.logits("g", [r for _, r in sampled])
            picked = self._pick([s for s, _ in sampled], logits, [s.num_tokens for s, _ in sampled])
            for (s, _), (t, q) in zip(sampled, picked, strict=True):
                self.drafts[s.seq_id] = Draft(t, q)
        for s, _ in ready:
            if s.params.greedy:
                self.drafts[s.seq_id] = GREEDY
        live = {s.seq_id for s in sched.running if s.decoding}
        self.drafts = {i: d for i, d in self.drafts.items() if i in live}
        ids = sorted(self.drafts)
        # its row of g, the index d_0 predicts
        rows = {s.seq_id: (r, s.num_tokens) for s, r in ready if r >= 0}
        rows_at = [rows.get(i, (-1, -1)) for i in ids]
        self.exec.keep(ids, [r for r, _ in rows_at], [a for _, a in rows_at])
