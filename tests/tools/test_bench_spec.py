"""`mlac bench --speculative-num-steps K`: the plain-decoding baseline it reports beside the speculative
result, and the profile record of a speculative step (kernels, graph replays, copies, GPU and wall
time, tokens per step)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum

import pytest
from click.testing import CliRunner

from mlac.cli import main
from mlac.tools.bench import _profile_record, busy_us, profile_line


def test_speculative_bench_reports_the_plain_baseline(artifact, tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", str(artifact("tiny-v3")), "--batch-sizes", "2", "--input-len", "5", "--output-len", "8",
            "--device", "cpu", "--dtype", "float32", "--no-verify", "--speculative-num-steps", "2",
            "--json", str(out)]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "plain decoding (same engine, same overlap setting)" in result.output
    (r,) = json.loads(out.read_text())["results"]
    assert r["accept_length"] >= 1.0 and r["plain_decode_tokens_per_s"] > 0


def test_plain_bench_has_no_baseline_field_value(artifact, tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", str(artifact("tiny-v3")), "--batch-sizes", "1", "--input-len", "5", "--output-len", "3",
            "--device", "cpu", "--dtype", "float32", "--no-verify", "--json", str(out)]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "plain decoding" not in result.output
    assert json.loads(out.read_text())["results"][0]["plain_decode_tokens_per_s"] is None


class Kind(Enum):
    CPU = 0
    CUDA = 1


@dataclass
class Span:
    start: float  # µs
    end: float


@dataclass
class Event:
    name: str
    device_type: Kind
    device_time: float = 0.0  # µs
    time_range: Span = field(default_factory=lambda: Span(0.0, 0.0))


def test_busy_time_is_the_union_of_the_spans():
    assert busy_us([]) == 0.0
    assert busy_us([(0, 10), (5, 12), (20, 25)]) == 17.0  # overlapping (PDL) and a gap
    assert busy_us([(20, 25), (0, 10), (10, 11)]) == 16.0  # unsorted, touching


def test_profile_record_of_speculative_steps():
    events = [Event("cudaGraphLaunch", Kind.CPU), Event("cudaGraphLaunch", Kind.CPU)]
    gemms = [Event("gemm", Kind.CUDA, 100.0, Span(200.0 * i, 200.0 * i + 100.0)) for i in range(6)]
    events += gemms + [Event("argmax", Kind.CUDA, 10.0, Span(50.0, 60.0))] * 2  # inside a gemm's span
    events += [Event("Memcpy HtoD", Kind.CUDA, 1.0)] * 2 + [Event("aten::copy_", Kind.CPU)]
    rec = _profile_record(events, Kind, batch=1, steps=2, wall=0.004, tokens=5, k=3)
    assert rec["kernels_per_step"] == 4 and rec["graph_replays_per_step"] == 1 and rec["copies_per_step"] == 1
    assert rec["gpu_kernel_ms_per_step"] == pytest.approx(0.31)  # summed
    assert rec["gpu_busy_ms_per_step"] == pytest.approx(0.30)  # the argmax spans overlap a gemm's
    assert rec["wall_ms_per_step"] == pytest.approx(2.0) and rec["gpu_idle_ms_per_step"] == pytest.approx(
        1.70
    )
    assert rec["tokens_per_step"] == 2.5 and rec["kernels_by_gpu_time"][0]["name"] == "gemm"
    line = profile_line(rec)
    assert "per speculative step (K = 3)" in line and "1.0 graph replays" in line and "2.50 tokens" in line
