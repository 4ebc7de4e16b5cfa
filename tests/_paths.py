"""Where things are, for tests at any depth under tests/."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
CONFIGS = TESTS / "configs"


def load_script(path: Path):
    """A script that is not a package module (benchmarks/...) imported by its path, under its stem."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # before it runs: its dataclasses look their module up
    spec.loader.exec_module(module)
    return module
