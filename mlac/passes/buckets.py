"""buckets: the CUDA-graph decode batch sizes and the per-rank memory plan (any machine), recorded
in the manifest as `buckets`. The arithmetic and every formula: mlac/core/plan.py.
"""

from __future__ import annotations

from mlac.core.artifact import CompileOptions
from mlac.core.plan import PREFILL_TOKENS, SAFETY_FACTOR, decode_buckets, plan_buckets  # noqa: F401
from mlac.passes import PassContext

NAME = "buckets"


def check(options: CompileOptions) -> None:
    """Refuse a --cuda-graph-max-bs outside 1..MAX_BS (before any tensor is read)."""
    decode_buckets(options.cuda_graph_max_bs)


def params(ctx: PassContext) -> dict:
    ladder = decode_buckets(ctx.options.cuda_graph_max_bs)
    return {"cuda_graph_max_bs": ctx.options.cuda_graph_max_bs, "buckets": len(ladder),
            "safety_factor": SAFETY_FACTOR, "prefill_tokens": PREFILL_TOKENS}  # fmt: skip
