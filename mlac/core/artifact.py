"""The artifact's on-disk contract: the manifest (pydantic, schema-versioned) and its paths.

Both sides read this file: the compiler writes a Manifest, the runtime loads and checks one.
Format documentation: artifacts/README.md. JSON Schema: artifacts/manifest.schema.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mlac.core.config import ModelConfig
from mlac.core.errors import MlacError
from mlac.core.hashing import PIECE_SIZE, FileHashes, hash_file, piece_count

SCHEMA_VERSION = 2  # what this mlac writes; 2: files may carry piece hashes (FileEntry.pieces)
READS = (1, 2)  # the schema versions this mlac loads
MANIFEST = "manifest.json"
IDENTITY = "manifest.sha256"  # the artifact's identity; `sha256sum -c manifest.sha256` checks it too
TOKENIZER_DIR = "tokenizer"


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SourceInfo(Frozen):
    """Where the artifact came from: enough to tell whether two artifacts share a source."""

    config_sha256: str
    index_sha256: str | None = None
    files: int
    bytes: int
    dtypes: list[str]  # dtypes of the source weight tensors, sorted
    mtp_layers: list[int] = []  # MTP layers found in the source (V3); Manifest.mtp: which were compiled
    mtp_tensors: int = 0


class MTPInfo(Frozen):
    """The MTP (NextN) layers compiled into the artifact, the draft of speculative decoding."""

    source_layers: list[int]  # their indices in the source (V3: num_hidden_layers + k)
    prefixes: list[str]  # their tensor names' prefixes, in order: "mtp.0", ...
    shared_embed: bool  # their embedding is the main `embed` (the source's copies were equal)
    shared_head: bool  # their head is the main `head`
    tensors: int  # tensors under the prefixes, per rank


class CompileOptions(Frozen):
    fp8: bool = False
    tp: int = 1
    ep: int = 1
    kv_cache_dtype: Literal["bf16", "fp8_e4m3", "fp8_e5m2"] = "bf16"
    accuracy_check: bool = True
    mtp: bool = True  # compile the checkpoint's MTP layers (when it has any); `--no-mtp` turns it off
    cuda_graph_max_bs: int = 256  # largest CUDA-graph decode bucket (1..4096, checked by the buckets pass)
    dp_attention: bool = False  # tp > 1: attention weights whole on every rank (runtime/dp_attention.py)


class PassRecord(Frozen):
    name: str
    params: dict[str, Any] = {}


class ParallelPlan(Frozen):
    tp: int = 1
    ep: int = 1
    # each rank runs attention for its own requests over its own KV cache (attention weights
    # whole on every rank); MLPs and MoE stay sharded over all ranks (runtime/dp_attention.py)
    dp_attention: bool = False

    @property
    def world_size(self) -> int:
        return self.tp


class KVCalibration(Frozen):
    """What the FP8 KV cache's scales were calibrated on (mlac/compiler/check/calibrate.py)."""

    text_sha256: str  # of the calibration text file's bytes
    tokens: int  # tokens run through the model (the text's first, at most calibrate.MAX_TOKENS)
    window: int  # tokens per window; each window is scored as its own sequence
    amax: list[float]  # per layer: max |value| of the cache entries [latent ‖ roped key] written


class Quantization(Frozen):
    scheme: Literal["none", "fp8-block"]
    fmt: Literal["e4m3"] | None = None
    block: tuple[int, int] | None = None
    scale_dtype: Literal["float32"] | None = None
    kept_source_blocks: bool = False  # True when FP8 blocks came from the checkpoint untouched
    tensors: int = 0  # how many weights are FP8
    # per layer, the FP8 KV cache's static scale (value = stored * scale); None: 1.0 for every layer
    kv_scales: list[float] | None = None
    kv_calibration: KVCalibration | None = None  # where kv_scales came from


