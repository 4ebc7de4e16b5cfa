"""--attention-backend triton|flashinfer on serve, generate, bench and prepare: the field it sets, and
its one-line refusals before anything loads (serve: before any process starts). flashinfer is not
installed here: the prepare refusal says so for real."""

from __future__ import annotations

import pytest
from _cli import invoke, one_line_error
from test_flags import parsed_flags

import mlac.runtime.serve.engine_process as engine_process
from mlac.cli import flags
from mlac.cli.build import prepare
from mlac.cli.run import bench, generate
from mlac.cli.serve import serve
from mlac.runtime.engine.options import EngineOptions
from mlac.runtime.serve.config import ServerConfig
from mlac.runtime.worker.backend_check import flashinfer_installed


@pytest.mark.parametrize("command", [serve, generate, bench], ids=lambda c: c.name)
def test_the_flag_sets_the_runtime_field(command, tmp_path):
    own = ("generation_config",) if command is generate else ()
    extra = ["--prompt", "x"] if command is generate else []
    for args, want in (([], "triton"), (["--attention-backend", "triton"], "triton")):
        fields = flags.option_fields(parsed_flags(command, [str(tmp_path), *extra, *args], own))
        chain = (
            ServerConfig.of(artifact=tmp_path, **fields).engine
            if command is serve
            else EngineOptions.of(**fields)
        )
        assert chain.runtime.attention_backend == want
    with pytest.raises(Exception, match="'flash' is not one of 'triton', 'flashinfer'"):
        parsed_flags(command, [str(tmp_path), *extra, "--attention-backend", "flash"], own)


def test_prepare_takes_several_backends(tmp_path):
    ctx = prepare.make_context("prepare", [str(tmp_path), "--attention-backend", "triton",
                                           "--attention-backend", "flashinfer"])  # fmt: skip
    assert ctx.params["attention_backend"] == ("triton", "flashinfer")
    assert prepare.make_context("prepare", [str(tmp_path)]).params["attention_backend"] == ("triton",)


def test_generate_refuses_flashinfer_on_cpu_before_loading(artifact):
    r = invoke("generate", artifact("tiny-v2-lite"), "--prompt", "hi", "--device", "cpu",
               "--attention-backend", "flashinfer")  # fmt: skip
    one_line_error(r, "--attention-backend flashinfer: needs a CUDA device, not cpu")


def test_serve_refuses_before_any_process_starts(artifact, monkeypatch):
    monkeypatch.setattr(
        engine_process.EngineProcess, "start", lambda *a, **k: pytest.fail("a process started")
    )
    r = invoke("serve", artifact("tiny-v2-lite"), "--device", "cpu", "--attention-backend", "flashinfer")
    one_line_error(r, "--attention-backend flashinfer: needs a CUDA device, not cpu")
    r = invoke("serve", artifact("tiny-v2-lite"), "--dtype", "float32", "--attention-backend", "flashinfer")
    one_line_error(r, "FlashInfer's MLA kernels take bfloat16 or float16, not --dtype float32")


@pytest.mark.skipif(flashinfer_installed(), reason="flashinfer is installed here")
def test_prepare_refuses_flashinfer_where_it_is_not_installed(artifact):
    r = invoke("prepare", artifact("tiny-v2-lite"), "--attention-backend", "flashinfer")
    one_line_error(
        r, "--attention-backend flashinfer: flashinfer is not installed (pip install flashinfer-python)"
    )


def test_the_commands_list_the_flag():
    from click.testing import CliRunner

    for command in (serve, generate, bench, prepare):
        out = CliRunner().invoke(command, ["--help"]).output
        assert "--attention-backend [triton|flashinfer]" in out, command.name
