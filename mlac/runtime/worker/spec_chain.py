"""One greedy speculative step as ONE CUDA graph per batch-size bucket: K - 1 chained draft steps,
the verify, the acceptance count and the refresh, with nothing launched from Python between them.

The per-replay path (spec_exec.SpecExecutor.chain over DecodeGraphs and DraftGraphs) fills static
inputs and launches glue ops (argmax, gathers, copies) from the host around each of its K + 1
replays; on a small model that host work, not the GPU's, sets the step's time. Here the host writes
only what it knows, in one pinned buffer and ONE host-to-device copy (ChainInputs): per sequence
its last token t_{n-1}, its cached length c = n - 1 and its block table. Everything else follows
on the device. Rows are laid out step-major ("j-major"): row j * bs + i is sequence i's position
c_i + j, j = 0..K, so the verify's K + 1 rows per sequence are one [(K + 1) bs] decode-shaped batch
and draft step j's rows (position c_i + j - 1) are its slice j - 1: every replay's positions,
slots, sequence lengths and tables are views of one derivation.

    ids[0]    = t_{n-1}                      (host)
    ids[1]    = d_0, x = g                   (the state: the last step's refresh, below)
    ids[j+1]  = argmax head(g_j), g_j = MTP(x, ids[j]) at rows j - 1      j = 1..K-1
    hidden    = target(ids) over all rows; top = argmax head(hidden)      (the verify)
    a         = leading matches of ids[1..K] against top[0..K-1]          [bs]
    g'        = MTP(hidden, top) over all rows: the refresh; the pool entries at kept positions
                are final, those past them provisional (rewritten before they are read)
    state     = g'[a * bs + i], d_0' = argmax head(that)                  (the next step's input)
    out[i]    = [d_0..d_{K-1}, top_0..top_K] of sequence i                [bs, 2K + 1]: one transfer
    nxt[:, i] = (top_a, c + a + 1): the next step's last token and cached length, so that the
                next step of the same sequences can start before the host reads out (run_next)

A sequence that stays in the batch keeps its state in the graph's rows (`g`, `tokens`), so a
steady batch needs nothing but the one copy in and the one copy out. The refresh is exact for a
sequence that goes on: it appended a + 1 tokens t_n..t_{n+a} = top_0..top_a, so its MTP entries at
n - 1 .. n - 1 + a are those of the host-side refresh and its new state is row a's. Padding rows
(bs > B) decode position j of the cache's scratch block. A bucket that was not captured (CPU)
runs the same body eagerly.
"""

from __future__ import annotations

import torch

from mlac.core.errors import MlacError
from mlac.runtime.kvcache.batch import ForwardBatch
from mlac.runtime.kvcache.paged import PagedKVCache
from mlac.runtime.model.model import DeepseekModel
from mlac.runtime.worker.graphs import capture_buckets, pick_bucket


