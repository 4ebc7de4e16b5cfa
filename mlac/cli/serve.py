"""`mlac serve`: the OpenAI-compatible server over an artifact (runtime/serve/).

The order matters for the start-up time: the engine's process (and a multi-rank artifact's other
ranks) start first and import torch while this process imports the HTTP stack; the ServerConfig
is built from the flags after that, and passed down whole.
"""

from __future__ import annotations

from dataclasses import replace

import click

from mlac.cli.common import PROCESS_START, friendly_errors
from mlac.cli.flags import (
    API_KEY,
    ATTENTION_BACKEND,
    CHAT_TEMPLATE,
    CHUNKED_PREFILL_SIZE,
    CUDA_GRAPH,
    CUDA_GRAPH_MAX_BS,
    DEVICE,
    DISABLE_LOG_STATS,
    DP_ATTENTION,
    DRAIN_TIMEOUT,
    DTYPE,
    ENABLE_AUTO_TOOL_CHOICE,
    GENERATION_CONFIG,
    HOST,
    KV_CACHE_BYTES,
    KV_CACHE_DTYPE,
    LOG_REQUESTS,
    LOG_STATS_INTERVAL,
    MAX_BODY_BYTES,
    MAX_QUEUE,
    MAX_RUNNING_REQUESTS,
    NO_VERIFY,
    NUM_BLOCKS,
    PORT,
    PREFIX_CACHE,
    REASONING_PARSER,
    REQUEST_BODY_TIMEOUT,
    REQUIRE_PREPARED,
    SERVED_MODEL_NAME,
    TENSOR_PARALLEL_SIZE,
    TOOL_CALL_PARSER,
    WARMUP,
    decode_flags,
    memory_flags,
    option_fields,
    source_flags,
    with_flags,
)
from mlac.cli.ship import ARTIFACT, fetched


@click.command()
@click.argument("out_dir", type=ARTIFACT)
@with_flags(HOST, PORT, API_KEY, DEVICE, DTYPE, TENSOR_PARALLEL_SIZE, KV_CACHE_DTYPE, MAX_RUNNING_REQUESTS,
            CHUNKED_PREFILL_SIZE, PREFIX_CACHE, KV_CACHE_BYTES, NUM_BLOCKS, MAX_QUEUE, DRAIN_TIMEOUT, SERVED_MODEL_NAME,
            GENERATION_CONFIG, CHAT_TEMPLATE, REASONING_PARSER, TOOL_CALL_PARSER, ENABLE_AUTO_TOOL_CHOICE,
            MAX_BODY_BYTES, REQUEST_BODY_TIMEOUT)  # fmt: skip
@click.option("--nnodes", type=int, default=1, show_default=True, help="Nodes of a multi-rank artifact.")
@click.option(
    "--node-rank", type=int, default=0, show_default=True, help="This node's rank (node 0 serves HTTP)."
)
@click.option("--master-addr", default="127.0.0.1", show_default=True, help="Rendezvous address (node 0).")
@click.option(
    "--master-port", type=click.IntRange(1, 65535), default=29500, show_default=True, help="Rendezvous port."
)
@with_flags(CUDA_GRAPH, CUDA_GRAPH_MAX_BS, DP_ATTENTION, ATTENTION_BACKEND, WARMUP)
@click.option(
    "--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True
)
@with_flags(LOG_REQUESTS, DISABLE_LOG_STATS, LOG_STATS_INTERVAL, NO_VERIFY)
@memory_flags
@decode_flags
@REQUIRE_PREPARED
@source_flags
@click.option("--engine-process/--no-engine-process", default=True, show_default=True,
              help="Run the engine in a process of its own (else on a thread of the HTTP server's).")  # fmt: skip
@friendly_errors
def serve(out_dir, nnodes, node_rank, master_addr, master_port, log_level, engine_process, **flags):
    """Serve the artifact OUT_DIR over an OpenAI-compatible HTTP API (see docs/serving.md). OUT_DIR
    may be an oci://HOST[:PORT]/REPO:TAG reference: the artifact is pulled into the local store
    (--download-dir) first, with this GPU's kernel-cache unit; a second start downloads nothing.

    \b
      mlac serve out/ --port 8000
      curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "out", "messages": [{"role": "user", "content": "Hi"}]}'
    """
    from mlac.runtime.dist.world import LaunchSpec, launches_rank_0, start_node_ranks
    from mlac.runtime.serve.engine_process import EngineProcess

    out_dir = fetched(out_dir, flags, node=(node_rank, nnodes) if nnodes > 1 else None)
    if flags.get("require_signature") is not None:  # refused here, before any process starts or loads
        from mlac.core.signed import check_artifact_signature

        check_artifact_signature(out_dir, flags["require_signature"])
    check_stated(out_dir, flags)
    launch = LaunchSpec(nnodes=nnodes, node_rank=node_rank, master_addr=master_addr, master_port=master_port)
    launch = launch if nnodes > 1 else None
    serves = launches_rank_0(launch)  # else another node, or torchrun RANK > 0: no HTTP server here
    # the other ranks of this node start now and import torch while this process (or the engine's) does
    if not serves:
        launch = replace(launch or LaunchSpec(), ranks=start_node_ranks(out_dir, launch))
    process = EngineProcess.start(out_dir, launch) if engine_process and serves else None
    if process is not None:
        click.get_current_context().call_on_close(process.close)
    from mlac.runtime.serve.config import ServerConfig  # (no torch: the options chain is plain data)

    config = ServerConfig.of(artifact=out_dir, launch=launch, process_start=PROCESS_START,
                             engine_process=process is not None, **option_fields(flags))  # fmt: skip
    if process is not None:  # the engine's process loads while this one imports the HTTP stack (and torch)
        from mlac.runtime.serve.preflight import refuse_before_load  # (no torch)

        refuse_before_load(config)  # as launch.serve does, before the engine loads
        process.configure(config, log_level)
    from mlac.runtime.serve import load_engine
    from mlac.runtime.serve import serve as run_server

    if not serves:  # this node's ranks run rank 0's steps inside make_runner, which ends the process
        try:
            load_engine(config).close()
        finally:
            if launch.ranks is not None:
                launch.ranks.close()  # those the load did not take: it failed before it needed them
        return
    run_server(config, log_level=log_level, process=process)


def check_stated(out_dir, flags: dict) -> None:
    """--tensor-parallel-size, --kv-cache-dtype and --dp-attention against the artifact's manifest,
    when any is given, and --attention-backend against --device, --dtype and what is installed:
    refused here, before any process starts (runtime/expect.py, worker/backend_check.py)."""
    from mlac.runtime.worker.backend_check import refuse_launch  # (no torch, no flashinfer import)

    refuse_launch(flags["attention_backend"], flags["device"], flags["dtype"])
    stated = option_fields({k: flags[k] for k in ("tensor_parallel_size", "kv_cache_dtype", "dp_attention")})
    # none stated: the manifest is not read here (pydantic's import would delay the engine's process)
    if any(v is not None for v in stated.values()):
        from mlac.core.artifact import Manifest
        from mlac.runtime.expect import check_expected

        check_expected(Manifest.load(out_dir), **stated)
