"""mlac: compile Hugging Face DeepSeek checkpoints into verified artifacts and serve them."""

from mlac.core.version import __version__

__all__ = ["__version__", "Engine", "SamplingParams"]


def __getattr__(name: str):
    # Lazy: `import mlac` must stay cheap for the CLI and must not import torch-heavy runtime code.
    if name == "Engine":
        from mlac.runtime.engine.engine import Engine

        return Engine
    if name == "SamplingParams":
        from mlac.runtime.engine.params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'mlac' has no attribute {name!r}")
