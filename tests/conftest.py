"""Shared fixtures: synthetic checkpoints and compiled artifacts, built once per session."""

from __future__ import annotations

import os

# Tiny models on a small shared machine: one intra-op thread avoids OpenMP contention that makes
# small ops ~100x slower. Set before torch is imported (pytest imports conftest first).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest
import torch

# Without CUDA, Triton kernels run under the interpreter: TRITON_INTERPRET must be set before any
# kernel module is imported (its @triton.jit functions are made interpreted or compiled then), and
# a test file outside tests/kernels/ may import one (through mlac.runtime) before a kernel test does.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests mirror mlac's packages (tests/runtime/engine/, ...). Test files have unique names and import
# each other's helpers by name (`from test_spec_decode import spec_engine`): every folder of tests/
# is on sys.path, as pytest's default import mode puts a test file's own folder there.
for _folder in sorted(p for p in Path(__file__).parent.rglob("*") if p.is_dir() and p.name != "__pycache__"):
    if any(_folder.glob("test_*.py")) and str(_folder) not in sys.path:
        sys.path.append(str(_folder))

TINY_PRESETS = ("tiny-v2-lite", "tiny-v2", "tiny-v3")


def pytest_collection_modifyitems(config, items):
    """The one way a test says it needs GPUs: `@pytest.mark.gpu` (one device) or
    `@pytest.mark.gpu(2)` (that many). Without them it is skipped, saying what it needs."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("gpu")
        need = (marker.args[0] if marker.args else 1) if marker else 0
        if need > have:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA device{'s' if need > 1 else ''}"))


@pytest.fixture(autouse=True)
def _settings_read_afresh():
    """Each test reads mlac's settings (mlac/settings.py, read once per process) from the
    environment as it finds it, not as an earlier test left it."""
    from mlac import settings

    settings.reload()
    yield
    settings.reload()


@pytest.fixture
def setting(monkeypatch):
    """setting(name, value): the environment variable set for this test (None: unset), and mlac's
    settings read again from it."""
    from mlac import settings

    def put(name: str, value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        settings.reload()

    return put


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(preset) -> path of a synthetic HF checkpoint (seed 0), cached for the session."""
    from mlac.synth import synthesize

    made: dict[str, Path] = {}

    def get(preset: str) -> Path:
        if preset not in made:
            made[preset] = synthesize(tmp_path_factory.mktemp("ckpt") / preset, preset=preset, seed=0)
        return made[preset]

    return get


@pytest.fixture(scope="session")
def artifact(tmp_path_factory, checkpoint):
    """artifact(preset, fp8=False) -> path of the compiled artifact, cached for the session."""
    from mlac.compiler.pipeline import compile_checkpoint
    from mlac.core.artifact import CompileOptions

    made: dict[tuple[str, bool], Path] = {}

    def get(preset: str, fp8: bool = False) -> Path:
        key = (preset, fp8)
        if key not in made:
            out = tmp_path_factory.mktemp("artifact") / f"{preset}{'-fp8' if fp8 else ''}"
            compile_checkpoint(checkpoint(preset), out, CompileOptions(fp8=fp8))
            made[key] = out
        return made[key]

    return get


@pytest.fixture
def steady(monkeypatch) -> list[bool]:
    """Overlap scheduling's landed flights: for each, whether the next step was already in flight
    (the steady state). Used by the overlap tests, one rank and several."""
    import mlac.runtime.engine.overlap as overlap_mod

    seen: list[bool] = []
    land = overlap_mod.Overlap.land

    def spy(sched, flight):
        seen.append(sched.overlap.flight is not None and sched.overlap.flight is not flight)
        return land(sched, flight)

    monkeypatch.setattr(overlap_mod.Overlap, "land", staticmethod(spy))
    return seen
