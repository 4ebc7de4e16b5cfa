"""The artifact's on-disk contract: the manifest (pydantic, schema-versioned) and its paths.

Both sides read this file: the compiler writes a Manifest, the runtime loads and checks one.
Format documentation: artifacts/README.md. JSON Schema: artifacts/manifest.schema.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from mlac.core.config import ModelConfig
from mlac.core.errors import IntegrityError, MlacError
from mlac.core.files import FileEntry, check_inside, check_no_symlinks, sha256_file
from mlac.core.frozen import Frozen
from mlac.core.units import CACHE_DIR, KernelCache, cache_path

# what this mlac writes; 2: files may carry piece hashes (FileEntry.pieces); 3: provenance, and kernel
# caches as units of their own beside the artifact (core/units.py), no longer in its manifest
SCHEMA_VERSION = 3
READS = (1, 2, 3)  # the schema versions this mlac loads
MANIFEST = "manifest.json"
IDENTITY = "manifest.sha256"  # the artifact's identity; `sha256sum -c manifest.sha256` checks it too
TOKENIZER_DIR = "tokenizer"


class SourceInfo(Frozen):
    """Where the artifact came from: enough to tell whether two artifacts share a source."""

    config_sha256: str
    index_sha256: str | None = None
    files: int
    bytes: int
    dtypes: list[str]  # dtypes of the source weight tensors, sorted
    mtp_layers: list[int] = []  # MTP layers found in the source (V3); Manifest.mtp: which were compiled
    mtp_tensors: int = 0


class SourceFile(Frozen):
    """One file of the source checkpoint, as the compile read it."""

    path: str  # relative to the checkpoint folder, POSIX
    size: int
    sha256: str


class Provenance(Frozen):
    """What the artifact was compiled from, and with what (compiler/provenance.py)."""

    repo: str | None = None  # the source's repository id ("deepseek-ai/DeepSeek-V3"), when known
    revision: str | None = None  # its revision (a commit hash), when known
    files: list[SourceFile]  # every source file the compile read, sorted by path
    tools: dict[str, str | None]  # versions: mlac, torch, triton, safetensors, python


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


class Manifest(Frozen):
    schema_version: Literal[1, 2, 3] = SCHEMA_VERSION
    mlac_version: str
    torch_version: str
    triton_version: str | None
    source: SourceInfo
    provenance: Provenance | None = None  # None: compiled before schema 3 recorded it
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
    # schema 1-2 only: compile caches per GPU target, listed here (schema 3 keeps them as units, units.py)
    caches: list[KernelCache] = []

    @model_validator(mode="after")
    def _fields_match_the_version(self) -> Manifest:
        if self.schema_version < 2 and any(f.pieces is not None for f in self.files):
            raise ValueError("piece hashes (files[].pieces) need schema_version 2")
        if self.schema_version < 3 and self.provenance is not None:
            raise ValueError("provenance needs schema_version 3")
        if self.schema_version >= 3 and self.caches:
            raise ValueError(
                "schema_version 3 keeps kernel caches as units (cache/<key>/unit.json), not in caches"
            )
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
        return cls.from_bytes(path.read_bytes(), str(path))

    @classmethod
    def from_bytes(cls, data: bytes, path: str) -> Manifest:
        """The manifest in `data` (a manifest.json's bytes, read from `path`: named in errors)."""
        try:
            raw = json.loads(data.decode())
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


# -- kernel caches: one per GPU target, under cache/<key>/ ------------------------------------------


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
        raise IntegrityError(
            f"{path}: malformed (want '<64 hex digits>  {MANIFEST}'); recompile the artifact"
        )
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
        raise IntegrityError(
            f"{root}: {IDENTITY} not found: the artifact is unfinished (a compile's temporary folder) "
            "or was written by an mlac older than its identity check; recompile it"
        )
    if recorded is not None and recorded != identity:
        raise IntegrityError(
            f"{root / MANIFEST}: sha256 {identity[:16]}... does not match {IDENTITY} ({recorded[:16]}...): "
            "the manifest was edited or is corrupt; recompile the artifact"
        )
    return identity
