"""Atomic output folders: a command builds OUT in a temporary sibling `.<name>.tmp-<pid>` and
renames it into place when complete; one killed outright leaves that folder, which the next run
for the same OUT removes once its process is gone. Used by compile, prepare and export.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from mlac.core.errors import MlacError


def check_not_source(out: Path, source: Path) -> None:
    """Refuse an output directory that is, contains, or lies inside the source checkpoint (symlinks
    resolved): `--force` would delete the source, and the temporary folder would land inside it."""
    o, s = out.resolve(), source.resolve()
    if o == s or s.is_relative_to(o) or o.is_relative_to(s):
        relation = "is" if o == s else "contains" if s.is_relative_to(o) else "lies inside"
        raise MlacError(
            f"{out}: the output directory {relation} the source checkpoint {source}; "
            "choose an OUT_DIR outside the source"
        )


def tmp_dir(out: Path, pid: int) -> Path:
    """The folder where process `pid` builds the artifact for `out`."""
    return out.parent / f".{out.name}.tmp-{pid}"


def remove_stale_tmp(out: Path) -> list[Path]:
    """Remove the temporary folders that killed compiles to `out` left (`.<name>.tmp-<pid>` whose
    process is gone, or is this one: its name is about to be reused); return them. A folder of a
    live process is kept. NOTE: only the PID is checked; a compile to shared storage from another
    host is not seen, and a PID reused by an unrelated process keeps its folder."""
    prefix = f".{out.name}.tmp-"
    removed = []
    for p in sorted(out.parent.iterdir()):
        pid = p.name[len(prefix) :]
        ours = p.name.startswith(prefix) and pid.isascii() and pid.isdigit() and int(pid) > 0
        if not ours or p.is_symlink():
            continue
        if p.is_dir() and not _alive(int(pid)):
            shutil.rmtree(p)
            removed.append(p)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # an earlier compile of this process; its folder's name is ours now
    try:
        os.kill(pid, 0)  # signal 0: only checks that the process exists
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process, or no PID this system can have: not ours to remove
    return True
