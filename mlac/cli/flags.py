"""The command-line flags of the options chain, each declared once, with the options field it sets.

    ServerConfig (serve's HTTP side) ⊃ EngineOptions (chat template, launch)
                                       ⊃ SchedulerConfig (batch limits, speculation, overlap)
                                       ⊃ RuntimeOptions (device, dtype, KV cache, CUDA graphs, ...)

A command takes the flags it offers from this table (`with_flags`, or a Flag as a decorator),
receives them as **flags, and builds its options by field name:
`EngineOptions.of(**option_fields(flags))` (core/options.py puts each field in its layer). Adding
an option is one field on the options type that reads it and one Flag here; a command that words a
flag its own way (another help text, another default) uses `FLAG.but(help=...)`, which keeps the
flag's field and conversion. Nothing here imports torch: conversions import what they need when
the command runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import click

Convert = Callable[[Any, Mapping[str, Any]], Any]  # (the flag's value, every parsed flag) -> the field's


class Flag:
    """One click option and the options field it sets (`field`; None: read by another flag's
    `convert`), its value turned into the field's by `convert` (default: as parsed)."""

    def __init__(self, *decls: str, field: str | None, convert: Convert | None = None, **attrs: Any):
        self.decls, self.field, self.convert, self.attrs = decls, field, convert, attrs
        self.param: str = click.Option(decls, **attrs).name  # the keyword the command receives

    def __call__(self, fn: Callable) -> Callable:
        return click.option(*self.decls, **self.attrs)(fn)

    def but(self, **attrs: Any) -> Flag:
        """This flag with other click attributes (a command's own help, default or type)."""
        return Flag(*self.decls, field=self.field, convert=self.convert, **{**self.attrs, **attrs})

    def value(self, parsed: Mapping[str, Any]) -> Any:
        given = parsed[self.param]
        return given if self.convert is None else self.convert(given, parsed)


def with_flags(*chosen: Flag) -> Callable[[Callable], Callable]:
    """A decorator adding the `chosen` flags, listed in that order by --help."""

    def add(fn: Callable) -> Callable:
        for flag in reversed(chosen):
            fn = flag(fn)
        return fn

    return add


# ---- conversions (the flag's word -> the field's value) --------------------------------------


def _negated(value: bool, parsed: Mapping[str, Any]) -> bool:
    return not value


def _device(value: str | None, parsed: Mapping[str, Any]) -> str:
    from mlac.runtime.worker.device import check_device

    return check_device(value)  # None: cuda when a GPU is present


def _stated(value: str, parsed: Mapping[str, Any]) -> str | None:
    return None if value == "auto" else value  # auto: not stated (the artifact decides)


def _kernel_cache(require_prepared: bool, parsed: Mapping[str, Any]) -> str:
    return "require" if require_prepared else "use"


def _attention_backend(value: str, parsed: Mapping[str, Any]) -> str:
    from mlac.runtime.worker.backend_check import refuse_launch

    refuse_launch(value, parsed.get("device"), parsed.get("dtype"))  # before any process starts
    return value


def _overlap(disabled: bool, parsed: Mapping[str, Any]) -> bool | None:
    return False if disabled else None  # None: on CUDA


def _speculative_num_steps(steps: int | None, parsed: Mapping[str, Any]) -> int:
    from mlac.runtime.engine.options import num_steps_of

    return num_steps_of(parsed.get("speculative_algorithm"), steps)


def _api_key(given: str | None, parsed: Mapping[str, Any]) -> str | None:
    from mlac.runtime.serve.config import api_key_from_env

    return api_key_from_env(given)


# ---- RuntimeOptions ---------------------------------------------------------------------------

DEVICE = Flag("--device", field="device", convert=_device, default=None,
              help="cpu, cuda or cuda:N (default: cuda when a GPU is present).")  # fmt: skip
DTYPE = Flag("--dtype", field="dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16",
             show_default=True)  # fmt: skip
NO_VERIFY = Flag("--no-verify", field="verify", convert=_negated, is_flag=True,
                 help="trusted storage: check sizes only, skip sha256")  # fmt: skip
KV_CACHE_BYTES = Flag("--kv-cache-bytes", field="kv_cache_bytes", type=int, default=None,
                      help="KV cache budget in bytes (default: CUDA, the memory plan; CPU, 1 GiB capped at 4 full "
                      "contexts).")  # fmt: skip
