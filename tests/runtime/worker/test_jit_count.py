"""The server's count of Triton JIT compiles (mlac:triton_jit_compiles_total) hears Triton's listener."""

from __future__ import annotations

import pytest

from mlac.runtime.worker.jit_compiles import count_compiles

triton = pytest.importorskip("triton")


def test_count_compiles_counts_misses_not_cache_hits():
    knobs = getattr(getattr(triton, "knobs", None), "compilation", None)
    if knobs is None or not hasattr(knobs, "listener"):
        pytest.skip("triton without a compilation listener")
    before, seen = knobs.listener, []
    try:
        assert count_compiles(seen.append) is not None
        for hit, name in ((False, "a"), (True, "b"), (False, "c")):
            knobs.listener(src=None, metadata={"name": name}, metadata_group=None, times=None, cache_hit=hit)
        assert seen == ["a", "c"]
    finally:
        knobs.listener = before
