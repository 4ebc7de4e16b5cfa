"""CUDA graphs of the decode step, one per batch-size bucket.

A decode step launches hundreds of small kernels; launched one by one from Python they cost far
more than the GPU work itself. `DecodeGraphs` captures the whole step (model forward and LM head)
once per bucket of the ladder (passes/buckets.py), largest first, all in one memory pool, over
static input buffers. A decode batch of B sequences runs the graph of the smallest bucket >= B:
its inputs are copied into the buffers (three host-to-device copies), the graph is replayed, and
the first B rows of the static logits are the result.

Short extends run through the same graphs, one row per new token ("flattened"): token j of a
sequence with c cached tokens is a decode row at position c + j that attends over the first
c + j + 1 tokens of that sequence's blocks. Every row's latent is written to the cache (mla_prep)
before any row attends, so row j sees rows < j of its own step: causal attention, in the absorbed
form. A step of T <= max bucket new tokens (a prompt's suffix after a prefix-cache hit, a short
prompt, decode rows mixed with a prefill chunk) so replays a graph instead of launching the
eager forward's hundreds of kernels from Python; the logits of each sequence's last row are
gathered after the replay.

A sequence's rows in such a step attend grouped (mla_decode's grouped form: the rows of one
sequence share each KV tile's load, `row_groups`) where `prefer_row_groups` says so: a few buckets
(`grouped_buckets`) are captured a second time in that form, and a step replays the grouped graph
of the smallest of them that holds it exactly when some sequence runs more than one row. Pure
decode steps keep the per-row graphs (their kernels are tuned for one row per program).
`DecodeGraphs(row_groups=False)` captures no grouped graph (DP attention; tests compare the forms).

Only the largest bucket runs eagerly before its capture (`capture_buckets`, warm_once): it loads
every kernel and makes every lazily made buffer; a later bucket runs eagerly too only when its
capture meets a Triton kernel variant that is not loaded yet (V2-Lite on an H200: 7 eager runs of
26, the graphs phase 0.4-1.5 s shorter). Multi-rank captures run every bucket eagerly first: a rank
that fell back alone would run collectives that the others do not.

A decode step of more sequences than the largest bucket (max_running_requests above
--cuda-graph-max-bs) replays in pieces (`pieces`): max_bs sequences at a time, the rest padded to
its bucket (512 = 256 + 256; 300 = 256 + 44 in the bucket of 48), each piece's logits copied out
of the static output into one [B, V] tensor before the next piece's inputs are written (stream
order). Decode rows are independent: each attends over its own sequence's blocks, writes its own
KV slot, and routes its own token through the MoE; sampling runs on the whole [B, V] afterwards.
Each piece waits on the host for the previous piece's input copy (`DecodeInputs.fill`), not for
its replay. NOTE: the [B, V] float32 output lives outside the graph pool and the memory plan
(V2-Lite at B = 512: 210 MB); the eager step that such a batch ran before allocated it and all of
its activations besides (on 2xH100, V2-Lite bf16, that eager step cut the HTTP peak from 10,309
tok/s at --max-running-requests 256 to 4,037 at 512). Not in pieces, still eager:
steps of more than max_bs tokens with a prefill chunk (the MHA prefill form suits a long chunk
better than flattened rows, and its launches cost little next to its compute), scoring steps
(`every_token`), and speculative decoding's target steps (spec_exec reads the hidden states of one
replay: it asks `fits`, not `can_run`).

Padding rows (T..bucket) decode token 0 at position 0 of a one-token sequence whose only block is
the cache's scratch block (kvcache/paged.py): they read and write nothing a real sequence owns.

With the FlashInfer attention backend (attention_backend.py) each bucket has its own FlashInfer
wrapper, with fixed index buffers, that its graph's attention runs: planned (host work) for the
padding rows before the buckets are captured, and for the step's rows after its inputs are written
and before each replay. HAZARD: a captured run keeps the plan's launch geometry (FlashInfer's
cluster size, from the mean query rows per row: always one here) and workspace offsets (fixed
sizes); a replanned step changes only the workspace's contents. No grouped graphs then.

Every rank of a multi-rank artifact captures the same buckets in the same order, so the
collectives inside the graphs line up; every rank then replays the same bucket for each step.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import torch

from mlac.core.errors import MlacError
from mlac.kernels._triton import CaptureNeedsWarmup, triton
from mlac.kernels.attention.mla_decode_plan import decode_group_rows, prefer_row_groups, row_groups_host
from mlac.runtime.device_copy import to_device
from mlac.runtime.kvcache.batch import ForwardBatch
from mlac.runtime.kvcache.paged import PagedKVCache
from mlac.runtime.model.model import DeepseekModel
from mlac.runtime.step import Step
from mlac.runtime.worker.attention_backend import TRITON, AttentionBackend

log = logging.getLogger("mlac.runtime")


def pick_bucket(buckets: list[int], batch: int) -> int | None:
    """The smallest bucket >= batch (buckets ascending), None when the batch is above them all."""
    i = bisect.bisect_left(buckets, batch)
    return buckets[i] if i < len(buckets) else None


@contextmanager
def _refusing_new_kernels():
    """While active, a Triton launch on this thread whose variant is not in memory yet raises
    CaptureNeedsWarmup before Triton touches the GPU (its jit_cache_hook runs ahead of any compile
    or load); other threads' launches go on as before. A no-op without the hook (triton < 3.4)."""
    knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    if knobs is None or not hasattr(knobs, "jit_cache_hook"):
        yield
        return
    before, thread = knobs.jit_cache_hook, threading.get_ident()

    def hook(**kwargs):
        if threading.get_ident() == thread:
            raise CaptureNeedsWarmup(f"a Triton kernel variant not loaded yet: {kwargs.get('repr', '?')}")
        return before(**kwargs) if before is not None else None

    knobs.jit_cache_hook = hook
    try:
        yield
    finally:
        knobs.jit_cache_hook = before


