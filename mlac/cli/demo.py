"""`mlac demo`: the whole path (synth, compile, serve, one request) on CPU in about a minute."""

from __future__ import annotations

from pathlib import Path

import click

from mlac.cli.common import friendly_errors


@click.command()
@click.option(
    "--work",
    type=click.Path(path_type=Path),
    default=None,
    help="Working directory (default: a temporary one, removed after).",
)
@click.option(
    "--tp",
    type=int,
    default=2,
    show_default=True,
    help="Tensor-parallel ranks of the compiled demo artifact.",
)
@click.option(
    "--prompt", default="What is the capital of France?", show_default=True, help="The chat message sent."
)
@click.option("--max-tokens", type=int, default=24, show_default=True)
@friendly_errors
def demo(work, tp, prompt, max_tokens):
    """Synthesize tiny-v3, compile it (--tp, --fp8), serve it on CPU, send one chat request over HTTP.

    Prints the reply and the timings: compile, load-to-ready, request.
    """
    from mlac.tools.demo import run_demo

    run_demo(work, tp=tp, prompt=prompt, max_tokens=max_tokens, echo=click.echo)
