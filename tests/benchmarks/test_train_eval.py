"""benchmarks/train/train_eval.py on CPU, end to end on a `micro` checkpoint of benchmarks/train/train_small.py:
every row of the perplexity-delta table is compiled and scored through the CLI, the tp2 row with two
gloo ranks; the numbers are finite, tp2 equals its 1-rank float32 reference, and the calibrated rows
carry per-layer KV scales that the uncalibrated ones do not. The end-to-end tests start 14 CLI
processes (40 s on 2 idle cores, 80 s on busy ones): marked slow. The table's arithmetic, its
markdown and train_small's step planning are checked without them.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pytest
from _paths import REPO

from mlac.synth import train_data

BENCH = REPO / "benchmarks" / "train"
ROWS = ["bf16", "fp8", "kv-e4m3", "kv-e4m3-cal", "kv-e5m2", "kv-e5m2-cal", "bf16-cpu", "tp2"]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def te():
    return _load("train_eval")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    ts = _load("train_small")
    out = tmp_path_factory.mktemp("train") / "micro"
    ts.run(ts.parse_args([str(out), "--steps", "10"]))
    return out


@pytest.fixture(scope="module")
def table(te, ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("table") / "t"
    args = ["--device", "cpu", "--max-tokens", "200", "--cpu-max-tokens", "130", "--top1-tokens", "150",
            "--calibration-bytes", "3000"]  # fmt: skip
    return out, te.run(te.parse_args([str(ckpt), str(out), *args]))


@pytest.mark.slow
def test_every_row_is_measured_and_finite(table):
    out, t = table
    rows = {r["row"]: r for r in t["rows"]}
    assert list(rows) == ROWS
    for name, r in rows.items():
        assert "error" not in r, r
        assert math.isfinite(r["perplexity"]) and r["perplexity"] > 1.0, name
        assert math.isfinite(r["delta"]) and math.isfinite(r["delta_pct"]), name
        assert 0.0 <= r["top1_vs_reference"] <= 1.0, name
        assert (r["device_arg"], r["dtype"]) == ("cpu", "float32")
    assert rows["bf16"]["tokens"] == 200 - 200 // t["context_len"] - 1  # each window's first token is context
    assert rows["tp2"]["tokens"] == rows["bf16-cpu"]["tokens"] < rows["bf16"]["tokens"]
    assert json.loads((out / "table.json").read_text())["rows"] == t["rows"]
    md = (out / "table.md").read_text()
    assert all(f"| {name} |" in md for name in ROWS) and "failed" not in md


@pytest.mark.slow
def test_references_and_tp2(table):
    _, t = table
    rows = {r["row"]: r for r in t["rows"]}
    assert rows["bf16"]["delta"] == 0.0 and rows["bf16"]["top1_vs_reference"] == 1.0
    assert rows["tp2"]["reference"] == "bf16-cpu"
    assert rows["tp2"]["perplexity"] == pytest.approx(rows["bf16-cpu"]["perplexity"], rel=1e-4)
    assert rows["tp2"]["top1_vs_reference"] > 0.99


@pytest.mark.slow
def test_calibrated_rows_carry_their_scales(table):
    _, t = table
    rows = {r["row"]: r for r in t["rows"]}
    for kv in ("e4m3", "e5m2"):
        assert rows[f"kv-{kv}"]["accuracy"]["kv_scales"] is None  # every layer 1.0
        scales = rows[f"kv-{kv}-cal"]["accuracy"]["kv_scales"]
        assert len(scales) == 2 and all(0 < s < 1 for s in scales)
    assert rows["kv-e4m3-cal"]["compile_args"][-2:] == ["--calibration-text", "{calibration}"]


@pytest.mark.slow
def test_texts_are_split(table):
    out, _ = table
    train, held = train_data.split(train_data.stdlib_files())
    first = {f: train_data.read_texts([f], None)[0] for f in (train[0], held[0])}
    assert (out / "calibration.txt").read_text().startswith(first[train[0]])  # train split
    assert (out / "held_out.txt").read_text().startswith(first[held[0]])


def test_bad_out_dir_is_a_one_line_error(te, ckpt, tmp_path, capsys):
    (tmp_path / "keep").write_text("x")
    assert te.main([str(ckpt), str(tmp_path), "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "not an empty directory" in err[0]


def test_deltas_and_markdown_of_a_partial_table(te):
    rows = [{"row": "bf16", "reference": "bf16", "perplexity": 10.0},
            {"row": "fp8", "reference": "bf16", "perplexity": 10.5},
            {"row": "tp2", "reference": "bf16-cpu", "perplexity": 9.0},  # its reference failed
            {"row": "bf16-cpu", "reference": "bf16-cpu", "error": "mlac eval exited 1: boom"}]  # fmt: skip
    te.add_deltas(rows)
    assert (rows[0]["delta"], rows[1]["delta"]) == (0.0, 0.5) and rows[1]["delta_pct"] == pytest.approx(5.0)
    assert "delta" not in rows[2]
    for r in rows:
        r.update(what="w", device_arg="cpu", dtype="float32", eval_s=1.0)
    texts = {
        "held_out_files": 1,
        "held_out_chars": 10,
        "calibration_files": 1,
        "python": "3",
        "calibration_chars": 5,
    }
    md = te.markdown({"checkpoint": "c", "rows": rows, "texts": texts, "context_len": 64, "max_tokens": 100,
                      "cpu_max_tokens": 50, "top1_tokens": 50, "device": "cpu", "seconds": 1.0,
                      "versions": {"torch": "t", "python": "3", "gpu": None, "mlac_commit": None}})  # fmt: skip
    lines = md.splitlines()
    assert "| fp8 | w | cpu float32 | 10.5000 | +0.5000 vs bf16 | +5.000 | — |" in md
    assert any(line.startswith("| bf16 |") and "reference" in line for line in lines)
    assert any(line.startswith("| tp2 |") and "| — vs bf16-cpu | — |" in line for line in lines)
    assert any(
        line.startswith("| bf16-cpu |") and "failed: mlac eval exited 1: boom" in line for line in lines
    )


def test_planned_steps_fit_the_clock():
    ts = _load("train_small")
    first = ts.PACE_STEPS[1]
    assert ts.planned_steps(3000, 0.1, 10.0, 5.0) == first + int(0.98 * 290 / 0.1)  # 2857: the clock binds
    assert ts.planned_steps(100, 0.1, 10.0, 5.0) == 100  # the steps bind
