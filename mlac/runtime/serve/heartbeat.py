"""The engine's heartbeat: whether the engine and its ranks still answer, known within a second.

A thread next to the engine's (Heartbeat, started by EngineLoop) calls `beat` every BEAT_S seconds,
whatever the engine thread is doing (a step that waits on a stopped rank included). EngineLoop's
beat looks at the ranks this process spawned (a multi-rank artifact's: RankGroup.trouble):

    a rank exited      the engine is dead: EngineLoop.die ends every request with an error, and
                       the server stops (`mlac serve` exits 1) rather than answer 500s forever
    a rank is stopped  (SIGSTOP, a debugger) /health answers 503 until it runs again

and reports what it found (None: all is well) to its `on_beat`: in the engine's own process, a
("beat", trouble) message to the server's process (engine_child.py). There EngineClient takes a
beat older than BEAT_DEADLINE_S as an engine process that stopped answering (frozen by SIGSTOP, or
stuck holding the GIL): /health answers 503 until the beats come again. A process that died
closes its pipe: that the server's reader thread sees at once (engine_client.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("mlac.server")

BEAT_S = 0.1  # how often the engine's process beats
BEAT_DEADLINE_S = 0.6  # a beat older than this: the engine's process is not answering (/health 503)


class Heartbeat:
    """A daemon thread that calls `beat()` every `interval` seconds until `stop`. What `beat`
    raises is logged once and the beats go on (a heartbeat that dies silently would hide the
    engine's trouble)."""

    def __init__(self, beat: Callable[[], None], interval: float = BEAT_S):
        self._beat, self.interval = beat, interval
        self._stopped = threading.Event()
        self._logged = False
        self._thread = threading.Thread(target=self._main, name="mlac-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _main(self) -> None:
        while not self._stopped.wait(self.interval):
            try:
                self._beat()
            except Exception:  # noqa: BLE001  (logged once: see the class docstring)
                if not self._logged:
                    log.exception("the engine's heartbeat failed")
                    self._logged = True
