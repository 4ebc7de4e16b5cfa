"""One version: the package's, pyproject's and the one manifests and `/version` carry."""

import tomllib
from _paths import REPO

import mlac
from mlac.core.version import __version__


def test_the_version_is_the_same_everywhere():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert mlac.__version__ == __version__ == project["version"]
