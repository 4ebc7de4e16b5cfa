"""benchmarks/kernels/inductor_glue.py on CPU at the tiny presets' shapes (--smoke): every piece's
reference, traced whole by torch.compile as the GPU run compiles it, agrees with mlac's piece (its
Triton kernel under the interpreter: tests/conftest.py sets TRITON_INTERPRET=1 without CUDA), and a
piece that is off is reported as a mismatch. The pieces run in a worker process: a simulated CUDA
fault (--inject-fault, the script's test hook) ends only that worker, and the record on disk, rewritten
after every row, holds every row measured, the one that faulted included."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from _paths import REPO, load_script

BENCH = REPO / "benchmarks" / "kernels"


@pytest.fixture(scope="module")
def ig():
    return load_script(BENCH / "inductor_glue.py")


def smoke(ig, tmp_path, *extra: str) -> dict:
    return ig.main(["--device", "cpu", "--smoke", "--json", str(tmp_path / "record.json"), *extra])


def on_disk(tmp_path) -> dict:
    return json.loads((tmp_path / "record.json").read_text())


def test_every_piece_agrees_with_its_reference(ig, tmp_path):
    """aot_eager: Dynamo traces each reference whole (fullgraph, as Inductor gets it), no code made."""
    record = smoke(ig, tmp_path, "--backend", "aot_eager")
    assert record["mlac_path"] == "Triton interpreter"
    rows = record["rows"]
    # every piece at both tiny models and both batches; q_norm only where there is a q-LoRA (v3)
    assert len(rows) == 2 * (2 * len(ig.gp.PIECES) - 1)
    # V2-Lite first, then V3; within each, 1 token then 5
    order = [(r["model"], r["batch"]) for r in rows]
    assert order == sorted(order, key=lambda mb: (mb[0] != "v2-lite", mb[1]))
    for row in rows:
        what = f"{row['piece']} {row['model']} T={row['batch']}"
        assert "error" not in row, what
        assert row["ref_ok"], (what, row["ref_max_error"])
        compiled = row["inductor"]["default"]
        assert compiled.get("ok"), (what, compiled)
        assert row["bytes"] > 0 and row["mlac_us"] > 0
    sampled = [r for r in rows if r["piece"] == "sample"]
    # the batched draw gives sampling.sample's own seeded draws, row for row
    assert [r["draws_equal_sampler"] for r in sampled] == [1.0] * len(sampled)
    assert all(r["eager_us"]["sampler"] > 0 for r in sampled)
    assert record["complete"] and record["worker_starts"] == 1
    assert on_disk(tmp_path) == record


def test_a_piece_that_is_off_is_a_mismatch(ig, tmp_path, monkeypatch):
    """silu_mul made 5% off (patched here: --in-process): its row fails both checks."""
    real = ig.gp.silu_mul
    monkeypatch.setattr(ig.gp, "silu_mul", lambda x, use_triton=None: real(x, use_triton) * 1.05)
    args = ("--backend", "aot_eager", "--pieces", "silu_mul", "--batches", "3", "--in-process")
    rows = smoke(ig, tmp_path, *args)["rows"]
    assert len(rows) == 2
    for row in rows:
        assert row["ref_ok"] is False and row["ref_max_error"] > 0.04
        assert row["inductor"]["default"]["ok"] is False


@pytest.mark.slow
def test_inductor_compiles_every_piece_on_cpu(ig, tmp_path):
    """Inductor itself (C++ on CPU, not the GPU's Triton) lowers every reference, and its outputs agree."""
    record = smoke(ig, tmp_path, "--models", "v3", "--batches", "5")
    for row in record["rows"]:
        compiled = row["inductor"]["default"]
        assert compiled.get("ok"), (row["piece"], compiled)
        assert compiled["compile_s"] > 0


def test_no_compile_starts_past_the_budget(ig, tmp_path):
    """--budget-s 0: every row keeps mlac's time and says its compile was skipped, and why."""
    record = smoke(
        ig, tmp_path, "--backend", "aot_eager", "--budget-s", "0", "--pieces", "greedy", "--batches", "1"
    )
    assert [r["mlac_us"] > 0 for r in record["rows"]] == [True, True]
    assert all("budget" in r["inductor"]["default"]["skipped"] for r in record["rows"])


def test_a_later_mode_only_where_the_first_came_close(ig, tmp_path):
    """The second mode runs only on rows whose first mode took at most 1.2 x mlac's time (aot_eager
    ignores the mode: the selection is what is tested). Under the interpreter mlac's Triton kernels
    take milliseconds (silu_mul: Inductor far ahead), its eager argmax microseconds (greedy: behind)."""
    modes = ("default", "max-autotune-no-cudagraphs")
    args = ("--backend", "aot_eager", "--pieces", "greedy", "silu_mul", "--batches", "1", "--modes", *modes)
    rows = smoke(ig, tmp_path, *args)["rows"]
    assert {r["piece"] for r in rows} == {"greedy", "silu_mul"}
    for row in rows:
        first, later = (row["inductor"][m] for m in modes)
        if first["us"] <= 1.2 * row["mlac_us"]:
            assert later.get("ok"), row
        else:
            assert "us" not in later and "within 20%" in later["skipped"], row
    assert "us" in rows[1]["inductor"][modes[1]]  # silu_mul v2-lite: mlac's kernel interpreted
    assert "skipped" in rows[0]["inductor"][modes[1]]  # greedy v2-lite: eager argmax is fast on CPU


@pytest.mark.parametrize("kind", ["raise", "die"])
def test_a_cuda_fault_ends_only_its_worker(ig, tmp_path, kind):
    """raise: the error of an illegal memory access, after which the worker raises it on every call
    (a poisoned CUDA context); die: the worker exits. Either way that compile's row records a CUDA
    fault, a fresh worker measures every row after it, and the record on disk has every row."""
    pieces = ("--pieces", "greedy", "silu_mul", "--batches", "1")
    record = smoke(
        ig, tmp_path, "--backend", "aot_eager", *pieces, "--inject-fault", f"greedy/v2-lite/1:{kind}"
    )
    rows = record["rows"]
    assert [(r["piece"], r["model"]) for r in rows] == [
        ("greedy", "v2-lite"), ("silu_mul", "v2-lite"), ("greedy", "v3"), ("silu_mul", "v3")
    ]  # fmt: skip
    faulted, *after = rows
    assert faulted["mlac_us"] > 0  # measured before the fault
    assert faulted["inductor"]["default"]["error"].startswith("CUDA fault: ")
    for row in after:
        assert "error" not in row and row["inductor"]["default"].get("ok"), row
    assert record["worker_starts"] == 2 and record["complete"]
    assert on_disk(tmp_path) == record


def test_a_run_cut_off_keeps_what_it_measured(tmp_path):
    """The script as a user runs it, its worker made to hang at silu_mul v2-lite's compile: while it
    hangs, the record on disk holds the rows before (complete: false); past --compile-cap-s the
    worker is stopped, that compile recorded as a timeout, and a fresh worker does the rest."""
    path = tmp_path / "record.json"
    cmd = [sys.executable, str(BENCH / "inductor_glue.py"), "--device", "cpu", "--smoke", "--backend", "aot_eager",
           "--pieces", "greedy", "silu_mul", "--batches", "1", "--json", str(path), "--compile-cap-s", "10",
           "--inject-fault", "silu_mul/v2-lite/1:hang"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        during = None
        limit = time.monotonic() + 120
        while during is None and proc.poll() is None and time.monotonic() < limit:
            time.sleep(0.1)
            record = json.loads(path.read_text()) if path.exists() else {"rows": []}
            if len(record["rows"]) == 2 and not record["rows"][1]["inductor"]:
                during = record  # silu_mul v2-lite measured, its compile hanging
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert during is not None, out
    assert during["complete"] is False and during["rows"][0]["inductor"]["default"]["ok"]
    assert during["rows"][1]["mlac_us"] > 0
    assert proc.returncode == 0, out
    record = json.loads(path.read_text())
    rows = record["rows"]
    assert len(rows) == 4 and record["complete"] and record["worker_starts"] == 2
    assert rows[1]["inductor"]["default"]["error"].startswith("timeout")
    assert all(r["inductor"]["default"].get("ok") for r in rows[2:]), rows
    assert "Traceback" not in out
