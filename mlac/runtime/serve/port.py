"""The listening port, checked before anything loads (the CLI checks it before the engine's process is
configured, launch.serve before the model loads): no HTTP stack, no torch."""

from __future__ import annotations

import errno
import socket

from mlac.core.errors import MlacError


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
