"""mlac command line: compile, prepare, inspect, verify, synth, generate, serve, bench, eval, export, demo.

Thin wiring over the Python API. Every MlacError becomes `error: <message>` on stderr with exit
code 1 and no traceback.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import click

from mlac.core.errors import MlacError

PROCESS_START = time.monotonic()  # the start-up log's import phase counts from here


def friendly_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MlacError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            sys.exit(130)

    return wrapper


def _progress(length: int, label: str):
    return click.progressbar(length=length, label=label, file=sys.stderr, show_eta=True, show_percent=True,
                             item_show_func=None, width=30)  # fmt: skip


def _log(msg: str) -> None:
    click.echo(msg, err=True)


def _memory_options(fn):
    """--gpu-memory-utilization (alias --mem-fraction-static) and --max-model-len, of the commands
    that run a model (see mlac/runtime/worker/memory_plan.py)."""
    fn = click.option("--max-model-len", type=int, default=None,
                      help="Cap the context (default: the model's max_position_embeddings).")(fn)  # fmt: skip
    return click.option(
        "--gpu-memory-utilization", "--mem-fraction-static", "gpu_memory_utilization", type=float, default=0.9,
        show_default=True, help="CUDA: fraction of the GPU's memory to use; the KV cache takes what the weights, "
        "CUDA graphs and activations of the artifact's memory plan leave of it.",
    )(fn)  # fmt: skip


def _speculative_options(fn):
    """--speculative-algorithm and --speculative-num-steps (SGLang's names), of the commands that
    decode: the artifact's MTP layer drafts that many tokens per step (runtime/spec_decode.py)."""
    fn = click.option("--speculative-num-steps", type=click.IntRange(0), default=None,
                      help="Draft tokens per decode step, chained through the MTP layer (0: off; default 3 "
                           "with --speculative-algorithm).")(fn)  # fmt: skip
    return click.option("--speculative-algorithm", type=click.Choice(["nextn", "mtp"], case_sensitive=False),
                        default=None, help="Speculative decoding with the artifact's MTP (NextN) layer as the "
                        "draft (mtp: an alias).")(fn)  # fmt: skip


def _overlap_option(fn):
    """--disable-overlap-schedule (SGLang's name), of the commands that decode: overlap scheduling
    (runtime/overlap.py) is on by default on CUDA (one rank or several; not under DP attention)."""
    return click.option("--disable-overlap-schedule", is_flag=True,
                        help="Run each decode step's host work (sampling's sync, detokenizing, stop checks) "
                        "after the step, not while the device runs the next one.")(fn)  # fmt: skip


def _early_launch(out_dir):
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


def _overlap(disabled: bool) -> bool | None:
    """SchedulerConfig.overlap of --disable-overlap-schedule: False, else None (on CUDA)."""
    return False if disabled else None


REQUIRE_PREPARED_HELP = "On a GPU, refuse to start without a kernel cache of this GPU's signature (prepare)."


def _read_json_schema(path: Path) -> str:
    """The text of a --json-schema file: a JSON object (MlacError naming the file otherwise)."""
    try:
        text = path.read_text(encoding="utf-8")
        schema = json.loads(text)
    except (UnicodeDecodeError, ValueError) as e:
        raise MlacError(f"--json-schema {path}: not a JSON file ({e})") from None
    if not isinstance(schema, dict):
        raise MlacError(f"--json-schema {path}: a JSON schema is an object, not a {type(schema).__name__}")
    return text


def _cache_mode(require_prepared: bool) -> str:
    return "require" if require_prepared else "use"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mlac")
def main() -> None:
    """mlac: compile DeepSeek checkpoints into verified artifacts, and run them.

    \b
      mlac synth tiny-v3 ckpt/            # a synthetic checkpoint (random weights)
      mlac compile --fp8 ckpt/ out/       # HF checkpoint -> artifact
      mlac generate out/ --prompt "Hi"    # run it
    """


@main.command()
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
    with _progress(ckpt.total_bytes, "compiling") as bar:
        manifest = compile_checkpoint(ckpt, out_dir, options, force=force, progress=bar.update, log=_log,
                                      calibration_text=calibration_text)  # fmt: skip
    acc = manifest.accuracy
    if acc.status == "measured":
        _log(
            f"accuracy vs {acc.reference}: rel_l2={acc.rel_l2:.3e} max_abs={acc.max_abs:.3e} top1={acc.top1_agreement:.4f}"
        )
    else:
        _log(f"accuracy: skipped ({acc.reason})")
    click.echo(f"wrote {out_dir}")
    if then_prepare:
        from mlac.runtime.engine.options import EngineOptions
        from mlac.tools.prepare import prepare as run_prepare

        cache = run_prepare(out_dir, EngineOptions.of(device="cuda"), log=_log)
        click.echo(f"prepared {out_dir} for {cache.key}")


@main.command()
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--device", default="cuda", show_default=True, help="cuda or cuda:N: the GPU to prepare for.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True,
              help="Compute dtype the server will run (serve's --dtype).")  # fmt: skip
