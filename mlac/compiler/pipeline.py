"""The compile pipeline: read -> passes -> write, one tensor group (embed, layer i, head) at a time.

    compile_checkpoint(model_dir, out_dir, CompileOptions(fp8=True))   # writes an artifact
    compile_tensors(model_dir, CompileOptions())                       # the same, in memory

Every check that can fail (config, tensor set, shapes, dtypes, options) runs before the first
byte is written. The pipeline owns all I/O; passes only transform lazy tensors.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path

import torch

from mlac.compiler.check import accuracy, calibrate
from mlac.compiler.mtp import compiled_layers, mtp_group, mtp_info
from mlac.compiler.provenance import SourceHashes, check_origin, provenance
from mlac.compiler.reader import INDEX, Checkpoint, read_globals, read_layer
from mlac.compiler.writer import ArtifactWriter
from mlac.core.artifact import (
    TOKENIZER_DIR,
    AccuracyReport,
    CompileOptions,
    Manifest,
    ParallelPlan,
    PassRecord,
    Quantization,
    SourceInfo,
)
from mlac.core.config import ModelConfig
from mlac.core.errors import MlacError
from mlac.core.fp8 import BLOCK
from mlac.core.lazy import LazyTensor
from mlac.core.version import __version__
from mlac.passes import PassContext, absorb, buckets, fp8, fuse, rope, shard

LAYER_PASSES = (rope, fuse, absorb)  # then shard (one layer -> one dict per rank), then fp8 per rank
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
GLOBAL_FILES = {"embed.safetensors": ("embed",), "head.safetensors": ("norm", "head")}

Log = Callable[[str], None]


def check_options(config: ModelConfig, options: CompileOptions) -> None:
    """Everything about the options that can be refused from the config alone (no tensor read)."""
    shard.check(config, options)
    buckets.check(options)


def check_out_dir(out_dir: str | Path) -> None:
    """Refuse an OUT_DIR that cannot be created, before any heavy work: one under a file, or
    whose nearest existing folder is not writable (a read-only file system, permissions).
    (The writer builds the artifact in a sibling of OUT_DIR, so that folder must be writable.)"""
    folder = Path(out_dir).absolute().parent
    while not folder.exists() and not folder.is_symlink() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise MlacError(f"{out_dir}: cannot create it: {folder} is not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise MlacError(f"{out_dir}: cannot create it: {folder} is not writable (read-only or no permission)")


def tensor_groups(
    ckpt: Checkpoint, options: CompileOptions, on_read: Callable[[int], None] | None = None
) -> Iterator[tuple[str, list[dict[str, LazyTensor]]]]:
    """(file name, final lazy tensors of each rank) for every group, after all passes."""
    cfg = ckpt.config
    globals_ = read_globals(ckpt, on_read)
    top = PassContext(cfg, options, None)
    yield "embed.safetensors", shard.run({"embed": globals_["embed"]}, top)
    for i in range(cfg.num_hidden_layers):
        ckpt.read_ahead(i + 1)
        tensors = read_layer(ckpt, i, keep_fp8=options.fp8, on_read=on_read)
        ctx = PassContext(cfg, options, i)
        for p in LAYER_PASSES:
            tensors = p.run(tensors, ctx)
        yield f"layer-{i:05d}.safetensors", [fp8.run(rank, ctx) for rank in shard.run(tensors, ctx)]
    yield "head.safetensors", shard.run({"norm": globals_["norm"], "head": globals_["head"]}, top)
    for k, n in enumerate(compiled_layers(ckpt, options)):
        ckpt.read_ahead(n)
        yield f"mtp-{k:05d}.safetensors", mtp_group(ckpt, k, options, on_read)


def pass_records(ckpt: Checkpoint, options: CompileOptions) -> list[PassRecord]:
    ctx = PassContext(ckpt.config, options, None)
    records = [PassRecord(name="read", params={"fp8_source": ckpt.config.quantization is not None})]
    records += [PassRecord(name=p.NAME, params=p.params(ctx)) for p in LAYER_PASSES]
    if options.tp > 1:
        records.append(PassRecord(name=shard.NAME, params=shard.params(ctx)))
    if options.fp8:
        records.append(PassRecord(name=fp8.NAME, params=fp8.params(ctx)))
    records.append(PassRecord(name=buckets.NAME, params=buckets.params(ctx)))
    return records


def compile_tensors(
    model_dir: str | Path | Checkpoint, options: CompileOptions | None = None
) -> list[dict[str, torch.Tensor]]:
    """The compiled tensors of every rank, in memory (for small models and references)."""
    ckpt = model_dir if isinstance(model_dir, Checkpoint) else Checkpoint(model_dir)
    options = options or CompileOptions()
    check_options(ckpt.config, options)
    if options.mtp:
        ckpt.check_mtp()
    ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(options.tp)]
    for _, group in tensor_groups(ckpt, options):
        for r, tensors in enumerate(group):
            ranks[r] |= {n: t.load() for n, t in tensors.items()}
    return ranks


def compile_checkpoint(
    model_dir: str | Path | Checkpoint,
    out_dir: str | Path,
    options: CompileOptions | None = None,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
    log: Log = lambda msg: None,
    calibration_text: str | Path | None = None,
    source_repo: str | None = None,
    source_revision: str | None = None,
) -> Manifest:
    """Compile a HF DeepSeek checkpoint into an artifact at out_dir (atomically). With
    `calibration_text` and an FP8 KV cache, the cache's per-layer scales are calibrated on that
    text (calibrate.py) and stored in the manifest; with an unquantized cache there is nothing to
    calibrate (a warning in the log). Either way the accuracy report adds perplexity over the
    text's tokens (accuracy.py). The manifest's provenance hashes every source file read and names
    `source_repo` / `source_revision` (else what a Hugging Face cache layout says; provenance.py).
    `progress(n)` counts source bytes read by the passes and hashed for provenance: 2x the source."""
    options = options or CompileOptions()
    check_origin(source_repo, source_revision)
    check_out_dir(out_dir)
    if not isinstance(model_dir, Checkpoint):
        check_options(ModelConfig.from_dir(model_dir), options)
    ckpt = model_dir if isinstance(model_dir, Checkpoint) else Checkpoint(model_dir)
    check_options(ckpt.config, options)
    if options.mtp:
        ckpt.check_mtp()
    kv_text = _check_calibration(ckpt, options, calibration_text, log)
    cfg = ckpt.config
    log(
        f"source: {cfg.model_type}, {cfg.num_hidden_layers} layers, {ckpt.total_bytes / 1e9:.2f} GB in {len(ckpt.files)} file(s)"
    )
    if ckpt.mtp_layers:
        what = "compiled as mtp.*" if options.mtp else "left out (--no-mtp)"
        log(f"source: MTP layer(s) {ckpt.mtp_layers} {what}")
    start = time.perf_counter()
    tokenizer = [name for name in TOKENIZER_FILES if (ckpt.dir / name).is_file()]
    with (
        ArtifactWriter(out_dir, world_size=options.tp, source=ckpt.dir, force=force, log=log) as w,
        closing(SourceHashes(ckpt.dir, source_files(ckpt) + tokenizer, progress)) as hashes,
    ):
        for file, ranks in tensor_groups(ckpt, options, progress):
            w.write_group(file, ranks)
        for name in tokenizer:
            w.copy_file(ckpt.dir / name, f"{TOKENIZER_DIR}/{name}")
        elapsed = time.perf_counter() - start
        log(
            f"wrote {sum(f.size for f in w.files) / 1e9:.2f} GB in {elapsed:.1f} s "
            f"({ckpt.total_bytes / 1e6 / max(elapsed, 1e-9):.0f} MB/s of source)"
        )
        manifest = _manifest(ckpt, options, w)
        origin = provenance(ckpt.dir, hashes.result(), source_repo, source_revision)
        manifest = manifest.model_copy(update={"provenance": origin})
        if kv_text is not None:
            manifest = _calibrate_kv(ckpt, options, manifest, kv_text, log)
        report = _accuracy(ckpt, w.root, manifest, log, calibration_text)
        return _commit(w, manifest.model_copy(update={"accuracy": report}))


def progress_bytes(ckpt: Checkpoint) -> int:
    """What compile_checkpoint's `progress` counts to: the tensor bytes the passes read, and every
    source file's bytes hashed for the provenance."""
    files = source_files(ckpt) + [n for n in TOKENIZER_FILES if (ckpt.dir / n).is_file()]
    return ckpt.total_bytes + sum((ckpt.dir / rel).stat().st_size for rel in files)


