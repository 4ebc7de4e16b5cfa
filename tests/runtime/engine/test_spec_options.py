"""The speculative flags of `mlac generate`, `bench` and `serve` (SGLang's names), and /metrics."""

from __future__ import annotations

import json

import pytest
from _cli import invoke, one_line_error

from mlac.core.errors import MlacError
from mlac.runtime.engine.options import DEFAULT_STEPS, num_steps_of


def test_num_steps_of_the_flags():
    assert num_steps_of(None, None) == 0
    assert num_steps_of("nextn", None) == num_steps_of("MTP", None) == DEFAULT_STEPS
    assert num_steps_of(None, 2) == num_steps_of("nextn", 2) == 2
    with pytest.raises(MlacError, match="eagle"):
        num_steps_of("eagle", 2)


def test_generate_speculative_matches_plain(artifact):
    path = artifact("tiny-v3")
    args = (
        "generate",
        path,
        "--prompt",
        "The morning train",
        "--dtype",
        "float32",
        "--max-tokens",
        "12",
        "--temperature",
        "0",
    )
    plain = invoke(*args)
    spec = invoke(*args, "--speculative-algorithm", "nextn", "--speculative-num-steps", "3")
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert spec.output == plain.output


def test_bench_reports_accept_length(artifact, tmp_path):
    out = tmp_path / "b.json"
    r = invoke("bench", artifact("tiny-v3"), "--batch-sizes", "1,3", "--input-len", "8", "--output-len", "8",
               "--dtype", "float32", "--speculative-num-steps", "2", "--json", out)  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "tokens per verify at batch 1" in r.output
    record = json.loads(out.read_text())
    assert record["speculative_num_steps"] == 2
    for row in record["results"]:
        assert 1.0 <= row["accept_length"] <= 3.0
        assert row["decode_tokens_per_s"] > 0


def test_refused_without_mtp_layer_one_line(checkpoint, tmp_path):
    art = tmp_path / "a"
    assert invoke("compile", checkpoint("tiny-v3"), art, "--no-mtp", "--skip-accuracy-check").exit_code == 0
    r = invoke("generate", art, "--prompt", "x", "--speculative-algorithm", "mtp")
    one_line_error(r, "no MTP layer")


def test_server_speculates_and_counts_it(artifact):
    """`mlac serve --speculative-num-steps 2` in process: a greedy completion equals the plain
    engine's, and /metrics counts the verifies, drafts and accepted drafts."""
    import httpx
    import torch

    from mlac.runtime.engine.engine import Engine
    from mlac.runtime.engine.scheduler import SchedulerConfig
    from mlac.runtime.serve import ServerConfig, ServerThread

    path = artifact("tiny-v3")
    want = Engine.from_artifact(path, dtype=torch.float32, verify=False).generate([5, 6, 7], max_tokens=8)
    config = ServerConfig.of(artifact=path, dtype="float32", verify=False, served_model_name="m",
                          scheduler=SchedulerConfig(speculative_num_steps=2))  # fmt: skip
    with ServerThread(config) as srv:
        body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text
        text = httpx.get(f"{srv.url}/metrics").text
    counts = {}  # by the name's end: the prefix and labels are the metrics module's
    for line in text.splitlines():
        for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total"):
            if not line.startswith("#") and name in line.split()[0]:
                counts[name] = float(line.split()[-1])
    assert counts["spec_decode_num_drafts_total"] > 0
    assert counts["spec_decode_num_draft_tokens_total"] >= counts["spec_decode_num_drafts_total"]


def test_negative_steps_are_refused():
    from mlac.runtime.engine.scheduler import SchedulerConfig

    with pytest.raises(MlacError, match="speculative_num_steps=-1"):
        SchedulerConfig(speculative_num_steps=-1)