NUM_BLOCKS = Flag("--num-blocks", field="num_blocks", type=int, default=None,
                  help="KV cache size in blocks of 16 tokens (instead of --kv-cache-bytes).")  # fmt: skip
# vLLM's --enforce-eager: another name of --no-cuda-graph
CUDA_GRAPH = Flag("--cuda-graph/--no-cuda-graph", " /--enforce-eager", "cuda_graph", field="cuda_graph", default=True,
                  show_default=True, help="Run decode steps as CUDA graphs (CUDA, bfloat16).")  # fmt: skip
CUDA_GRAPH_MAX_BS = Flag("--cuda-graph-max-bs", field="cuda_graph_max_bs", type=click.IntRange(1, 4096),
                         default=256, show_default=True,
                         help="Largest decode batch captured as a CUDA graph (larger batches replay it in pieces).")  # fmt: skip
DP_ATTENTION = Flag("--dp-attention/--no-dp-attention", field="dp_attention", default=None,
                    help="Refuse an artifact whose plan says otherwise (default: run as it was compiled).")  # fmt: skip
GPU_MEMORY_UTILIZATION = Flag(
    "--gpu-memory-utilization", "--mem-fraction-static", "gpu_memory_utilization", field="gpu_memory_utilization",
    type=float, default=0.9, show_default=True, help="CUDA: fraction of the GPU's memory to use; the KV cache "
    "takes what the weights, CUDA graphs and activations of the artifact's memory plan leave of it.",
)  # fmt: skip
MAX_MODEL_LEN = Flag("--max-model-len", field="max_model_len", type=int, default=None,
                     help="Cap the context (default: the model's max_position_embeddings).")  # fmt: skip
# vLLM's names; the artifact decides both (mlac compile --tp, --kv-cache-dtype): a launch may only state them
TENSOR_PARALLEL_SIZE = Flag("--tensor-parallel-size", "-tp", "tensor_parallel_size", field="tensor_parallel_size",
                            type=click.IntRange(1), default=None,
                            help="Refuse an artifact not compiled for this TP degree (default: as compiled).")  # fmt: skip
