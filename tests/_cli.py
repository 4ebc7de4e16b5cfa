"""The CLI as the tests drive it: invoke a command in process, and check a one-line error."""

from __future__ import annotations

from click.testing import CliRunner, Result

from mlac.cli import main


def invoke(*args) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line_error(r: Result, *needles: str, code: int = 1) -> str:
    """The last output line is `error: ...` holding every needle, exit code `code` (1: bad input,
    3: integrity, 4: target mismatch, 5: registry; mlac/core/errors.py), no traceback."""
    assert r.exit_code == code, (r.exit_code, r.output)
    assert "Traceback" not in r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("error: "), r.output
    for n in needles:
        assert n in last, (n, last)
    return last
