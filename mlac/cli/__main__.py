"""`python -m mlac.cli`: the `mlac` command."""

from mlac.cli import main

main()