KV_CACHE_DTYPE = Flag("--kv-cache-dtype", field="kv_cache_dtype", convert=_stated, default="auto", show_default=True,
                      type=click.Choice(["auto", "bf16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]),
                      help="Refuse an artifact whose KV cache was compiled otherwise (auto: as compiled; fp8 is "
                      "fp8_e4m3).")  # fmt: skip
REQUIRE_PREPARED = Flag("--require-prepared", field="kernel_cache", convert=_kernel_cache, is_flag=True,
                        help="On a GPU, refuse to start without a kernel cache of this GPU's signature (prepare).")  # fmt: skip
# SGLang's name for the choice (vLLM's is the VLLM_ATTENTION_BACKEND variable)
ATTENTION_BACKEND = Flag("--attention-backend", field="attention_backend", convert=_attention_backend,
                         type=click.Choice(["triton", "flashinfer"]), default="triton", show_default=True,
                         help="Whose kernel runs the MLA attention of decode steps: mlac's Triton kernel, or "
                         "FlashInfer's (installed; CUDA, bfloat16, a bf16 KV cache); prefill keeps mlac's.")  # fmt: skip
REQUIRE_SIGNATURE = Flag("--require-signature", field="require_signature", default=None,
                         type=click.Path(exists=True, dir_okay=False, path_type=Path), metavar="PUB.pem",
                         help="Refuse an artifact not signed with this public key's private key (mlac sign), "
                         "before anything loads; use a kernel-cache unit only if it is signed too.")  # fmt: skip

# ---- where an oci:// artifact is pulled to (read by the command, not an options field) ---------

DOWNLOAD_DIR = Flag("--download-dir", field=None, default=None, type=click.Path(path_type=Path),
                    help="With an oci:// ARTIFACT: the local store it is pulled into (default: "
                    "$XDG_CACHE_HOME/mlac, else ~/.cache/mlac); a second start downloads nothing.")  # fmt: skip
PLAIN_HTTP = Flag("--plain-http", field=None, is_flag=True,
                  help="Talk to the registry over plain HTTP (a registry without TLS, e.g. a local one).")  # fmt: skip

# ---- SchedulerConfig --------------------------------------------------------------------------

MAX_RUNNING_REQUESTS = Flag("--max-running-requests", "--max-num-seqs", "max_running_requests",
                            field="max_running_requests", type=int, default=64, show_default=True,
                            help="Most requests in the running batch (--max-num-seqs: vLLM's name).")  # fmt: skip
CHUNKED_PREFILL_SIZE = Flag("--chunked-prefill-size", field="chunked_prefill_size", type=int, default=2048,
                            show_default=True, help="Most prompt tokens run per step.")  # fmt: skip
# vLLM's name; SGLang's --disable-radix-cache is another name of --no-enable-prefix-caching
PREFIX_CACHE = Flag("--enable-prefix-caching/--no-enable-prefix-caching", " /--disable-radix-cache",
                    "enable_prefix_caching", field="prefix_cache", default=True, show_default=True,
                    help="Share the KV of common prompt prefixes between requests (off: recompute every prompt "
                    "from its start).")  # fmt: skip
# SGLang's names; the artifact's MTP layer drafts that many tokens per step (runtime/engine/spec/decode.py)
SPECULATIVE_ALGORITHM = Flag("--speculative-algorithm", field=None, default=None,
                             type=click.Choice(["nextn", "mtp"], case_sensitive=False),
                             help="Speculative decoding with the artifact's MTP (NextN) layer as the draft "
                             "(mtp: an alias).")  # fmt: skip
SPECULATIVE_NUM_STEPS = Flag("--speculative-num-steps", field="speculative_num_steps",
                             convert=_speculative_num_steps, type=click.IntRange(0), default=None,
                             help="Draft tokens per decode step, chained through the MTP layer (0: off; default 3 "
                             "with --speculative-algorithm).")  # fmt: skip
# SGLang's name: overlap scheduling (runtime/engine/overlap.py) is on by default on CUDA
DISABLE_OVERLAP_SCHEDULE = Flag("--disable-overlap-schedule", field="overlap", convert=_overlap, is_flag=True,
                                help="Run each decode step's host work (sampling's sync, detokenizing, stop "
                                "checks) after the step, not while the device runs the next one.")  # fmt: skip

# ---- EngineOptions ----------------------------------------------------------------------------

CHAT_TEMPLATE = Flag("--chat-template", field="chat_template", default=None,
                     type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     help="A Jinja chat template file used instead of the artifact's.")  # fmt: skip

# ---- ServerConfig -----------------------------------------------------------------------------

HOST = Flag("--host", field="host", default="127.0.0.1", show_default=True,
            help="Address to bind (0.0.0.0 exposes the server).")  # fmt: skip
PORT = Flag("--port", field="port", type=click.IntRange(1, 65535), default=8000, show_default=True)
API_KEY = Flag("--api-key", field="api_key", convert=_api_key, default=None,
               help="Require 'Authorization: Bearer KEY' on /v1 routes (default: env MLAC_API_KEY).")  # fmt: skip
MAX_QUEUE = Flag("--max-queue", field="max_queue", type=int, default=256, show_default=True,
                 help="Requests waiting beyond the running batch before 503.")  # fmt: skip
DRAIN_TIMEOUT = Flag("--drain-timeout", field="drain_timeout", type=float, default=30.0, show_default=True,
                     help="Seconds SIGTERM waits for running requests.")  # fmt: skip
SERVED_MODEL_NAME = Flag("--served-model-name", field="served_model_name", default=None,
                         help="Model id of the API (default: OUT_DIR's name).")  # fmt: skip
GENERATION_CONFIG = Flag("--generation-config", field="generation_config", default="auto", show_default=True,
                         help="Default sampling of requests that leave it out: auto (the artifact's "
                         "generation_config.json), vllm or none (mlac's: temperature 1, no top-p/top-k), or a "
                         "folder with a generation_config.json.")  # fmt: skip
REASONING_PARSER = Flag("--reasoning-parser", field="reasoning_parser",
                        type=click.Choice(["deepseek_r1", "deepseek_v3"]), default=None,
                        help="Chat: return the text before </think> as reasoning_content (deepseek_r1: every "
                        "answer; deepseek_v3, DeepSeek-V3.1: with chat_template_kwargs {\"thinking\": true}; "
                        "default: none).")  # fmt: skip
TOOL_CALL_PARSER = Flag("--tool-call-parser", field="tool_call_parser",
                        type=click.Choice(["deepseek_v3", "deepseek_v31"]), default=None,
                        help="Chat: parse DeepSeek-V3's (or V3.1's) tool calls out of answers into tool_calls "
                        "(default: none).")  # fmt: skip
ENABLE_AUTO_TOOL_CHOICE = Flag("--enable-auto-tool-choice", field="enable_auto_tool_choice", is_flag=True,
                               help='Allow tool_choice "auto" (the default for requests with tools); needs '
                               "--tool-call-parser.")  # fmt: skip
MAX_BODY_BYTES = Flag("--max-body-bytes", field="max_body_bytes", type=int, default=4 << 20, show_default=True,
                      help="Largest request body accepted.")  # fmt: skip
REQUEST_BODY_TIMEOUT = Flag("--request-body-timeout", field="request_body_timeout", type=float, default=30.0,
                            show_default=True, help="Seconds a client has to send a request body (408 and the "
                            "connection closed past it).")  # fmt: skip
WARMUP = Flag("--warmup/--no-warmup", field="warmup", default=True, show_default=True,
              help="On CUDA, run the step shapes once (Triton JIT) before /health reports ready.")  # fmt: skip
LOG_REQUESTS = Flag("--enable-log-requests/--disable-log-requests", "--log-requests", "log_requests",
                    field="log_requests", default=False, show_default=True,
                    help="Log one line per request at arrival and one at its end.")  # fmt: skip
DISABLE_LOG_STATS = Flag("--disable-log-stats", field="log_stats", convert=_negated, is_flag=True,
                         help="No periodic stats line (throughput, queue, KV usage).")  # fmt: skip
LOG_STATS_INTERVAL = Flag("--log-stats-interval", field="log_stats_interval", type=float, default=10.0,
                          show_default=True, help="Seconds between two stats lines while the server is busy.")  # fmt: skip

RUNTIME_FLAGS = (DEVICE, DTYPE, NO_VERIFY, KV_CACHE_BYTES, NUM_BLOCKS, CUDA_GRAPH, CUDA_GRAPH_MAX_BS,
                 DP_ATTENTION, TENSOR_PARALLEL_SIZE, KV_CACHE_DTYPE, GPU_MEMORY_UTILIZATION, MAX_MODEL_LEN,
                 REQUIRE_PREPARED, REQUIRE_SIGNATURE, ATTENTION_BACKEND)  # fmt: skip
SOURCE_FLAGS = (DOWNLOAD_DIR, PLAIN_HTTP)
SCHEDULER_FLAGS = (MAX_RUNNING_REQUESTS, CHUNKED_PREFILL_SIZE, PREFIX_CACHE, SPECULATIVE_ALGORITHM,
                   SPECULATIVE_NUM_STEPS, DISABLE_OVERLAP_SCHEDULE)  # fmt: skip
ENGINE_FLAGS = (CHAT_TEMPLATE,)
SERVER_FLAGS = (HOST, PORT, API_KEY, MAX_QUEUE, DRAIN_TIMEOUT, SERVED_MODEL_NAME, GENERATION_CONFIG,
                REASONING_PARSER, TOOL_CALL_PARSER, ENABLE_AUTO_TOOL_CHOICE, MAX_BODY_BYTES, REQUEST_BODY_TIMEOUT,
                WARMUP, LOG_REQUESTS, DISABLE_LOG_STATS, LOG_STATS_INTERVAL)  # fmt: skip
BY_PARAM = {
    f.param: f for f in (*RUNTIME_FLAGS, *SCHEDULER_FLAGS, *ENGINE_FLAGS, *SERVER_FLAGS, *SOURCE_FLAGS)
}

# the groups several commands take whole
memory_flags = with_flags(GPU_MEMORY_UTILIZATION, MAX_MODEL_LEN)  # see runtime/worker/memory_plan.py
artifact_flags = with_flags(TENSOR_PARALLEL_SIZE, KV_CACHE_DTYPE)  # what a launch states of the artifact
source_flags = with_flags(REQUIRE_SIGNATURE, DOWNLOAD_DIR, PLAIN_HTTP)  # an artifact from a registry, trusted
decode_flags = with_flags(SPECULATIVE_ALGORITHM, SPECULATIVE_NUM_STEPS, DISABLE_OVERLAP_SCHEDULE)


def option_fields(flags: Mapping[str, Any]) -> dict[str, Any]:
    """{options field: value} of a command's parsed flags of this table (every key of `flags`)."""
    unknown = flags.keys() - BY_PARAM.keys()
    if unknown:
        raise TypeError(f"not flags of the options table: {', '.join(sorted(unknown))}")
    fields = (BY_PARAM[param] for param in flags)
    return {f.field: f.value(flags) for f in fields if f.field is not None}
