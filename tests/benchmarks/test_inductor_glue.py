"""benchmarks/kernels/inductor_glue.py on CPU at the tiny presets' shapes (--smoke): every piece's
reference, traced whole by torch.compile as the GPU run compiles it, agrees with mlac's piece (its
Triton kernel under the interpreter: tests/conftest.py sets TRITON_INTERPRET=1 without CUDA), and a
piece that is off is reported as a mismatch."""

from __future__ import annotations

import pytest
from _paths import REPO, load_script

BENCH = REPO / "benchmarks" / "kernels"


@pytest.fixture(scope="module")
def ig():
    return load_script(BENCH / "inductor_glue.py")


def smoke(ig, tmp_path, *extra: str) -> dict:
    return ig.main(["--device", "cpu", "--smoke", "--json", str(tmp_path / "record.json"), *extra])


def test_every_piece_agrees_with_its_reference(ig, tmp_path):
    """aot_eager: Dynamo traces each reference whole (fullgraph, as Inductor gets it), no code made."""
    record = smoke(ig, tmp_path, "--backend", "aot_eager")
    assert record["mlac_path"] == "Triton interpreter"
    rows = record["rows"]
    # every piece at both tiny models and both batches; q_norm only where there is a q-LoRA (v3)
    assert len(rows) == 2 * (2 * len(ig.gp.PIECES) - 1)
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


def test_a_piece_that_is_off_is_a_mismatch(ig, tmp_path, monkeypatch):
    """silu_mul made 5% off: its row fails both the reference and the compiled check."""
    real = ig.gp.silu_mul
    monkeypatch.setattr(ig.gp, "silu_mul", lambda x, use_triton=None: real(x, use_triton) * 1.05)
    record = smoke(ig, tmp_path, "--backend", "aot_eager", "--pieces", "silu_mul", "--batches", "3")
    rows = record["rows"]
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
