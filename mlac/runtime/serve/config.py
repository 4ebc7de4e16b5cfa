"""ServerConfig: everything `mlac serve` is told, checked once, frozen: the outer layer of the
options chain (ServerConfig ⊃ EngineOptions ⊃ RuntimeOptions, SchedulerConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mlac import settings
from mlac.core.errors import MlacError
from mlac.core.options import Options
from mlac.runtime.engine.options import EngineOptions
from mlac.runtime.serve.reasoning import check_reasoning_parser
from mlac.runtime.serve.tools import check_tool_call_parser

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_REQUEST_BODY_TIMEOUT = 30.0


@dataclass(frozen=True)
class ServerConfig(Options):
    """Everything `mlac serve` is told: the HTTP side's fields, and the `engine`'s options passed
    down whole (build it flat with `ServerConfig.of(artifact=..., port=..., dtype=..., ...)`:
    core/options.py). `api_key` None: no auth (the default bind is 127.0.0.1)."""

    artifact: Path
    engine: EngineOptions = field(default_factory=EngineOptions)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 256  # requests waiting beyond max_running_requests before 503
    drain_timeout: float = 30.0
    served_model_name: str | None = None  # default: the artifact directory's name
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_body_timeout: float = DEFAULT_REQUEST_BODY_TIMEOUT  # seconds to receive a whole body
    warmup: bool = True  # run the step shapes once before /health turns ready (CUDA: Triton JIT)
    process_start: float | None = None  # time.monotonic() at process start: the start-up log's import phase
    generation_config: str = "auto"  # default sampling: auto | vllm | none | a folder (generation_config.py)
    reasoning_parser: str | None = None  # deepseek_r1 | deepseek_v3: splits reasoning out (reasoning.py)
    tool_call_parser: str | None = None  # deepseek_v3 | deepseek_v31: tool calls parsed out (tools.py)
    enable_auto_tool_choice: bool = False  # tool_choice "auto" allowed (and the default with tools)
    log_requests: bool = False  # a log line per request at arrival and at its end (stats.py)
    log_stats: bool = True  # the periodic stats line while busy
    log_stats_interval: float = 10.0  # seconds between two stats lines
    engine_process: bool = False  # the engine in its own process (`mlac serve`'s default)

    def __post_init__(self) -> None:
        lows = (("max_queue", 0), ("drain_timeout", 0), ("max_body_bytes", 1))
        for name, low in lows:
            if getattr(self, name) < low:
                raise MlacError(f"{name}={getattr(self, name)!r}: must be >= {low}")
        if not 0 <= self.port <= 65535:
            raise MlacError(f"port={self.port!r}: must be in [0, 65535]")
        if not self.log_stats_interval > 0:
            raise MlacError(f"--log-stats-interval {self.log_stats_interval}: must be > 0")
        if not self.request_body_timeout > 0:
            raise MlacError(f"request_body_timeout={self.request_body_timeout!r}: must be > 0")
        check_reasoning_parser(self.reasoning_parser)
        check_tool_call_parser(self.tool_call_parser, self.enable_auto_tool_choice)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.artifact).resolve().name

    def summary(self) -> str:
        """The start-up line that says what this server was told, e.g. `serving 'tiny' (out/) on
        http://127.0.0.1:8000: cpu, float32, up to 64 running + 256 queued requests, ...`."""
        sched, rt = self.engine.scheduler, self.engine.runtime
        stats = f"every {self.log_stats_interval:g} s" if self.log_stats else "off"
        return (
            f"serving '{self.model_name}' ({self.artifact}) on http://{self.host}:{self.port}: {rt.device}, "
            f"{rt.dtype_name}, up to {sched.max_running_requests} running + {self.max_queue} queued requests, "
            f"chunked prefill {sched.chunked_prefill_size} tokens, prefix cache {'on' if sched.prefix_cache else 'off'}, "
            f"API key {'required' if self.api_key else 'none'}; stats line {stats}, "
            f"request logs {'on' if self.log_requests else 'off'}"
        )

    @property
    def max_unfinished(self) -> int:
        """Most engine requests queued or running at once; a request with more prompts never fits."""
        return self.engine.scheduler.max_running_requests + self.max_queue


def api_key_from_env(given: str | None) -> str | None:
    """--api-key as given, else the setting MLAC_API_KEY (None when neither)."""
    return given if given is not None else settings.API_KEY.get()
