"""The device side of speculative decoding: engine/spec/decode.py's model calls as a few ops over
device state that every rank of a multi-rank artifact holds alike.

engine/spec/decode.py decides on the host (rank 0) what runs; each decision is one op here:

    target(step)                 hidden = the main model over a Step                [T, D]
    logits(src, rows)            the head over rows of `src` -> float32 [R, V]
    draft(src, rows, step)       g = the MTP layer over rows of `src` and the Step's tokens (t_{p+1})
                                 at its positions                                   [N, D]
    keep(seq_ids, rows, at)      store[seq_ids[i]] = g[rows[i]] and tokens[seq_ids[i]] = its greedy
                                 draft (-1: as it is); others dropped
    chain(seq_ids, ks, base, k, want_logits)
                                 greedy drafts chained on the device, then their verify; ONE
                                 transfer to the host at its end (drafts and target argmax)
    prepare(k)                   make (on a GPU: capture) the ChainGraphs of K = k now, not at
                                 the first step that needs them
    launch(seq_ids, k, tables, first)
                                 chain's one replay without waiting for it (one rank): its results
                                 come later (Launched.read); first=None launches the next step of
                                 the same sequences from the last one's results on the device

`src` names a state: "hidden" (the last target's), "g" (the last draft's) or "store" (rows are
seq_ids: each decoding sequence's last MTP output, the chain's first input). On rank 0 of a
multi-rank artifact, `send` broadcasts each op (code and integers, step_link.send_spec) before it runs,
and the other ranks `apply` it: every rank runs the same forwards, so the collectives inside them
(all-reduce, the head's all-gather) line up. Only rank 0 uses the logits.

With a runner's CUDA graphs (or their buffers, on CPU), `chain` runs its step as ONE ChainGraphs
replay (spec_chain.py: the drafts, the verify, the acceptance and the refresh together) when every
sequence drafts K and none wants logprobs; each such sequence's state then stays in the graph's
rows (`resident`) until another op needs it in `store` (`evacuate`). Otherwise:

`chain` is one speculative step of greedy sequences without a host round trip between its
replays: every draft step's metadata (positions, slots, tables) follows from the sequences'
lengths, known before it starts; only its token ids depend on the previous draft, and they are
written into the static inputs on the device (DecodeInputs.fill's `ids`). The verify step's ids
[t_{n-1}, d_0..d_{k-1}] are gathered on the device too; one transfer then brings the drafts and
the target's argmax of every verified row to the host (`to_host`, the one place spec code syncs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mlac.runtime.device_copy import to_device
from mlac.runtime.step import Step
from mlac.runtime.worker.spec_chain import ChainGraphs

TARGET, LOGITS, DRAFT, KEEP, CHAIN, PREPARE = 1, 2, 3, 4, 5, 6  # op codes
SOURCES = ("hidden", "g", "store")
Send = Callable[[int, list[int]], None]
Fail = Callable[[BaseException], BaseException]  # RankGroup.fail


def to_host(x: torch.Tensor) -> list:
    """x as a (nested) list of Python numbers: a device-to-host transfer, which waits for the device
    (speculative decoding's host syncs all go through here, so that tests can count them)."""
    return x.tolist()


def rows_step(ctx_lens: list[int], ks: list[int], tables: list) -> Step:
    """The decode-shaped step (spec/decode.verify_step) of sequence i's k_i + 1 rows after its
    ctx_lens[i] cached tokens, with token ids 0 (the caller writes them on the device)."""
    rows = [(c + j, t) for c, k, t in zip(ctx_lens, ks, tables, strict=True) for j in range(k + 1)]
    return Step.of([[0]] * len(rows), [c for c, _ in rows], [t for _, t in rows])


def step_ints(step: Step) -> list[int]:
    """A Step as integers: [T, B, W, ids.., ctx_lens.., q_lens.., table lens.., tables padded to W]."""
    b, w = step.num_seqs, max(len(t) for t in step.block_tables)
    tables = [x for t in step.block_tables for x in (*t, *[0] * (w - len(t)))]
    lens = [len(t) for t in step.block_tables]
    return [len(step.token_ids), b, w, *step.token_ids, *step.ctx_lens, *step.q_lens, *lens, *tables]


def step_of_ints(ints: list[int]) -> tuple[Step, list[int]]:
    """(the Step that step_ints wrote at the head of `ints`, the integers after it)."""
    t, b, w = ints[:3]
    parts, at = [], 3
    for n in (t, b, b, b, b * w):
        parts.append(ints[at : at + n])
        at += n
    ids, ctx, q, lens, flat = parts
    tables = tuple(tuple(flat[i * w : i * w + n]) for i, n in enumerate(lens))
    return Step(tuple(ids), tuple(ctx), tuple(q), tables), ints[at:]


def split_out(out: list[list[int]], k: int) -> tuple[list[list[int]], list[int]]:
    """A ChainGraphs' out as host lists -> (each sequence's drafts, the target's argmax of every
    verified row, sequence after sequence)."""
    return [row[:k] for row in out], [t for row in out for t in row[k:]]


@dataclass(eq=False)
class Launched:
    """A one-replay chain step whose out [B, 2K + 1] is on its way to the host (SpecExecutor.launch)."""

    host: torch.Tensor  # pinned on CUDA; written once `done` has passed
    done: torch.cuda.Event | None  # None on CPU: nothing to wait for
    k: int

    def read(self) -> tuple[list[list[int]], list[int]]:
        """(drafts, the target's argmax of every verified row), as `SpecExecutor.chain` returns them."""
        if self.done is not None:
            self.done.synchronize()
        return split_out(to_host(self.host), self.k)


class SpecExecutor:
    """One rank's runner (model, KV cache, CUDA graphs), running the ops above (see the module
    doc). A decode-shaped target step replays the runner's DecodeGraphs (kept hidden states) and
    a decode-shaped draft step its DraftGraphs (spec_graphs.py), when it has them; then the
    logits the graphs computed are used as they are. Every rank decides alike (same graphs, same
    steps), so the collectives still line up."""

    def __init__(self, runner, send: Send | None = None, fail: Fail | None = None):
        self.runner, self.send, self.fail = runner, send, fail
        self.model, self.cache = runner.model, runner.cache
        self.hidden: torch.Tensor | None = None  # [T, D]
        self.g: torch.Tensor | None = None  # [N, D]
        self.ready: dict[str, torch.Tensor | None] = {"hidden": None, "g": None}  # logits from graphs
        self.store: dict[int, torch.Tensor] = {}  # seq_id -> [D]
        self.tokens: dict[int, torch.Tensor] = {}  # seq_id -> [] int64: the greedy d_0 of its store entry
        self.chains: dict[int, ChainGraphs] = {}  # K -> the one-replay chain (prepare, or first use)
        self.resident: tuple[int, ...] = ()  # seq_ids whose state is in rows 0.. of `resident_in`
        self.resident_in: ChainGraphs | None = None

    @contextmanager
    def _op(self, code: int, ints: list[int]) -> Iterator[None]:
        """Broadcast the op (rank 0 of several), then run it here. A failure here goes through
        `fail` (RankGroup.fail: it stops the other ranks, which would wait in the op's collectives)."""
        if self.send is not None:
            self.send(code, ints)
        try:
            yield
        except BaseException as e:
            if self.fail is None:
                raise
            error = self.fail(e)
            if isinstance(e, Exception):
                raise error from e
            raise

    def evacuate(self) -> None:
        """Move the states that live in a ChainGraphs' rows into `store` / `tokens` (before anything
        else reads those or loads other rows there)."""
        if self.resident:
            g, t = self.resident_in.state(len(self.resident))
            for r, i in enumerate(self.resident):
                self.store[i], self.tokens[i] = g[r], t[r]
            self.resident = ()

    def _rows(self, src: str, rows: list[int]) -> torch.Tensor:
        if src == "store":
            self.evacuate()
            return torch.stack([self.store[i] for i in rows])
        x = self.hidden if src == "hidden" else self.g
        return x[to_device(rows, torch.int64, x.device)]  # a copy: graphs overwrite their outputs

    def pick(self, logits: torch.Tensor, seq_ids: list[int], at: list[int]) -> torch.Tensor:
        """Greedy drafts [N] int64, on the device, from the MTP's logits [N, V]: the drafts of
        sequences seq_ids' tokens at indices `at` (the argmax; the tests' oracle replaces it)."""
        return logits.argmax(dim=-1)

    def _target(self, step: Step, ids: torch.Tensor | None = None) -> None:
        """hidden (and the graphs' logits) of the main model over `step`; `ids` [T] on the device
        in place of step.token_ids."""
        graphs = self.runner.graphs
        if graphs is not None and graphs.hidden is not None and graphs.fits(step):  # one replay's hidden
            # one row per new token, also for a short extend (flattened rows, graphs.py); the
            # graphs' logits are those of each sequence's last row: usable as they are only
            # when every sequence has one row
            logits = graphs.run(step, ids) if ids is not None else graphs.run(step)
            self.hidden = graphs.hidden[: len(step.token_ids)]
            self.ready["hidden"] = logits if step.is_decode else None
        else:
            host_ids, batch = step.to_device(self.cache.block_size, self.model.device)
            ids = host_ids if ids is None else ids
            self.hidden, self.ready["hidden"] = self.model(ids, batch, self.cache), None

    def _draft(self, x: torch.Tensor, step: Step, ids: torch.Tensor | None = None) -> None:
        """g (and the graphs' logits) of the MTP layer over hidden rows x [N, D] and `step`."""
        graphs = getattr(self.runner, "draft_graphs", None)
        if graphs is not None and graphs.can_run(step):
            self.g, self.ready["g"] = graphs.run(step, x, ids) if ids is not None else graphs.run(step, x)
        else:
            host_ids, batch = step.to_device(self.cache.block_size, self.model.device)
            ids = host_ids if ids is None else ids
            self.g, self.ready["g"] = self.model.draft(x, ids, batch, self.cache), None

    def _logits(self, src: str, rows: torch.Tensor) -> torch.Tensor:
        """float32 [R, V] over rows (a device index) of "hidden" or "g"."""
        ready = self.ready.get(src)
        if ready is not None:
            return ready[rows]
        x, head = (self.hidden, self.model.head) if src == "hidden" else (self.g, self.model.mtp[0].head)
        return head(x[rows]).float()

    @torch.inference_mode()
    def target(self, step: Step) -> torch.Tensor:
        """The main model over `step` -> hidden [T, D] (kept as "hidden")."""
        with self._op(TARGET, step_ints(step)):
            self._target(step)
        return self.hidden

    @torch.inference_mode()
    def logits(self, src: str, rows: list[int]) -> torch.Tensor:
        """float32 [R, V]: the main head over hidden rows, the MTP layer's over g or store rows."""
        with self._op(LOGITS, [SOURCES.index(src), *rows]):
            if src == "store":
                return self.model.mtp[0].head(self._rows(src, rows)).float()
            x = self.hidden if src == "hidden" else self.g
            return self._logits(src, to_device(rows, torch.int64, x.device))

    @torch.inference_mode()
    def draft(self, src: str, rows: list[int], step: Step) -> torch.Tensor:
        """The MTP layer over rows of `src` and step's tokens at step's positions -> g [N, D]."""
        with self._op(DRAFT, [SOURCES.index(src), len(rows), *rows, *step_ints(step)]):
            self._draft(self._rows(src, rows), step)
        return self.g

    @torch.inference_mode()
    def keep(self, seq_ids: list[int], rows: list[int], at: list[int]) -> None:
        """store = {seq_ids[i]: g[rows[i]]} and tokens = {seq_ids[i]: its greedy draft of the token
        at index at[i]} (rows[i] == -1: their current entries); others dropped."""
        with self._op(KEEP, [len(seq_ids), *seq_ids, *rows, *at]):
            new = [(i, r, a) for i, r, a in zip(seq_ids, rows, at, strict=True) if r >= 0]
            if new:
                self.evacuate()
            store = {
                i: self.store[i] for i, r in zip(seq_ids, rows, strict=True) if r < 0 and i in self.store
            }
            tokens = {i: self.tokens[i] for i in store if i in self.tokens}
            if new:
                index = to_device([r for _, r, _ in new], torch.int64, self.g.device)
                top = self.pick(self._logits("g", index), [i for i, _, _ in new], [a for *_, a in new])
                for j, (i, r, _) in enumerate(new):
                    store[i], tokens[i] = self.g[r].clone(), top[j]
            self.store, self.tokens = store, tokens

    @torch.inference_mode()
    def chain(
        self, seq_ids: list[int], ks: list[int], base: Step, k: int = 0, want_logits: bool = True
    ) -> tuple[list[list[int]], list[int], torch.Tensor | None, bool]:
        """One greedy speculative step of the decode-shaped `base` (sequence i: its last token t_{n-1}
        after ctx_lens[i] = n - 1 cached ones): k_i - 1 draft steps chained on the device from its
        stored (g, d_0), then the verify of [t_{n-1}, d_0..d_{k_i - 1}] (k_i + 1 rows). One host
        sync. Returns (each sequence's drafts, the target's argmax of every verified row, its
        logits float32 [T, V] or None, refreshed). When every k_i is the speculation's `k` and no
        logits are wanted it runs as one ChainGraphs replay, refresh included (refreshed: the
        sequences' next states are set, their keep is -1); else "hidden" holds the verify's
        hidden states for the refresh."""
        mirrored = self.send is not None  # the op's integers are only for the other ranks
        ints = [len(seq_ids), k, int(want_logits), *seq_ids, *ks, *step_ints(base)] if mirrored else []
        with self._op(CHAIN, ints):
            graphs = None if want_logits or set(ks) != {k} else self._chain_graphs(k, len(ks))
            if graphs is not None:
                return *self._run_chain(graphs, seq_ids, base), None, True
            self.evacuate()
            dev, ctx, tables = self.model.device, base.ctx_lens, base.block_tables
            flat, at = self._chain(seq_ids, ks, base)  # [B + drafts] int64: lasts, then d_j by j
            index = [r for i, rows in enumerate(at) for r in (i, *rows)]  # [T] rows of flat
            self._target(rows_step(list(ctx), ks, list(tables)), flat[to_device(index, torch.int64, dev)])
            logits = self._logits("hidden", torch.arange(len(index), device=dev))  # [T, V]
            host = to_host(torch.cat([flat, logits.argmax(dim=-1)]))  # the step's one sync
        drafts = [[host[r] for r in rows] for rows in at]
        return drafts, host[len(flat) :], logits, False

    def _chain_graphs(self, k: int, num_seqs: int) -> ChainGraphs | None:
        """The ChainGraphs of K = k (made, and on a GPU captured, at first use: every rank at once,
        inside this op), when the runner has decode graphs and one bucket fits num_seqs."""
        graphs = self.chains.get(k)
        if graphs is None:
            graphs = self._make_chain(k)
            if graphs is not None:
                self.chains[k] = graphs
        return graphs if graphs is not None and graphs.can_run(num_seqs) else None

    def release_graphs(self) -> None:
        """Drop the ChainGraphs (ModelRunner.release_graphs: before the process group goes). Only
        the runner's end calls it: the sequences' states in their rows go with them."""
        self.chains, self.resident, self.resident_in = {}, (), None

    @torch.inference_mode()
    def prepare(self, k: int) -> None:
        """Make the ChainGraphs of K = k now (captured on a GPU: every rank at once, in this op)."""
        with self._op(PREPARE, [k]):
            self._chain_graphs(k, 0)

    def _make_chain(self, k: int) -> ChainGraphs | None:
        """None without decode graphs that keep hidden states, or without a bucket whose k + 1 rows
        per sequence fit the largest decode bucket."""
        decode = self.runner.graphs
        if decode is None or getattr(decode, "hidden", None) is None or k + 1 > self.cache.block_size:
            return None
        buckets = [b for b in decode.buckets if b * (k + 1) <= decode.max_bs]  # the verify's rows fit
        if not buckets:
            return None
        graphs = ChainGraphs(
            self.model, self.cache, buckets, decode.inputs.max_blocks * self.cache.block_size, k
        )
        if decode.graphs:  # captured (CUDA): these too, into the same pool
            graphs.capture(decode.pool)
        return graphs

    def _run_chain(
        self, graphs: ChainGraphs, seq_ids: list[int], base: Step
    ) -> tuple[list[list[int]], list[int]]:
        """`chain` as one ChainGraphs replay: (drafts, the target's argmax of every verified row)."""
        self._make_resident(graphs, seq_ids)
        out = graphs.run(list(base.token_ids), list(base.ctx_lens), list(base.block_tables))
        return split_out(to_host(out), graphs.k)

    def _make_resident(self, graphs: ChainGraphs, seq_ids: list[int]) -> None:
        """The states of seq_ids in rows 0.. of `graphs`, in that order (loaded when they are not)."""
        if tuple(seq_ids) != self.resident or graphs is not self.resident_in:
            self.evacuate()
            graphs.load(
                torch.stack([self.store[i] for i in seq_ids]), torch.stack([self.tokens[i] for i in seq_ids])
            )
            for i in seq_ids:
                del self.store[i], self.tokens[i]
            self.resident, self.resident_in = tuple(seq_ids), graphs

    @torch.inference_mode()
    def launch(
        self, seq_ids: list[int], k: int, tables: list, first: tuple[list[int], list[int]] | None
    ) -> Launched | None:
        """`chain`'s one-replay step, launched and its results on their way to the host, not waited
        for (overlap: spec/overlap.SpecOverlap.advance). `first`: the sequences' (last tokens, cached
        lengths); None: they follow the last launch (the same sequences, in the same rows), which
        left theirs on the device. One rank only; None where `chain` would not run one replay."""
        graphs = self._chain_graphs(k, len(seq_ids)) if self.send is None else None
        follows = tuple(seq_ids) == self.resident and graphs is self.resident_in
        if graphs is None or (first is None and not follows):
            return None
        if first is None:
            out = graphs.run_next(tables)
        else:
            self._make_resident(graphs, seq_ids)
            out = graphs.run(*first, tables)
        if out.device.type != "cuda":
            return Launched(out.clone(), None, k)  # the next step overwrites out
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True).copy_(out, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return Launched(host, done, k)

    def _chain(self, seq_ids: list[int], ks: list[int], base: Step) -> tuple[torch.Tensor, list[list[int]]]:
        """(flat [B + sum k] int64 on the device: base's token ids, then the drafts d_0 of every
        drafting sequence, d_1 of those with k > 1, ...; at[i]: where sequence i's d_j is in flat)."""
        dev, b = self.model.device, len(ks)
        active = [i for i in range(b) if ks[i] > 0]
        cols = [to_device(list(base.token_ids), torch.int64, dev)]
        at: list[list[int]] = [[] for _ in range(b)]
        if active:
            cols.append(torch.stack([self.tokens[seq_ids[i]] for i in active]))
            x = torch.stack([self.store[seq_ids[i]] for i in active])  # [N, D] each g at n - 2
        offset = b
        for j in range(max(ks, default=0)):
            if j:  # d_j from the MTP at position n - 2 + j over (g, d_{j-1})
                nxt = [i for i in active if ks[i] > j]
                sel = to_device([active.index(i) for i in nxt], torch.int64, dev)
                positions = [base.ctx_lens[i] - 1 + j for i in nxt]
                step = Step.of([[0]] * len(nxt), positions, [base.block_tables[i] for i in nxt])
                self._draft(x[sel], step, cols[-1][sel])
                logits = self._logits("g", torch.arange(len(nxt), device=dev))
                cols.append(
                    self.pick(logits, [seq_ids[i] for i in nxt], [base.ctx_lens[i] + 1 + j for i in nxt])
                )
                x, active = self.g, nxt
            for r, i in enumerate(active):
                at[i].append(offset + r)
            offset += len(active)
        return torch.cat(cols), at

    def apply(self, code: int, ints: list[int]) -> None:
        """Run an op rank 0 sent (the other ranks of a multi-rank artifact)."""
        if code == TARGET:
            self.target(step_of_ints(ints)[0])
        elif code == LOGITS:
            self.logits(SOURCES[ints[0]], ints[1:])
        elif code == DRAFT:
            n = ints[1]
            self.draft(SOURCES[ints[0]], ints[2 : 2 + n], step_of_ints(ints[2 + n :])[0])
        elif code == KEEP:
            n = ints[0]
            self.keep(ints[1 : 1 + n], ints[1 + n : 1 + 2 * n], ints[1 + 2 * n :])
        elif code == CHAIN:
            n, k, want = ints[:3]
            rest = ints[3:]
            self.chain(rest[:n], rest[n : 2 * n], step_of_ints(rest[2 * n :])[0], k, bool(want))
        elif code == PREPARE:
            self.prepare(ints[0])
        else:
            raise ValueError(f"unknown speculative op {code}")
