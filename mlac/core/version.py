"""mlac's version: written into every manifest and kernel-cache unit, served at `/version` (pyproject.toml
carries the same number)."""

__version__ = "0.1.0"
