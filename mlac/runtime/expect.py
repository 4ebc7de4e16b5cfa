"""What a launch expects of an artifact, checked against its manifest before anything loads.

mlac compiles the parallel split and the KV cache's element type into the artifact: a launch
does not choose them, it may only state them (vLLM's `--tensor-parallel-size` and
`--kv-cache-dtype`, mlac's `--dp-attention`). A statement that agrees is accepted; one that
contradicts the artifact is refused with one line naming both values. No torch here: `mlac serve`
checks before it starts any process, and `make_runner` before it loads.
"""

from __future__ import annotations

from mlac.core.artifact import Manifest
from mlac.core.errors import MlacError

# --kv-cache-dtype as vLLM spells it -> the artifact's kv_cache_dtype (vLLM's "fp8" is e4m3)
KV_CACHE_DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3",
                   "fp8_e5m2": "fp8_e5m2"}  # fmt: skip


def kv_cache_dtype_of(name: str | None) -> str | None:
    """The artifact's name of a --kv-cache-dtype value (None or "auto": whatever it was compiled
    with); MlacError for a name that is not a KV cache dtype."""
    if name is None or name == "auto":
        return None
    if name not in KV_CACHE_DTYPES:
        raise MlacError(f"--kv-cache-dtype {name}: must be auto or one of {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


def check_expected(
    manifest: Manifest,
    dp_attention: bool | None = None,
    tensor_parallel_size: int | None = None,
    kv_cache_dtype: str | None = None,
) -> None:
    """Refuse a launch whose stated DP attention, TP degree or KV cache dtype (None: not stated)
    contradicts what the artifact was compiled with."""
    plan, compiled_kv = manifest.plan, manifest.options.kv_cache_dtype
    if tensor_parallel_size is not None and tensor_parallel_size != plan.tp:
        raise MlacError(
            f"--tensor-parallel-size {tensor_parallel_size}: the artifact was compiled for tp={plan.tp} "
            f"(mlac compile --tp sets it; drop the flag or give {plan.tp})"
        )
    wanted = kv_cache_dtype_of(kv_cache_dtype)
    if wanted is not None and wanted != compiled_kv:
        raise MlacError(
            f"--kv-cache-dtype {kv_cache_dtype}: the artifact's KV cache is {compiled_kv} "
            f"(mlac compile --kv-cache-dtype sets it; drop the flag or give {compiled_kv})"
        )
    if dp_attention is not None and dp_attention != plan.dp_attention:
        how = "with" if plan.dp_attention else "without"
        fix = "drop --no-dp-attention" if plan.dp_attention else "recompile with --dp-attention"
        raise MlacError(
            f"artifact compiled {how} --dp-attention (tp={plan.tp}); this launch asks otherwise: {fix}"
        )
