"""Progress on a stream that is not a terminal: a plain line at least every interval, also while no
bytes move, with done/total, rate and ETA; a final line; Watch for steps of unknown size."""

from __future__ import annotations

import io
import re
import time

from mlac.core.progress import Progress, Watch, human_bytes, human_seconds


class Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_a_line_every_interval_even_while_stalled_then_a_final_line():
    out = Pipe()
    with Progress(1_000_000, "pulling", stream=out, interval=0.05) as p:
        p.update(250_000)
        time.sleep(0.32)  # no bytes move: lines must keep coming
    lines = out.getvalue().splitlines()
    assert len(lines) >= 5, lines
    assert all(line.startswith("pulling: 250.00 kB of 1.00 MB (25.0%)") for line in lines[:-1]), lines
    assert re.search(r", [0-9.]+ [kMG]?B/s, ETA \d+", lines[0]), lines[0]
    assert lines[-1].startswith("pulling: 250.00 kB of 1.00 MB")
    out = Pipe()
    with Progress(100, "verifying", stream=out, interval=60) as p:
        p.update(100)
    assert out.getvalue().splitlines() == [out.getvalue().splitlines()[-1]]  # only the final line
    assert "100.0%" in out.getvalue() and ", in " in out.getvalue()


def test_units_other_than_bytes_and_a_terminal_redraws_in_place():
    out = Pipe()
    with Progress(2000, "scoring", stream=out, interval=60, unit="tokens") as p:
        p.update(2000)
    assert "scoring: 2,000 tokens of 2,000 tokens (100.0%)" in out.getvalue()
    tty = io.StringIO()
    with Progress(10, "x", stream=tty, terminal=True) as p:
        p.update(10)
    assert tty.getvalue().startswith("\r\x1b[K") and tty.getvalue().endswith("\n")


def test_watch_reports_its_probe_while_the_step_runs():
    out, n = Pipe(), [0]

    def probe() -> str:
        n[0] += 1
        return f"{n[0]} files"

    with Watch("compiling kernels", probe, stream=out, interval=0.05):
        time.sleep(0.27)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 4 and lines[0].startswith("compiling kernels: 1 files, 0 s"), lines


def test_human_units():
    assert human_bytes(999) == "999 B" and human_bytes(31_400_000_000) == "31.40 GB"
    assert human_seconds(42) == "42 s" and human_seconds(125) == "2m05s" and human_seconds(3725) == "1h02m"
