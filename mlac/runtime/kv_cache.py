"""Paged MLA latent cache, its block allocator, and the metadata of one forward step.

Per layer the cache is one tensor [num_blocks, block_size, kv_lora + rope]: each token stores its
normalized latent followed by its roped shared key (`kv_latent_dim` values, one "head").
A sequence owns a block table (a list of block ids); token `p` of the sequence lives in block
`table[p // block_size]` at offset `p % block_size`, i.e. at slot `block * block_size + offset`.

A scheduler drives it with three calls: `cache.allocator.reserve(table, n_tokens)` before a step,
`ForwardBatch.build(...)` for the step, `cache.allocator.free(table)` when a sequence ends.

The stored dtype is the artifact's `kv_cache_dtype`: the compute dtype, or FP8 (e4m3 / e5m2)
with a static float32 scale per layer (see PagedKVCache).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mlac.config import ModelConfig
from mlac.errors import MlacError
from mlac.runtime import shared_prefix
from mlac.runtime.prefix_cache import PrefixCache
from mlac.runtime.shared_prefix import SharedPrefix


class BlockAllocator:
    """Free list of block ids [0, num_blocks) of `block_size` tokens. Freed blocks are reused first.

    With a prefix cache attached (`reclaimer`, see prefix_cache.py), blocks it holds that no
    sequence uses count as free: `alloc` evicts them (least recently used first) when the free
    list runs short. `num_unused` is the free list alone.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise MlacError(
                f"KV cache needs at least one block of one token (got {num_blocks} x {block_size})"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._used: set[int] = set()
        self.reclaimer = None  # a PrefixCache: num_evictable, evict(n)

    @property
    def num_unused(self) -> int:
        """Blocks on the free list."""
        return len(self._free)

    @property
    def num_free(self) -> int:
        """Blocks `alloc` can hand out: the free list and the evictable cached blocks."""
        return len(self._free) + (self.reclaimer.num_evictable if self.reclaimer is not None else 0)

    def free_list(self) -> list[int]:
        """The block ids on the free list (a copy)."""
        return list(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free) and self.reclaimer is not None:
            self.reclaimer.evict(n - len(self._free))
        if n > len(self._free):
            raise MlacError(
                f"KV cache full: {n} block(s) wanted, {len(self._free)} free of {self.num_blocks}"
            )
        blocks = [self._free.pop() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise MlacError(f"block {b} freed twice or never allocated")
            self._used.remove(b)
            self._free.append(b)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def reserve(self, table: list[int], num_tokens: int) -> None:
        """Grow `table` in place until it covers `num_tokens` tokens (all or nothing)."""
        need = self.blocks_for(num_tokens) - len(table)
        if need > 0:
            table.extend(self.alloc(need))


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
    """Per-layer latent pools [num_blocks, block_size, kv_lora + rope] and their allocator.

    `kv_dtype` (the artifact's `options.kv_cache_dtype`) picks the stored element type: "bf16"
    stores the compute dtype as it is; "fp8_e4m3" / "fp8_e5m2" store FP8 with one static float32
    scale per layer (`scales[layer]`, a one-element tensor: value = stored * scale, the
    `kv_scale` contract of kernels/mla_decode.py). Writes quantize (divide by the scale, clamp to
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
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.prefix = PrefixCache(self.allocator)  # shared prefix blocks; the scheduler may use it
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

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (0..1)."""
        return 1.0 - self.allocator.num_free / self.num_blocks

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


@dataclass(frozen=True)
class ForwardBatch:
    """What one model step needs besides the token ids: B sequences, their new tokens packed.

    Sequence i contributes `q_lens[i]` new tokens (packed back to back, from
    `cu_seqlens_q[i]`) after `ctx_lens[i]` tokens already in the cache; it attends to all
    `ctx_lens[i] + q_lens[i]` tokens causally. `is_decode` (every q_len == 1) selects the
    absorbed attention over the paged cache; otherwise prefill/extend runs in MHA form over the
    sequences' cached tokens, gathered by `kv_slots`. Tensor dtypes follow the kernels'
    contracts (kernels/mla_decode.py, kernels/extend_attention.py).
    """

    is_decode: bool
    q_lens: tuple[int, ...]  # [B] new tokens per sequence
    ctx_lens: tuple[int, ...]  # [B] cached tokens per sequence before this step
    positions: torch.Tensor  # [T] int64: ctx_len + 0..q_len-1 per sequence
    slots: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with block 0 (masked by seq_lens)
    seq_lens: torch.Tensor  # [B] int32: ctx_len + q_len
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: packed new-token offsets
    cu_seqlens_kv: torch.Tensor  # [B + 1] int32: packed offsets of all tokens (kv_slots)
    kv_slots: torch.Tensor  # [sum(seq_lens)] int64: every token's slot, per sequence (extend only)
    row_groups: torch.Tensor | None = None  # [2, B] int32: decode rows grouped per sequence (mla_decode)
    shared: SharedPrefix | None = None  # extend: cached blocks several sequences share (shared_prefix.py)

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def last_token_indices(self) -> torch.Tensor:
        """[B] index of each sequence's last new token in the packed tokens (where its logits are)."""
        return self.cu_seqlens_q[1:].long() - 1

    @classmethod
    def build(
        cls,
        ctx_lens: Sequence[int],
        q_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """Metadata for B sequences; each table must already cover ctx_len + q_len tokens."""
        if not (len(ctx_lens) == len(q_lens) == len(block_tables)) or not q_lens:
            raise MlacError("ForwardBatch: ctx_lens, q_lens, block_tables must be non-empty, of one length")
        is_decode = all(n == 1 for n in q_lens)
        seq_lens = [c + n for c, n in zip(ctx_lens, q_lens, strict=True)]
        for ctx, n, table in zip(ctx_lens, q_lens, block_tables, strict=True):
            if n < 1 or ctx < 0:
                raise MlacError(f"ForwardBatch: bad sequence (ctx_len={ctx}, q_len={n})")
            if len(table) * block_size < ctx + n:
                raise MlacError(f"ForwardBatch: {len(table)} blocks cannot hold {ctx + n} tokens")

        tables = [torch.tensor(t, dtype=torch.int64) for t in block_tables]

        def slots(
            table: torch.Tensor, start: int, end: int
        ) -> torch.Tensor:  # slots of positions [start, end)
            p = torch.arange(start, end)
            return table[p // block_size] * block_size + p % block_size

        new = [slots(t, c, s) for t, c, s in zip(tables, ctx_lens, seq_lens, strict=True)]
        every = [] if is_decode else [slots(t, 0, s) for t, s in zip(tables, seq_lens, strict=True)]
        width = max(-(-s // block_size) for s in seq_lens)
        padded = [list(t[:width]) + [0] * (width - min(len(t), width)) for t in block_tables]

        def tensor(x: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype, device=device)

        def cat(parts: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(parts).to(device) if parts else tensor([])

        return cls(
            is_decode=is_decode,
            q_lens=tuple(q_lens),
            ctx_lens=tuple(ctx_lens),
            positions=cat([torch.arange(c, s) for c, s in zip(ctx_lens, seq_lens, strict=True)]),
            slots=cat(new),
            block_tables=tensor(padded, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            cu_seqlens_q=tensor(list(itertools.accumulate(q_lens, initial=0)), torch.int32),
            cu_seqlens_kv=tensor(list(itertools.accumulate(seq_lens, initial=0)), torch.int32),
            kv_slots=cat(every),
            shared=None
            if is_decode
            else shared_prefix.build(ctx_lens, q_lens, block_tables, block_size, device),
        )
