"""`mlac bench` on CPU with a tiny artifact: the table, the JSON record, the roofline arithmetic, bad input."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mlac.cli import main
from mlac.core.artifact import Manifest
from mlac.tools.bench import ITEMSIZE, decode_step_bytes


def test_bench_prints_a_row_per_batch_and_writes_json(artifact, tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", str(artifact("tiny-v3")), "--batch-sizes", "2,1", "--input-len", "5", "--output-len", "4",
            "--device", "cpu", "--dtype", "float32", "--no-verify", "--json", str(out)]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2"]  # sorted, one row each
    record = json.loads(out.read_text())
    assert record["device"] == "cpu" and record["tp"] == 1 and record["copy_bandwidth_bytes_per_s"] > 0
    for r, batch in zip(record["results"], (1, 2), strict=True):
        assert r["batch"] == batch and r["decode_steps"] == 3  # output_len - 1 steps after the prefill
        assert r["decode_tokens_per_s"] == pytest.approx(batch * 3 / r["decode_s"])
        assert r["roofline_fraction"] == pytest.approx(r["decode_tokens_per_s"] / r["roofline_tokens_per_s"])


def test_bench_samples_as_told_and_refuses_a_bad_parameter_before_loading(artifact, tmp_path, monkeypatch):
    """--temperature/--top-p/--top-k (vLLM bench's names): every sequence samples so (the sampler
    runs; the record says how); an out-of-range value is one line naming it, before any load."""
    from mlac.runtime.engine import sampling

    seen = []
    real = sampling.sample_deferred
    monkeypatch.setattr(sampling, "sample_deferred", lambda l, p, g: seen.append(p[0]) or real(l, p, g))
    out = tmp_path / "bench.json"
    args = ["bench", str(artifact("tiny-v3")), "--batch-sizes", "2", "--input-len", "5", "--output-len", "4",
            "--device", "cpu", "--dtype", "float32", "--no-verify", "--temperature", "0.8", "--top-k", "20",
            "--top-p", "0.9", "--json", str(out)]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert seen and all((p.temperature, p.top_k, p.top_p) == (0.8, 20, 0.9) for p in seen)
    assert json.loads(out.read_text())["sampling"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 20}
    loads = []
    monkeypatch.setattr("mlac.runtime.engine.engine.Engine.from_artifact", lambda *a, **k: loads.append(1))
    bad = CliRunner().invoke(main, [*args[:12], "--top-p", "1.5"])
    assert bad.exit_code != 0 and not loads
    assert (
        "top_p" in bad.output and "Traceback" not in bad.output and len(bad.output.strip().splitlines()) == 1
    )


def test_decode_step_bytes_counts_every_weight_once_and_the_touched_experts(artifact):
    m = Manifest.load(artifact("tiny-v3"))
    cfg, tensors = m.model, m.tensors[0]

    def size(name: str) -> int:
        t = tensors[name]
        n = ITEMSIZE[t.dtype]
        for d in t.shape:
            n *= d
        return n

    experts = sum(size(n) for n in tensors if ".moe.w13" in n or ".moe.w2" in n)
    embed_row = size("embed") // tensors["embed"].shape[0]
    others = sum(size(n) for n in tensors) - experts - size("embed")
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    for batch in (1, 4):
        touched = 1 - (1 - k / e) ** batch  # the fraction of experts a batch is expected to pick
        want = others + embed_row * batch + experts * touched + batch * 10 * 7
        assert decode_step_bytes(m, batch, 10, 7) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("sizes", ["0", "a,b", ""])
def test_bad_batch_sizes_are_one_line_errors(artifact, sizes):
    result = CliRunner().invoke(
        main, ["bench", str(artifact("tiny-v3")), "--batch-sizes", sizes, "--device", "cpu"]
    )
    assert result.exit_code == 1
    assert result.output.strip().startswith("error: --batch-sizes") and "Traceback" not in result.output


def test_decode_steps_count_forwards_with_overlap_scheduling(artifact):
    """With overlap scheduling the last scheduler call only lands the step before it: the step count
    (and ms per step) counts decode forwards, output_len - 1, as without overlap."""
    import torch

    from mlac.runtime.engine.engine import Engine
    from mlac.runtime.engine.scheduler import SchedulerConfig
    from mlac.tools.bench import run_batch

    for overlap in (False, True):
        cfg = SchedulerConfig(overlap=overlap)
        with Engine.from_artifact(
            artifact("tiny-v3"), dtype=torch.float32, verify=False, scheduler=cfg
        ) as engine:
            run = run_batch(engine, batch=2, input_len=5, output_len=6, seed=0)
        assert run.steps == 5 and run.tokens == 2 * 5, (overlap, run)
