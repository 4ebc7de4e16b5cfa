"""cli/flags.py: every flag of the options chain sets a field that exists, the serve flags' defaults
are the options' defaults, and importing the CLI stays cheap."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _paths import REPO

from mlac.cli import flags
from mlac.cli.run import bench, generate
from mlac.cli.serve import serve
from mlac.core.options import field_names
from mlac.runtime.engine.options import EngineOptions
from mlac.runtime.serve.config import ServerConfig
from mlac.runtime.worker.device import check_device


def parsed_flags(command, args: list[str], own: tuple[str, ...] = ()) -> dict:
    """The table's flags of `command` as click parses `args` (the command is not run), but those
    it takes as its `own` parameters (generate reads --generation-config itself)."""
    ctx = command.make_context(command.name, args)
    return {k: v for k, v in ctx.params.items() if k in flags.BY_PARAM and k not in own}


def test_every_flag_sets_a_field_of_the_options_chain():
    names = field_names(ServerConfig)
    assert [f.param for f in flags.BY_PARAM.values() if f.field is not None and f.field not in names] == []
    assert len(flags.BY_PARAM) == len(
        flags.RUNTIME_FLAGS
        + flags.SCHEDULER_FLAGS
        + flags.ENGINE_FLAGS
        + flags.SERVER_FLAGS
        + flags.SOURCE_FLAGS
    )  # one flag per parameter name


def test_serve_flag_defaults_are_the_server_config_defaults(tmp_path, setting):
    setting("MLAC_API_KEY", None)
    given = parsed_flags(serve, [str(tmp_path)])
    assert set(given) == set(flags.BY_PARAM)  # serve takes every flag of the table
    config = ServerConfig.of(artifact=tmp_path, **flags.option_fields(given))
    assert config == ServerConfig.of(artifact=tmp_path, device=check_device(None))


def test_flags_convert_to_their_fields(tmp_path, setting):
    setting("MLAC_API_KEY", "from-env")
    args = [str(tmp_path), "--no-verify", "--require-prepared", "--disable-overlap-schedule",
            "--disable-radix-cache", "--speculative-algorithm", "mtp", "--disable-log-stats", "--device", "cpu",
            "--dtype", "float32", "--max-running-requests", "8", "--mem-fraction-static", "0.5"]  # fmt: skip
    config = ServerConfig.of(artifact=tmp_path, **flags.option_fields(parsed_flags(serve, args)))
    rt, sched = config.engine.runtime, config.engine.scheduler
    assert (rt.verify, rt.kernel_cache, rt.device, rt.dtype_name, rt.gpu_memory_utilization) == (
        False, "require", "cpu", "float32", 0.5,
    )  # fmt: skip
    assert (sched.overlap, sched.prefix_cache, sched.speculative_num_steps) == (False, False, 3)
    assert sched.max_running_requests == 8 and not config.log_stats and config.api_key == "from-env"


def test_a_command_words_a_flag_its_own_way_but_sets_the_same_field(tmp_path):
    options = EngineOptions.of(
        **flags.option_fields(
            parsed_flags(generate, [str(tmp_path), "--prompt", "x"], ("generation_config",))
        )
    )
    assert options.runtime.cuda_graph_max_bs == 1  # generate's default: one prompt
    given = parsed_flags(bench, [str(tmp_path), "--num-blocks", "9", "--speculative-num-steps", "2"])
    options = EngineOptions.of(**flags.option_fields(given))
    assert (options.runtime.num_blocks, options.scheduler.speculative_num_steps) == (9, 2)
    with pytest.raises(TypeError, match="not flags of the options table: prompt"):
        flags.option_fields({"prompt": "x"})


def test_importing_the_cli_imports_no_torch():
    code = (
        "import sys, mlac.cli; print(sorted(m for m in ('torch', 'fastapi', 'uvicorn') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, cwd=Path(REPO))  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_vllm_names_set_the_same_fields(tmp_path):
    args = [str(tmp_path), "--max-num-seqs", "8", "--no-enable-prefix-caching", "--enforce-eager", "-tp", "2",
            "--kv-cache-dtype", "fp8"]  # fmt: skip
    config = ServerConfig.of(artifact=tmp_path, **flags.option_fields(parsed_flags(serve, args)))
    rt, sched = config.engine.runtime, config.engine.scheduler
    assert (sched.max_running_requests, sched.prefix_cache, rt.cuda_graph) == (8, False, False)
    assert (rt.tensor_parallel_size, rt.kv_cache_dtype) == (2, "fp8")
    on = ServerConfig.of(artifact=tmp_path, **flags.option_fields(parsed_flags(serve, [str(tmp_path),
                         "--enable-prefix-caching", "--kv-cache-dtype", "auto"])))  # fmt: skip
    assert on.engine.scheduler.prefix_cache and on.engine.runtime.kv_cache_dtype is None
    args = [str(tmp_path), "--prompt", "x", "--enforce-eager", "-tp", "1"]
    given = parsed_flags(generate, args, ("generation_config",))
    options = EngineOptions.of(**flags.option_fields(given))
    assert (options.runtime.cuda_graph, options.runtime.tensor_parallel_size) == (False, 1)


def test_serve_help_lists_the_vllm_names():
    from click.testing import CliRunner

    out = CliRunner().invoke(serve, ["--help"]).output
    for name in ("--tensor-parallel-size", "-tp", "--max-num-seqs", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--disable-radix-cache", "--enforce-eager", "--kv-cache-dtype"):  # fmt: skip
        assert name in out, name
