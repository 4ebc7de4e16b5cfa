"""KV cache sizing at start-up, from the artifact's compile-time memory plan (pure arithmetic).

    kv = plan_kv_cache(manifest.buckets, rank, total_bytes=total, free_bytes=free,
                       max_position_embeddings=cfg.max_position_embeddings, block_size=16)
    log(kv.summary()); [log(w) for w in kv.warnings]

On one rank, with util = --gpu-memory-utilization:

    budget    = total_bytes · util, or free_bytes when less is free (another process holds the rest)
    transient = graph_pool_bytes + prefill_activation_bytes       with CUDA graphs (the pool is held)
              = max(prefill, largest decode bucket's activations)   without them (one step at a time)
    usable    = budget − weight_bytes[rank] − transient − RESERVE_BYTES
    num_blocks  = usable // (kv_bytes_per_token · block_size) − 1     (the pools' scratch block)
    max_context = min(max_model_len or max_position_embeddings, num_blocks · block_size)

kv_bytes_per_token is what the runtime's pools take per token (start.plan_kv passes it: the
storage itemsize of the compute dtype, every layer's pool, the MTP layers' included), not the
artifact's plan.kv_bytes_per_token, which counts the main layers at the compiled kv_cache_dtype's
itemsize with bf16 compute: a bf16 cache under float32 compute stores 4-byte elements, and
speculative decoding adds a pool per MTP layer.

RESERVE_BYTES (1 GiB) covers what no plan counts: the CUDA context and cuBLAS workspaces
(about 0.5 GiB on an H100/H200), NCCL buffers, Triton's loaded kernels and fragmentation.
A budget with no room for one block refuses to start, naming the numbers in GiB.

A multi-rank artifact allocates one block count on every rank (rank 0's allocator drives them
all): `plan_ranks` is the smallest of the ranks' plans on one GPU's memory (the ranks of a node
have identical GPUs). An artifact compiled before the buckets pass gets the plan that pass would
have written, from its manifest (`bucket_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlac.core.artifact import BucketPlan, Manifest
from mlac.core.errors import MlacError
from mlac.core.plan import plan_buckets

GiB = 1 << 30
RESERVE_BYTES = 1 * GiB


@dataclass(frozen=True)
class KVPlan:
    """How many KV blocks one rank allocates and the context that follows from it."""

    num_blocks: int
    block_size: int
    kv_bytes: int  # (num_blocks + 1) · block_size · kv_bytes_per_token: the pools, scratch block included
    max_context: int
    graph_buckets: int  # 0 without CUDA graphs
    warnings: tuple[str, ...]  # one line each, for the start-up log

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def summary(self) -> str:
        """One line for the start-up log."""
        graphs = f"CUDA graphs: {self.graph_buckets} buckets" if self.graph_buckets else "CUDA graphs: off"
        return (
            f"KV cache: {self.kv_tokens:,} tokens ({self.num_blocks:,} blocks of {self.block_size}, "
            f"{_gib(self.kv_bytes)}), max context {self.max_context:,}, {graphs}"
        )


def plan_kv_cache(
    plan: BucketPlan,
    rank: int,
    total_bytes: int,
    max_position_embeddings: int,
    block_size: int,
    gpu_memory_utilization: float = 0.9,
    max_model_len: int | None = None,
    free_bytes: int | None = None,
    cuda_graphs: bool = True,
    kv_bytes_per_token: int | None = None,
) -> KVPlan:
    """Size rank `rank`'s KV cache (module docstring); raise MlacError when nothing fits.
    `free_bytes` is the device's free memory measured before anything is loaded;
    `kv_bytes_per_token` the bytes the pools take per token (None: the plan's)."""
    context = _check(plan, rank, max_position_embeddings, block_size, gpu_memory_utilization, max_model_len)
    warnings: list[str] = []
    budget = int(total_bytes * gpu_memory_utilization)
    if free_bytes is not None and free_bytes < budget:
        warnings.append(
            f"only {_gib(free_bytes)} free of {_gib(total_bytes)} (another process holds the rest): "
            f"the KV cache is sized on the free memory, not on {gpu_memory_utilization:g} of the total"
        )
        budget = free_bytes
    fixed = _fixed(plan, rank, cuda_graphs)
    per_block = (kv_bytes_per_token or plan.kv_bytes_per_token) * block_size
    num_blocks = max(0, budget - sum(fixed.values())) // per_block - 1  # the pools hold a scratch block more
    if num_blocks < 1:
        raise MlacError(_no_fit(fixed, budget, per_block, rank, gpu_memory_utilization))
    tokens = num_blocks * block_size
    if tokens < context:
        warnings.append(
            f"the KV cache holds {tokens:,} tokens, less than one full context of {context:,}: max context "
            f"capped at {tokens:,}; lower --max-model-len or raise --gpu-memory-utilization"
        )
    return KVPlan(
        num_blocks=num_blocks, block_size=block_size, kv_bytes=(num_blocks + 1) * per_block,
        max_context=min(context, tokens), graph_buckets=len(plan.decode_batch_sizes) if cuda_graphs else 0,
        warnings=tuple(warnings),
    )  # fmt: skip


def plan_ranks(plan: BucketPlan, total_bytes: int, **kw) -> KVPlan:
    """The KV plan every rank can hold: the smallest of plan_kv_cache over the plan's ranks, each
    on the same GPU memory (`kw`: plan_kv_cache's other arguments). Raises as plan_kv_cache."""
    plans = [plan_kv_cache(plan, rank, total_bytes, **kw) for rank in range(len(plan.weight_bytes))]
    return min(plans, key=lambda p: p.num_blocks)


def bucket_plan(manifest: Manifest) -> BucketPlan:
    """The artifact's memory plan: manifest.buckets, or for an artifact compiled before the buckets
    pass, the plan that pass computes from the manifest's config, options and tensor entries."""
    if manifest.buckets is not None:
        return manifest.buckets
    return plan_buckets(manifest.model, manifest.options, manifest.tensors)


def check_max_model_len(max_model_len: int | None, max_pos: int) -> int:
    """The context the user asked for: `max_model_len` (1..max_pos), else max_pos."""
    if max_model_len is not None and not 1 <= max_model_len <= max_pos:
        raise MlacError(
            f"--max-model-len {max_model_len}: must be in 1..{max_pos:,} "
            "(the model's max_position_embeddings)"
        )
    return max_model_len or max_pos


def _check(
    plan: BucketPlan, rank: int, max_pos: int, block_size: int, util: float, max_model_len: int | None
) -> int:
    """Refuse bad arguments; return the context the user asked for."""
    if not 0 < util <= 1:
        raise MlacError(f"--gpu-memory-utilization {util}: must be in (0, 1]")
    if block_size < 1:
        raise MlacError(f"KV block size {block_size}: must be at least 1")
    if not 0 <= rank < len(plan.weight_bytes):
        raise MlacError(f"rank {rank}: the artifact's memory plan has {len(plan.weight_bytes)} rank(s)")
    return check_max_model_len(max_model_len, max_pos)


def _fixed(plan: BucketPlan, rank: int, cuda_graphs: bool) -> dict[str, int]:
    """Everything but the KV cache, by name (the order of the does-not-fit message)."""
    if cuda_graphs:
        steps = {"CUDA graphs": plan.graph_pool_bytes, "prefill activations": plan.prefill_activation_bytes}
    else:
        steps = {"activations": max(plan.prefill_activation_bytes, max(plan.activation_bytes, default=0))}
    return {"weights": plan.weight_bytes[rank], **steps, "reserve": RESERVE_BYTES}


def _no_fit(fixed: dict[str, int], budget: int, per_block: int, rank: int, util: float) -> str:
    parts = " + ".join(f"{name} {_gib(n)}" for name, n in fixed.items())
    return (
        f"rank {rank}: {parts} = {_gib(sum(fixed.values()))} leave no room for one KV block "
        f"({per_block / (1 << 20):.1f} MiB) in a budget of {_gib(budget)} "
        f"(--gpu-memory-utilization {util:g}); "
        f"raise --gpu-memory-utilization, use more GPUs (compile with a larger --tp) or --fp8, or lower "
        f"--cuda-graph-max-bs / run with --no-cuda-graph"
    )


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"
