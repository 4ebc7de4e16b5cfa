"""`mlac serve` hands the engine's process its config before the server's own process imports the
HTTP stack, and torch unless --device needs it to ask about CUDA (cli/serve.py): the
engine loads while the server imports. What launch.serve refuses before the model loads is
refused first."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "triton", "fastapi", "uvicorn")
EARLY = (*HEAVY, "pydantic", "mlac.core.artifact")  # none of it before the engine's process is started

# The CLI in a fresh interpreter with a stand-in engine process that reports what was imported
# when it was configured, then ends the command.
DRIVER = """
import sys
from mlac.runtime.serve import engine_process

class Recorder:
    configured = False

    @classmethod
    def start(cls, artifact, launch):
        print("started", sorted(m for m in {early!r} if m in sys.modules), flush=True)
        return cls()

    def configure(self, config, log_level, load=None):
        heavy = sorted(m for m in {heavy!r} if m in sys.modules)
        print("configured", config.port, heavy, flush=True)
        raise SystemExit(3)

    def close(self):
        pass

engine_process.EngineProcess = Recorder
from mlac.cli import main
sys.argv = ["mlac", "serve", *sys.argv[1:]]
main()
"""


def run_serve(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    code = DRIVER.format(heavy=HEAVY, early=EARLY)
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_engine_is_configured_before_torch_and_the_http_stack_are_imported(artifact):
    port = free_port()
    out = run_serve(str(artifact("tiny-v3")), "--device", "cpu", "--port", str(port))
    assert out.returncode == 3, out.stdout + out.stderr
    assert out.stdout.strip().splitlines() == ["started []", f"configured {port} []"], out.stdout + out.stderr


def test_the_engine_process_starts_before_the_manifest_is_read(artifact):
    """Reading the manifest imports pydantic (a tenth of a second here, more on a GPU host): the
    engine's process is spawned first, unless a stated flag must be checked against it."""
    out = run_serve(str(artifact("tiny-v3")), "--device", "cpu", "--port", str(free_port()))
    assert out.stdout.splitlines()[0] == "started []", out.stdout + out.stderr
    out = run_serve(str(artifact("tiny-v3")), "--device", "cpu", "--port", str(free_port()), "-tp", "1")
    assert out.stdout.splitlines()[0] == "started ['mlac.core.artifact', 'pydantic']", out.stdout + out.stderr


@pytest.mark.parametrize("case", ["busy port", "generation config"])
def test_what_serve_refuses_is_refused_before_the_engine_is_configured(case, artifact, tmp_path):
    args = [str(artifact("tiny-v3")), "--device", "cpu"]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        if case == "busy port":
            args += ["--port", str(busy.getsockname()[1])]
            needle = "is in use"
        else:
            (tmp_path / "generation_config.json").write_text('{"top_p": 0}')
            args += ["--port", str(free_port()), "--generation-config", str(tmp_path)]
            needle = "top_p=0: must be in (0, 1]"
        out = run_serve(*args)
    assert out.returncode == 1 and "configured" not in out.stdout, out.stdout + out.stderr
    assert needle in out.stderr.strip().splitlines()[-1] and "Traceback" not in out.stderr
