"""Strict artifact loading: check one rank's files and tensors against the manifest, then read,
hash and place them in one pass.

A rank reads only its own files (its `rank-XXXXX-of-YYYYY/` folder; rank 0 also the shared files
such as the tokenizer): the ranks of a multi-rank artifact load in parallel, each hashing and
reading its own slice. Each file is read once, by several threads when the manifest cuts it into
hashed pieces (else by one), and hashed as it is copied to the device (readpass.py); its tensors
are views of one allocation per file. The only
conversion at load time: non-FP8 floating tensors are cast to the compute dtype. FP8 weights stay
FP8; their block scales and the router's correction bias stay float32.

Two ways to load: `load_artifact` returns the tensors once they hold their values; `start_load`
returns them at once, at their final addresses (zero-filled), and reads in the background, so
that the caller can build the model and capture its CUDA graphs (which record addresses, not
values) while the bytes stream in; `PendingLoad.join` then checks the pass and gives the values.
The rule that makes that correct: a tensor that is not a plain view of its file's bytes (one cast
to the compute dtype, or one copied out because its offset is not VIEW_ALIGN-aligned) is a
*derived* tensor: allocated up front like the views, and recomputed in place, into the same
storage, by `join` (the graphs then read its right values). Whoever builds on a pending load's
tensors must compute nothing from their values before `join` (the model does not: it only keeps
them, layers.Weights).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from mlac.core.artifact import Manifest
from mlac.core.errors import MlacError
from mlac.core.files import FileEntry
from mlac.core.safetensors_io import SafetensorsFile, TensorInfo
from mlac.core.validity import check_artifact
from mlac.runtime.worker.readpass import FileRead, ReadPass, default_threads, read_files

KEEP_FLOAT32 = (".scale", ".gate_bias")  # tensor contract: float32 whatever the compute dtype
ROUTER = ".moe.gate"  # the router computes its logits in float32 (as transformers does)


@dataclass(frozen=True)
class LoadStats:
    """What the load did, for the caller to log ("verify+load: 30.1 GB in 2.4 s, 12.5 GB/s")."""

    bytes: int  # read from disk (and hashed, with verified)
    seconds: float  # the whole load: manifest, checks, read, hash, copy to the device
    threads: int
    verified: bool

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / max(self.seconds, 1e-9)

    def __str__(self) -> str:
        what = "verify+load" if self.verified else "load (sizes only)"
        return f"{what}: {self.bytes / 1e9:.3g} GB in {self.seconds:.3g} s, {self.gb_per_s:.3g} GB/s"


@dataclass(frozen=True)
class LoadedRank:
    manifest: Manifest
    rank: int
    tensors: dict[str, torch.Tensor]  # views of one allocation per file; a derived tensor has its own
    stats: LoadStats


def rank_files(manifest: Manifest, rank: int) -> list[FileEntry]:
    """The files rank `rank` reads: its own folder; rank 0 also every file outside the rank folders."""
    own = manifest.rank_dir(rank) + "/"
    shared = lambda path: not path.startswith("rank-")  # noqa: E731 (tokenizer/, cache/ of schema 1-2)
    return [f for f in manifest.files if f.path.startswith(own) or (rank == 0 and shared(f.path))]


def load_artifact(
    path: str | Path,
    rank: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    verify: bool = True,
    threads: int | None = None,
    chunk_bytes: int | None = None,
) -> LoadedRank:
    """Load rank `rank` of the artifact at `path`; raise MlacError on any mismatch with the manifest.

    Every file of the rank is checked for presence and size, and every tensor's name, shape and
    dtype against the manifest, before any data is read. Then one pass reads each file once with
    `threads` threads (default: readpass.default_threads, this node's CPUs over its ranks) in reads of `chunk_bytes` (default 64 MiB), hashing
    what it copies to `device` (with `verify`); each file's tensors become views of one uint8
    allocation per file (see readpass.py), but for the derived ones (cast to the compute dtype, or
    at an unaligned offset), each a new allocation of its own (place_tensors).
    """
    start = time.perf_counter()
    plan = _plan_rank(path, rank, device, verify, threads)
    reads = [_read(plan, f, _finish(plan.headers.get(f.path), dtype)) for f in plan.files]
    done = read_files(reads, plan.device, verify, plan.threads, chunk_bytes)
    tensors = {name: t for rel in sorted(done.results) for name, t in done.results[rel].items()}
    stats = LoadStats(done.bytes_read, time.perf_counter() - start, plan.threads, verify)
    return LoadedRank(plan.manifest, rank, tensors, stats)


@dataclass(frozen=True)
class _RankPlan:
    """What a rank's load reads, checked against the manifest before any data is read."""

    root: Path
    manifest: Manifest
    files: list[FileEntry]  # the rank's files (rank_files)
    headers: dict[str, SafetensorsFile]  # rel -> header, for the files that hold tensors
    device: torch.device
    threads: int


def _plan_rank(
    path: str | Path, rank: int, device: torch.device | str, verify: bool, threads: int | None
) -> _RankPlan:
    """Every check of load_artifact that reads no tensor data (manifest identity, rank, files and
    sizes, headers against the manifest) and the reader thread count."""
    root, device = Path(path), torch.device(device)
    # the one check of what a valid artifact is (core/validity.py, as `mlac verify`), for this rank's
    # files: everything but their bytes, which the read pass hashes as it reads them
    checked = check_artifact(root, ranks=[rank], hashes=False, identity_required=verify)
    manifest = checked.manifest
    headers = {rel: h for rel, h in checked.headers.items() if rel.startswith(manifest.rank_dir(rank) + "/")}
    if threads is None:  # the ranks of this node load at once (one per GPU) and share its cores
        gpus = torch.cuda.device_count() if device.type == "cuda" else 1
        threads = default_threads(local_ranks=min(manifest.plan.world_size, max(1, gpus)))
    return _RankPlan(root, manifest, rank_files(manifest, rank), headers, device, threads)


class PendingLoad:
    """A load running in the background (start_load). `tensors` are the rank's tensors at their
    final addresses, zero-filled at first, their values complete once `join` returns: build on
    them, compute nothing from them before. Exactly one of `join` or `cancel` must follow."""

    def __init__(
        self, plan: _RankPlan, rank: int, dtype: torch.dtype, verify: bool, chunk: int | None, start: float
    ):
        self.manifest, self.rank, self.verify = plan.manifest, rank, verify
        self._start = start  # perf_counter() when start_load began (its checks count as the load's)
        self.tensors: dict[str, torch.Tensor] = {}
        self._derived: list[tuple[torch.Tensor, torch.Tensor, TensorInfo]] = []  # (tensor, its bytes, info)
        reads = [self._allocate(plan, f, dtype) for f in plan.files]
        if plan.device.type == "cuda":
            torch.cuda.current_stream(plan.device).synchronize()  # NOTE: the zeros land before the reads
        self._pass = ReadPass(reads, plan.device, verify, plan.threads, chunk)
        self.threads = len(self._pass.lanes)
        self._pass.start()

    def _allocate(self, plan: _RankPlan, f: FileEntry, dtype: torch.dtype) -> FileRead:
        """File `f`'s read, into a zero-filled allocation of its size that its tensors view (a file
        without tensors: hashed only)."""
        header = plan.headers.get(f.path)
        if header is None:
            return _read(plan, f, None)
        dest = torch.zeros(f.size, dtype=torch.uint8, device=plan.device)
        views, derived = place_tensors(header, dest, dtype)
        self.tensors.update(views)
        self._derived += derived
        return _read(plan, f, _placed, dest)

    def join(self) -> LoadedRank:
        """Wait for the pass; raise its error (MlacError: a file short or modified; then nothing
        built on `tensors` may be used); else recompute the derived tensors in place and return
        the load (its seconds: from start_load to the last byte placed, derived tensors included)."""
        done = self._pass.join()
        fill_start = time.perf_counter()
        for tensor, raw, info in self._derived:
            fill_derived(tensor, raw, info)
        assert self._pass.finished_at is not None
        seconds = self._pass.finished_at - self._start + time.perf_counter() - fill_start
        stats = LoadStats(done.bytes_read, seconds, self.threads, self.verify)
        return LoadedRank(self.manifest, self.rank, self.tensors, stats)

    def cancel(self) -> None:
        """Stop the readers and wait for them (after a failure on the building side)."""
        self._pass.cancel()


def start_load(
    path: str | Path,
    rank: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    verify: bool = True,
    threads: int | None = None,
    chunk_bytes: int | None = None,
) -> PendingLoad:
    """load_artifact's checks (raised here, before anything is allocated), then every tensor
    allocated at its final address, zero-filled (so that a forward run before `join`, such as a
    CUDA-graph capture's warm-up, sees finite values), and the read pass started in the background.
    `device`: cpu or cuda (the pass's own destinations)."""
    start = time.perf_counter()
    plan = _plan_rank(path, rank, device, verify, threads)
    if plan.device.type not in ("cpu", "cuda"):
        raise MlacError(f"a background load runs on cpu or cuda, not {plan.device}: use load_artifact")
    return PendingLoad(plan, rank, dtype, verify, chunk_bytes, start)


def _read(plan: _RankPlan, f: FileEntry, finish, dest: torch.Tensor | None = None) -> FileRead:
    """The pass's read of manifest file `f` (checked by its pieces when it has them)."""
    return FileRead(plan.root / f.path, f.path, f.size, f.sha256, finish, dest, f.pieces)


def _placed(data: torch.Tensor) -> int:
    """A pending load's finish: its tensors are views made up front; nothing to return but the size."""
    return data.numel()


def _finish(header: SafetensorsFile | None, dtype: torch.dtype):
    """What the pass does with a tensor file's bytes (None: a file that holds no tensors)."""
    return None if header is None else partial(tensor_views, header, dtype=dtype)


VIEW_ALIGN = 16  # bytes: Triton specializes pointers on 16-byte alignment (vectorized loads)


def tensor_views(header: SafetensorsFile, data: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of one file from its bytes `data` (uint8 [file size], any device, every byte in
    place): place_tensors, with the derived tensors filled."""
    out, derived = place_tensors(header, data, dtype)
    for tensor, raw, info in derived:
        fill_derived(tensor, raw, info)
    return out


def place_tensors(
    header: SafetensorsFile, data: torch.Tensor, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor, TensorInfo]]]:
    """(tensors, derived) of one file over `data` (uint8 [file size], its bytes now or later),
    computing nothing from the bytes. A tensor is a view of `data`, unless it is cast to the
    compute dtype (to_compute_dtype) or its offset is not VIEW_ALIGN-aligned (the kernels' vector
    loads need aligned rows; mlac's writer aligns all but the odd sizes, see
    safetensors_io.aligned_order): such a derived tensor is a new zero-filled allocation, listed
    in `derived` as (tensor, its bytes [nbytes] in `data`, info) for fill_derived once the bytes are in."""
    out, derived = {}, []
    for name, info in header.tensors.items():
        raw = data[info.start : info.start + info.nbytes]
        target = compute_dtype(name, info.dtype, dtype)
        if info.start % VIEW_ALIGN == 0 and target == info.dtype:
            out[name] = raw.view(info.dtype).view(info.shape)
        else:
            out[name] = torch.zeros(info.shape, dtype=target, device=data.device)
            derived.append((out[name], raw, info))
    return out, derived


def fill_derived(tensor: torch.Tensor, raw: torch.Tensor, info: TensorInfo) -> None:
    """A derived tensor (place_tensors) recomputed in place, into its own storage, from its bytes."""
    if info.start % VIEW_ALIGN:
        raw = raw.clone()  # NOTE: the allocation is aligned, this offset is not (nor maybe the dtype's)
    tensor.copy_(raw.view(info.dtype).view(info.shape))  # the cast as to_compute_dtype's .to()


def to_compute_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The one load-time conversion: non-FP8 floating tensors (but scales and gate_bias) -> dtype;
    the router's weight -> float32, so that no step casts it."""
    target = compute_dtype(name, t.dtype, dtype)
    return t if target == t.dtype else t.to(target)


def compute_dtype(name: str, stored: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The dtype tensor `name`, stored as `stored`, has once loaded (to_compute_dtype's rule)."""
    if not stored.is_floating_point or stored.itemsize == 1 or name.endswith(KEEP_FLOAT32):
        return stored
    return torch.float32 if name.endswith(ROUTER) else dtype
