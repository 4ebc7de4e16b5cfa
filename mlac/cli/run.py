"""The commands that run an artifact in this process: generate, bench, eval. Each starts a
multi-rank artifact's other ranks before it imports torch (common.early_launch), then builds its
EngineOptions once from its flags (flags.py) and hands them to Engine.from_artifact."""

from __future__ import annotations

import json
from pathlib import Path

import click

from mlac.cli.common import early_launch, friendly_errors, log, progress
from mlac.cli.flags import (
    ATTENTION_BACKEND,
    CHAT_TEMPLATE,
    CUDA_GRAPH,
    CUDA_GRAPH_MAX_BS,
    DEVICE,
    DTYPE,
    GENERATION_CONFIG,
    NO_VERIFY,
    NUM_BLOCKS,
    REQUIRE_PREPARED,
    artifact_flags,
    decode_flags,
    memory_flags,
    option_fields,
    source_flags,
    with_flags,
)
from mlac.cli.ship import ARTIFACT, fetched
from mlac.core.errors import MlacError

TRUSTED_STORAGE_HELP = "Trusted storage: check file sizes only, skip sha256."


@click.command()
@click.argument("out_dir", type=ARTIFACT)
@click.option(
    "--prompt", required=True, help="Prompt text (encoded with the artifact's tokenizer, BOS prepended)."
)
@click.option("--chat", is_flag=True, help="Render the prompt as one user message through the chat template.")
@CHAT_TEMPLATE
@click.option("--max-tokens", type=int, default=32, show_default=True)
@click.option(
    "--temperature", type=float, default=None, help="0 means greedy (default: --generation-config's)."
)
@click.option("--top-p", type=float, default=None, help="Default: --generation-config's.")
@click.option("--top-k", type=int, default=None, help="0 means off (default: --generation-config's).")
@GENERATION_CONFIG
@click.option("--seed", type=int, default=None, help="Sampling seed (same seed, same output).")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--json-schema", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Constrain the output to JSON valid under the JSON schema in this file.")  # fmt: skip
@with_flags(
    DEVICE,
    DTYPE,
    NO_VERIFY,
    CUDA_GRAPH_MAX_BS.but(default=1, help="Largest decode batch captured as a CUDA graph (one prompt: 1)."),
    CUDA_GRAPH,
    ATTENTION_BACKEND,
)
@memory_flags
@artifact_flags
@decode_flags
@REQUIRE_PREPARED
@source_flags
@friendly_errors
def generate(out_dir, prompt, chat, max_tokens, temperature, top_p, top_k, generation_config, seed, stop,
             json_schema, **flags):  # fmt: skip
    """Load the artifact OUT_DIR (a folder, or oci://... pulled into the local store) and print a
    completion of --prompt."""
    out_dir = fetched(out_dir, flags)
    launch = early_launch(out_dir)
    from mlac.runtime.engine.engine import Engine
    from mlac.runtime.engine.generation_config import sampling_defaults
    from mlac.runtime.engine.options import EngineOptions
    from mlac.runtime.engine.params import GrammarSpec, InvalidGrammar

    grammar = None if json_schema is None else GrammarSpec("json_schema", read_json_schema(json_schema))
    engine = Engine.from_artifact(out_dir, EngineOptions.of(**option_fields(flags), launch=launch))
    click.get_current_context().call_on_close(engine.close)  # and a multi-rank artifact's other ranks
    if chat:  # ids, not text: the template wrote bos, and encoding its text would add a second one
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    d = sampling_defaults(out_dir, generation_config)
    temperature, top_p = (
        d.temperature if temperature is None else temperature,
        d.top_p if top_p is None else top_p,
    )
    top_k = d.top_k if top_k is None else top_k
    try:
        out = engine.generate(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              seed=seed, stop=list(stop) or None, grammar=grammar)  # fmt: skip
    except InvalidGrammar as e:  # a schema llguidance cannot compile: name the flag, not the HTTP field
        raise MlacError(f"--json-schema {json_schema}: {str(e).removeprefix('response_format: ')}") from None
    click.echo(out.text)
    log(
        f"[{out.prompt_tokens} prompt tokens, {out.completion_tokens} completion tokens, finish: {out.finish_reason}]"
    )


