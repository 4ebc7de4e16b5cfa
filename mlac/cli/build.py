"""The commands that make and check an artifact: compile, prepare, inspect, verify, synth."""

from __future__ import annotations

from pathlib import Path

import click

from mlac.cli.common import friendly_errors, log, print_json, progress
from mlac.cli.flags import (
    ATTENTION_BACKEND,
    CHUNKED_PREFILL_SIZE,
    CUDA_GRAPH_MAX_BS,
    DEVICE,
    DTYPE,
    MAX_RUNNING_REQUESTS,
    option_fields,
    with_flags,
)
from mlac.core.errors import MlacError


@click.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option(
    "--fp8",
    is_flag=True,
    help="Quantize linear weights to block-wise 128x128 e4m3 (FP8 sources keep their blocks).",
)
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel ranks per model replica.")
@click.option(
    "--ep",
    type=int,
    default=1,
    show_default=True,
    help="Expert-parallel split of the routed experts (1 or --tp).",
)
@click.option("--dp-attention", is_flag=True,
              help="With --tp N: each rank runs attention for its own requests over its own KV cache "
                   "(attention weights whole on every rank; MLPs and MoE stay sharded).")  # fmt: skip
@click.option(
    "--kv-cache-dtype",
    type=click.Choice(["bf16", "fp8_e4m3", "fp8_e5m2"]),
    default="bf16",
    show_default=True,
    help="Dtype of the latent KV cache, recorded for the runtime.",
)
@click.option(
    "--cuda-graph-max-bs",
    type=int,
    default=256,
    show_default=True,
    help="Largest CUDA-graph decode batch size (1..4096); the buckets and memory plan are made for it.",
)
@click.option("--no-mtp", is_flag=True,
              help="Leave out the checkpoint's MTP (NextN) layers (compiled by default: the speculative-decoding draft).")  # fmt: skip
@click.option(
    "--skip-accuracy-check",
    is_flag=True,
    help="Do not run the artifact against the source (for models that do not fit).",
)
@click.option("--calibration-text", type=click.Path(path_type=Path), default=None,
              help="Text file to calibrate the FP8 KV cache's per-layer scales on (with --kv-cache-dtype fp8_*).")  # fmt: skip
@click.option(
    "--force", is_flag=True, help="Replace OUT_DIR if it exists (only once the new artifact is complete)."
)
@click.option("--prepare", "then_prepare", is_flag=True,
              help="Then run `mlac prepare OUT_DIR` (this GPU's kernel-cache unit into the artifact; needs a GPU).")  # fmt: skip
@click.option("--source-repo", default=None,
              help="The source's repository id (ORG/NAME), recorded in the provenance (default: read off a "
                   "Hugging Face cache layout, else none).")  # fmt: skip
@click.option("--source-revision", default=None,
              help="The source's revision (a commit hash), recorded in the provenance (default: as --source-repo).")  # fmt: skip
