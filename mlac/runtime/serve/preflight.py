"""What a server refuses before its model loads: a bad artifact, a bad --generation-config, a busy
port. No HTTP stack and no torch: `mlac serve` checks these before it configures the engine's process
(cli/serve.py), launch.serve before it loads the model in its own."""

from __future__ import annotations

import errno
import socket
from typing import TYPE_CHECKING

from mlac.core.errors import MlacError

if TYPE_CHECKING:
    from mlac.runtime.serve.config import ServerConfig


def refuse_before_load(config: ServerConfig) -> None:
    """MlacError (one line) for an artifact whose manifest does not load, a generation config that
    sampling refuses, or a port another process listens on."""
    from mlac.core.artifact import Manifest
    from mlac.runtime.engine.generation_config import sampling_defaults

    Manifest.load(config.artifact)
    sampling_defaults(config.artifact, config.generation_config)
    check_port(config.host, config.port)


def check_port(host: str, port: int) -> None:
    """Refuse, before the model loads, a port that another process listens on (uvicorn binds the
    same way: SO_REUSEADDR, so a port in TIME_WAIT is not refused)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise MlacError(
                    f"port {port} is in use (on {host}): stop what holds it or pick another --port"
                ) from None
            raise MlacError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