class ChainInputs:
    """The host's part of a chain step for up to `max_bs` sequences of up to `max_blocks` blocks, as
    one flat int64 buffer (pinned on CUDA): [width, last tokens [bs], cached lengths [bs], block
    tables [bs, width] packed], `width` the step's longest table. Only that prefix is copied to the
    device, in one go: a step copies what its tables hold, not max_blocks per row."""

    def __init__(self, max_bs: int, max_blocks: int, cache: PagedKVCache, device: torch.device):
        self.max_blocks, self.scratch = max_blocks, cache.scratch_block
        pin, size = device.type == "cuda", 1 + 2 * max_bs + max_bs * max_blocks
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self.dev = torch.zeros(size, dtype=torch.int64, device=device)
        self.copied = torch.cuda.Event() if pin else None  # the last host-to-device copy
        self.fill([0], [0], [[self.scratch]], max_bs)  # every row a padding row

    def fill(self, last: list[int], ctx: list[int], tables: list, bs: int) -> None:
        """Sequence i's (last token, cached length, block table) as row i < B; rows B..bs padding
        (token 0, nothing cached, the scratch block)."""
        width = max(len(t) for t in tables)
        if width > self.max_blocks:
            raise MlacError(f"a sequence of {width} blocks is longer than the graphs' {self.max_blocks}")
        pad = bs - len(last)
        flat = [width, *last, *[0] * pad, *ctx, *[0] * pad]
        for t in tables:
            flat += [*t, *[0] * (width - len(t))]
        flat += [self.scratch, *[0] * (width - 1)] * pad
        if self.copied is not None:
            self.copied.synchronize()  # the host buffer is free again once its last copy is done
        n = len(flat)
        self.host[:n] = torch.tensor(flat, dtype=torch.int64)
        self.dev[:n].copy_(self.host[:n], non_blocking=True)  # the step's one copy in
        if self.copied is not None:
            self.copied.record()

    def follow(self, nxt: torch.Tensor, bs: int) -> None:
        """Rows [0, N) take their last tokens and cached lengths from nxt [2, N] on the device (a
        step that follows the last one: ChainGraphs.nxt), over what `fill` wrote (stream order)."""
        n = nxt.shape[1]
        self.dev[1 : 1 + n].copy_(nxt[0])
        self.dev[1 + bs : 1 + bs + n].copy_(nxt[1])

    def unpack(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(last tokens [bs], cached lengths [bs], block tables [bs, max_blocks]) on the device, from
        the packed prefix (columns past a table's width repeat its last column: never read)."""
        dev = self.dev
        width = dev[0]
        cols = torch.minimum(torch.arange(self.max_blocks, device=dev.device), width - 1)  # [W]
        index = 1 + 2 * bs + torch.arange(bs, device=dev.device)[:, None] * width + cols[None, :]
        return dev[1 : 1 + bs], dev[1 + bs : 1 + 2 * bs], dev[index]


def chain_batches(
    inputs: ChainInputs, bs: int, k: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, list]:
    """(ids [bs] of t_{n-1}, cached lengths [bs], [ForwardBatch of all (k + 1) bs rows, then of row
    block j = 0..k - 1]) from the inputs' first bs rows (module doc: row j * bs + i is position
    c_i + j)."""
    last, ctx, tab = inputs.unpack(bs)  # [bs], [bs], [bs, W]
    dev = tab.device
    steps = torch.arange(k + 1, device=dev)[:, None]  # [k + 1, 1]
    positions = (ctx[None, :] + steps).reshape(-1)  # [R] j-major
    tables = tab.repeat(k + 1, 1)  # [R, W]
    blocks = tables.gather(1, (positions // block_size)[:, None])[:, 0]
    slots = blocks * block_size + positions % block_size
    tables, seq_lens = tables.to(torch.int32), (positions + 1).to(torch.int32)
    cu = torch.arange((k + 1) * bs + 1, dtype=torch.int32, device=dev)
    none = torch.zeros(0, dtype=torch.int64, device=dev)

    def rows(a: int, b: int) -> ForwardBatch:
        return ForwardBatch(
            is_decode=True, q_lens=(1,) * (b - a), ctx_lens=(0,) * (b - a), positions=positions[a:b],
            slots=slots[a:b], block_tables=tables[a:b], seq_lens=seq_lens[a:b], cu_seqlens_q=cu[: b - a + 1],
            cu_seqlens_kv=cu[: b - a + 1], kv_slots=none,
        )  # fmt: skip

    return last, ctx, [rows(0, (k + 1) * bs), *[rows(j * bs, (j + 1) * bs) for j in range(k)]]


def accepted(drafts: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """drafts [K, B], the target's argmax top [K + 1, B] -> [B] int64: how many leading drafts
    equal the target's argmax (spec/sampling.accept_greedy's a, on the device)."""
    match = (drafts == top[: drafts.shape[0]]).to(torch.int64)
    return match.cumprod(dim=0).sum(dim=0)


class ChainGraphs:
    """One captured greedy speculative step of K drafts per bucket; its state rows (`g`, `tokens`)
    hold each sequence's MTP output at n - 2 and its draft d_0 between steps."""

    def __init__(
        self, model: DeepseekModel, cache: PagedKVCache, buckets: list[int], max_context: int, k: int
    ):
        if not buckets or k < 1 or k + 1 > cache.block_size:
            raise MlacError(
                f"chain graphs: buckets {buckets}, K = {k} (1 <= K < block size {cache.block_size})"
            )
        self.model, self.cache, self.buckets, self.k = model, cache, list(buckets), k
        device, max_bs, d = model.device, buckets[-1], model.config.hidden_size
        self.inputs = ChainInputs(max_bs, -(-max_context // cache.block_size), cache, device)
        self.g = torch.zeros(max_bs, d, dtype=model.dtype, device=device)  # [bs, D] the state
        self.tokens = torch.zeros(max_bs, dtype=torch.int64, device=device)  # [bs] each d_0
        self.out = torch.zeros(max_bs, 2 * k + 1, dtype=torch.int64, device=device)
        # [2, bs]: each sequence's next last token t_{n+a} and cached length n + a, as accepted
        self.nxt = torch.zeros(2, max_bs, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    @property
    def max_bs(self) -> int:
        return self.buckets[-1]

    def pick(self, g: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """Greedy drafts [N] int64 from MTP outputs g [N, D]: each the draft of the token at index
        at[N] of its sequence (the argmax of the MTP head; the tests' oracle replaces it)."""
        return self.model.mtp[0].head(g).float().argmax(dim=-1)

    def _step(self, bs: int) -> None:
        k, model, cache = self.k, self.model, self.cache
        last, ctx, (every, *blocks) = chain_batches(self.inputs, bs, k, cache.block_size)  # ctx: n - 1
        cols, x = [last, self.tokens[:bs]], self.g[:bs]
        for j in range(1, k):  # d_j (token n + j) from the MTP at position n - 2 + j over (g, d_{j-1})
            x = model.draft(x, cols[j], blocks[j - 1], cache)  # [bs, D]
            cols.append(self.pick(x, ctx + 1 + j))
        ids = torch.cat(cols)  # [(k + 1) bs] j-major
        hidden = model(ids, every, cache)  # the verify
        top = model.logits(hidden).argmax(dim=-1)  # [(k + 1) bs]
        a = accepted(ids[bs:].view(k, bs), top.view(k + 1, bs))  # [bs]
        g = model.draft(hidden, top, every, cache)  # the refresh, every row
        rows = a * bs + torch.arange(bs, device=a.device)
        self.g[:bs].copy_(g.index_select(0, rows))
        self.tokens[:bs].copy_(self.pick(self.g[:bs], ctx + a + 2))  # token n + a + 1
        self.out[:bs].copy_(torch.cat([ids[bs:].view(k, bs), top.view(k + 1, bs)]).t())
        self.nxt[0, :bs].copy_(top.view(k + 1, bs).gather(0, a[None])[0])
        self.nxt[1, :bs].copy_(ctx + a + 1)

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Capture every bucket, largest first, into one pool (`pool`: share another's). It runs
        padding rows only: call it before any state is loaded."""
        self.graphs, self.pool = capture_buckets(self.buckets, self._step, pool)

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_bs

    def load(self, g: torch.Tensor, tokens: torch.Tensor) -> None:
        """State rows [0, N) = g [N, D] and d_0 tokens [N] (a batch that differs from the last)."""
        self.g[: len(g)].copy_(g)
        self.tokens[: len(tokens)].copy_(tokens)

    def state(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of state rows [0, n): (g [n, D], d_0 [n]) (before another batch's load)."""
        return self.g[:n].clone(), self.tokens[:n].clone()

    @torch.inference_mode()
    def run(self, last: list[int], ctx: list[int], tables: list) -> torch.Tensor:
        """One step of the B sequences whose state is in rows [0, B): last tokens, cached lengths
        (n - 1) and block tables -> out [B, 2K + 1] int64 on the device (drafts d_0..d_{K-1}, the
        target's argmax at the K + 1 verified positions); the state rows advance."""
        n = len(last)
        bs = pick_bucket(self.buckets, n)
        self.inputs.fill(last, ctx, tables, bs)
        return self._replay(n, bs)

    @torch.inference_mode()
    def run_next(self, tables: list) -> torch.Tensor:
        """`run` of the next step of the same B sequences in the same rows, launched before the host
        has read this one's results: their last tokens and cached lengths come from `nxt`, on the
        device. `tables`: blocks for the worst case (K + 1 accepted now, then K + 1 positions)."""
        n = len(tables)
        bs = pick_bucket(self.buckets, n)
        self.inputs.fill([0] * n, [0] * n, tables, bs)
        self.inputs.follow(self.nxt[:, :n], bs)
        return self._replay(n, bs)

    def _replay(self, n: int, bs: int) -> torch.Tensor:
        graph = self.graphs.get(bs)
        if graph is not None:
            graph.replay()
        else:
            self._step(bs)
        return self.out[:n]
