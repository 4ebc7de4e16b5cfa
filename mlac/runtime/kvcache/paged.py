"""Paged MLA latent cache: the device pools of one rank, one tensor per layer.

Per layer the cache is one tensor [num_blocks, block_size, kv_lora + rope]: each token stores its
normalized latent followed by its roped shared key (`kv_latent_dim` values, one "head").
A sequence owns a block table (a list of block ids); token `p` of the sequence lives in block
`table[p // block_size]` at offset `p % block_size`, i.e. at slot `block * block_size + offset`.

The pools hold tensors only. Which blocks a sequence owns is rank 0's bookkeeping (pool.BlockPool:
the allocator and the radix prefix tree, one per rank that holds a cache); a step's view of the
blocks is a ForwardBatch (batch.py).

The stored dtype is the artifact's `kv_cache_dtype`: the compute dtype, or FP8 (e4m3 / e5m2)
with a static float32 scale per layer (see PagedKVCache).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mlac.core.config import ModelConfig
from mlac.core.errors import MlacError

KV_DTYPES: dict[str, torch.dtype | None] = {
    "bf16": None,  # unquantized: the model's compute dtype (bf16 in production, fp32 in tests)
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
DEFAULT_KV_SCALE = 1.0


def kv_storage_dtype(kv_dtype: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The element dtype a cache of `kv_dtype` (a manifest's options.kv_cache_dtype) stores."""
    if kv_dtype not in KV_DTYPES:
        raise MlacError(f"unknown KV cache dtype {kv_dtype!r}: expected one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[kv_dtype] or compute_dtype


def layer_scales(kv_scale: float | Sequence[float], num_layers: int) -> list[float]:
    """One positive finite scale per layer: `kv_scale` repeated, or the per-layer list as it is."""
    single = isinstance(kv_scale, int | float)
    scales = [float(kv_scale)] * num_layers if single else [float(s) for s in kv_scale]
    if len(scales) != num_layers:
        raise MlacError(f"KV cache: {len(scales)} per-layer scales for {num_layers} layers")
    bad = next((s for s in scales if not (0 < s < float("inf"))), None)
    if bad is not None:
        raise MlacError(f"KV cache: scale {bad} is not a positive finite number")
    return scales


class PagedKVCache:
    """Per-layer latent pools [num_blocks, block_size, kv_lora + rope].

    `kv_dtype` (the artifact's `options.kv_cache_dtype`) picks the stored element type: "bf16"
    stores the compute dtype as it is; "fp8_e4m3" / "fp8_e5m2" store FP8 with one static float32
    scale per layer (`scales[layer]`, a one-element tensor: value = stored * scale, the
    `kv_scale` contract of kernels/attention/mla_decode.py). Writes quantize (divide by the scale, clamp to
    the format's finite range, round); reads dequantize to the compute dtype. The scale defaults
    to 1.0: kv_norm'ed latents and roped keys sit well inside e4m3's range (|x| <= 448), and a
    static scale keeps a token's stored bytes independent of what else is in the cache.

    Each pool holds one block more than the allocator hands out: `scratch_block`, where the padding
    rows of a CUDA-graph decode batch write and read (graphs.py), so that padding never touches a
    sequence's latents.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        kv_dtype: str = "bf16",
        kv_scale: float | Sequence[float] = DEFAULT_KV_SCALE,
        extra_layers: int = 0,
    ):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dim = config.kv_latent_dim
        self.dtype = dtype  # compute dtype: what read() returns
        self.kv_dtype = kv_dtype
        self.storage_dtype = kv_storage_dtype(kv_dtype, dtype)
        self.quantized = KV_DTYPES[kv_dtype] is not None
        self.scratch_block = num_blocks  # not in the allocator: CUDA-graph padding rows only
        self.extra_layers = extra_layers  # the MTP layers' pools (speculative decoding), after the main ones
        self.layers = [
            torch.zeros(num_blocks + 1, block_size, self.dim, dtype=self.storage_dtype, device=device)
            for _ in range(config.num_hidden_layers + extra_layers)
        ]
        per_layer = layer_scales(kv_scale, config.num_hidden_layers) + [DEFAULT_KV_SCALE] * extra_layers
        self.scales = [torch.full((1,), s, dtype=torch.float32, device=device) for s in per_layer]
        self._finite_max = torch.finfo(self.storage_dtype).max if self.quantized else None

    @staticmethod
    def bytes_per_block(
        config: ModelConfig,
        block_size: int,
        dtype: torch.dtype,
        kv_dtype: str = "bf16",
        extra_layers: int = 0,
    ) -> int:
        itemsize = torch.empty((), dtype=kv_storage_dtype(kv_dtype, dtype)).element_size()
        return (config.num_hidden_layers + extra_layers) * block_size * config.kv_latent_dim * itemsize

    @property
    def scratch_slot(self) -> int:
        """The first token slot of the scratch block."""
        return self.scratch_block * self.block_size

    @classmethod
    def from_budget(
        cls,
        config: ModelConfig,
        num_bytes: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        kv_dtype: str = "bf16",
        kv_scale: float | Sequence[float] = DEFAULT_KV_SCALE,
        extra_layers: int = 0,
    ) -> PagedKVCache:
        """As many blocks as fit in `num_bytes` (at least one), the scratch block included."""
        num_blocks = num_bytes // cls.bytes_per_block(config, block_size, dtype, kv_dtype, extra_layers) - 1
        if num_blocks < 1:
            raise MlacError(f"KV cache budget of {num_bytes} bytes holds no block of {block_size} tokens")
        return cls(config, int(num_blocks), block_size, dtype, device, kv_dtype, kv_scale, extra_layers)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def kv_scale(self, layer: int) -> torch.Tensor | None:
        """The float32 [1] scale of `layer` of an FP8 cache (mla_decode's kv_scale), else None."""
        return self.scales[layer] if self.quantized else None

    def write(self, layer: int, slots: torch.Tensor, latent: torch.Tensor) -> None:
        """latent [T, kv_lora + rope] -> the token slots [T] of `layer` (quantized for an FP8 cache)."""
        dst = self.layers[layer].view(-1, self.dim)
        if not self.quantized:
            dst.index_copy_(0, slots, latent.to(self.storage_dtype))
            return
        m = self._finite_max  # NOTE: an FP8 cast of an out-of-range value gives NaN, not saturation
        q = (latent.float() / self.scales[layer]).clamp_(-m, m).to(self.storage_dtype)
        dst.view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))  # no FP8 index_copy_ on CPU

    def read(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The entries [N, kv_lora + rope] at token slots [N] of `layer`, in the compute dtype."""
        stored = self.layers[layer].view(-1, self.dim)[slots]
        if self.quantized:
            return (stored.float() * self.scales[layer]).to(self.dtype)
        return stored
