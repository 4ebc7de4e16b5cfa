"""How the engine refuses or ends requests (QueueFull, ShuttingDown, EngineDead), and those
errors as plain data for the pipe between the engine's process and the server's."""

from __future__ import annotations

from mlac.core.errors import IntegrityError, MlacError, RegistryError, TargetMismatch


class QueueFull(MlacError):
    """More requests would be queued or running than the server allows."""


class ShuttingDown(MlacError):
    """The server is draining and its drain timeout expired, or it has stopped."""


class EngineDead(MlacError):
    """The engine failed after it loaded (an exception escaped its loop, or its process died): the
    requests it held end with this error (500), later ones are refused with it (503)."""


def check_room(unfinished: int, n: int, limit: int, refusing: MlacError | None) -> None:
    """Whether n more requests may be submitted (under the caller's lock): once new requests are
    refused, `refusing` (ShuttingDown or EngineDead, raised anew), QueueFull when they would pass
    `limit`."""
    if refusing is not None:
        raise type(refusing)(str(refusing))
    if unfinished + n > limit:
        raise QueueFull(f"server busy: {unfinished} requests queued or running; retry later")


BY_CODE = {e.exit_code: e for e in (MlacError, IntegrityError, TargetMismatch, RegistryError)}


def encode_error(e: BaseException) -> tuple[str, str]:
    """An engine failure as plain data, to cross to the server's process: (kind, message); an
    error's kind keeps its exit code (an integrity failure stays one: core/errors.py)."""
    if isinstance(e, ShuttingDown | EngineDead):
        return ("shutdown" if isinstance(e, ShuttingDown) else "dead", str(e))
    return (f"error{getattr(e, 'exit_code', 1)}", str(e))


def decode_error(kind: str, message: str) -> MlacError:
    """encode_error's inverse: the exception Submission answers as in one process (503 / 500)."""
    if kind.startswith("error"):
        return BY_CODE.get(int(kind[5:] or 1), MlacError)(message)
    return {"shutdown": ShuttingDown, "dead": EngineDead}.get(kind, MlacError)(message)
