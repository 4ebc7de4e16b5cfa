"""Progress of a long command (compile, verify, prepare, push, pull, export, synth), on stderr.

    with Progress(total_bytes, "pulling") as p:
        ... p.update(n) ...        # from any thread

On a terminal: one line redrawn in place, at most 5 times a second. Elsewhere (a CI log, a pipe):
a plain line at least every `interval` seconds (10 by default), also while no bytes arrive, so a
silent log means a dead job, never a slow one:

    pulling: 12.40 of 31.40 GB (39.5%), 412.3 MB/s, ETA 46 s
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

INTERVAL_S = 10.0
REDRAW_S = 0.2


def human_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def human_count(unit: str):
    """A formatter of plain counts ("12,345 tokens") for a Progress over something else than bytes."""
    return lambda n: f"{n:,.0f} {unit}"


def human_seconds(s: float) -> str:
    s = int(round(s))
    return (
        f"{s // 3600}h{s % 3600 // 60:02d}m"
        if s >= 3600
        else f"{s // 60}m{s % 60:02d}s"
        if s >= 60
        else f"{s} s"
    )


class Progress:
    """Done and total bytes of one task, reported as the module docstring says."""

    def __init__(
        self,
        total: int,
        label: str,
        stream: TextIO | None = None,
        interval: float = INTERVAL_S,
        terminal: bool | None = None,
        unit: str = "bytes",
    ):
        self.total, self.label, self.done = max(int(total), 0), label, 0
        self.fmt = human_bytes if unit == "bytes" else human_count(unit)
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self.interval = REDRAW_S if self.terminal else interval
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="mlac-progress", daemon=True)

    def __enter__(self) -> Progress:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if exc[0] is None:
            self._emit(final=True)
        elif self.terminal:
            self.stream.write("\n")
            self.stream.flush()

    def update(self, n: int) -> None:
        with self._lock:
            self.done += int(n)

    def grow(self, n: int) -> None:
        """`n` more to do than the total given at the start (found once the work began)."""
        with self._lock:
            self.total += int(n)

    def line(self) -> str:
        elapsed = max(time.monotonic() - self._start, 1e-9)
        done, total = self.done, self.total
        rate = done / elapsed
        parts = [f"{self.label}: {self.fmt(done)}"]
        if total:
            parts[0] += f" of {self.fmt(total)} ({100 * min(done / total, 1):.1f}%)"
        parts.append(f"{self.fmt(rate)}/s")
        if total and rate > 0 and done < total:
            parts.append(f"ETA {human_seconds((total - done) / rate)}")
        elif done >= total:
            parts.append(f"in {human_seconds(elapsed)}")
        return ", ".join(parts)

    def _tick(self) -> None:
        while not self._stop.wait(self.interval):
            self._emit()

    def _emit(self, final: bool = False) -> None:
        text = self.line()
        if self.terminal:
            self.stream.write("\r\x1b[K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


class Watch:
    """A long step whose total is unknown (prepare's kernel compiles): `probe()` says how far it is
    ("143 files, 21.4 MB"), shown with the seconds elapsed, as Progress shows bytes (a line at least
    every `interval` seconds when stderr is not a terminal)."""

    def __init__(self, label: str, probe, stream: TextIO | None = None, interval: float = INTERVAL_S):
        self.label, self.probe = label, probe
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = self.stream.isatty()
        self.interval = REDRAW_S if self.terminal else interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="mlac-watch", daemon=True)
        self._start = time.monotonic()

    def __enter__(self) -> Watch:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._emit(final=True)

    def _tick(self) -> None:
        while not self._stop.wait(self.interval):
            self._emit()

    def _emit(self, final: bool = False) -> None:
        try:
            what = self.probe()
        except OSError:  # the watched folder changing under the probe
            what = "..."
        text = f"{self.label}: {what}, {human_seconds(time.monotonic() - self._start)}"
        self.stream.write(("\r\x1b[K" + text + ("\n" if final else "")) if self.terminal else text + "\n")
        self.stream.flush()