@click.option(
    "--json", "as_json", is_flag=True, help="Print a JSON summary on stdout (identity, sizes, times)."
)
@friendly_errors
def compile(model_dir, out_dir, fp8, tp, ep, dp_attention, kv_cache_dtype, cuda_graph_max_bs, no_mtp,
            skip_accuracy_check, calibration_text, force, then_prepare, source_repo, source_revision,
            as_json):  # fmt: skip
    """Compile the Hugging Face DeepSeek checkpoint MODEL_DIR into an artifact at OUT_DIR.

    Reads config.json and the safetensors weights (single file or sharded), runs the passes
    (rope, fuse, absorb, fp8), and writes the artifact atomically with a manifest that hashes
    every file. Unless --skip-accuracy-check, the artifact's logits are compared with the
    unquantized source on probe sequences and the error is recorded in the manifest. With
    --calibration-text and an FP8 KV cache, the cache's per-layer scales are calibrated on that
    text (max |entry| per layer maps to the format's max); without, every layer's scale is 1.0.
    The manifest's provenance records every source file's sha256, the source's repository and
    revision, and the versions of the tools.
    """
    import time

    from mlac.compiler.pipeline import check_options, check_out_dir, compile_checkpoint, progress_bytes
    from mlac.compiler.provenance import check_origin
    from mlac.compiler.reader import Checkpoint
    from mlac.core.artifact import CompileOptions, artifact_identity
    from mlac.core.atomic import check_not_source
    from mlac.core.config import ModelConfig

    options = CompileOptions(
        fp8=fp8, tp=tp, ep=ep, kv_cache_dtype=kv_cache_dtype, accuracy_check=not skip_accuracy_check,
        cuda_graph_max_bs=cuda_graph_max_bs, mtp=not no_mtp, dp_attention=dp_attention,
    )  # fmt: skip
    check_origin(source_repo, source_revision)
    check_not_source(out_dir, model_dir)  # before anything is read or written (the writer checks again)
    check_options(ModelConfig.from_dir(model_dir), options)  # before any safetensors file is opened
    check_out_dir(out_dir)
    if then_prepare:
        from mlac.runtime.worker.device import check_device

        check_device("cuda")  # no GPU: one line now, not after the compile
    ckpt = Checkpoint(model_dir)
    start = time.perf_counter()
    with progress(progress_bytes(ckpt), "compiling") as bar:
        manifest = compile_checkpoint(ckpt, out_dir, options, force=force, progress=bar.update, log=log,
                                      calibration_text=calibration_text, source_repo=source_repo,
                                      source_revision=source_revision)  # fmt: skip
    seconds = time.perf_counter() - start
    acc = manifest.accuracy
    if acc.status == "measured":
        log(
            f"accuracy vs {acc.reference}: rel_l2={acc.rel_l2:.3e} max_abs={acc.max_abs:.3e} top1={acc.top1_agreement:.4f}"
        )
    else:
        log(f"accuracy: skipped ({acc.reason})")
    identity = artifact_identity(out_dir)
    if as_json:
        print_json({"identity": identity, "path": str(out_dir), "files": len(manifest.files),
                    "bytes": sum(f.size for f in manifest.files), "seconds": round(seconds, 3),
                    "ranks": manifest.plan.world_size, "source_bytes": ckpt.total_bytes,
                    "accuracy": manifest.accuracy.model_dump(mode="json"),
                    "provenance": manifest.provenance.model_dump(mode="json") if manifest.provenance else None})  # fmt: skip
    else:
        click.echo(f"wrote {out_dir}; identity {identity}")
    if then_prepare:
        from mlac.runtime.engine.options import EngineOptions
        from mlac.tools.prepare import prepare as run_prepare

        unit, _ = run_prepare(out_dir, EngineOptions.of(device="cuda"), log=log)
        log(f"prepared {out_dir} for {unit.key}")


@click.command()
@click.argument("out_dir", type=click.Path(path_type=Path))
@with_flags(
    DEVICE.but(default="cuda", show_default=True, help="cuda or cuda:N: the GPU to prepare for."),
    DTYPE.but(help="Compute dtype the server will run (serve's --dtype)."),
    MAX_RUNNING_REQUESTS.but(type=click.IntRange(1), help="As serve's: the largest decode batch warmed up."),
    CHUNKED_PREFILL_SIZE.but(type=click.IntRange(1), help="As serve's: the largest prefill warmed up."),
    CUDA_GRAPH_MAX_BS.but(help="As serve's: the largest decode batch captured as a CUDA graph."),
    ATTENTION_BACKEND.but(multiple=True, default=("triton",), help="As serve's, repeatable: the attention "
                          "backends the server may run (--attention-backend triton --attention-backend "
                          "flashinfer: one unit for both; flashinfer's modules are stored in it too)."),
)  # fmt: skip
@click.option("--cache-out", type=click.Path(path_type=Path), default=None,
              help="Write the kernel-cache unit to this folder (new, empty, or a unit: replaced) instead of "
                   "OUT_DIR/cache/<target>/: a GPU job then publishes megabytes, not the weights.")  # fmt: skip
@friendly_errors
def prepare(out_dir, cache_out, **flags):
    """Compile on this GPU every kernel the server meets, as a kernel-cache unit of the artifact OUT_DIR.

    Builds the engine as `mlac serve` does (CUDA graphs for every decode bucket) and warms it up
    with an empty Triton cache, then stores that cache as a unit: its files hashed in its own
    unit.json with this GPU's signature (name, compute capability, CUDA, driver, torch, triton),
    bound to the artifact's identity, under OUT_DIR/cache/<target>/ (or --cache-out). The artifact's
    manifest and identity do not change. Atomic. A server on a GPU of the same signature then
    compiles nothing. Preparing a target again replaces its unit. With --attention-backend
    flashinfer, FlashInfer's compiled MLA modules are stored in the unit too.
    """
    from mlac.runtime.engine.options import EngineOptions
    from mlac.runtime.worker.backend_check import refuse_launch
    from mlac.tools.prepare import prepare as run_prepare

    backends = list(dict.fromkeys(flags.pop("attention_backend")))  # each once, in the order given
    for backend in backends:
        refuse_launch(backend, flags["device"], flags["dtype"])
    options = EngineOptions.of(**option_fields(flags))
    unit, folder = run_prepare(out_dir, options, log=log, cache_out=cache_out, backends=backends)
    click.echo(
        f"prepared {out_dir} for {unit.key}: {len(unit.files)} files, {unit.bytes / 1e6:.1f} MB in {folder}"
    )