@click.option("--max-running-requests", type=click.IntRange(1), default=64, show_default=True,
              help="As serve's: the largest decode batch warmed up.")  # fmt: skip
@click.option("--chunked-prefill-size", type=click.IntRange(1), default=2048, show_default=True,
              help="As serve's: the largest prefill warmed up.")  # fmt: skip
@click.option("--cuda-graph-max-bs", type=click.IntRange(1, 4096), default=256, show_default=True,
              help="As serve's: the largest decode batch captured as a CUDA graph.")  # fmt: skip
@friendly_errors
def prepare(out_dir, device, dtype, max_running_requests, chunked_prefill_size, cuda_graph_max_bs):
    """Compile on this GPU every kernel the server meets and add them to the artifact OUT_DIR.

    Builds the engine as `mlac serve` does (CUDA graphs for every decode bucket) and warms it up
    with an empty Triton cache, then stores that cache under OUT_DIR/cache/<target>/, hashed in the
    manifest with this GPU's signature (name, compute capability, CUDA, driver, torch, triton).
    Atomic: an interrupted prepare leaves the artifact as it was. A server on a GPU of the same
    signature then compiles nothing. Preparing a target again replaces its cache.
    """
    from mlac.runtime.engine.options import EngineOptions
    from mlac.runtime.worker.device import check_device
    from mlac.tools.prepare import prepare as run_prepare

    options = EngineOptions.of(device=check_device(device), dtype=dtype, max_running_requests=max_running_requests,
                               chunked_prefill_size=chunked_prefill_size, cuda_graph_max_bs=cuda_graph_max_bs)  # fmt: skip
    cache = run_prepare(out_dir, options, log=_log)
    click.echo(f"prepared {out_dir} for {cache.key}: {cache.files} files, {cache.bytes / 1e6:.1f} MB")


@main.command()
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


@main.command()
@click.argument("out_dir", type=click.Path(path_type=Path))
@friendly_errors
def verify(out_dir):
    """Check the manifest against its identity (manifest.sha256) and re-hash every file against the
    manifest; refuse symlinks; name the first thing that differs. Prints the identity."""
    from mlac.core.artifact import Manifest, check_identity, verify_files

    manifest = Manifest.load(out_dir)
    identity = check_identity(out_dir, manifest)
    total = sum(f.size for f in manifest.files)
    with _progress(total, "verifying") as bar:
        verify_files(out_dir, manifest, progress=bar.update)
    click.echo(
        f"ok: {len(manifest.files)} files, {total / 1e9:.3f} GB match the manifest; identity {identity}"
    )


@main.command()
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
    with _progress(total, "writing") as bar:
        path = synthesize(out_dir, preset=preset, config_path=config_path, seed=seed, num_layers=num_layers,
                          progress=bar.update)  # fmt: skip
    click.echo(f"wrote {path}")


