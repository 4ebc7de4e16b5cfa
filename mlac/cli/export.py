"""`mlac export`: a compiled artifact in another format (onnx)."""

from __future__ import annotations

from pathlib import Path

import click

from mlac.cli.common import friendly_errors, log, progress


@click.group()
def export() -> None:
    """Export a compiled artifact to another format (onnx)."""


@export.command(name="onnx")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option(
    "--force", is_flag=True, help="Replace OUT_DIR if it exists (only once the export is complete)."
)
@click.option(
    "--no-verify", is_flag=True, help="Skip re-hashing the artifact's files (sizes are still checked)."
)
@click.option(
    "--link-weights",
    is_flag=True,
    help="Hard-link the artifact's weight files instead of copying the weights (no disk, seconds; "
    "onnxruntime loads it, onnx.load and onnx.checker refuse hard links: see docs/onnx.md).",
)
@friendly_errors
def export_onnx(artifact, out_dir, force, no_verify, link_weights):
    """Write ARTIFACT as an ONNX graph in OUT_DIR (atomically): model.onnx, its weights as external
    data (model.onnx.data, or with --link-weights the artifact's own files hard-linked under
    weights/; FP8 blocks as float8e4m3fn with DequantizeLinear), mlac_onnx.json (how to feed it:
    inputs, latent cache, rope) and the tokenizer. One-rank artifacts only. See docs/onnx.md.
    """
    from mlac.export.onnx.writer import plan_export

    job = plan_export(artifact, out_dir, force=force, verify=not no_verify, link_weights=link_weights)
    with progress(job.total_bytes, "exporting") as bar:
        path = job.write(progress=bar.update, log=log)
    click.echo(f"wrote {path} ({job.layout.summary()})")