@click.command()
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True,
              help="Print the whole manifest as JSON, with the identity, the units and the signature added.")  # fmt: skip
@friendly_errors
def inspect(out_dir, as_json):
    """Show an artifact: identity, model, provenance, passes, plan, quantization, buckets and memory
    plan, kernel-cache units, signature, sizes, accuracy."""
    from mlac.core.artifact import Manifest
    from mlac.tools.inspect import describe, describe_identity, to_json

    manifest = Manifest.load(out_dir)
    text = to_json(out_dir, manifest) if as_json else describe_identity(out_dir) + describe(manifest, out_dir)
    click.echo(text, nl=not as_json)


@click.command()
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--public-key", type=click.Path(path_type=Path), default=None,
              help="Also check the artifact's signature (signature.sig.json) with this PEM public key.")  # fmt: skip
@click.option(
    "--json", "as_json", is_flag=True, help="Print a JSON summary on stdout (identity, files, ranks, units)."
)
@friendly_errors
def verify(out_dir, public_key, as_json):
    """Check the artifact as the loader does and re-hash every file: the manifest against its
    identity (manifest.sha256), every listed file's size and sha256, every tensor file's header
    against the manifest, no file that the identity does not cover, every kernel-cache unit bound
    to this identity with its own files; refuse symlinks; name the first thing that differs (exit
    code 3). Prints the identity. An artifact pulled with --ranks holds only those rank folders: it
    verifies, and the ranks held are printed. With --public-key, the signature must verify too."""
    import time

    from mlac.core.validity import check_artifact, verify_bytes

    start = time.perf_counter()
    with progress(verify_bytes(out_dir), "verifying") as bar:
        checked = check_artifact(out_dir, hashes=True, public_key=public_key, progress=bar.update)
    files, m = checked.files(), checked.manifest
    size = sum(f.size for f in files)
    if as_json:
        print_json({"identity": checked.identity, "path": str(out_dir), "files": len(files), "bytes": size,
                    "ranks": checked.ranks, "world_size": m.plan.world_size, "units": sorted(checked.units),
                    "signature_verified": public_key is not None, "seconds": round(time.perf_counter() - start, 3)})  # fmt: skip
        return
    held = "" if checked.whole else f" (ranks {', '.join(map(str, checked.ranks))} of {m.plan.world_size})"
    units = f"; {len(checked.units)} kernel-cache unit(s)" if checked.units else ""
    signed = f"; signature verified with {public_key}" if public_key else ""
    click.echo(f"ok: {len(files)} files, {size / 1e9:.3f} GB match the manifest{held}{units}{signed}; "
               f"identity {checked.identity}")  # fmt: skip


@click.command()
@click.argument("preset", required=False)
@click.argument("out_dir", type=click.Path(path_type=Path), required=False)
@click.option(
    "--from-config",
    "config_path",
    type=click.Path(path_type=Path),
    help="Use this config.json instead of a preset.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed (same seed, same bytes).")
@click.option("--num-layers", type=int, help="Override num_hidden_layers (keeps at least one MoE layer).")
@friendly_errors
def synth(preset, out_dir, config_path, seed, num_layers):
    """Write a synthetic HF DeepSeek checkpoint (real structure, random weights).

    \b
      mlac synth PRESET OUT_DIR [--seed N] [--num-layers N]
      mlac synth --from-config path/to/config.json OUT_DIR [--num-layers N]

    Presets: tiny-v2-lite, tiny-v2, tiny-v3 (FP8, as DeepSeek-V3 is released), v2-lite (real shape, ~31 GB).
    """
    from mlac.synth import PRESETS, synthesize, weight_bytes

    if config_path is not None:
        if out_dir is None and preset is not None:
            preset, out_dir = None, Path(preset)
        if preset is not None:
            raise MlacError("give either a PRESET or --from-config, not both")
    if out_dir is None:
        raise MlacError(f"missing OUT_DIR (usage: mlac synth PRESET OUT_DIR; presets: {', '.join(PRESETS)})")
    total = weight_bytes(preset=preset, config_path=config_path, num_layers=num_layers)
    with progress(total, "writing") as bar:
        path = synthesize(out_dir, preset=preset, config_path=config_path, seed=seed, num_layers=num_layers,
                          progress=bar.update)  # fmt: skip
    click.echo(f"wrote {path}")