class AccuracyReport(Frozen):
    """Logits of the compiled artifact against the unquantized source, on probe sequences."""

    status: Literal["measured", "skipped"]
    reason: str | None = None  # why it was skipped
    reference: str | None = None  # what the artifact was compared with
    probes: int = 0
    tokens_per_probe: int = 0
    rel_l2: float | None = None  # ‖compiled − ref‖ / ‖ref‖ over all probe logits
    max_abs: float | None = None
    top1_agreement: float | None = None  # fraction of positions with the same argmax
    # over the --calibration-text tokens (accuracy.py; None without calibration text):
    text_tokens: int | None = None  # calibration tokens scored (calibrate.text_tokens)
    text_window: int | None = None  # tokens per perplexity window (non-overlapping)
    source_perplexity: float | None = None  # the reference's (mlac.tools.evaluate.perplexity)
    artifact_perplexity: float | None = None  # the artifact's, with its KV-cache dtype and scales
    text_top1_agreement: float | None = None  # same argmax, over every position of the text
    kv_fp8_perplexity_cost: float | None = None  # FP8 KV cache: artifact ppl minus with an unquantized cache


class BucketPlan(Frozen):
    """CUDA-graph decode buckets and the per-rank memory plan, written by the buckets pass
    (mlac/passes/buckets.py, where every formula is documented) and read by the runtime to size
    its KV cache (mlac/runtime/worker/memory_plan.py). Byte counts are estimates except `weight_bytes`."""

    decode_batch_sizes: list[int]  # ascending; a decode batch is padded to the next one
    cuda_graph_max_bs: int
    weight_bytes: list[int]  # per rank: exact bytes of the rank's tensors as written
    kv_bytes_per_token: int  # per rank, all layers: num_hidden_layers * (kv_lora + rope) * itemsize
    activation_bytes: list[int]  # per bucket (aligned with decode_batch_sizes): peak of one decode step
    graph_pool_bytes: int  # the shared CUDA-graph pool: activation_bytes of the largest bucket
    prefill_tokens: int  # the chunked-prefill size the next field is planned for
    prefill_activation_bytes: int  # peak of one prefill step of prefill_tokens tokens
    safety_factor: float  # applied to every activation estimate


class TensorEntry(Frozen):
    file: str  # relative to the artifact root
    dtype: str  # safetensors dtype name: BF16, F32, F8_E4M3, ...
    shape: list[int]


class Pieces(Frozen):
    """A file's bytes cut into pieces [k*size, (k+1)*size) (the last one shorter), with the sha256
    of each: the loader and `verify` check a file with pieces piece by piece, on several threads."""

    size: int = Field(gt=0)  # bytes per piece (hashing.PIECE_SIZE when written)
    sha256: list[str]  # one per piece, in file order


class FileEntry(Frozen):
    """One file of the artifact. `sha256` is always the whole file's digest; a file longer than one
    piece also has `pieces` (schema_version 2), and those are what mlac checks (artifacts/README.md)."""

    path: str  # relative, POSIX
    size: int
    sha256: str
    pieces: Pieces | None = None

    @model_validator(mode="after")
    def _pieces_tile_the_file(self) -> FileEntry:
        p = self.pieces
        if p is not None and (self.size <= p.size or len(p.sha256) != piece_count(self.size, p.size)):
            raise ValueError(
                f"{self.path}: {len(p.sha256)} piece hashes for {self.size} bytes in pieces of {p.size} "
                f"(want {piece_count(self.size, p.size)}, and only for a file longer than one piece)"
            )
        return self

    @classmethod
    def of(cls, path: str, h: FileHashes) -> FileEntry:
        """The entry of a file with hashes `h` (pieces when it is longer than one piece)."""
        pieces = Pieces(size=h.piece, sha256=h.pieces) if h.pieces else None
        return cls(path=path, size=h.size, sha256=h.sha256, pieces=pieces)

    def checks(self) -> list[tuple[int, int, str]]:
        """(begin, end, sha256) of each byte range that is hashed on its own: every piece, or the
        whole file as one range. They tile [0, size)."""
        if self.pieces is None:
            return [(0, self.size, self.sha256)]
        step, digests = self.pieces.size, self.pieces.sha256
        return [
            (b, min(b + step, self.size), d) for b, d in zip(range(0, self.size, step), digests, strict=True)
        ]


