"""The artifact most server tests serve, and the in-process engine their answers are checked against."""

from pathlib import Path

import pytest
import torch

from mlac.runtime.engine.engine import Engine


@pytest.fixture(scope="module")
def art(artifact) -> Path:
    """The tiny V3 artifact (tests/conftest.py compiles it once per session)."""
    return artifact("tiny-v3")


@pytest.fixture(scope="module")
def ref(art) -> Engine:
    """A second engine over the same artifact, float32 on CPU: what each request gives when run alone."""
    return Engine.from_artifact(art, dtype=torch.float32, verify=False)
