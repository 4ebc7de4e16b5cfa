"""The compile's guards: one compile per OUT_DIR, no NaN/inf weight, a config that does not describe
the weights, odd rope dims, a full disk. Each is one `error: ...` line, exit code 1, nothing written."""

from __future__ import annotations

import errno
import subprocess
import sys
import time

import pytest
import torch
from _paths import REPO
from test_bad_input import (
    assert_clean_error,
    assert_nothing_written,
    ckpt,
    edit_config,
    edit_tensors,
    run_compile,
)

import mlac.compiler.writer as writer
from mlac.compiler.writer import lock_out_dir

__all__ = ["ckpt"]


def test_a_second_compile_to_the_same_out_dir_is_refused_while_the_first_runs(ckpt, tmp_path):
    out = tmp_path / "out"
    held = lock_out_dir(out)  # a compile in progress (this process stands for it)
    try:
        assert_clean_error(run_compile(ckpt, out), "another compile is writing it", "choose another OUT_DIR")
        assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))
    finally:
        held.release()
    assert run_compile(ckpt, out).exit_code == 0
    assert not (tmp_path / ".out.lock").exists()  # released and removed with the compile


def test_two_racing_compiles_leave_one_artifact_and_one_error(ckpt, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "mlac.cli", "compile", str(ckpt), str(out), "--skip-accuracy-check"]
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 1], results
    error = next(err for code, err in results if code == 1).strip().splitlines()[-1]
    assert "another compile is writing it" in error or "already exists" in error, error


def test_nan_weights_are_refused_naming_the_tensor(ckpt, tmp_path):
    def poison(t):
        w = t["model.layers.1.self_attn.o_proj.weight"]
        w[0, 0] = float("nan")

    edit_tensors(ckpt, poison)
    out = tmp_path / "out"
    assert_clean_error(run_compile(ckpt, out), "layers.1.attn.wo", "NaN or inf", "refusing")
    assert_nothing_written(out)


def test_inf_in_an_fp8_compile_is_refused_too(ckpt, tmp_path):
    edit_tensors(ckpt, lambda t: t["model.embed_tokens.weight"].__setitem__((3, 2), float("inf")))
    out = tmp_path / "out"
    assert_clean_error(run_compile(ckpt, out, "--fp8"), "embed", "NaN or inf")
    assert_nothing_written(out)


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"num_hidden_layers": 10**9}, "num_hidden_layers=1000000000, but the checkpoint holds"),
        ({"n_routed_experts": 10**8}, "n_routed_experts=100000000, but the checkpoint holds"),
        ({"qk_rope_head_dim": 15}, "qk_rope_head_dim=15: must be even"),
    ],
)
def test_a_config_that_does_not_describe_the_weights_is_one_line_and_quick(ckpt, tmp_path, changes, needle):
    edit_config(ckpt, **changes)
    out = tmp_path / "out"
    start = time.monotonic()
    assert_clean_error(run_compile(ckpt, out), needle)
    assert time.monotonic() - start < 10
    assert_nothing_written(out)


def test_a_full_disk_is_one_line_and_leaves_nothing(ckpt, tmp_path, monkeypatch):
    real = writer.write_safetensors_lockstep

    def full(paths, specs, piece):  # the disk fills up at the second layer's file
        if any("layer-00001" in str(p) for p in paths):
            paths[0].write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(paths, specs, piece)

    monkeypatch.setattr(writer, "write_safetensors_lockstep", full)
    out = tmp_path / "out"
    assert_clean_error(run_compile(ckpt, out), "layer-00001.safetensors", "no space left on the device")
    assert_nothing_written(out)


def test_non_finite_fp8_codes_are_found():
    chunk = torch.zeros(4, 4).to(torch.float8_e4m3fn)
    writer.check_finite("ok", chunk)
    chunk.view(torch.uint8)[1, 2] = 0xFF  # e4m3fn NaN
    with pytest.raises(Exception, match="bad: 1 NaN or inf"):
        writer.check_finite("bad", chunk)
