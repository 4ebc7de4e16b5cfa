"""What every command group shares: one-line errors, the progress bar, stderr logging, and the early
start of a multi-rank artifact's other ranks."""

from __future__ import annotations

import functools
import json
import sys
import time

import click

from mlac.core.errors import MlacError
from mlac.core.progress import Progress

PROCESS_START = time.monotonic()  # the start-up log's import phase counts from here


def friendly_errors(fn):
    """Every MlacError becomes `error: <message>` on stderr with its exit code (1 bad input, 3
    integrity, 4 target mismatch, 5 registry: core/errors.py) and no traceback (Ctrl-C:
    `error: interrupted`, exit code 130)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MlacError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            sys.exit(130)

    return wrapper


def progress(length: int, label: str, unit: str = "bytes") -> Progress:
    """Progress over `length` units (bytes, tokens) on stderr: redrawn on a terminal, else a line at
    least every 10 s (core/progress.py)."""
    return Progress(length, label, unit=unit)


def print_json(record: dict) -> None:
    """A command's `--json` summary: one JSON object on stdout."""
    click.echo(json.dumps(record, indent=2, sort_keys=True, default=str))


def log(msg: str) -> None:
    click.echo(msg, err=True)


def early_launch(out_dir):
    """A multi-rank artifact's other ranks on this node, spawned before the command imports torch
    (they import it meanwhile, as under `serve`): the LaunchSpec that hands them their work to
    Engine.from_artifact, or None (one rank, or a manifest the load will refuse). Ranks never handed
    their work (bad input, a failed load) are stopped when the command ends."""
    from mlac.runtime.dist.world import LaunchSpec, start_node_ranks  # (no torch)

    ranks = start_node_ranks(out_dir)
    if ranks is None:
        return None
    click.get_current_context().call_on_close(ranks.close)  # a no-op once they were handed over
    return LaunchSpec(ranks=ranks)
