"""`mlac synth --from-config` on the published DeepSeek configs, 2 layers, compiled with and without --fp8.

V2-Lite runs in the default suite (about 2 GB written). V2, V3 and R1 write 10-25 GB each (a
single V3 MoE layer is 11 GB in FP8) and are marked slow: `pytest -m slow tests/compiler/test_from_config.py`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from _paths import CONFIGS
from click.testing import CliRunner

from mlac.cli import main
from mlac.core.artifact import Manifest

CONFIGS = CONFIGS


def synth_and_compile(name: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    r = CliRunner().invoke(
        main, ["synth", "--from-config", str(CONFIGS / f"{name}.json"), str(ckpt), "--num-layers", "2"]
    )
    assert r.exit_code == 0, r.output
    for fp8 in (False, True):
        out = tmp_path / f"out-{fp8}"
        args = ["compile", str(ckpt), str(out), "--skip-accuracy-check"] + (["--fp8"] if fp8 else [])
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 0, r.output
        m = Manifest.load(out)
        assert m.model.num_hidden_layers == 2 and m.quantization.scheme == ("fp8-block" if fp8 else "none")
        assert any(n.startswith("layers.1.moe.w13") for n in m.tensors[0])
        shutil.rmtree(out)
    shutil.rmtree(ckpt)  # tens of GB for V3: free the disk for the next config


def test_v2_lite_config(tmp_path):
    synth_and_compile("DeepSeek-V2-Lite", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["DeepSeek-V2", "DeepSeek-V3", "DeepSeek-R1"])
def test_large_configs(name, tmp_path):
    synth_and_compile(name, tmp_path)
