"""mlac command line: compile, prepare, inspect, verify, synth, sign, push, pull, generate, serve, bench, eval,
export, demo.

Thin wiring over the Python API, one module per command group:

    build.py    compile, prepare, inspect, verify, synth: make and check an artifact
    ship.py     sign, push, pull: ship an artifact through an OCI registry; oci:// ARTIFACT arguments
    run.py      generate, bench, eval: run an artifact in this process
    serve.py    serve: the OpenAI-compatible server
    export.py   export onnx
    demo.py     demo: the whole path on CPU
    flags.py    the flags of the options chain (ServerConfig ⊃ EngineOptions ⊃ RuntimeOptions), each
                declared once with the field it sets
    common.py   one-line errors, the progress bar, the early start of a multi-rank artifact's ranks

Every MlacError becomes `error: <message>` on stderr with its exit code (core/errors.py) and no
traceback. Importing
this package imports no torch: each command imports what it runs.
"""

from __future__ import annotations

import click

from mlac.cli import build, demo, export, run, serve, ship


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mlac")
def main() -> None:
    """mlac: compile DeepSeek checkpoints into verified artifacts, and run them.

    \b
      mlac synth tiny-v3 ckpt/            # a synthetic checkpoint (random weights)
      mlac compile --fp8 ckpt/ out/       # HF checkpoint -> artifact
      mlac generate out/ --prompt "Hi"    # run it
    """


COMMANDS = (build.compile, build.prepare, build.inspect, build.verify, build.synth, ship.sign, ship.push, ship.pull,
            run.generate, run.bench, run.eval_, serve.serve, export.export, demo.demo)  # fmt: skip
for command in COMMANDS:
    main.add_command(command)