@main.command()
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option(
    "--prompt", required=True, help="Prompt text (encoded with the artifact's tokenizer, BOS prepended)."
)
@click.option("--chat", is_flag=True, help="Render the prompt as one user message through the chat template.")
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="A Jinja chat template file used instead of the artifact's.")  # fmt: skip
@click.option("--max-tokens", type=int, default=32, show_default=True)
@click.option("--temperature", type=float, default=None, help="0 means greedy (default: --generation-config's).")
@click.option("--top-p", type=float, default=None, help="Default: --generation-config's.")
@click.option("--top-k", type=int, default=None, help="0 means off (default: --generation-config's).")
@click.option("--generation-config", default="auto", show_default=True,
              help="Default sampling of requests that leave it out: auto (the artifact's generation_config.json), "
                   "vllm or none (mlac's: temperature 1, no top-p/top-k), or a folder with a generation_config.json.")  # fmt: skip
@click.option("--seed", type=int, default=None, help="Sampling seed (same seed, same output).")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--json-schema", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Constrain the output to JSON valid under the JSON schema in this file.")  # fmt: skip
@click.option("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when a GPU is present).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True)
@click.option("--no-verify", is_flag=True, help="trusted storage: check sizes only, skip sha256")
@click.option("--cuda-graph-max-bs", type=click.IntRange(1, 4096), default=1, show_default=True,
              help="Largest decode batch captured as a CUDA graph (one prompt: 1).")  # fmt: skip
@click.option("--cuda-graph/--no-cuda-graph", default=True, show_default=True,
              help="Run decode steps as CUDA graphs (CUDA, bfloat16).")  # fmt: skip
@_memory_options
@_speculative_options
@_overlap_option
@click.option("--require-prepared", is_flag=True, help=REQUIRE_PREPARED_HELP)
@friendly_errors
def generate(out_dir, prompt, chat, chat_template, max_tokens, temperature, top_p, top_k, generation_config, seed, stop, json_schema,
             device, dtype, no_verify, cuda_graph, cuda_graph_max_bs, require_prepared, gpu_memory_utilization, max_model_len,
             speculative_algorithm, speculative_num_steps, disable_overlap_schedule):  # fmt: skip
    """Load an artifact and print a completion of --prompt."""
    launch = _early_launch(out_dir)
    from mlac.runtime.engine.constrain import GrammarSpec, InvalidGrammar
    from mlac.runtime.engine.engine import Engine
    from mlac.runtime.engine.generation_config import sampling_defaults
    from mlac.runtime.engine.options import EngineOptions
    from mlac.runtime.engine.scheduler import SchedulerConfig
    from mlac.runtime.engine.spec.decode import num_steps_of
    from mlac.runtime.worker.device import check_device

    grammar = None if json_schema is None else GrammarSpec("json_schema", _read_json_schema(json_schema))
    sched = SchedulerConfig(speculative_num_steps=num_steps_of(speculative_algorithm, speculative_num_steps),
                            overlap=_overlap(disable_overlap_schedule))  # fmt: skip
    options = EngineOptions.of(device=check_device(device), dtype=dtype, verify=not no_verify, cuda_graph=cuda_graph,
                               cuda_graph_max_bs=cuda_graph_max_bs, max_model_len=max_model_len,
                               gpu_memory_utilization=gpu_memory_utilization, kernel_cache=_cache_mode(require_prepared),
                               scheduler=sched, chat_template=chat_template, launch=launch)  # fmt: skip
    engine = Engine.from_artifact(out_dir, options)
    click.get_current_context().call_on_close(engine.close)  # and a multi-rank artifact's other ranks
    if chat:  # ids, not text: the template wrote bos, and encoding its text would add a second one
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    d = sampling_defaults(out_dir, generation_config)
    temperature, top_p = d.temperature if temperature is None else temperature, d.top_p if top_p is None else top_p
    top_k = d.top_k if top_k is None else top_k
    try:
        out = engine.generate(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              seed=seed, stop=list(stop) or None, grammar=grammar)  # fmt: skip
    except InvalidGrammar as e:  # a schema llguidance cannot compile: name the flag, not the HTTP field
        raise MlacError(f"--json-schema {json_schema}: {str(e).removeprefix('response_format: ')}") from None
    click.echo(out.text)
    _log(
        f"[{out.prompt_tokens} prompt tokens, {out.completion_tokens} completion tokens, finish: {out.finish_reason}]"
    )


@main.command()
@click.argument("out_dir", type=click.Path(path_type=Path))
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
@click.option("--device", default=None, help="cpu or cuda (default: cuda when a GPU is present).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True)
@click.option(
    "--cuda-graph/--no-cuda-graph", default=True, show_default=True, help="Decode steps as CUDA graphs."
)
@click.option("--cuda-graph-max-bs", type=click.IntRange(1, 4096), default=256, show_default=True,
              help="Largest decode batch captured as a CUDA graph.")  # fmt: skip
@click.option("--num-blocks", type=click.IntRange(1), default=None,
              help="KV cache blocks of 16 tokens (default: CUDA, the memory plan; CPU, what the largest batch needs).")  # fmt: skip
@click.option("--no-verify", is_flag=True, help="Trusted storage: check file sizes only, skip sha256.")
@click.option("--profile", is_flag=True, help="Also profile decode steps of the smallest batch (CUDA).")
@click.option(
    "--json", "json_path", type=click.Path(path_type=Path), default=None, help="Write the results here."
)
@_memory_options
@_speculative_options
@_overlap_option
@click.option("--require-prepared", is_flag=True, help=REQUIRE_PREPARED_HELP)
@friendly_errors
def bench(out_dir, batch_sizes, input_len, output_len, device, dtype, cuda_graph, cuda_graph_max_bs, num_blocks,
          no_verify, profile, json_path, require_prepared, gpu_memory_utilization, max_model_len,
          speculative_algorithm, speculative_num_steps, disable_overlap_schedule):  # fmt: skip
    """Prefill and decode speed of OUT_DIR per batch size, against the bandwidth roofline.

    \b
      mlac bench out/ --batch-sizes 1,32,256 --input-len 64 --output-len 64 --json bench.json
    """
    launch = _early_launch(out_dir)
    from mlac.runtime.engine.engine import Engine
    from mlac.runtime.engine.options import EngineOptions
    from mlac.runtime.engine.scheduler import SchedulerConfig
    from mlac.runtime.worker.device import check_device
    from mlac.tools import bench as b

    sizes = _batch_sizes(batch_sizes)
    device = check_device(device)
    if num_blocks is None and device == "cpu":
        num_blocks = max(sizes) * -(-(input_len + output_len + 2 * (speculative_num_steps or 3)) // 16) + 1
    from mlac.runtime.engine.spec.decode import num_steps_of

    spec = num_steps_of(speculative_algorithm, speculative_num_steps)
    sched = SchedulerConfig(max_running_requests=max(sizes), chunked_prefill_size=max(2048, input_len),
                            speculative_num_steps=spec, overlap=_overlap(disable_overlap_schedule))  # fmt: skip
    options = EngineOptions.of(device=device, dtype=dtype, verify=not no_verify, num_blocks=num_blocks, scheduler=sched,
                               cuda_graph=cuda_graph, cuda_graph_max_bs=cuda_graph_max_bs, max_model_len=max_model_len,
                               gpu_memory_utilization=gpu_memory_utilization,
                               kernel_cache=_cache_mode(require_prepared), launch=launch)  # fmt: skip
    engine = Engine.from_artifact(out_dir, options)
    with engine:
        bandwidth, results = b.bench(engine, sizes, input_len, output_len, progress=_log)
        click.echo(b.table(bandwidth, results))
        prof = (
            b.profile_decode(engine, sizes[0], input_len)
            if profile and engine.device.type == "cuda"
            else None
        )
        if prof is not None:
            click.echo(b.profile_line(prof))
        if json_path is not None:
            settings = dict(input_len=input_len, output_len=output_len, cuda_graph=cuda_graph,
                            cuda_graph_max_bs=cuda_graph_max_bs, dtype=dtype, profile=prof,
                            speculative_num_steps=spec)  # fmt: skip
            json_path.write_text(b.to_json(engine, bandwidth, results, **settings) + "\n")


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise MlacError(f"--batch-sizes {text!r}: expected comma-separated integers, e.g. 1,32,256") from None
    if not sizes or sizes[0] < 1:
        raise MlacError(f"--batch-sizes {text!r}: sizes must be integers >= 1")
    return sizes


@main.command(name="eval")
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--text", "text_path", type=click.Path(path_type=Path), required=True,
              help="UTF-8 text file to score.")  # fmt: skip
@click.option("--context-len", type=int, default=None,
              help="Tokens per window (default: the engine's context, at most 2048).")  # fmt: skip
@click.option("--stride", type=int, default=None,
              help="Start a window every N tokens, scoring only its new tokens (default: --context-len).")  # fmt: skip
@click.option("--max-tokens", type=click.IntRange(1), default=None, help="Evaluate only the first N tokens.")
@click.option("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when a GPU is present).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True)
@click.option("--no-verify", is_flag=True, help="Trusted storage: check file sizes only, skip sha256.")
@click.option(
    "--json", "json_path", type=click.Path(path_type=Path), default=None, help="Write the record here."
)
@_memory_options
@click.option("--require-prepared", is_flag=True, help=REQUIRE_PREPARED_HELP)
@friendly_errors
def eval_(out_dir, text_path, context_len, stride, max_tokens, device, dtype, no_verify, json_path,
          require_prepared, gpu_memory_utilization, max_model_len):  # fmt: skip
    """Perplexity of OUT_DIR over a text file, token-weighted, through the serving runtime.

    \b
      mlac eval out/ --text held_out.txt --context-len 1024 --stride 512 --json ppl.json
    """
    launch = _early_launch(out_dir)
    from mlac.core.artifact import artifact_identity
    from mlac.runtime.engine import perplexity as ppl
    from mlac.runtime.engine.engine import Engine
    from mlac.runtime.engine.options import EngineOptions
    from mlac.runtime.worker.device import check_device
    from mlac.tools import evaluate as ev

    text = ev.read_text(text_path)
    options = EngineOptions.of(device=check_device(device), dtype=dtype, verify=not no_verify, cuda_graph=False,
                               max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                               kernel_cache=_cache_mode(require_prepared), launch=launch)  # fmt: skip
    engine = Engine.from_artifact(out_dir, options)
    with engine:
        ids, n_bytes = ev.encode_text(engine, text, max_tokens)
        if context_len is None:
            context_len = min(engine.max_context, ppl.DEFAULT_CONTEXT)
        stride = context_len if stride is None else stride
        plan = ppl.plan_windows(len(ids), context_len, stride, engine.max_context)
        with _progress(sum(w.end - w.first for w in plan), "scoring") as bar:
            result = ppl.perplexity(engine, ids, context_len, stride, progress=bar.update)
        click.echo(ev.summary(result, n_bytes))
        if json_path is not None:
            record = ev.to_json(engine, artifact_identity(out_dir), text_path, n_bytes, result, dtype)
            json_path.write_text(record + "\n")


@main.command()
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 exposes the server)."
)
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option(
    "--api-key",
    default=None,
    help="Require 'Authorization: Bearer KEY' on /v1 routes (default: env MLAC_API_KEY).",
)
@click.option("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when a GPU is present).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True)
@click.option(
    "--max-running-requests",
    type=int,
    default=64,
    show_default=True,
    help="Most requests in the running batch.",
)
@click.option(
    "--chunked-prefill-size",
    type=int,
    default=2048,
    show_default=True,
    help="Most prompt tokens run per step.",
)
@click.option(
    "--disable-radix-cache",
    is_flag=True,
    help="Recompute every prompt from its start (no prefix cache shared between requests).",
)
@click.option(
    "--kv-cache-bytes",
    type=int,
    default=None,
    help="KV cache budget in bytes (default: CUDA, the memory plan; CPU, 1 GiB capped at 4 full contexts).",
)
@click.option(
    "--num-blocks",
    type=int,
    default=None,
    help="KV cache size in blocks of 16 tokens (instead of --kv-cache-bytes).",
)
@click.option(
    "--max-queue",
    type=int,
    default=256,
    show_default=True,
    help="Requests waiting beyond the running batch before 503.",
)
@click.option(
    "--drain-timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds SIGTERM waits for running requests.",
)
@click.option("--served-model-name", default=None, help="Model id of the API (default: OUT_DIR's name).")
@click.option("--generation-config", default="auto", show_default=True,
              help="Default sampling of requests that leave it out: auto (the artifact's generation_config.json), "
                   "vllm or none (mlac's: temperature 1, no top-p/top-k), or a folder with a generation_config.json.")  # fmt: skip
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="A Jinja chat template file used instead of the artifact's.")  # fmt: skip
@click.option("--reasoning-parser", type=click.Choice(["deepseek_r1"]), default=None,
              help="Chat: return the text before </think> as reasoning_content (DeepSeek-R1; default: none).")  # fmt: skip
@click.option("--tool-call-parser", type=click.Choice(["deepseek_v3"]), default=None,
              help="Chat: parse DeepSeek-V3 tool calls out of answers into tool_calls (default: none).")  # fmt: skip
@click.option("--enable-auto-tool-choice", is_flag=True,
              help='Allow tool_choice "auto" (the default for requests with tools); needs --tool-call-parser.')  # fmt: skip
@click.option(
    "--max-body-bytes", type=int, default=4 << 20, show_default=True, help="Largest request body accepted."
)
@click.option(
    "--request-body-timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds a client has to send a request body (408 and the connection closed past it).",
)
@click.option("--nnodes", type=int, default=1, show_default=True, help="Nodes of a multi-rank artifact.")
@click.option(
    "--node-rank", type=int, default=0, show_default=True, help="This node's rank (node 0 serves HTTP)."
)
@click.option("--master-addr", default="127.0.0.1", show_default=True, help="Rendezvous address (node 0).")
@click.option(
    "--master-port", type=click.IntRange(1, 65535), default=29500, show_default=True, help="Rendezvous port."
)
@click.option("--cuda-graph/--no-cuda-graph", default=True, show_default=True,
              help="Run decode steps as CUDA graphs (CUDA, bfloat16).")  # fmt: skip
@click.option("--cuda-graph-max-bs", type=click.IntRange(1, 4096), default=256, show_default=True,
              help="Largest decode batch captured as a CUDA graph (larger batches run eagerly).")  # fmt: skip
@click.option("--dp-attention/--no-dp-attention", default=None,
              help="Refuse an artifact whose plan says otherwise (default: run as it was compiled).")  # fmt: skip
@click.option(
    "--warmup/--no-warmup",
    default=True,
    show_default=True,
    help="On CUDA, run the step shapes once (Triton JIT) before /health reports ready.",
)
@click.option(
    "--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True
)
@click.option("--enable-log-requests/--disable-log-requests", "--log-requests", "log_requests", default=False,
              show_default=True, help="Log one line per request at arrival and one at its end.")  # fmt: skip
@click.option("--disable-log-stats", is_flag=True, help="No periodic stats line (throughput, queue, KV usage).")
@click.option("--log-stats-interval", type=float, default=10.0, show_default=True,
              help="Seconds between two stats lines while the server is busy.")  # fmt: skip
@click.option("--no-verify", is_flag=True, help="trusted storage: check sizes only, skip sha256")
@_memory_options
@_speculative_options
@_overlap_option
@click.option("--require-prepared", is_flag=True, help=REQUIRE_PREPARED_HELP)
@click.option("--engine-process/--no-engine-process", default=True, show_default=True,
              help="Run the engine in a process of its own (else on a thread of the HTTP server's).")  # fmt: skip
@friendly_errors
def serve(out_dir, host, port, api_key, device, dtype, max_running_requests, chunked_prefill_size,
          disable_radix_cache, kv_cache_bytes,
          num_blocks, max_queue, drain_timeout, served_model_name, generation_config, chat_template,
          reasoning_parser, tool_call_parser, enable_auto_tool_choice, max_body_bytes, request_body_timeout, nnodes,
          node_rank, master_addr, master_port, cuda_graph, cuda_graph_max_bs, dp_attention, warmup, log_level,
          log_requests, disable_log_stats, log_stats_interval, no_verify, require_prepared, gpu_memory_utilization,
          max_model_len, speculative_algorithm, speculative_num_steps, disable_overlap_schedule,
          engine_process):  # fmt: skip
    """Serve the artifact OUT_DIR over an OpenAI-compatible HTTP API (see docs/serving.md).

    \b
      mlac serve out/ --port 8000
      curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "out", "messages": [{"role": "user", "content": "Hi"}]}'
    """
    from mlac.runtime.dist.world import LaunchSpec, launches_rank_0, start_node_ranks
    from mlac.runtime.serve.engine_process import EngineProcess

    launch = LaunchSpec(nnodes=nnodes, node_rank=node_rank, master_addr=master_addr, master_port=master_port)
    launch = launch if nnodes > 1 else None
    serves = launches_rank_0(launch)  # else another node, or torchrun RANK > 0: no HTTP server here
    # the other ranks of this node start now and import torch while this process (or the engine's) does
    if not serves:
        launch = replace(launch or LaunchSpec(), ranks=start_node_ranks(out_dir, launch))
    process = EngineProcess.start(out_dir, launch) if engine_process and serves else None
    if process is not None:
        click.get_current_context().call_on_close(process.close)
    from mlac.runtime.engine.scheduler import SchedulerConfig
    from mlac.runtime.engine.spec.decode import num_steps_of
    from mlac.runtime.serve import ServerConfig, api_key_from_env, load_engine
    from mlac.runtime.serve import serve as run_server
    from mlac.runtime.worker.device import check_device

    device = check_device(device)
    config = ServerConfig.of(
        artifact=out_dir, host=host, port=port, api_key=api_key_from_env(api_key), device=device, dtype=dtype,
        scheduler=SchedulerConfig(max_running_requests=max_running_requests, chunked_prefill_size=chunked_prefill_size,
                                  prefix_cache=not disable_radix_cache, overlap=_overlap(disable_overlap_schedule),
                                  speculative_num_steps=num_steps_of(speculative_algorithm, speculative_num_steps)),
        num_blocks=num_blocks, kv_cache_bytes=kv_cache_bytes, max_queue=max_queue, drain_timeout=drain_timeout,
        served_model_name=served_model_name, launch=launch, max_body_bytes=max_body_bytes,
        request_body_timeout=request_body_timeout, warmup=warmup, verify=not no_verify, cuda_graph=cuda_graph,
        cuda_graph_max_bs=cuda_graph_max_bs, gpu_memory_utilization=gpu_memory_utilization, dp_attention=dp_attention,
        max_model_len=max_model_len, process_start=PROCESS_START, kernel_cache=_cache_mode(require_prepared),
        chat_template=chat_template, generation_config=generation_config, reasoning_parser=reasoning_parser,
        tool_call_parser=tool_call_parser, enable_auto_tool_choice=enable_auto_tool_choice,
        log_requests=log_requests, log_stats=not disable_log_stats, log_stats_interval=log_stats_interval,
        engine_process=process is not None,
    )  # fmt: skip
    if not serves:  # this node's ranks run rank 0's steps inside make_runner, which ends the process
        try:
            load_engine(config).close()
        finally:
            if launch.ranks is not None:
                launch.ranks.close()  # those the load did not take: it failed before it needed them
        return
    run_server(config, log_level=log_level, process=process)


@main.group()
def export() -> None:
    """Export a compiled artifact to another format (onnx)."""


@export.command(name="onnx")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--force", is_flag=True, help="Replace OUT_DIR if it exists (only once the export is complete).")
@click.option("--no-verify", is_flag=True, help="Skip re-hashing the artifact's files (sizes are still checked).")
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
    with _progress(job.total_bytes, "exporting") as bar:
        path = job.write(progress=bar.update, log=_log)
    click.echo(f"wrote {path} ({job.layout.summary()})")


@main.command()
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


if __name__ == "__main__":
    main()