def hash_mismatch(entry: FileEntry, begin: int, end: int) -> str:
    """The one-line message for a range of `entry` (FileEntry.checks) whose sha256 does not match."""
    where = "" if entry.pieces is None else f" of bytes [{begin}, {end})"
    return f"{entry.path}: sha256{where} does not match the manifest (file modified or corrupt)"


class TargetSignature(Frozen):
    """What a compiled kernel depends on: a kernel cache is used only where every field is equal."""

    gpu_name: str  # torch.cuda.get_device_properties().name, e.g. "NVIDIA H200"
    compute_capability: str  # "9.0"
    cuda: str | None  # torch.version.cuda
    driver: str | None  # the NVIDIA driver version (nvidia-smi), None where it could not be read
    torch: str  # without the local part ("2.11.0", not "2.11.0+cu130")
    triton: str | None

    def label(self) -> str:
        """A short name for messages: "sm90/NVIDIA H200/triton 3.6.0"."""
        return f"sm{self.compute_capability.replace('.', '')}/{self.gpu_name}/triton {self.triton}"


class KernelCache(Frozen):
    """One target's compile caches, added by `mlac prepare`: Triton's cache directory, stored under
    `path` (cache/<key>/triton); its files are listed (hashed) in Manifest.files like every file."""

    key: str  # target_key(signature): the folder name under cache/
    signature: TargetSignature
    path: str  # relative, POSIX: cache/<key>/triton
    files: int
    bytes: int


class Manifest(Frozen):
    schema_version: Literal[1, 2] = SCHEMA_VERSION
    mlac_version: str
    torch_version: str
    triton_version: str | None
    source: SourceInfo
    model: ModelConfig
    options: CompileOptions
    passes: list[PassRecord]
    plan: ParallelPlan
    quantization: Quantization
    target: str = "portable"
    buckets: BucketPlan | None = None  # CUDA-graph buckets and memory plan (None: compiled before them)
    mtp: MTPInfo | None = None  # the compiled MTP layers (None: none in the source, or --no-mtp)
    accuracy: AccuracyReport
    # tensors[rank][name]: every tensor a rank must load, checked strictly at load
    tensors: list[dict[str, TensorEntry]] = Field(min_length=1)
    files: list[FileEntry]
    caches: list[KernelCache] = []  # compile caches per GPU target, sorted by key (`mlac prepare`)

    @model_validator(mode="after")
    def _pieces_need_version_2(self) -> Manifest:
        if self.schema_version < 2 and any(f.pieces is not None for f in self.files):
            raise ValueError("piece hashes (files[].pieces) need schema_version 2")
        return self

    def rank_dir(self, rank: int) -> str:
        return rank_dir(rank, self.plan.world_size)

    def to_json(self) -> str:
        # sort_keys + no timestamps: compiling twice gives the same bytes
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"

    @classmethod
    def load(cls, root: str | Path) -> Manifest:
        path = Path(root) / MANIFEST
        if not path.is_file():
            raise MlacError(f"{root}: not an mlac artifact ({MANIFEST} not found)")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise MlacError(f"{path}: invalid JSON ({e})") from None
        except RecursionError:
            raise MlacError(f"{path}: invalid JSON (nested too deeply)") from None
        if not isinstance(raw, dict):
            raise MlacError(f"{path}: not a manifest (a JSON {type(raw).__name__}, not an object)")
        version = raw.get("schema_version")
        if type(version) is int and version > SCHEMA_VERSION:
            raise MlacError(
                f"{path}: schema_version {version} is newer than this mlac reads "
                f"({', '.join(map(str, READS))}); upgrade mlac to load it"
            )
        if type(version) is not int or version not in READS:
            raise MlacError(
                f"{path}: schema_version {version!r} is not one of {READS}; recompile with this mlac"
            )
        try:
            manifest = cls.model_validate(raw)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise MlacError(f"{path}: invalid manifest at {where}: {err['msg']}") from None
        for entry in manifest.files:
            check_inside(entry.path, path)
        for cache in manifest.caches:
            if cache.path != cache_path(cache.key) or "/" in cache.key or cache.key in ("", ".", ".."):
                raise MlacError(
                    f"{path}: kernel cache {cache.key!r} at {cache.path!r}, not {CACHE_DIR}/<key>/triton"
                )
        return manifest