def source_files(ckpt: Checkpoint) -> list[str]:
    """The checkpoint's files that a compile reads: config, index, weight shards (relative paths)."""
    index = [INDEX] if ckpt.index_sha256 is not None else []
    return ["config.json", *index, *ckpt.files]


def _commit(w: ArtifactWriter, manifest: Manifest) -> Manifest:
    w.commit(Manifest.model_validate(manifest.model_dump()))
    return manifest


def _check_calibration(
    ckpt: Checkpoint, options: CompileOptions, text: str | Path | None, log: Log
) -> str | Path | None:
    """The calibration text to calibrate the KV cache on, checked before any heavy work; None when
    there is none, or the KV cache is not FP8 (logged as a warning)."""
    if text is None:
        return None
    calibrate.check_inputs(text, ckpt.dir)
    if options.kv_cache_dtype not in calibrate.FP8_KV_DTYPES:
        log(
            f"warning: --calibration-text with a {options.kv_cache_dtype} KV cache: no KV scales to calibrate"
        )
        return None
    return text


def _calibrate_kv(
    ckpt: Checkpoint, options: CompileOptions, manifest: Manifest, text: str | Path, log: Log
) -> Manifest:
    """`manifest` with the FP8 KV cache's per-layer scales, measured on the artifact's own weights
    compiled in memory on 1 rank (the latents do not depend on the split)."""
    tensors = compile_tensors(ckpt, options.model_copy(update={"tp": 1, "ep": 1, "dp_attention": False}))[0]
    scales, record = calibrate.calibrate_kv_scales(
        ckpt.config, tensors, ckpt.dir, text, options.kv_cache_dtype, log
    )
    quant = manifest.quantization.model_copy(update={"kv_scales": scales, "kv_calibration": record})
    return manifest.model_copy(update={"quantization": quant})