def capture_buckets(
    buckets: list[int],
    step: Callable[[int], None],
    pool=None,
    timings: dict[str, float] | None = None,
    label: str = "",
    warm_once: bool = False,
) -> tuple[dict[int, torch.cuda.CUDAGraph], object]:
    """({bucket: graph}, pool): `step(bs)` captured for every bucket, largest first, into one memory
    pool (`pool`: another capture's, to share it). Each bucket runs once eagerly first (on padding
    rows), so that every kernel is compiled and loaded and every lazily made buffer exists before
    capture. `warm_once`: only the first (largest) bucket does; each later one is captured at once,
    and runs eagerly first only when its capture meets what only an eager run can make: a Triton
    kernel variant not loaded yet, or a buffer made on first use (CaptureNeedsWarmup; the capture
    is then dropped and taken again). An eager run of V2-Lite costs ~40 ms, most of it the
    Python of ~900 launches, and the later buckets rarely meet a new variant. Single-rank only: a
    rank that falls back runs collectives that the others would not.
    `timings`: adds the seconds of those eager runs (to their end on the GPU) to label + "eager_s"
    and of the captures (recording and instantiation, dropped ones included) to label +
    "capture_s" (start-up's phases), and counts the eager runs in label + "eager_runs".

    Other threads may run CUDA work meanwhile, on their own streams (the weights' load, see
    build.build_runner): the capture is thread-local ("thread_local" mode: their calls are not
    the capture's), its allocations alone go to the graphs' pool, and it waits for this thread's
    stream only, never the device (torch.cuda.graph would synchronize the device at each bucket:
    wait for the load's queued copies). NOTE: nor does it empty the allocator's cache: the eager
    steps' activations stay cached beside the pool, as the memory plan counts them (activations
    and the graph pool at once); torch.cuda.graph freed them only to hold the next step's."""
    graphs = {}
    stream = torch.cuda.Stream()  # captures run on a side stream, as torch.cuda.graph's do
    timings = {} if timings is None else timings
    eager, captured, runs = f"{label}eager_s", f"{label}capture_s", f"{label}eager_runs"
    timings.setdefault(runs, 0)

    def run_eagerly(bs: int) -> None:
        t0 = time.perf_counter()
        step(bs)
        torch.cuda.current_stream().synchronize()
        timings[eager] = timings.get(eager, 0.0) + time.perf_counter() - t0
        timings[runs] += 1

    def capture(bs: int, refuse_new_kernels: bool) -> torch.cuda.CUDAGraph:
        t0 = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    with _refusing_new_kernels() if refuse_new_kernels else nullcontext():
                        step(bs)
                finally:
                    with warnings.catch_warnings():
                        if refuse_new_kernels:  # a dropped capture may have recorded nothing
                            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
                        graph.capture_end()
        finally:
            torch.cuda.current_stream().wait_stream(stream)
            timings[captured] = timings.get(captured, 0.0) + time.perf_counter() - t0
        return graph

    for i, bs in enumerate(reversed(buckets)):
        graph = None
        if warm_once and i > 0:
            try:
                graph = capture(bs, refuse_new_kernels=True)
            except CaptureNeedsWarmup as e:
                log.debug("CUDA graph of %s%d dropped (%s): running it eagerly first", label, bs, e)
                graph = None  # dropped: part of a step was recorded
        if graph is None:
            run_eagerly(bs)
            graph = capture(bs, refuse_new_kernels=False)
        pool = graph.pool()
        graphs[bs] = graph
    torch.cuda.current_stream().synchronize()
    return graphs, pool


