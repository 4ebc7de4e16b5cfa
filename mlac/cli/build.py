"""The commands that make and check an artifact: compile, prepare, inspect, verify, synth."""

from __future__ import annotations

from pathlib import Path

import click

from mlac.cli.common import friendly_errors, log, progress
from mlac.cli.flags import (
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
              help="Then run `mlac prepare OUT_DIR` (this GPU's kernel caches into the artifact; needs a GPU).")  # fmt: skip
@friendly_errors
def compile(model_dir, out_dir, fp8, tp, ep, dp_attention, kv_cache_dtype, cuda_graph_max_bs, no_mtp,
            skip_accuracy_check, calibration_text, force, then_prepare):  # fmt: skip
    """Compile the Hugging Face DeepSeek checkpoint MODEL_DIR into an artifact at OUT_DIR.

    Reads config.json and the safetensors weights (single file or sharded), runs the passes
    (rope, fuse, absorb, fp8), and writes the artifact atomically with a manifest that hashes
    every file. Unless --skip-accuracy-check, the artifact's logits are compared with the
    unquantized source on probe sequences and the error is recorded in the manifest. With
    --calibration-text and an FP8 KV cache, the cache's per-layer scales are calibrated on that
    text (max |entry| per layer maps to the format's max); without, every layer's scale is 1.0.
    """
    from mlac.compiler.pipeline import check_options, check_out_dir, compile_checkpoint
    from mlac.compiler.reader import Checkpoint
    from mlac.core.artifact import CompileOptions
    from mlac.core.atomic import check_not_source
    from mlac.core.config import ModelConfig

    options = CompileOptions(
        fp8=fp8, tp=tp, ep=ep, kv_cache_dtype=kv_cache_dtype, accuracy_check=not skip_accuracy_check,
        cuda_graph_max_bs=cuda_graph_max_bs, mtp=not no_mtp, dp_attention=dp_attention,
    )  # fmt: skip
    check_not_source(out_dir, model_dir)  # before anything is read or written (the writer checks again)
    check_options(ModelConfig.from_dir(model_dir), options)  # before any safetensors file is opened
    check_out_dir(out_dir)
    if then_prepare:
        from mlac.runtime.worker.device import check_device

        check_device("cuda")  # no GPU: one line now, not after the compile
    ckpt = Checkpoint(model_dir)
    with progress(ckpt.total_bytes, "compiling") as bar:
        manifest = compile_checkpoint(ckpt, out_dir, options, force=force, progress=bar.update, log=log,
                                      calibration_text=calibration_text)  # fmt: skip
    acc = manifest.accuracy
    if acc.status == "measured":
        log(
            f"accuracy vs {acc.reference}: rel_l2={acc.rel_l2:.3e} max_abs={acc.max_abs:.3e} top1={acc.top1_agreement:.4f}"
        )
    else:
        log(f"accuracy: skipped ({acc.reason})")
    click.echo(f"wrote {out_dir}")
    if then_prepare:
        from mlac.runtime.engine.options import EngineOptions
        from mlac.tools.prepare import prepare as run_prepare

        cache = run_prepare(out_dir, EngineOptions.of(device="cuda"), log=log)
        click.echo(f"prepared {out_dir} for {cache.key}")


@click.command()
@click.argument("out_dir", type=click.Path(path_type=Path))
@with_flags(
    DEVICE.but(default="cuda", show_default=True, help="cuda or cuda:N: the GPU to prepare for."),
    DTYPE.but(help="Compute dtype the server will run (serve's --dtype)."),
    MAX_RUNNING_REQUESTS.but(type=click.IntRange(1), help="As serve's: the largest decode batch warmed up."),
    CHUNKED_PREFILL_SIZE.but(type=click.IntRange(1), help="As serve's: the largest prefill warmed up."),
    CUDA_GRAPH_MAX_BS.but(help="As serve's: the largest decode batch captured as a CUDA graph."),
)
@friendly_errors
def prepare(out_dir, **flags):
    """Compile on this GPU every kernel the server meets and add them to the artifact OUT_DIR.

    Builds the engine as `mlac serve` does (CUDA graphs for every decode bucket) and warms it up
    with an empty Triton cache, then stores that cache under OUT_DIR/cache/<target>/, hashed in the
    manifest with this GPU's signature (name, compute capability, CUDA, driver, torch, triton).
    Atomic: an interrupted prepare leaves the artifact as it was. A server on a GPU of the same
    signature then compiles nothing. Preparing a target again replaces its cache.
    """
    from mlac.runtime.engine.options import EngineOptions
    from mlac.tools.prepare import prepare as run_prepare

    cache = run_prepare(out_dir, EngineOptions.of(**option_fields(flags)), log=log)
    click.echo(f"prepared {out_dir} for {cache.key}: {cache.files} files, {cache.bytes / 1e6:.1f} MB")


@click.command()
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
@friendly_errors
def inspect(out_dir, as_json):
    """Show an artifact: identity, model, passes, plan, quantization, buckets and memory plan, sizes, accuracy."""
    from mlac.core.artifact import Manifest
    from mlac.tools.inspect import describe, describe_identity

    manifest = Manifest.load(out_dir)
    text = manifest.to_json() if as_json else describe_identity(out_dir) + describe(manifest)
    click.echo(text, nl=not as_json)


@click.command()
@click.argument("out_dir", type=click.Path(path_type=Path))
@friendly_errors
def verify(out_dir):
    """Check the manifest against its identity (manifest.sha256) and re-hash every file against the
    manifest; refuse symlinks; name the first thing that differs. Prints the identity."""
    from mlac.core.artifact import Manifest, check_identity, verify_files

    manifest = Manifest.load(out_dir)
    identity = check_identity(out_dir, manifest)
    total = sum(f.size for f in manifest.files)
    with progress(total, "verifying") as bar:
        verify_files(out_dir, manifest, progress=bar.update)
    click.echo(
        f"ok: {len(manifest.files)} files, {total / 1e9:.3f} GB match the manifest; identity {identity}"
    )


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
