"""EngineOptions: everything an Engine is told, the middle layer of the options chain
(ServerConfig ⊃ EngineOptions ⊃ RuntimeOptions, SchedulerConfig). Built once (the CLI's flags,
`Engine.from_artifact(path, **fields)`, `ServerConfig.of(...)`) and passed down whole: the
Engine reads its own fields and the scheduler's, and hands `runtime` to the runner. Plain data,
without torch (worker/options.py says why)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mlac.core.errors import MlacError
from mlac.core.options import Options
from mlac.runtime.dist.world import LaunchSpec
from mlac.runtime.worker.options import RuntimeOptions

ALGORITHMS = ("nextn", "mtp")  # SGLang's name, and its alias
DEFAULT_STEPS = 3  # --speculative-algorithm without --speculative-num-steps (SGLang's DeepSeek setting)


def num_steps_of(algorithm: str | None, num_steps: int | None) -> int:
    """The draft tokens per step that `--speculative-algorithm` and `--speculative-num-steps` ask
    for (SGLang's flags): 0 (off) without either; DEFAULT_STEPS with the algorithm alone."""
    if algorithm is not None and algorithm.lower() not in ALGORITHMS:
        raise MlacError(
            f"--speculative-algorithm {algorithm!r}: mlac speculates with {' or '.join(ALGORITHMS)}"
        )
    if num_steps is None:
        return DEFAULT_STEPS if algorithm is not None else 0
    return num_steps


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of the running batch."""

    max_running_requests: int = 64
    chunked_prefill_size: int = 2048  # most prompt tokens run in one step, over all sequences
    prefix_cache: bool = True  # reuse cached prompt prefixes (radix cache, kvcache/radix.py)
    speculative_num_steps: int = 0  # MTP draft tokens verified per decode step (spec/decode.py); 0: off
    # host work of decode step N while the device runs N + 1 (overlap.py). None: on CUDA; True: on
    # wherever the runner runs here (CPU too: tests); speculation's greedy chain steps have their
    # own (spec/overlap.py, one rank)
    overlap: bool | None = None

    def __post_init__(self) -> None:
        for name in ("max_running_requests", "chunked_prefill_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise MlacError(f"{name}={value!r}: must be an integer >= 1")
        k = self.speculative_num_steps
        if not isinstance(k, int) or k < 0:
            raise MlacError(f"speculative_num_steps={k!r}: must be an integer >= 0 (0: off)")
        if not (self.overlap is None or isinstance(self.overlap, bool)):
            raise MlacError(f"overlap={self.overlap!r}: must be True, False or None (on CUDA)")


@dataclass(frozen=True)
class EngineOptions(Options):
    """How an Engine runs an artifact: its ranks' `runtime`, the `scheduler`'s limits, how the
    ranks of a multi-rank artifact find each other (`launch`, see start.make_runner; None: on this
    machine) and a Jinja `chat_template` file used instead of the artifact's."""

    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    launch: LaunchSpec | None = None
    chat_template: Path | None = None
