"""EngineOptions: everything an Engine is told, the middle layer of the options chain
(ServerConfig ⊃ EngineOptions ⊃ RuntimeOptions, SchedulerConfig). Built once (the CLI's flags,
`Engine.from_artifact(path, **fields)`, `ServerConfig.of(...)`) and passed down whole: the
Engine reads its own fields and the scheduler's, and hands `runtime` to the runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mlac.core.options import Options
from mlac.runtime.dist.world import LaunchSpec
from mlac.runtime.engine.scheduler import SchedulerConfig
from mlac.runtime.worker.options import RuntimeOptions


@dataclass(frozen=True)
class EngineOptions(Options):
    """How an Engine runs an artifact: its ranks' `runtime`, the `scheduler`'s limits, how the
    ranks of a multi-rank artifact find each other (`launch`, see start.make_runner; None: on this
    machine) and a Jinja `chat_template` file used instead of the artifact's."""

    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    launch: LaunchSpec | None = None
    chat_template: Path | None = None
