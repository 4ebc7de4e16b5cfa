"""core/options.py: layered options built from field names, each put in the layer that declares it."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from mlac.core.errors import MlacError
from mlac.core.options import Options, build, field_names, layers
from mlac.runtime.engine.options import EngineOptions
from mlac.runtime.engine.scheduler import SchedulerConfig
from mlac.runtime.serve.config import ServerConfig
from mlac.runtime.worker.options import RuntimeOptions

ENV = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))


@dataclass(frozen=True)
class Inner:
    depth: int = 1
    name: str = "inner"


@dataclass(frozen=True)
class Other:
    width: int = 2


@dataclass(frozen=True)
class Outer(Options):
    inner: Inner = field(default_factory=Inner)
    other: Other = field(default_factory=Other)
    label: str = "outer"
    numbers: list[int] = field(default_factory=list)  # a factory that is not a layer


@dataclass(frozen=True)
class Clash:
    width: int = 3


@dataclass(frozen=True)
class Ambiguous(Options):
    other: Other = field(default_factory=Other)
    clash: Clash = field(default_factory=Clash)


def test_layers_are_the_fields_made_by_a_dataclass_factory():
    assert layers(Outer) == {"inner": Inner, "other": Other}
    assert field_names(Outer) == {"inner", "other", "label", "numbers", "depth", "name", "width"}


def test_each_name_goes_to_the_layer_that_declares_it():
    got = Outer.of(depth=5, width=7, label="x")
    assert got == Outer(inner=Inner(depth=5), other=Other(width=7), label="x")
    assert build(Outer, {}) == Outer()


def test_a_layer_given_whole_is_the_base_of_its_other_fields():
    got = Outer.of(inner=Inner(depth=3, name="given"), depth=4)
    assert got.inner == Inner(depth=4, name="given")


def test_updated_changes_only_the_named_fields():
    base = Outer.of(depth=5, name="kept", label="kept")
    got = base.updated(width=9)
    assert got == Outer(inner=Inner(depth=5, name="kept"), other=Other(width=9), label="kept")
    assert base.other.width == 2  # frozen: a copy


def test_an_unknown_or_ambiguous_name_is_a_type_error():
    with pytest.raises(TypeError, match="Outer: no option 'colour'"):
        Outer.of(colour="red")
    with pytest.raises(TypeError, match=r"several layers \(other, clash\)"):
        Ambiguous.of(width=1)


def test_the_serve_chain_routes_flat_fields_and_validates_each_layer():
    config = ServerConfig.of(artifact=Path("out"), port=8001, max_running_requests=8, dtype="float32",
                             num_blocks=40, chat_template=Path("t.jinja"))  # fmt: skip
    assert config.port == 8001 and config.engine.chat_template == Path("t.jinja")
    assert config.engine.scheduler == SchedulerConfig(max_running_requests=8)
    assert config.engine.runtime == RuntimeOptions(dtype=torch.float32, num_blocks=40)
    assert config.max_unfinished == 8 + config.max_queue
    assert field_names(ServerConfig) >= field_names(EngineOptions) >= field_names(RuntimeOptions)
    with pytest.raises(MlacError, match="give --kv-cache-bytes or --num-blocks, not both"):
        ServerConfig.of(artifact=Path("out"), num_blocks=4, kv_cache_bytes=1 << 20)
    with pytest.raises(MlacError, match="--gpu-memory-utilization 1.5: must be in"):
        EngineOptions.of(gpu_memory_utilization=1.5)
    with pytest.raises(MlacError, match="--max-model-len 0: must be at least 1"):
        RuntimeOptions(max_model_len=0)
    with pytest.raises(MlacError, match="max_running_requests=0"):
        ServerConfig.of(artifact=Path("out"), max_running_requests=0)


def test_runtime_dtype_by_name_or_torch_dtype():
    assert RuntimeOptions(dtype="float32").torch_dtype is torch.float32
    assert RuntimeOptions(dtype=torch.float32) == RuntimeOptions(dtype="float32")
    assert RuntimeOptions(dtype=torch.bfloat16).dtype_name == "bfloat16"
    with pytest.raises(
        MlacError, match=r"dtype='float9': not a compute dtype \(bfloat16, float16, float32\)"
    ):
        RuntimeOptions(dtype="float9")
    with pytest.raises(MlacError, match="dtype=torch.int8: not a compute dtype"):
        RuntimeOptions(dtype=torch.int8)


def test_graphs_on_cuda_devices_in_a_graph_dtype():
    options = RuntimeOptions(dtype="bfloat16")
    assert (
        options.graphs_on("cuda")
        and options.graphs_on("cuda:1")
        and options.graphs_on(torch.device("cuda", 0))
    )
    assert not options.graphs_on("cpu") and not options.graphs_on(torch.device("cpu"))
    assert not RuntimeOptions(dtype="float32").graphs_on("cuda")
    assert not RuntimeOptions(cuda_graph=False).graphs_on("cuda")


def test_the_options_chain_is_built_without_torch():
    """`mlac serve` hands the ServerConfig to the engine's process before its own imports torch
    (cli/serve.py): building the whole chain must not import it."""
    code = (
        "import sys; from pathlib import Path; from mlac.runtime.serve.config import ServerConfig; "
        "c = ServerConfig.of(artifact=Path('out'), dtype='float32', num_blocks=8, max_running_requests=4); "
        "import pickle; pickle.dumps(c); "
        "print(sorted(m for m in ('torch', 'triton', 'fastapi', 'uvicorn', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=ENV)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
