"""Counting Triton's JIT compiles in this process (the proof that a prepared artifact compiles nothing).

    with JitCompiles() as jit:
        engine.generate(...)
    assert jit.compiled == []

Triton's compile entry point calls `triton.knobs.compilation.listener` (triton >= 3.4) once per
kernel variant it is asked for: `cache_hit` True when the variant was found in the cache directory
(loaded, not compiled), False when it was compiled. A variant already in the process's memory does
not reach that entry point and counts as neither.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlac.core.errors import MlacError


class JitCompiles:
    """While active: `compiled` names each kernel variant Triton compiled, `loaded` each one it found
    in its cache directory. A listener that was set before keeps being called."""

    def __init__(self, on_compile: Callable[[str], None] | None = None) -> None:
        self.on_compile = on_compile  # called with each compiled kernel's name (a server's counter)
        self.compiled: list[str] = []
        self.loaded: list[str] = []
        self._knobs: Any = None
        self._before: Any = None

    def __enter__(self) -> JitCompiles:
        import triton

        knobs = getattr(getattr(triton, "knobs", None), "compilation", None)
        if knobs is None or not hasattr(knobs, "listener"):
            raise MlacError(f"triton {triton.__version__} has no compilation listener (triton >= 3.4 has)")
        self._knobs, self._before = knobs, knobs.listener
        knobs.listener = self._listen
        return self

    def __exit__(self, *exc: object) -> None:
        self._knobs.listener = self._before

    def _listen(self, *, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool) -> None:
        name = metadata.get("name", "?") if isinstance(metadata, dict) else getattr(src, "name", "?")
        (self.loaded if cache_hit else self.compiled).append(str(name))
        if not cache_hit and self.on_compile is not None:
            self.on_compile(str(name))
        if self._before is not None:
            self._before(
                src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit
            )


def count_compiles(on_compile: Callable[[str], None]) -> JitCompiles | None:
    """Call `on_compile` for every Triton kernel this process compiles from now on (for good); None
    when triton is missing or too old to say (the server then exports no count)."""
    try:
        return JitCompiles(on_compile).__enter__()
    except (ImportError, MlacError):
        return None
