"""The CLI as the tests drive it: invoke a command in process, and check a one-line error."""

from __future__ import annotations

from click.testing import CliRunner, Result

from mlac.cli import main


def invoke(*args) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line_error(r: Result, *needles: str) -> str:
    """The last output line is `error: ...` holding every needle, exit code 1, no traceback."""
    assert r.exit_code == 1, (r.exit_code, r.output)
    assert "Traceback" not in r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("error: "), r.output
    for n in needles:
        assert n in last, (n, last)
    return last