def rank_dir(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}"


def check_inside(rel: str, where: Path) -> None:
    """Refuse a manifest path that would leave the artifact directory."""
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or "\\" in rel or not rel:
        raise MlacError(f"{where}: file path {rel!r} leaves the artifact directory; refusing to load")


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_entry(root: Path, rel: str, piece: int = PIECE_SIZE) -> FileEntry:
    """The manifest entry of the file `root/rel`: its size, sha256 and piece hashes (one read)."""
    return FileEntry.of(rel, hash_file(root / rel, piece))


def verify_files(
    root: str | Path,
    manifest: Manifest,
    progress: Any = None,
    files: list[FileEntry] | None = None,
    hashes: bool = True,
    threads: int | None = None,
) -> None:
    """Check every file (or `files`): present with its size; then, with `hashes`, its bytes (the
    tamper check): each range of FileEntry.checks (the file's pieces, or the whole file) hashed on
    one of `threads` threads (default: this process's CPUs, at most VERIFY_THREADS). Raise naming
    the first file (in the manifest's order) that is missing or of another size; else the first
    whose bytes differ (with the piece's byte range). `progress(n)` is called with the bytes checked."""
    root = Path(root)
    entries = manifest.files if files is None else files
    for entry in entries:
        check_size(root, entry)
        if progress is not None and not hashes:
            progress(entry.size)
    if not hashes:
        return
    ranges = [(entry, begin, end, want) for entry in entries for begin, end, want in entry.checks()]
    pool = ThreadPoolExecutor(
        max(1, min(threads or _cpus(), VERIFY_THREADS)), thread_name_prefix="mlac-verify"
    )
    try:
        digests = pool.map(lambda r: sha256_range(root / r[0].path, r[1], r[2]), ranges)
        for (entry, begin, end, want), digest in zip(ranges, digests, strict=True):
            if digest != want:
                raise MlacError(hash_mismatch(entry, begin, end))
            if progress is not None:
                progress(end - begin)
    finally:
        pool.shutdown(cancel_futures=True)


VERIFY_THREADS = 16  # sha256 runs at ~1.1 GB/s per core: verify scales with threads up to the disk


def check_size(root: Path, entry: FileEntry) -> None:
    """Raise unless `root/entry.path` is a file of the manifest's size."""
    path = root / entry.path
    if not path.is_file():
        raise MlacError(f"{entry.path}: missing from the artifact")
    size = path.stat().st_size
    if size != entry.size:
        raise MlacError(f"{entry.path}: size {size} does not match the manifest ({entry.size})")


def sha256_range(path: Path, begin: int, end: int, chunk: int = 1 << 24) -> str:
    """The sha256 of bytes [begin, end) of a file (of fewer, if it ends before `end`)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        f.seek(begin)
        while begin < end and (block := f.read(min(chunk, end - begin))):
            h.update(block)
            begin += len(block)
    return h.hexdigest()


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# -- kernel caches: one per GPU target, under cache/<key>/ ------------------------------------------

CACHE_DIR = "cache"


def target_key(sig: TargetSignature) -> str:
    """The folder name of a target's caches: "sm90-nvidia-h200-triton3.6.0-torch2.11.0-cu13.0"
    (lowercase letters, digits, dots and dashes). The driver is not in it: a target prepared again
    under another driver replaces its cache."""
    slug = lambda s: re.sub(r"[^a-z0-9.]+", "-", str(s).lower()).strip("-.") or "none"  # noqa: E731
    sm = sig.compute_capability.replace(".", "")
    return f"sm{slug(sm)}-{slug(sig.gpu_name)}-triton{slug(sig.triton)}-torch{slug(sig.torch)}-cu{slug(sig.cuda)}"


def cache_path(key: str) -> str:
    """Where a target's Triton cache lies in the artifact."""
    return f"{CACHE_DIR}/{key}/triton"


