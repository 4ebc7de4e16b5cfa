"""Where things are, for tests at any depth under tests/."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
CONFIGS = TESTS / "configs"
