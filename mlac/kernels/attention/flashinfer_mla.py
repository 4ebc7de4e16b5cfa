"""FlashInfer's MLA paged attention (BatchMLAPagedAttentionWrapper) over mlac's latent pool: the
absorbed decode's attention in place of mla_decode where RuntimeOptions.attention_backend is
"flashinfer" (runtime/worker/attention_backend.py plans it, attention.decode_absorbed runs it).

The pool is mlac's own, not copied: a layer's [blocks, page, C + R] latents are FlashInfer's ckv
[blocks, page, C] and kpe [blocks, page, R] as two strided views. Each row's page list is its row
of mlac's block table, as it is (`page_layout`):

    kv_indptr [B + 1] = b · W        W: the table's width; row b's page slots start at b · W
    kv_indices [B · W] = table [B, W], flattened
    kv_len [B] = seq_lens

FlashInfer's MLA kernels read token p of row b from page kv_indices[kv_indptr[b] + p // page], for
p < kv_len[b] only: a row owns W page slots and uses the first ceil(kv_len / page), so the padding of
a table row is never read. Blocks that several rows share (a cached prefix of the radix tree) need
nothing of their own: their ids appear in each sharer's row. HAZARD: that bound is what FlashInfer
0.6's mla.cuh and mla_hopper.cuh do ("packed_kv_bound"), not a documented promise; `paged_mla_ref`
is its definition, and the GPU tests compare the tokens with mlac's kernel over tables wider than
the rows use.

`plan()` (host work: FlashInfer splits the rows' KV over the SMs and copies that schedule to the
device from a pinned buffer) runs once per step, before any layer runs; every layer's `run()` reads
the same plan. A CUDA graph captures `run()` only: a wrapper made with `rows` has fixed index buffers,
and is planned again before each replay (graphs.DecodeGraphs).

Compiled modules: FlashInfer JIT-compiles each module (its CUDA sources, nvcc, ninja) into its
workspace, FLASHINFER_WORKSPACE_BASE (read when flashinfer is imported; `point_flashinfer_at`
re-points an imported one). `mlac prepare` stores the built libraries (`workspace_modules`) in the
artifact's kernel-cache unit; at start they are copied into a fresh workspace (worker/kernel_cache.py).
`import_flashinfer` makes FlashInfer load a module already built in its workspace as it is, without
running its build (FlashInfer reruns ninja on every load, which would rebuild a copied module whose
object files and build.ninja are not there): it points FlashInfer's prebuilt-module folder at its
JIT folder. HAZARD: a library left half-written in the workspace by a killed build would be loaded.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from mlac.core.errors import MlacError

WORKSPACE_ENV = "FLASHINFER_WORKSPACE_BASE"
WORKSPACE_BYTES = 128 << 20  # the float workspace (split-KV partials): FlashInfer's recommended size


def import_flashinfer():
    """The flashinfer module, with modules built in its workspace loaded without a rebuild
    (module docstring). MlacError (one line) where it does not import."""
    try:
        import flashinfer
        from flashinfer.jit import env as jit_env
    except Exception as e:  # noqa: BLE001  (a broken install: an ImportError, an OSError of a library, ...)
        lines = str(e).strip().splitlines() or [""]
        raise MlacError(
            f"--attention-backend flashinfer: flashinfer does not import ({type(e).__name__}: {lines[0][:200]})"
        ) from None
    jit_env.FLASHINFER_AOT_DIR = jit_env.FLASHINFER_JIT_DIR
    return flashinfer


def point_flashinfer_at(base: Path) -> None:
    """FlashInfer's workspace is `base` for every later module build or load of this process (and of
    the processes it starts): the environment variable, and flashinfer.jit.env where flashinfer is
    imported (it reads the variable once, at import)."""
    os.environ[WORKSPACE_ENV] = str(base)
    env = sys.modules.get("flashinfer.jit.env")
    if env is None:
        return
    cache = Path(base) / ".cache" / "flashinfer"
    workspace = cache / env.FLASHINFER_WORKSPACE_DIR.relative_to(env.FLASHINFER_CACHE_DIR)  # <version>/<arch>
    env.FLASHINFER_BASE_DIR, env.FLASHINFER_CACHE_DIR = Path(base), cache
    env.FLASHINFER_WORKSPACE_DIR = workspace
    env.FLASHINFER_JIT_DIR, env.FLASHINFER_GEN_SRC_DIR = workspace / "cached_ops", workspace / "generated"
    env.FLASHINFER_AOT_DIR = env.FLASHINFER_JIT_DIR
    workspace.mkdir(parents=True, exist_ok=True)


def workspace_modules(base: Path) -> list[str]:
    """The built module libraries under FlashInfer workspace `base`, as POSIX paths relative to it
    (`.cache/flashinfer/<version>/<arch>/cached_ops/<name>/<name>.so`), sorted. Object files, build
    files and generated sources are left out: loading a module needs its library alone."""
    base = Path(base)
    return sorted(
        p.relative_to(base).as_posix()
        for p in base.rglob("*.so")
        if p.is_file()
        and not p.is_symlink()
        and p.parent.name == p.stem
        and p.parent.parent.name == "cached_ops"
    )


def jit_modules() -> set[str]:
    """The names of the modules built in the current workspace of this process's flashinfer."""
    from flashinfer.jit import env as jit_env

    return {p.stem for p in jit_env.FLASHINFER_JIT_DIR.glob("*/*.so") if p.parent.name == p.stem}


