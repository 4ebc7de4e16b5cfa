"""Starting the engine of a server, in either process (launch.py's, or the engine's own:
engine_child.py): Engine.from_artifact with the ServerConfig's engine options, the warm-up, the start-up record
(engine.startup, /health's phases) and its one log line.

It imports no HTTP stack (FastAPI, uvicorn): the engine's process imports this module while the
server's process is still importing its own (engine_process.py), and starts loading sooner.
"""

from __future__ import annotations

import logging
import time

from mlac.runtime.serve.config import ServerConfig

log = logging.getLogger("mlac.server")

GIL_SWITCH_INTERVAL_S = 0.0002  # see launch.serve()


def load_engine(config: ServerConfig):
    """Engine.from_artifact with `config.engine` (runs on the engine thread), then the warm-up;
    fills engine.startup (the phases, see startup_line, also in /health) and logs startup_line."""
    from mlac.runtime.engine.engine import Engine

    start = time.monotonic()
    engine = Engine.from_artifact(config.artifact, config.engine)
    warm = time.monotonic()
    if config.warmup:  # Triton's JIT compiles now, while /health still says 503, not in the first requests
        try:
            engine.warmup()
        except BaseException:
            engine.close()
            raise
    origin = start if config.process_start is None else config.process_start
    record_startup(engine, start - origin, time.monotonic() - warm, time.monotonic() - origin)
    log.info(
        startup_line(engine.startup, verified=config.engine.runtime.verify, kv_dtype=engine.cache.kv_dtype)
    )
    return engine


def record_startup(engine, import_s: float, warmup_s: float, ready_s: float) -> None:
    """Add the server's phases and the engine's sizes to engine.startup (seconds rounded to ms)."""
    graphs = engine.runner.graphs
    kv_tokens = sum(p.capacity_tokens for p in engine.runner.kv_pools)  # every DP-attention rank's
    engine.startup.update(
        import_s=import_s, warmup_s=warmup_s, ready_s=ready_s, kv_tokens=kv_tokens,
        max_context=engine.max_context, graph_buckets=len(graphs.buckets) if graphs is not None else 0,
        graph_max_bs=max(graphs.buckets) if graphs is not None else 0,
    )  # fmt: skip
    engine.startup.update({k: round(v, 3) for k, v in engine.startup.items() if isinstance(v, float)})


def startup_line(s: dict, verified: bool, kv_dtype: str) -> str:
    """The one start-up summary line of engine.startup, e.g. `ready in 9.8 s: import 1.2 s,
    verify+load 3.1 s (31.4 GB, 10.1 GB/s), graphs 1.9 s (20 buckets), load+graphs 3.3 s, warm-up
    2.0 s; KV cache 812,032 tokens (fp8_e4m3), max context 163,840, CUDA graphs up to batch 256`;
    a multi-rank artifact's has `ranks met 0.1 s` after the import (rank 0's wait for the other
    ranks to reach the store: their spawn and imports, dist.RankGroup.start)."""
    gbps = s["load_gb"] / max(s["load_s"], 1e-9)
    what = "verify+load" if verified else "load"
    load = f"{what} {s['load_s']:.1f} s ({s['load_gb']:.1f} GB, {gbps:.1f} GB/s)"
    graphs = (
        f"graphs {s['graphs_s']:.1f} s ({s['graph_buckets']} buckets)" if s["graph_buckets"] else "graphs off"
    )
    if s["graph_buckets"] and "load_graphs_s" in s:  # the two overlapped (build.build_runner): their wall
        graphs += f", load+graphs {s['load_graphs_s']:.1f} s"
    upto = f"up to batch {s['graph_max_bs']}" if s["graph_buckets"] else "off"
    ranks = (
        f", ranks met {s['ranks_met_s']:.1f} s" if "ranks_met_s" in s else ""
    )  # multi-rank (distributed.py)
    return (
        f"ready in {s['ready_s']:.1f} s: import {s['import_s']:.1f} s{ranks}, {load}, {graphs}, "
        f"warm-up {s['warmup_s']:.1f} s; KV cache {s['kv_tokens']:,} tokens ({kv_dtype}), "
        f"max context {s['max_context']:,}, CUDA graphs {upto}"
    )


def log_to_stderr(level: str) -> None:
    """mlac's loggers (mlac.server, mlac.runtime, ...) print to stderr at `level` (--log-level),
    as uvicorn's do and with the time, unless the application gave them a handler already."""
    root = logging.getLogger("mlac")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(asctime)s %(message)s"))
        root.addHandler(handler)
        root.setLevel(level.upper())
