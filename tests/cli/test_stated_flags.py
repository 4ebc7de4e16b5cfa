"""--tensor-parallel-size and --kv-cache-dtype (vLLM's names) state what the artifact was compiled
with: a value that agrees is accepted, one that contradicts it is refused with one line naming
both values, by `mlac serve` before any process starts and by `mlac generate` before it loads."""

from __future__ import annotations

import pytest
from _cli import invoke, one_line_error

from mlac.runtime.serve.engine_process import EngineProcess


@pytest.mark.parametrize(
    "flag, value, needles",
    [("--tensor-parallel-size", "2", ("--tensor-parallel-size 2", "tp=1")),
     ("-tp", "4", ("--tensor-parallel-size 4", "tp=1")),
     ("--kv-cache-dtype", "fp8", ("--kv-cache-dtype fp8", "bf16")),
     ("--kv-cache-dtype", "fp8_e5m2", ("--kv-cache-dtype fp8_e5m2", "bf16"))],
)  # fmt: skip
def test_a_contradiction_is_one_line_naming_both_values(flag, value, needles, artifact, monkeypatch):
    art = artifact("tiny-v3")

    def no_process(*args, **kwargs):
        raise AssertionError("serve started the engine's process before it refused the flag")

    monkeypatch.setattr(EngineProcess, "start", no_process)
    one_line_error(invoke("serve", art, "--device", "cpu", flag, value), *needles)
    one_line_error(invoke("generate", art, "--prompt", "hi", "--device", "cpu", flag, value), *needles)


def test_values_that_agree_are_accepted(artifact):
    art = artifact("tiny-v3")
    r = invoke("generate", art, "--prompt", "hi", "--device", "cpu", "--dtype", "float32", "--max-tokens", "2",
               "-tp", "1", "--kv-cache-dtype", "bfloat16", "--enforce-eager", "--no-verify")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "completion tokens, finish:" in r.output


def test_an_unknown_kv_cache_dtype_is_a_usage_error(artifact):
    r = invoke("serve", artifact("tiny-v3"), "--kv-cache-dtype", "int4")
    assert r.exit_code == 2 and "Invalid value for '--kv-cache-dtype'" in r.output
