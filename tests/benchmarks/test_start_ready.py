"""benchmarks/e2e/start_ready.py: two trees' servers started in turns, each start's seconds to the first
/health 200 beside the server's own phases; a start that fails is a row with its error, not a crash.
CPU, the tiny artifact served from this tree twice."""

from __future__ import annotations

import json

import pytest
from _paths import REPO, load_script


@pytest.fixture(scope="module")
def sr():
    return load_script(REPO / "benchmarks" / "e2e" / "start_ready.py")


def test_two_trees_in_turns_with_the_servers_phases(sr, artifact, tmp_path):
    art = str(artifact("tiny-v3"))
    out = tmp_path / "startup.json"
    record = sr.main(["--tree", f"a={REPO}:{art}", "--tree", f"b={REPO}:{art}", "--pairs", "2",
                      "--serve-args", "--device cpu --no-verify", "--json", str(out), "--logs", str(tmp_path)])  # fmt: skip
    assert [(r["tree"], r["turn"]) for r in record["rows"]] == [("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    for row in record["rows"]:
        assert row["error"] is None and row["ready_s"] > 0
        assert set(row["phases"]) >= {"import_s", "load_s", "warmup_s", "ready_s"}
        assert row["phases"]["ready_s"] <= row["ready_s"]  # the server counts from its own start
    assert record["summary"]["a"]["starts"] == 2 and json.loads(out.read_text())["rows"] == record["rows"]


def test_a_start_that_fails_is_a_row_with_its_error(sr, tmp_path):
    record = sr.main(["--tree", f"a={REPO}:{tmp_path / 'missing'}", "--tree", f"b={REPO}:{tmp_path / 'missing'}",
                      "--pairs", "1", "--serve-args", "--device cpu", "--logs", str(tmp_path)])  # fmt: skip
    assert [r["ready_s"] for r in record["rows"]] == [None, None]
    assert all("missing" in r["error"] for r in record["rows"]), record["rows"]
    assert record["summary"]["a"] == {"starts": 0}


def test_tree_specs(sr):
    assert sr.parse_tree("base=/x/y:/a/b") == ("base", sr.Path("/x/y").resolve(), "/a/b")
    with pytest.raises(SystemExit, match="NAME=TREE_DIR:ARTIFACT"):
        sr.parse_tree("base=/x/y")