def signature_differences(cached: TargetSignature, here: TargetSignature) -> list[tuple[str, Any, Any]]:
    """(field, value in the cache, value here) for every field that differs, in field order."""
    fields = TargetSignature.model_fields
    return [
        (f, getattr(cached, f), getattr(here, f)) for f in fields if getattr(cached, f) != getattr(here, f)
    ]


def cache_files(manifest: Manifest, cache: KernelCache) -> list[FileEntry]:
    """The manifest's files of one kernel cache (those under cache.path/)."""
    return [f for f in manifest.files if f.path.startswith(cache.path + "/")]


def manifest_json_schema() -> str:
    return json.dumps(Manifest.model_json_schema(), indent=2, sort_keys=True) + "\n"


# -- identity: one digest over the manifest, which lists every file with its size and sha256 --------


def artifact_identity(root: str | Path) -> str:
    """The artifact's identity: the sha256 of its manifest.json bytes. The manifest holds every
    file's sha256, so this one digest covers the model config, the plan and every byte of every file."""
    return sha256_file(Path(root) / MANIFEST)


def identity_record(identity: str) -> str:
    """The contents of manifest.sha256, in `sha256sum` format."""
    return f"{identity}  {MANIFEST}\n"


def recorded_identity(root: str | Path) -> str | None:
    """The identity in manifest.sha256, or None when the file is absent (an unfinished artifact,
    or one written before mlac recorded identities); raise if it is malformed."""
    path = Path(root) / IDENTITY
    if not path.exists() and not path.is_symlink():
        return None
    text = ""
    if path.is_file():
        with open(path, "rb") as f:
            text = f.read(200).decode(errors="replace")
    identity = text[:64]
    if text != identity_record(identity) or not all(c in "0123456789abcdef" for c in identity):
        raise MlacError(f"{path}: malformed (want '<64 hex digits>  {MANIFEST}'); recompile the artifact")
    return identity


def check_identity(root: str | Path, manifest: Manifest, required: bool = True) -> str:
    """Refuse an artifact whose manifest.json does not hash to manifest.sha256, or any of whose files
    (the manifest, the identity, every listed file) is a symlink or lies under one. Without
    manifest.sha256 the artifact is refused when `required`, else (a compile measuring its own
    unfinished artifact) only the symlinks are checked. Return the identity (sha256 hex)."""
    root = Path(root)
    check_no_symlinks(root, [MANIFEST, IDENTITY] + [f.path for f in manifest.files])
    identity, recorded = artifact_identity(root), recorded_identity(root)
    if recorded is None and required:
        raise MlacError(
            f"{root}: {IDENTITY} not found: the artifact is unfinished (a compile's temporary folder) "
            "or was written by an mlac older than its identity check; recompile it"
        )
    if recorded is not None and recorded != identity:
        raise MlacError(
            f"{root / MANIFEST}: sha256 {identity[:16]}... does not match {IDENTITY} ({recorded[:16]}...): "
            "the manifest was edited or is corrupt; recompile the artifact"
        )
    return identity


def check_no_symlinks(root: Path, rels: list[str]) -> None:
    """Refuse a path of the artifact that is a symlink, lies under one, or resolves outside `root`
    (`root` itself may be a symlink: the artifact is what it points to)."""
    top = root.resolve()
    for rel in rels:
        check_inside(rel, root / MANIFEST)
        parts = PurePosixPath(rel).parts
        for i in range(1, len(parts) + 1):
            if (top.joinpath(*parts[:i])).is_symlink():
                raise MlacError(
                    f"{root / '/'.join(parts[:i])}: is a symlink; an artifact must hold its own files "
                    "(replace the link by the file, or recompile)"
                )
        if not top.joinpath(*parts).resolve().is_relative_to(top):
            raise MlacError(f"{rel}: resolves outside the artifact directory; refusing it")