def _accuracy(
    ckpt: Checkpoint, root: Path, manifest: Manifest, log: Log, text: str | Path | None = None
) -> AccuracyReport:
    """The artifact at root against the source compiled in memory without FP8, on 1 rank; with
    calibration `text`, also perplexity over its tokens (accuracy.TextCheck)."""
    params = sum(info.nbytes // info.dtype.itemsize for info in ckpt.where.values())
    unquantized = CompileOptions(mtp=manifest.options.mtp)
    reference = lambda: compile_tensors(ckpt, unquantized)[0]  # noqa: E731
    check = None
    if text is not None and manifest.options.accuracy_check:
        one_rank = manifest.options.model_copy(update={"tp": 1, "ep": 1, "dp_attention": False})
        check = accuracy.TextCheck(
            tokens=calibrate.text_tokens(ckpt.dir, text),
            artifact_tensors=lambda: compile_tensors(ckpt, one_rank)[0],
        )
    return accuracy.measure_accuracy(root, manifest, reference, params, log, check)


def _manifest(ckpt: Checkpoint, options: CompileOptions, w: ArtifactWriter) -> Manifest:
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    n_fp8 = sum(1 for n in w.tensors[0] if n.endswith(".scale"))
    quant = Quantization(scheme="none")
    if options.fp8:
        quant = Quantization(
            scheme="fp8-block", fmt="e4m3", block=(BLOCK, BLOCK), scale_dtype="float32",
            kept_source_blocks=ckpt.config.quantization is not None, tensors=n_fp8,
        )  # fmt: skip
    source = SourceInfo(
        config_sha256=ckpt.config_sha256, index_sha256=ckpt.index_sha256, files=len(ckpt.files),
        bytes=ckpt.total_bytes, dtypes=ckpt.source_dtypes(), mtp_layers=ckpt.mtp_layers, mtp_tensors=ckpt.mtp_tensors,
    )  # fmt: skip
    return Manifest(
        mlac_version=__version__,
        torch_version=torch.__version__.split("+")[0],
        triton_version=triton_version,
        source=source,
        model=ckpt.config,
        options=options,
        passes=pass_records(ckpt, options),
        plan=ParallelPlan(tp=options.tp, ep=options.ep, dp_attention=options.dp_attention),
        quantization=quant,
        buckets=buckets.plan_buckets(ckpt.config, options, w.tensors),
        mtp=mtp_info(ckpt, options, w.tensors[0]),
        accuracy=AccuracyReport(status="skipped", reason="not measured yet"),
        tensors=w.tensors,
        files=sorted(w.files, key=lambda f: f.path),
    )
