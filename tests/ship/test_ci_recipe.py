"""examples/ci/github-actions.yml as it is written: its build job's mlac steps run, in order, with bash,
against a local registry (made plain-HTTP by MLAC_INSECURE_REGISTRIES, not by editing a command), on a
synthetic checkpoint. A change to mlac's commands or flags that the recipe does not follow fails here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import yaml
from _paths import REPO

from mlac.core.validity import check_artifact

WORKFLOW = REPO / "examples" / "ci" / "github-actions.yml"
DOCKERFILE = REPO / "Dockerfile"
BUILD_STEPS = ("compile", "verify", "sign", "push")  # the CPU job's steps that call mlac


def test_the_build_job_runs_as_written(checkpoint, registry, tmp_path):
    flow = yaml.safe_load(WORKFLOW.read_text())
    steps = {s.get("id"): s for s in flow["jobs"]["build"]["steps"]}
    assert set(BUILD_STEPS) <= set(steps), sorted(k for k in steps if k)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mlac").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m mlac.cli "$@"\n')
    (bin_dir / "mlac").chmod(0o755)
    key = tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", key], check=True
    )
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "MODEL_DIR": str(checkpoint("tiny-v3")),
        "ARTIFACT_DIR": str(tmp_path / "artifact"),
        "COMPILE_FLAGS": "--fp8 --tp 2",  # the recipe's flags, for a tiny model on 2 ranks
        "SOURCE_REPO": flow["env"]["SOURCE_REPO"],
        "SOURCE_REVISION": "0123abc",
        "TARGET": registry.ref("models/deepseek-v3:0123abc"),
        "MLAC_INSECURE_REGISTRIES": registry.host,
        "SIGNING_KEY": key.read_text(),
    }
    for step_id in BUILD_STEPS:
        step = steps[step_id]
        step_env = {**env, **{k: env[k] for k in (step.get("env") or {})}}
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", step["run"]], cwd=tmp_path, env=step_env,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert proc.returncode == 0, (step_id, proc.stderr[-3000:])
    compiled = json.loads((tmp_path / "compile.json").read_text())
    pushed = json.loads((tmp_path / "push.json").read_text())
    verified = json.loads((tmp_path / "verify.json").read_text())
    assert compiled["identity"] == verified["identity"] == pushed["identity"] and pushed["signed"]
    assert compiled["provenance"]["repo"] == flow["env"]["SOURCE_REPO"]
    assert check_artifact(tmp_path / "artifact").whole
    assert not (tmp_path / "signing-key.pem").exists()  # the key is not left on disk


def test_the_gpu_job_and_the_deploy_line_use_mlacs_commands():
    """The GPU job cannot run here; its commands are checked against the CLI's own flags."""
    from click.testing import CliRunner

    from mlac.cli import main

    flow = yaml.safe_load(WORKFLOW.read_text())
    runs = [s["run"] for s in flow["jobs"]["prepare"]["steps"] if "run" in s]
    lines = [line.strip() for run in runs for line in run.splitlines() if line.strip().startswith("mlac ")]
    assert [line.split()[1] for line in lines] == ["pull", "prepare", "sign", "push"]
    for line in lines:
        words = [w for w in line.split() if w.startswith("--")]
        usage = CliRunner().invoke(main, [line.split()[1], "--help"]).output
        assert all(w in usage for w in words), (line, usage)
    deploy = WORKFLOW.read_text().split("mlac serve", 1)[1].splitlines()[0]
    usage = CliRunner().invoke(main, ["serve", "--help"]).output
    assert all(w in usage for w in deploy.split() if w.startswith("--"))


def test_the_dockerfile_pins_the_target_signature():
    text = DOCKERFILE.read_text()
    assert "ARG TORCH_VERSION=2.11.0" in text and "ARG TRITON_VERSION=3.6.0" in text
    assert '"torch==${TORCH_VERSION}"' in text and '"triton==${TRITON_VERSION}"' in text
    assert 'ENTRYPOINT ["mlac"]' in text