def read_json_schema(path: Path) -> str:
    """The text of a --json-schema file: a JSON object (MlacError naming the file otherwise)."""
    try:
        text = path.read_text(encoding="utf-8")
        schema = json.loads(text)
    except (UnicodeDecodeError, ValueError) as e:
        raise MlacError(f"--json-schema {path}: not a JSON file ({e})") from None
    if not isinstance(schema, dict):
        raise MlacError(f"--json-schema {path}: a JSON schema is an object, not a {type(schema).__name__}")
    return text


@click.command()
@click.argument("out_dir", type=ARTIFACT)
@click.option(
    "--batch-sizes", default="1,32,256", show_default=True, help="Comma-separated decode batch sizes."
)
@click.option(
    "--input-len", type=click.IntRange(1), default=64, show_default=True, help="Prompt tokens per sequence."
)
@click.option(
    "--output-len",
    type=click.IntRange(2),
    default=64,
    show_default=True,
    help="Tokens generated per sequence.",
)
@with_flags(
    DEVICE.but(help="cpu or cuda (default: cuda when a GPU is present)."),
    DTYPE,
    CUDA_GRAPH.but(help="Decode steps as CUDA graphs."),
    CUDA_GRAPH_MAX_BS.but(help="Largest decode batch captured as a CUDA graph."),
    NUM_BLOCKS.but(type=click.IntRange(1), help="KV cache blocks of 16 tokens (default: CUDA, the memory plan; "
                   "CPU, what the largest batch needs)."),
    NO_VERIFY.but(help=TRUSTED_STORAGE_HELP),
    ATTENTION_BACKEND,
)  # fmt: skip
@click.option(
    "--temperature",
    type=float,
    default=0.0,
    show_default=True,
    help="Every sequence samples at this temperature (0: greedy), as vLLM's bench's flag.",
)
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Every sequence's top_p.")
@click.option("--top-k", type=int, default=0, show_default=True, help="Every sequence's top_k (0: off).")
@click.option("--profile", is_flag=True, help="Also profile decode steps of the smallest batch (CUDA).")
@click.option(
    "--json", "json_path", type=click.Path(path_type=Path), default=None, help="Write the results here."
)
@memory_flags
@artifact_flags
@decode_flags
@REQUIRE_PREPARED
@source_flags
@friendly_errors
def bench(
    out_dir, batch_sizes, input_len, output_len, temperature, top_p, top_k, profile, json_path, **flags
):
    """Prefill and decode speed of OUT_DIR per batch size, against the bandwidth roofline (greedy, or
    every sequence sampling as --temperature, --top-p and --top-k say).

    \b
      mlac bench out/ --batch-sizes 1,32,256 --input-len 64 --output-len 64 --json bench.json
    """
    from mlac.runtime.engine.params import SamplingParams

    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
    SamplingParams(**sampling)  # out of range: one line naming the field, before anything loads
    out_dir = fetched(out_dir, flags)
    launch = early_launch(out_dir)
    from mlac.runtime.engine.engine import Engine
    from mlac.runtime.engine.options import EngineOptions
    from mlac.tools import bench as b

    sizes = parse_batch_sizes(batch_sizes)
    fields = option_fields(flags)
    spec = fields["speculative_num_steps"]
    if fields["num_blocks"] is None and fields["device"] == "cpu":  # what the largest batch needs
        fields["num_blocks"] = max(sizes) * -(-(input_len + output_len + 2 * (spec or 3)) // 16) + 1
    options = EngineOptions.of(**fields, max_running_requests=max(sizes),
                               chunked_prefill_size=max(2048, input_len), launch=launch)  # fmt: skip
    with Engine.from_artifact(out_dir, options) as engine:
        bandwidth, results = b.bench(engine, sizes, input_len, output_len, progress=log, sampling=sampling)
        click.echo(b.table(bandwidth, results))
        prof = (
            b.profile_decode(engine, sizes[0], input_len)
            if profile and engine.device.type == "cuda"
            else None
        )
        if prof is not None:
            click.echo(b.profile_line(prof))
        if json_path is not None:
            rt = options.runtime
            settings = dict(input_len=input_len, output_len=output_len, cuda_graph=rt.cuda_graph,
                            cuda_graph_max_bs=rt.cuda_graph_max_bs, dtype=rt.dtype_name, profile=prof,
                            speculative_num_steps=spec, attention_backend=rt.attention_backend,
                            sampling=sampling)  # fmt: skip
            json_path.write_text(b.to_json(engine, bandwidth, results, **settings) + "\n")


def parse_batch_sizes(text: str) -> list[int]:
    """--batch-sizes: comma-separated integers >= 1, sorted, each once (MlacError otherwise)."""
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise MlacError(f"--batch-sizes {text!r}: expected comma-separated integers, e.g. 1,32,256") from None
    if not sizes or sizes[0] < 1:
        raise MlacError(f"--batch-sizes {text!r}: sizes must be integers >= 1")
    return sizes


@click.command(name="eval")
@click.argument("out_dir", type=ARTIFACT)
@click.option("--text", "text_path", type=click.Path(path_type=Path), required=True,
              help="UTF-8 text file to score.")  # fmt: skip
@click.option("--context-len", type=int, default=None,
              help="Tokens per window (default: the engine's context, at most 2048).")  # fmt: skip
@click.option("--stride", type=int, default=None,
              help="Start a window every N tokens, scoring only its new tokens (default: --context-len).")  # fmt: skip
@click.option("--max-tokens", type=click.IntRange(1), default=None, help="Evaluate only the first N tokens.")
@with_flags(DEVICE, DTYPE, NO_VERIFY.but(help=TRUSTED_STORAGE_HELP))
@click.option(
    "--json", "json_path", type=click.Path(path_type=Path), default=None, help="Write the record here."
)
@memory_flags
@artifact_flags
@REQUIRE_PREPARED
@source_flags
@friendly_errors
def eval_(out_dir, text_path, context_len, stride, max_tokens, json_path, **flags):
    """Perplexity of OUT_DIR over a text file, token-weighted, through the serving runtime.

    \b
      mlac eval out/ --text held_out.txt --context-len 1024 --stride 512 --json ppl.json
    """
    out_dir = fetched(out_dir, flags)
    launch = early_launch(out_dir)
    from mlac.core.artifact import artifact_identity
    from mlac.runtime.engine import perplexity as ppl
    from mlac.runtime.engine.engine import Engine
    from mlac.runtime.engine.options import EngineOptions
    from mlac.tools import evaluate as ev

    text = ev.read_text(text_path)
    options = EngineOptions.of(**option_fields(flags), cuda_graph=False, launch=launch)
    with Engine.from_artifact(out_dir, options) as engine:
        ids, n_bytes = ev.encode_text(engine, text, max_tokens)
        if context_len is None:
            context_len = min(engine.max_context, ppl.DEFAULT_CONTEXT)
        stride = context_len if stride is None else stride
        plan = ppl.plan_windows(len(ids), context_len, stride, engine.max_context)
        with progress(sum(w.end - w.first for w in plan), "scoring", unit="tokens") as bar:
            result = ppl.perplexity(engine, ids, context_len, stride, progress=bar.update)
        click.echo(ev.summary(result, n_bytes))
        if json_path is not None:
            record = ev.to_json(engine, artifact_identity(out_dir), text_path, n_bytes, result,
                                options.runtime.dtype_name)  # fmt: skip
            json_path.write_text(record + "\n")