def grouped_buckets(buckets: list[int]) -> list[int]:
    """The buckets captured a second time in the grouped form: the powers of two from 8 on, and the
    largest bucket (none when that is 1: no step has two rows). Every grouped capture costs start-up
    time (all 19 multi-row buckets of the default ladder: /health 8.3 -> 10.0 s on an H200,
    benchmarks/e2e/serve_http.py's start-up), so a flattened step pads to the next of these few; its
    padding rows cost little next to the weights that a step of 8 or more tokens reads."""
    if buckets[-1] < 2:
        return []
    return sorted({b for b in buckets if b >= 8 and b & (b - 1) == 0} | {buckets[-1]})


class DecodeInputs:
    """The static inputs of the captured decode step for up to `max_bs` sequences of up to
    `max_blocks` blocks, and their pinned host mirrors (filled per step, copied in one go each).
    `group_rows`: the most rows of one sequence per group of the grouped form (`row_groups`)."""

    def __init__(
        self, max_bs: int, max_blocks: int, cache: PagedKVCache, device: torch.device, group_rows: int = 1
    ):
        self.max_bs, self.max_blocks, self.group_rows = max_bs, max_blocks, group_rows
        self.block_size, self.scratch = cache.block_size, cache.scratch_block
        pin = device.type == "cuda"
        # int64 rows: token ids, positions, slots; int32 rows: sequence lengths and the two rows of
        # mla_decode's row_groups (group sizes, group lengths); the block tables
        self.host64 = torch.zeros(3, max_bs, dtype=torch.int64, pin_memory=pin)
        self.host_lens = torch.zeros(3, max_bs, dtype=torch.int32, pin_memory=pin)
        self.host_tables = torch.zeros(max_bs, max_blocks, dtype=torch.int32, pin_memory=pin)
        self.dev64 = torch.zeros(3, max_bs, dtype=torch.int64, device=device)
        self.lens = torch.zeros(3, max_bs, dtype=torch.int32, device=device)
        self.seq_lens = self.lens[0]
        self.tables = torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=device)
        self.cu_seqlens = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.copied = torch.cuda.Event() if pin else None  # the last host-to-device copy
        self.fill(Step.of([[0]], [0], [[self.scratch]]), max_bs)  # every row a padding row

    def batch(self, bs: int, grouped: bool = False) -> tuple[torch.Tensor, ForwardBatch]:
        """(token ids [bs], ForwardBatch) over the first `bs` rows of the static buffers; `grouped`:
        with the row groups (the grouped attention form)."""
        ids, positions, slots = self.dev64[:, :bs]
        groups = self.lens[1:, :bs] if grouped else None  # [2, bs]
        none = torch.zeros(0, dtype=torch.int64, device=ids.device)
        return ids, ForwardBatch(
            is_decode=True, q_lens=(1,) * bs, ctx_lens=(0,) * bs, positions=positions, slots=slots,
            block_tables=self.tables[:bs], seq_lens=self.seq_lens[:bs],
            cu_seqlens_q=self.cu_seqlens[: bs + 1], cu_seqlens_kv=self.cu_seqlens[: bs + 1], kv_slots=none,
            row_groups=groups,
        )  # fmt: skip

    def fill(self, step: Step, bs: int, ids: torch.Tensor | None = None) -> None:
        """Write `step` (T <= bs new tokens, one row each: module docstring) into rows [0, bs);
        rows T..bs become padding. `ids` [T] int64 on the device: the token ids, copied on the
        device in place of step.token_ids (speculative decoding's chain: no host sync)."""
        step_rows, size = len(step.token_ids), self.block_size
        width = max(len(t) for t in step.block_tables)
        if width > self.max_blocks:
            raise MlacError(f"a sequence of {width} blocks is longer than the graphs' {self.max_blocks}")
        pad = bs - step_rows
        if self.copied is not None:
            self.copied.synchronize()  # the host mirrors are free again once their last copy is done
        if step.is_decode:  # the common case, one row per sequence
            positions, tables = list(step.ctx_lens), step.block_tables
        else:
            positions = [c + j for c, q in zip(step.ctx_lens, step.q_lens, strict=True) for j in range(q)]
            tables = [t for t, q in zip(step.block_tables, step.q_lens, strict=True) for _ in range(q)]
        slots = [t[p // size] * size + p % size for t, p in zip(tables, positions, strict=True)]
        # block tables: one padded row per sequence, repeated for its flattened rows (a 64-token
        # suffix over a 2,000-token prefix would otherwise build 64 rows of 130 ids in Python)
        seq_rows = torch.tensor(
            [list(t) + [0] * (width - len(t)) for t in step.block_tables], dtype=torch.int32
        )
        if not step.is_decode:
            seq_rows = seq_rows.repeat_interleave(torch.tensor(step.q_lens), dim=0)
        self.host64[:, :bs] = torch.tensor(
            [list(step.token_ids) + [0] * pad, positions + [0] * pad, slots + [self.scratch * size] * pad]
        )
        lead, kv_len = row_groups_host(step.ctx_lens, step.q_lens, self.group_rows, pad)
        lens = [p + 1 for p in positions] + [1] * pad
        self.row_lens, self.width = lens, width  # the rows' lengths and table width, for a backend's plan
        self.host_lens[:, :bs] = torch.tensor([lens, lead, kv_len], dtype=torch.int32)
        self.host_tables[:step_rows, :width] = seq_rows
        self.host_tables[step_rows:bs, :width] = 0
        self.host_tables[step_rows:bs, 0] = self.scratch  # padding rows: the scratch block
        # Columns past `width` keep stale block ids: the kernels read only the blocks of seq_len.
        self.dev64[:, :bs].copy_(self.host64[:, :bs], non_blocking=True)
        self.lens[:, :bs].copy_(self.host_lens[:, :bs], non_blocking=True)
        self.tables[:bs, :width].copy_(self.host_tables[:bs, :width], non_blocking=True)
        if ids is not None:
            self.dev64[0, :step_rows].copy_(ids)  # after the host copy, on the same stream
        if self.copied is not None:
            self.copied.record()


class DecodeGraphs:
    """One captured decode step per bucket; `run(step)` replays the right one."""

    def __init__(
        self,
        model: DeepseekModel,
        cache: PagedKVCache,
        buckets: list[int],
        max_context: int,
        keep_hidden: bool = False,
        row_groups: bool = True,
        attention: AttentionBackend = TRITON,
    ):
        """`row_groups`: capture the grouped form too where the model's heads group
        (decode_group_rows) and the backend runs it; False: every step per row. `attention`: the
        runner's attention backend (a FlashInfer wrapper per bucket, module docstring)."""
        if not buckets or buckets != sorted(set(buckets)) or buckets[0] < 1:
            raise MlacError(f"CUDA-graph buckets must be ascending positive sizes, got {buckets}")
        self.model, self.cache, self.buckets = model, cache, list(buckets)
        device = model.device
        max_blocks = -(-max_context // cache.block_size)
        self.n_heads = model.layers[0].attn.n_local_heads
        self.kv_dtype = cache.layers[0].dtype
        grouping = row_groups and attention.groups_rows
        self.group_rows = decode_group_rows(self.n_heads, device, self.kv_dtype) if grouping else 1
        self.inputs = DecodeInputs(buckets[-1], max_blocks, cache, device, self.group_rows)
        # bucket -> its attention backend's wrapper (FlashInfer's); None: mla_decode
        self.mla = attention.graph_wrappers(self.buckets, max_blocks)
        self.logits = torch.empty(buckets[-1], model.config.vocab_size, dtype=torch.float32, device=device)
        # keep_hidden: the final hidden states too (speculative decoding's MTP layer reads them)
        d = model.config.hidden_size
        self.hidden = torch.empty(buckets[-1], d, dtype=model.dtype, device=device) if keep_hidden else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.grouped_buckets = grouped_buckets(self.buckets) if self.group_rows > 1 else []
        self.grouped_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # grouped_buckets, grouped form
        self.pool = None
        self.timings: dict[str, float] = {}  # capture's phases (capture_buckets), start-up's record
        # capture_buckets: multi-rank captures warm every bucket (their collectives line up)
        self.warm_once = model.ctx.tp == 1

    @property
    def max_bs(self) -> int:
        return self.buckets[-1]

    def _step(self, bs: int, grouped: bool = False) -> None:
        ids, batch = self.inputs.batch(bs, grouped)
        mla = None if grouped else self.mla[bs]
        if mla is not None:  # planned already (capture, _replay): outside any capture
            batch = replace(batch, paged_mla=mla)
        hidden = self.model(ids, batch, self.cache)
        self.model.logits_into(hidden, self.logits[:bs])
        if self.hidden is not None:
            self.hidden[:bs].copy_(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one pool (capture_buckets); then, where rows
        group, the grouped buckets again in the grouped form, into the same pool."""
        warm_once = self.warm_once
        for bs, mla in self.mla.items():  # every row a padding row (DecodeInputs): one page each
            if mla is not None:
                mla.plan(self.inputs.tables[:bs, :1], [1] * bs)
        self.graphs, self.pool = capture_buckets(
            self.buckets, self._step, self.pool, self.timings, "", warm_once
        )
        if self.grouped_buckets:
            step = lambda bs: self._step(bs, grouped=True)  # noqa: E731
            self.grouped_graphs, self.pool = capture_buckets(
                self.grouped_buckets, step, self.pool, self.timings, "grouped_", warm_once
            )

    def grouped(self, step: Step) -> bool:
        """Whether `step` runs in the grouped form (module docstring)."""
        if not self.grouped_buckets or step.is_decode:  # decode: the common step, never grouped
            return False
        return prefer_row_groups(step.q_lens, self.n_heads, self.model.device, self.kv_dtype)

    def fits(self, step: Step) -> bool:
        """One replay takes `step`: at most max_bs new tokens, logits of each sequence's last."""
        return not step.every_token and len(step.token_ids) <= self.max_bs

    def can_run(self, step: Step) -> bool:
        """`step` fits one replay, or is a decode step of more sequences: it replays in pieces."""
        return self.fits(step) or step.is_decode

    def pieces(self, step: Step) -> list[list[int]]:
        """The sequences (step indices, ascending) of each replay of a decode step above max_bs:
        max_bs at a time, the rest padded to its bucket (512 = 256 + 256; 300 = 256 + 44 in 48)."""
        n, m = step.num_seqs, self.max_bs
        return [list(range(s, min(s + m, n))) for s in range(0, n, m)]

    @torch.inference_mode()
    def run(self, step: Step, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, V] float32 of the last new token of each of the step's B sequences (for a
        decode step that fits one replay a view of the static output: valid until the next
        replay). A bucket that was not captured (on CPU, where nothing is) runs the same padded
        step eagerly: the tests check the padding and the flattened rows that way. `ids`: the
        token ids on the device (fill). A decode step above max_bs replays in `pieces`."""
        return self._replay(step, ids) if self.fits(step) else self._run_pieces(step, ids)

    def _run_pieces(self, step: Step, ids: torch.Tensor | None) -> torch.Tensor:
        """A decode step too large for one replay, as one replay per piece (module docstring):
        each piece's logits are copied out before the next piece's inputs overwrite the buffers
        (stream order). Returns a fresh [B, V] float32 tensor (not a view of the static output)."""
        out = self.logits.new_empty(step.num_seqs, self.logits.shape[1])  # [B, V] float32
        for rows in self.pieces(step):
            if rows[-1] - rows[0] + 1 == len(rows):  # contiguous (always, but under DP attention)
                at = slice(rows[0], rows[-1] + 1)
            else:
                at = to_device(rows, torch.int64, out.device)
            out[at] = self._replay(step.select(rows), None if ids is None else ids[at])
        return out

    def _replay(self, step: Step, ids: torch.Tensor | None = None) -> torch.Tensor:
        """`run` of a step that fits one replay."""
        grouped = self.grouped(step)
        bs = pick_bucket(self.grouped_buckets if grouped else self.buckets, len(step.token_ids))
        self.inputs.fill(step, bs, ids)
        mla = None if grouped else self.mla[bs]
        if mla is not None:  # after the inputs' copies (stream order), before the replay
            mla.plan(self.inputs.tables[:bs, : self.inputs.width], self.inputs.row_lens)
        graph = (self.grouped_graphs if grouped else self.graphs).get(bs)
        if graph is not None:
            graph.replay()
        else:
            self._step(bs, grouped)
        if step.is_decode:
            return self.logits[: step.num_seqs]
        last = list(itertools.accumulate(step.q_lens, initial=-1))[1:]  # each sequence's last row
        return self.logits[to_device(last, torch.int64, self.logits.device)]
