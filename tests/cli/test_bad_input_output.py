"""The output directory of `compile`: never the source (nor around or inside it), and the stale
temporary folders of killed compiles removed (and named) by the next compile to the same place."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from _cli import invoke


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def src(checkpoint, tmp_path) -> Path:
    """A private copy of a tiny checkpoint, at tmp_path/models/ckpt."""
    return Path(shutil.copytree(checkpoint("tiny-v2-lite"), tmp_path / "models" / "ckpt"))


def assert_refused_and_intact(r, src: Path, before: dict[str, bytes], tmp_path: Path, relation: str) -> None:
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output
    (line,) = r.output.strip().splitlines()
    assert line.startswith("error: ") and f"the output directory {relation} the source checkpoint" in line
    assert tree(src) == before
    assert listing(tmp_path) == ["models", "models/ckpt"] + [f"models/ckpt/{n}" for n in sorted(before)]


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_out_equal_to_the_source_is_refused_and_the_source_kept(src, tmp_path, force):
    before = tree(src)
    r = invoke("compile", src, src, "--skip-accuracy-check", *force)
    assert_refused_and_intact(r, src, before, tmp_path, "is")


@pytest.mark.parametrize("parent", ["models", "."])
def test_out_a_parent_of_the_source_is_refused(src, tmp_path, parent):
    before = tree(src)
    r = invoke("compile", src, tmp_path / parent, "--force", "--skip-accuracy-check")
    assert_refused_and_intact(r, src, before, tmp_path, "contains")


def test_out_inside_the_source_is_refused(src, tmp_path):
    before = tree(src)
    r = invoke("compile", src, src / "out", "--skip-accuracy-check")
    assert_refused_and_intact(r, src, before, tmp_path, "lies inside")


def test_symlinks_are_resolved(src, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(src)
    before = tree(src)
    r = invoke("compile", src, link, "--force", "--skip-accuracy-check")
    link.unlink()
    assert_refused_and_intact(r, src, before, tmp_path, "is")
    r = invoke(
        "compile", src, tmp_path / "models" / "ckpt" / ".." / "ckpt", "--force", "--skip-accuracy-check"
    )
    assert_refused_and_intact(r, src, before, tmp_path, "is")


def test_a_sibling_of_the_source_is_fine(src, tmp_path):
    r = invoke("compile", src, tmp_path / "models" / "ckpt-out", "--skip-accuracy-check")
    assert r.exit_code == 0, r.output


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_stale_tmp_folders_of_dead_compiles_are_removed_and_named_live_ones_kept(src, tmp_path):
    out = tmp_path / "out"
    dead = tmp_path / f".out.tmp-{dead_pid()}"
    (dead / "rank-00000-of-00001").mkdir(parents=True)
    (dead / "manifest.json").write_text("{}")
    with subprocess.Popen(["sleep", "60"]) as live_process:
        live = tmp_path / f".out.tmp-{live_process.pid}"
        live.mkdir()
        others = [tmp_path / ".other.tmp-1", tmp_path / ".out.tmp-notapid", tmp_path / ".out.tmp-0"]
        for d in others:
            d.mkdir()
        r = invoke("compile", src, out, "--skip-accuracy-check")
        live_process.kill()
    assert r.exit_code == 0, r.output
    assert f"removed {dead}: the temporary folder of a compile that no longer runs" in r.output
    assert not dead.exists() and live.is_dir() and all(d.is_dir() for d in others)
    assert str(live) not in r.output
    assert invoke("verify", out).exit_code == 0


def test_a_refused_compile_removes_no_stale_folder(src, tmp_path):
    """Nothing is deleted before the output is accepted."""
    (tmp_path / "out").mkdir()
    dead = tmp_path / f".out.tmp-{dead_pid()}"
    dead.mkdir()
    r = invoke("compile", src, tmp_path / "out", "--skip-accuracy-check")
    assert r.exit_code == 1 and "already exists" in r.output
    assert dead.is_dir()


def test_a_stale_folder_of_this_process_is_reused(src, tmp_path):
    mine = tmp_path / f".out.tmp-{os.getpid()}"
    mine.mkdir()
    (mine / "junk").write_text("x")
    r = invoke("compile", src, tmp_path / "out", "--skip-accuracy-check")
    assert r.exit_code == 0, r.output
    assert not mine.exists() and not (tmp_path / "out" / "junk").exists()


def test_the_python_api_refuses_too(src, tmp_path):
    """The writer itself checks: `compile_checkpoint` without the CLI cannot delete its source."""
    from mlac.compiler.pipeline import compile_checkpoint
    from mlac.core.artifact import CompileOptions
    from mlac.core.errors import MlacError

    before = tree(src)
    with pytest.raises(MlacError, match="the output directory contains the source checkpoint"):
        compile_checkpoint(src, tmp_path / "models", CompileOptions(accuracy_check=False), force=True)
    assert tree(src) == before and listing(tmp_path / "models") == ["ckpt"] + [
        f"ckpt/{n}" for n in sorted(before)
    ]