# ---- the paged layout and its reference ---------------------------------------------------------


def page_layout(
    tables: torch.Tensor, seq_lens: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mlac's block tables [B, W] int32 (on the pool's device) and the rows' lengths [B] (host) ->
    FlashInfer's (kv_indptr [B + 1] int32 host, kv_indices [B · W] int32 on the tables' device,
    kv_len [B] int32 host): row b's pages from b · W (module docstring). kv_indices is a view of the
    tables when they are contiguous, else one copy."""
    if tables.dim() != 2 or tables.dtype != torch.int32:
        raise MlacError(f"page_layout: tables must be [B, W] int32, got {tables.dtype}{tuple(tables.shape)}")
    b, w = tables.shape
    if len(seq_lens) != b or any(n < 1 for n in seq_lens):
        raise MlacError(f"page_layout: {len(seq_lens)} lengths for {b} rows (each >= 1)")
    indptr = torch.arange(b + 1, dtype=torch.int32) * w
    return indptr, tables.reshape(-1), torch.tensor(list(seq_lens), dtype=torch.int32)


def paged_mla_ref(
    q_lat: torch.Tensor,  # [B, H, C]
    q_rope: torch.Tensor,  # [B, H, R]
    pool: torch.Tensor,  # [blocks, page, C + R]
    kv_indptr: torch.Tensor,  # [B + 1]
    kv_indices: torch.Tensor,  # [kv_indptr[-1]]
    kv_len: torch.Tensor,  # [B]
    scale: float,
) -> torch.Tensor:  # [B, H, C] in q's dtype
    """Float32 MLA decode read through FlashInfer's paged layout, as its kernels read it: row b's
    token p from page kv_indices[kv_indptr[b] + p // page], p < kv_len[b]. The definition that
    PagedMLA computes; equal to mla_decode_ref over the block tables when page_layout is right."""
    c, page = q_lat.shape[-1], pool.shape[1]
    out = []
    for b in range(q_lat.shape[0]):
        n = int(kv_len[b])
        start = int(kv_indptr[b])
        pages = kv_indices[start : start + -(-n // page)].long().cpu()
        kv = pool[pages].reshape(-1, pool.shape[-1])[:n].float()  # [n, C + R]
        q = torch.cat([q_lat[b], q_rope[b]], dim=-1).float()  # [H, C + R]
        p = torch.softmax(q @ kv.T * scale, dim=-1)  # [H, n]
        out.append(p @ kv[:, :c])
    return torch.stack(out).to(q_lat.dtype)


# ---- the wrapper ------------------------------------------------------------------------------------


class PagedMLA:
    """One FlashInfer MLA wrapper over mlac's pools: planned once per step (`plan`), run by every
    layer (`run`). `rows` given: CUDA-graph mode for a bucket of exactly that many rows, its page ids
    in the fixed int32 buffer `indices` (as many as it holds: rows · the widest table); None: any
    batch (eager steps). `workspace` (FlashInfer's float workspace) and `indices` may be shared by
    the wrappers of one runner: one step runs at a time, and each plan rewrites the page ids before
    its step. Each wrapper holds FlashInfer's own int workspace (the plan's schedule): 8 MiB on the
    device and 8 MiB pinned on the host."""

    def __init__(
        self,
        workspace: torch.Tensor,
        heads: int,
        kv_lora: int,
        rope: int,
        page: int,
        scale: float,
        dtype: torch.dtype,
        rows: int | None = None,
        indices: torch.Tensor | None = None,
    ):
        fi = import_flashinfer()
        self.heads, self.kv_lora, self.rope, self.page = heads, kv_lora, rope, page
        self.scale, self.dtype = scale, dtype
        self.rows, self.capacity = rows, 0 if indices is None else indices.numel()
        dev = workspace.device
        if rows is None:
            self.wrapper = fi.mla.BatchMLAPagedAttentionWrapper(workspace, backend="auto")
        else:  # fixed buffers: a captured run() reads kv_indices from this address (the others: plan only)
            if indices is None or indices.dtype != torch.int32 or indices.dim() != 1:
                raise MlacError("PagedMLA: a CUDA-graph wrapper needs its page-id buffer (1-D int32)")
            i32 = dict(dtype=torch.int32, device=dev)
            bufs = dict(qo_indptr=torch.zeros(rows + 1, **i32), kv_indptr=torch.zeros(rows + 1, **i32),
                        kv_indices=indices, kv_len_arr=torch.ones(rows, **i32))  # fmt: skip
            self.wrapper = fi.mla.BatchMLAPagedAttentionWrapper(
                workspace, use_cuda_graph=True, backend="auto", **bufs
            )
        # the last plan's copy from the pinned buffer: the next plan rewrites that buffer only after it
        self.planned = torch.cuda.Event() if dev.type == "cuda" else None

    def plan(self, tables: torch.Tensor, seq_lens: Sequence[int]) -> None:
        """Plan a step of B rows: tables [B, W] int32 on the device (each row's block ids, padded;
        the device copies that filled them are stream-ordered before this), seq_lens [B] host ints
        (the new token included). Host work; never inside a CUDA-graph capture."""
        b, w = tables.shape
        if self.rows is not None and (b != self.rows or b * w > self.capacity):
            raise MlacError(f"PagedMLA: a step of {b} rows x {w} pages for a bucket of {self.rows} rows "
                            f"and {self.capacity} page ids")  # fmt: skip
        if max(seq_lens) > w * self.page:
            raise MlacError(f"PagedMLA: a row of {max(seq_lens)} tokens in {w} pages of {self.page}")
        if self.planned is not None:
            self.planned.synchronize()
        indptr, indices, kv_len = page_layout(tables, seq_lens)
        qo_indptr = torch.arange(b + 1, dtype=torch.int32)  # one query row per row
        self.wrapper.plan(qo_indptr, indptr, indices, kv_len, self.heads, self.kv_lora, self.rope, self.page,
                          False, self.scale, self.dtype, self.dtype)  # fmt: skip
        if self.planned is not None:
            self.planned.record()

    def run(self, q_lat: torch.Tensor, q_rope: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
        """q_lat [B, H, C], q_rope [B, H, R] (last dims contiguous) and one layer's pool [blocks, page,
        C + R], all in the planned dtype -> o_lat [B, H, C] (new, contiguous), over the planned rows."""
        c = self.kv_lora
        if not (q_lat.dtype == q_rope.dtype == pool.dtype == self.dtype):
            raise MlacError(f"PagedMLA: q {q_lat.dtype}, q_rope {q_rope.dtype}, pool {pool.dtype}; "
                            f"planned for {self.dtype}")  # fmt: skip
        if q_lat.shape[1:] != (self.heads, c) or pool.shape[1:] != (self.page, c + self.rope):
            raise MlacError(f"PagedMLA: q_lat {tuple(q_lat.shape)}, pool {tuple(pool.shape)} for {self.heads} "
                            f"heads, C {c}, R {self.rope}, page {self.page}")  # fmt: skip
        ckv, kpe = pool[..., :c], pool[..., c:]  # [blocks, page, C] and [blocks, page, R]: views of the pool
        return self.wrapper.run(q_lat, q_rope, ckv, kpe)
